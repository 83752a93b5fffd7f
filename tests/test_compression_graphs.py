"""The graph path of compression (static buffers, padded batches, history and pooling
always on) against the eager path, on the CPU where the 'graph' runs eagerly."""

from types import SimpleNamespace

import pytest
import torch

from zipage.compression.executor import Compressor, compacts_in_place
from zipage.compression.graphs import CompressionGraphs, graph_bucket_sizes
from zipage.compression.planner import CompressionTask
from zipage.config import CompressionConfig

LAYERS, BLOCKS, BS, KV_HEADS, HEADS, DIM, WINDOW, N = 3, 48, 4, 2, 4, 8, 4, 3


def _caches(seed: int):
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, LAYERS, BLOCKS, BS, KV_HEADS, DIM, generator=gen)
    scores = torch.rand(LAYERS, BLOCKS, BS, KV_HEADS, generator=gen)
    queries = torch.randn(LAYERS, 6 * WINDOW + 1, HEADS, DIM, generator=gen)
    return kv, scores, queries


def _tasks(count: int, seed: int) -> list[CompressionTask]:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(BLOCKS, generator=gen).tolist()
    tasks = []
    for i in range(count):
        sources = blocks[i * N:(i + 1) * N]
        # In place, or (as the block manager does for a shared leading block) a fresh first block.
        targets = sources[:N - 1] if i % 2 == 0 else blocks[40 + i:41 + i] + sources[1:N - 1]
        tasks.append(CompressionTask(
            seq=SimpleNamespace(query_slot=i), source_blocks=sources, target_blocks=targets, num_tokens=N * BS,
            keep=(N - 1) * BS, num_previous=[0, 5, (N - 1) * BS][i % 3], last_position=100 + 7 * i,
            pool=i % 3 == 0, protected=[0, 3, 20][i % 3], pending_release=[]))
    return tasks


@pytest.mark.parametrize("count", [1, 3, 5])
@pytest.mark.parametrize("redundancy", ["lightning", "raw"])
def test_graph_path_matches_eager_path(count, redundancy):
    config = CompressionConfig(max_blocks_per_seq=N, window=WINDOW, redundancy=redundancy, layer_group=2)
    results = []
    for use_graphs in (False, True):
        kv, scores, queries = _caches(0)
        compressor = Compressor(config, kv, scores, queries, DIM ** -0.5, BS)
        if use_graphs:
            compressor.graphs = CompressionGraphs(compressor, max_requests=4)  # 5 requests: two replays
            assert compressor.graphs.fits(_tasks(count, 1))
        compressor.run(_tasks(count, 1))
        results.append((kv, scores))
    (kv_eager, scores_eager), (kv_graph, scores_graph) = results
    assert torch.equal(kv_graph, kv_eager)
    assert torch.equal(scores_graph, scores_eager)


def test_graphs_take_only_the_steady_state_shape():
    kv, scores, queries = _caches(0)
    compressor = Compressor(CompressionConfig(max_blocks_per_seq=N, window=WINDOW), kv, scores, queries,
                            DIM ** -0.5, BS)
    graphs = CompressionGraphs(compressor, max_requests=100)
    assert graphs.buckets == graph_bucket_sizes(32) == [1, 2, 4, 8, 16, 32]
    long_prompt = _tasks(1, 2)[0]
    long_prompt.source_blocks = long_prompt.source_blocks + [47]
    long_prompt.num_tokens += BS
    assert graphs.fits(_tasks(2, 2)) and not graphs.fits([long_prompt])


def test_compacts_in_place():
    """Single pass only when no target is read by the batch at another place."""
    def task(sources, targets):
        return SimpleNamespace(source_blocks=sources, target_blocks=targets)

    assert compacts_in_place([task([1, 2, 3], [1, 2]), task([4, 5, 6], [9, 5])])  # in place; fresh 9
    assert not compacts_in_place([task([1, 2, 3], [2, 1])])  # own sources, swapped
    assert not compacts_in_place([task([1, 2, 3], [1, 2]), task([4, 5, 6], [3, 5])])  # another's released block


def test_a_batch_that_needs_two_passes_runs_eagerly_and_matches():
    """A request whose fresh target is another request's released source (a synchronous batch can
    do that): not for the graphs; the eager path's two-pass compaction gives what compacting the
    two requests one after the other gives."""
    config = CompressionConfig(max_blocks_per_seq=N, window=WINDOW, layer_group=2)
    first, second = _tasks(2, 3)
    second.target_blocks = [first.source_blocks[-1]] + second.source_blocks[1:N - 1]
    results = []
    for together in (True, False):
        kv, scores, queries = _caches(0)
        compressor = Compressor(config, kv, scores, queries, DIM ** -0.5, BS)
        compressor.graphs = CompressionGraphs(compressor, max_requests=4)
        assert not compressor.graphs.fits([first, second])
        for batch in ([[first, second]] if together else [[first], [second]]):
            compressor.run(batch)
        results.append((kv, scores))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("history,pooling", [(None, None), (0.9, 3)])
def test_warm_up_runs_every_eager_variant_and_changes_nothing(history, pooling):
    """The start-up warm-up of eager batches (prompts compressed between chunks): each width and
    variant runs as an inactive request, which leaves the caches as they were."""
    from zipage.compression.executor import eager_widths

    config = CompressionConfig(max_blocks_per_seq=N, window=WINDOW, layer_group=2, global_score_decay=history,
                               pooling_width=pooling)
    kv, scores, queries = _caches(0)
    before = kv.clone(), scores.clone()
    compressor = Compressor(config, kv, scores, queries, DIM ** -0.5, BS)
    calls = []
    compress = compressor.compress
    compressor.compress = lambda b: calls.append((b.n_max, b.use_history, b.any_pool, b.single_pass)) or compress(b)
    widths = eager_widths(config, BS, chunk_tokens=3 * BS, max_blocks=BLOCKS, with_graphs=True)
    assert widths == [N + 1, N + 2]  # 16 tokens (pads to 16), 20 (pads to 32); 24 pads to 32 as well
    compressor.warm_up(widths)
    variants = 2 * (2 if history else 1) * (2 if pooling else 1)
    assert len(calls) == len(widths) * variants == len(set(calls))
    assert torch.equal(kv, before[0]) and torch.equal(scores, before[1])
    # Without graphs the steady-state width is eager too; the table's width bounds the rest.
    assert eager_widths(config, BS, chunk_tokens=64 * BS, max_blocks=N + 2, with_graphs=False) == [N, N + 2]  # 12 and 16 tokens pad alike
