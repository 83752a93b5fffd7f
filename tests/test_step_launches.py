"""A step's repeated Triton launches: found once through Triton's dispatch, then launched directly
(``zipage/kernels/common.StepLaunches``), with the same results as launching every time."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # TRITON_INTERPRET=0: the compiled kernels (a GPU run of the cuda tests)

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import test_kernels as kt  # noqa: E402
from tests.conftest import require_triton  # noqa: E402
from zipage.kernels import common  # noqa: E402
from zipage.kernels.common import StepLaunches, quantize_fp8_torch  # noqa: E402
from zipage.kernels.paged_decode import paged_decode_attention  # noqa: E402
from zipage.kernels.store_kv import store_kv  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the kernels on CPU tensors run in the interpreter; on a GPU, see the CUDA test")
cuda = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("ZIPAGE_TEST_DEVICE", "cpu") == "cpu",
                          reason="needs a GPU (ZIPAGE_TEST_DEVICE=cuda)")


class Kernel:
    """Stands for a Triton kernel: ``kernel[grid](...)`` is the dispatch, which launches and returns
    the binary; ``binary[grid](*every_argument)`` a direct launch. Both are recorded."""

    arg_names = ["x", "n", "BLOCK", "FLAG"]

    def __init__(self, binary_fails=False):
        self.calls = []
        self.binary_fails = binary_fails

    def __getitem__(self, grid):
        def dispatch(*args, **kwargs):
            self.calls.append(("dispatch", grid, args, kwargs))
            return Binary(self)

        return dispatch


class Binary:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def run(*args):
            if self.kernel.binary_fails:
                raise TypeError("this binary takes its arguments otherwise")
            self.kernel.calls.append(("direct", grid, args))

        return run


def test_the_first_launch_dispatches_and_the_others_run_the_binary_with_every_argument_in_order():
    kernel, launches = Kernel(), StepLaunches()
    x = torch.zeros(8)
    for _ in range(3):
        launches.launch(kernel, (4,), (x, 32), dict(BLOCK=64, FLAG=True), num_warps=4)
    assert kernel.calls[0] == ("dispatch", (4,), (x, 32), dict(BLOCK=64, FLAG=True, num_warps=4))
    # direct: the grid made three-dimensional, then the positional arguments and the constants in the kernel's order
    assert kernel.calls[1:] == [("direct", (4, 1, 1), (x, 32, 64, True))] * 2
    assert launches.direct == 2


@pytest.mark.parametrize("change", ["dtype", "alignment", "integer"])
def test_arguments_of_another_specialization_go_through_the_dispatch(change):
    kernel, launches = Kernel(), StepLaunches()
    x = torch.zeros(64)
    launches.launch(kernel, (1,), (x, 32), dict(BLOCK=64, FLAG=False))
    other = {"dtype": (x.double(), 32), "alignment": (x[1:], 32), "integer": (x, 33)}[change]
    launches.launch(kernel, (1,), other, dict(BLOCK=64, FLAG=False))
    assert [c[0] for c in kernel.calls] == ["dispatch", "dispatch"] and launches.direct == 0
    launches.launch(kernel, (1,), other, dict(BLOCK=64, FLAG=False))  # the newer binary now serves it
    assert kernel.calls[-1][0] == "direct"


def test_a_binary_that_refuses_a_direct_launch_turns_direct_launches_off(monkeypatch, caplog):
    monkeypatch.setitem(common._DIRECT_LAUNCH, "usable", True)
    kernel, launches = Kernel(binary_fails=True), StepLaunches()
    x = torch.zeros(8)
    for _ in range(3):
        launches.launch(kernel, (2,), (x, 16), dict(BLOCK=8, FLAG=False))
    assert [c[0] for c in kernel.calls] == ["dispatch"] * 3  # every launch still ran, through the dispatch
    assert common._DIRECT_LAUNCH["usable"] is False and "directly failed" in caplog.text


def test_scratch_is_made_once_a_step():
    launches, made = StepLaunches(), []
    first = launches.scratch("buffers", lambda: made.append(1) or torch.zeros(3))
    assert launches.scratch("buffers", lambda: made.append(1) or torch.zeros(3)) is first and made == [1]


def layered_caches(dtype, layers=2):
    """Two layers' caches as equal slices of one tensor, as the engine holds them."""
    q, k_cache, v_cache, tables, lens = kt.make_decode_inputs(4, 16, dtype)
    ks = torch.stack([k_cache + i for i in range(layers)])
    vs = torch.stack([v_cache - i for i in range(layers)])
    return q, ks, vs, tables, lens


def decode_layers(q, ks, vs, tables, lens, launches, **kw):
    return [paged_decode_attention(q, ks[i], vs[i], tables, lens, kt.HEAD_DIM**-0.5, launches=launches, **kw)
            for i in range(ks.shape[0])]


@interpreted
@pytest.mark.parametrize("num_splits", [1, 3], ids=["1-split", "3-splits"])
def test_decode_layer_after_layer_with_the_step_launches_equals_launching_each(num_splits):
    require_triton()
    q, ks, vs, tables, lens = layered_caches(torch.float32)
    launches = StepLaunches()
    got = decode_layers(q, ks, vs, tables, lens, launches, num_splits=num_splits, min_split_tokens=1)
    want = decode_layers(q, ks, vs, tables, lens, None, num_splits=num_splits, min_split_tokens=1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(launches._scratch) == (num_splits > 1)  # the split buffers: once for both layers


@interpreted
def test_store_kv_layer_after_layer_with_the_step_launches_equals_launching_each():
    require_triton()
    key, value, k_cache, v_cache, slots = kt.make_store_inputs(torch.float32, torch.int64)
    caches = [torch.stack([k_cache, v_cache]).clone() for _ in range(2)]
    launches = StepLaunches()
    for step_launches, cache in zip((launches, None), caches):
        for layer in range(2):  # the same rows into two layers (different caches)
            store_kv(key + layer, value - layer, cache[0], cache[1], slots, launches=step_launches)
    assert torch.equal(caches[0], caches[1])


# ---------------------------------------------------------------- CUDA (skipped on the CPU)


@cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_splits", [1, 4], ids=["1-split", "4-splits"])
def test_cuda_direct_launches_equal_the_dispatched_ones(fp8, num_splits):
    """On the GPU the binaries are launched directly from the second layer on, and every layer's
    output is bit for bit the plainly launched kernel's."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    q, ks, vs, tables, lens = layered_caches(torch.float32, layers=3)
    q, tables, lens = q.to(dev, torch.bfloat16), tables.to(dev), lens.to(dev)
    ks, vs = ks.to(dev, torch.bfloat16), vs.to(dev, torch.bfloat16)
    scales = {}
    if fp8:
        ks, k_scale = quantize_fp8_torch(ks)
        vs, v_scale = quantize_fp8_torch(vs)
    launches = StepLaunches()
    outs = {}
    for name, step in (("direct", launches), ("dispatched", None)):
        outs[name] = []
        for i in range(ks.shape[0]):
            if fp8:
                scales = dict(k_scale=k_scale[i], v_scale=v_scale[i])
            outs[name].append(paged_decode_attention(q, ks[i], vs[i], tables, lens, kt.HEAD_DIM**-0.5,
                                                     num_splits=num_splits, min_split_tokens=1, launches=step,
                                                     **scales))
    assert all(torch.equal(a, b) for a, b in zip(outs["direct"], outs["dispatched"]))
    assert launches.direct == (ks.shape[0] - 1) * (1 if num_splits == 1 else 2)  # the split kernel and its merge
    # store_kv with the window queries, layer after layer
    key = torch.randn(40, 2, 128, device=dev, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    query = torch.randn(40, 8, 128, device=dev, dtype=torch.bfloat16)
    slots = torch.randperm(4 * 16, device=dev)[:40]
    rows = torch.randperm(41, device=dev)[:40]
    results = []
    for step in (StepLaunches(), None):
        cache = torch.zeros(3, 2, 4, 16, 2, 128, device=dev, dtype=torch.bfloat16)
        query_cache = torch.zeros(3, 41, 8, 128, device=dev, dtype=torch.bfloat16)
        for layer in range(3):
            store_kv(key + layer, value, cache[layer, 0], cache[layer, 1], slots, query, query_cache[layer], rows,
                     launches=step)
        results.append((cache, query_cache))
        if step is not None:
            assert step.direct == 2
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
