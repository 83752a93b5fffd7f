"""The graph path of compression (static buffers, padded batches, history and pooling
always on) against the eager path, on the CPU where the 'graph' runs eagerly."""

from types import SimpleNamespace

import pytest
import torch

from zipage.compression.executor import Compressor
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
        targets = sources[:N - 1] if i % 2 == 0 else blocks[40 + i:41 + i] + sources[:N - 2]  # in place or not
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
