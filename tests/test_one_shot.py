"""The one-shot all-reduce kernel (kernels/one_shot.py) against PyTorch sums and the RMSNorm
kernel it fuses, and its signal and buffer bookkeeping.

On the CPU the kernel runs under Triton's interpreter, one rank at a time: the test plays the
peers, writing their rows into their buffers and their announcements into this rank's signal
slots beforehand, then checks what the call left (its own slots consumed, the peers' slots
set, the call count advanced, the next call on the other buffer). With ZIPAGE_TEST_DEVICE=cuda
the ranks of a group run for real, as concurrent kernels on two streams of one GPU (each rank's
region a plain tensor of that GPU), eagerly and in CUDA graphs; the tensor-parallel engine tests
run it across GPUs (tests/test_tensor_parallel.py).
"""

import os

import pytest
import torch

from tests.conftest import require_triton
from zipage import distributed
from zipage.kernels import one_shot
from zipage.kernels.one_shot import Region

EPS = 1e-6
CUDA = os.environ.get("ZIPAGE_TEST_DEVICE") == "cuda"


def _regions(world: int, buffer_bytes: int, device) -> list[torch.Tensor]:
    return [torch.zeros(Region.region_bytes(world, buffer_bytes), dtype=torch.uint8, device=device)
            for _ in range(world)]


def _view(region: Region, raw: torch.Tensor, buffer: int, rows: int, hidden: int, dtype) -> torch.Tensor:
    """Rows [rows, hidden] of ``buffer`` (0 or 1) in one rank's raw region."""
    start = Region.signal_bytes(region.world) + buffer * region.buffer_bytes
    nbytes = rows * hidden * torch.empty((), dtype=dtype).element_size()
    return raw[start:start + nbytes].view(dtype).view(rows, hidden)


def _slots(raw: torch.Tensor, world: int) -> torch.Tensor:
    return raw[:Region.signal_bytes(world)].view(torch.int32).view(-1, world)


def _norm_reference(total, residual, weight):
    """The unfused path: the sum rounded to the dtype, then the RMSNorm kernel's add and norm."""
    from zipage.kernels.norm_rope import add_rms_norm_triton
    return add_rms_norm_triton(total, residual, weight, EPS)


@pytest.mark.skipif(CUDA, reason="the interpreter's one-rank-at-a-time checks")
@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_rank_sums_its_peers_rows_and_norms(world, rank, dtype):
    require_triton()
    gen = torch.Generator().manual_seed(100 * world + rank)
    rows, hidden = 5, 96
    raws = _regions(world, rows * hidden * 4, "cpu")
    region = Region(torch.tensor([r.data_ptr() for r in raws], dtype=torch.int64), rank, world,
                    rows * hidden * 4, torch.zeros(2, dtype=torch.int32))
    parts = [torch.randn(rows, hidden, generator=gen).to(dtype) for _ in range(world)]
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    # two calls: the first on buffer 0, the second (the plain all-reduce) on buffer 1
    for call in range(2):
        for q in range(world):
            if q != rank:  # peer q has written its rows and announced them to every program
                _view(region, raws[q], call, rows, hidden, dtype).copy_(parts[q] * (call + 1))
                _slots(raws[rank], world)[:rows, q] = 1
        mine = parts[rank] * (call + 1)
        total = sum((p.float() * (call + 1) for p in parts), torch.zeros(rows, hidden)).to(dtype)
        if call == 0:
            out, residual_out = one_shot.all_reduce_add_rms_norm(mine.clone(), residual, weight, EPS, region)
            ref_out, ref_residual = _norm_reference(total, residual, weight)
            assert torch.equal(out, ref_out) and torch.equal(residual_out, ref_residual)
        else:
            x = mine.clone()
            assert one_shot.all_reduce(x, region) is x
            assert torch.equal(x, total)
        assert torch.equal(_view(region, raws[rank], call, rows, hidden, dtype), mine)  # its rows, for the peers
        assert not _slots(raws[rank], world).any(), "this rank left a peer's announcement unconsumed"
        for q in range(world):  # it announced itself to every peer, from each of its programs
            expected = torch.zeros_like(_slots(raws[q], world))
            if q != rank:
                expected[:rows, rank] = 1
            assert torch.equal(_slots(raws[q], world), expected)
            _slots(raws[q], world).zero_()  # the peers consume them
        assert region.epoch.tolist() == [call + 1, 0]


@pytest.mark.skipif(CUDA, reason="CPU checks")
def test_one_shot_refuses_what_does_not_fit():
    require_triton()
    raws = _regions(2, 64, "cpu")
    region = Region(torch.tensor([r.data_ptr() for r in raws], dtype=torch.int64), 0, 2, 64,
                    torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="does not fit the 64-byte one-shot buffer"):
        one_shot.all_reduce(torch.zeros(3, 8), region)
    with pytest.raises(ValueError, match="contiguous columns"):
        one_shot.all_reduce(torch.zeros(8, 2).t(), region)
    assert region.epoch.tolist() == [0, 0]  # nothing was launched


def test_without_the_one_shot_group_the_sum_goes_to_nccl():
    """Off (the default, and always at size 1): the fused entry declines, ``PartialSum`` sums
    through the plain all-reduce, and at size 1 that returns its input."""
    assert not distributed.one_shot_enabled()
    x = torch.randn(3, 8)
    assert distributed.all_reduce_add_rms_norm(x, x, torch.ones(8), EPS) is None
    assert distributed.PartialSum(x).reduce() is x


def test_a_second_one_shot_group_in_a_process_is_refused(monkeypatch):
    """PyTorch keeps a group's symmetric-memory state by name for the process's life, and the
    next engine's group has the same name: its setup is refused with a clear error (it would
    wait in the rendezvous forever)."""
    monkeypatch.setattr(distributed, "_symmetric_groups", set())
    distributed.check_fresh_symmetric_group("0")
    distributed._symmetric_groups.add("0")
    with pytest.raises(RuntimeError, match="one tensor-parallel engine per process.*all_reduce='nccl'"):
        distributed.check_fresh_symmetric_group("0")
    distributed.check_fresh_symmetric_group("1")


def test_config_checks_the_all_reduce():
    from zipage.config import EngineConfig
    with pytest.raises(ValueError, match=r"all_reduce must be one of \('nccl', 'one-shot'\), got 'ring'"):
        EngineConfig(model="m", device="cpu", all_reduce="ring")
    with pytest.raises(ValueError, match="all_reduce='one-shot' needs CUDA GPUs, got device='cpu'"):
        EngineConfig(model="m", device="cpu", all_reduce="one-shot")


# -- a real group: two ranks as concurrent kernels on one GPU ---------------------------
# A wait that outlasts this traps (the test process then fails instead of hanging).
GPU_TIMEOUT_S = 20.0


def _pair(world: int, buffer_bytes: int, dtype: torch.dtype, hidden: int):
    """The ranks' regions on this GPU, each rank's kernels loaded first (below)."""
    raws = _regions(world, buffer_bytes, "cuda")
    bases = torch.tensor([r.data_ptr() for r in raws], dtype=torch.int64, device="cuda")
    # Every rank's programs must be resident at once (each waits for its peers'): on one GPU at
    # most 32 a rank (more rows each), far fewer than the GPU holds.
    regions = [Region(bases, r, world, buffer_bytes, torch.zeros(2, dtype=torch.int32, device="cuda"),
                      GPU_TIMEOUT_S, max_programs=32) for r in range(world)]
    _load_kernels(raws, regions, dtype, hidden)
    return raws, regions


def _load_kernels(raws, regions, dtype, hidden):
    """Run each rank's kernels (one binary per rank, plain and fused, for every number of rows)
    once alone, its peers' announcements set beforehand, then clear every slot and count. The
    first launch of a binary loads its module into the context, which waits for the device's
    running kernels: with a rank already spinning in its kernel for a peer not launched yet, that
    wait would never end (in the engine every rank has its own GPU and context, whose kernels
    before the load all finish)."""
    world = len(regions)
    x = torch.zeros(1, hidden, device="cuda", dtype=dtype)
    for region in regions:
        for norm in (False, True):
            _slots(raws[region.rank], world)[0, :] = 1
            _slots(raws[region.rank], world)[0, region.rank] = 0
            if norm:
                one_shot.all_reduce_add_rms_norm(x, x, x[0], EPS, region)
            else:
                one_shot.all_reduce(x.clone(), region)
            torch.cuda.synchronize()
            for raw in raws:
                _slots(raw, world).zero_()
            region.epoch.zero_()


@pytest.mark.skipif(not CUDA, reason="needs a GPU (ZIPAGE_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ranks_on_streams_sum_call_after_call(dtype):
    """World 2, then 4: 40 calls of varying rows (fused and plain, alternating buffers) back to
    back on each rank's stream, no host wait between them; every result equals PyTorch's sum (and
    the norm kernel's output), and every rank ends with its slots clear and its count at 40."""
    require_triton()
    for world in (2, 4):
        hidden = 4096
        raws, regions = _pair(world, 256 * hidden * 4, dtype, hidden)
        streams = [torch.cuda.Stream() for _ in range(world)]
        gen = torch.Generator(device="cuda").manual_seed(world)
        weight = torch.randn(hidden, device="cuda", generator=gen).to(dtype)
        calls = []
        torch.cuda.synchronize()
        for call in range(40):
            rows = [1, 7, 64, 256, 130][call % 5]
            parts = [torch.randn(rows, hidden, device="cuda", generator=gen).to(dtype) for _ in range(world)]
            residual = torch.randn(rows, hidden, device="cuda", generator=gen).to(dtype)
            results = []
            torch.cuda.synchronize()  # the inputs exist before any rank's stream reads them
            for rank in range(world):
                with torch.cuda.stream(streams[rank]):
                    x = parts[rank].clone()
                    if call % 2:
                        results.append((one_shot.all_reduce(x, regions[rank]),))
                    else:
                        results.append(one_shot.all_reduce_add_rms_norm(x, residual, weight, EPS, regions[rank]))
            calls.append((parts, residual, results))
        torch.cuda.synchronize()
        for call, (parts, residual, results) in enumerate(calls):
            total = sum((p.float() for p in parts), torch.zeros_like(parts[0], dtype=torch.float32)).to(dtype)
            expected = (total,) if call % 2 else _norm_reference(total, residual, weight)
            for rank in range(world):
                for got, want in zip(results[rank], expected):
                    assert torch.equal(got, want), f"world {world}, call {call}, rank {rank}"
        for rank in range(world):
            assert regions[rank].epoch.tolist() == [40, 0]
            assert not _slots(raws[rank], world).any()


@pytest.mark.skipif(not CUDA, reason="needs a GPU (ZIPAGE_TEST_DEVICE=cuda)")
def test_ranks_replay_graphs_of_many_calls():
    """Each rank captures 72 fused calls (a Qwen3-8B step) in a CUDA graph; replayed together
    with new inputs, then mixed with eager calls, every replay gives the sums of its inputs."""
    require_triton()
    world, rows, hidden, dtype = 2, 64, 4096, torch.bfloat16
    raws, regions = _pair(world, rows * hidden * 2, dtype, hidden)
    streams = [torch.cuda.Stream() for _ in range(world)]
    weight = torch.randn(hidden, device="cuda").to(dtype)
    inputs = [torch.zeros(72, rows, hidden, device="cuda", dtype=dtype) for _ in range(world)]
    residual = torch.randn(rows, hidden, device="cuda").to(dtype)
    outputs, graphs = [], []
    for rank in range(world):  # captured one after the other: capture launches nothing
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=streams[rank]):
            outs = [one_shot.all_reduce_add_rms_norm(inputs[rank][i], residual, weight, EPS, regions[rank])[0]
                    for i in range(72)]
        graphs.append(graph)
        outputs.append(outs)
    for replay in range(3):
        for rank in range(world):
            inputs[rank].copy_(torch.randn(72, rows, hidden, device="cuda").to(dtype))
        torch.cuda.synchronize()
        for rank in range(world):
            with torch.cuda.stream(streams[rank]):
                graphs[rank].replay()
                if replay == 1:  # an eager call between replays keeps the ranks' buffers in step
                    one_shot.all_reduce(torch.ones(3, hidden, device="cuda", dtype=dtype), regions[rank])
        torch.cuda.synchronize()
        total = (inputs[0].float() + inputs[1].float()).to(dtype)
        for i in range(72):
            want = _norm_reference(total[i], residual, weight)[0]
            for rank in range(world):
                assert torch.equal(outputs[rank][i], want), f"replay {replay}, call {i}, rank {rank}"
    assert regions[0].epoch.tolist() == regions[1].epoch.tolist() == [3 * 72 + 1, 0]
