"""Programmatic dependent launch (``kernels.common.PDL``): where it turns on, that every kernel of a
decode step launches with it and waits for the kernel before it before touching memory, and (on a
GPU) that an engine's tokens do not change with it."""

import ast
import importlib
import inspect
import textwrap

import pytest
import torch

from tests import test_kernels as kt
from tests.conftest import TEST_DEVICE, make_llm, require_triton
from zipage.kernels import common

cuda = pytest.mark.skipif(TEST_DEVICE != "cuda" or not torch.cuda.is_available(), reason="needs a CUDA GPU")
PDL_ARGS = {"PDL": True, "launch_pdl": True}


def _modules():
    """The kernel modules of a decode step (``zipage.kernels`` exports functions of the same names)."""
    return [importlib.import_module(f"zipage.kernels.{name}")
            for name in ("fp8_linear", "norm_rope", "paged_decode", "store_kv")]


def _step_kernels():
    """The Triton kernels a decode step runs, by name."""
    fp8_linear, norm_rope, paged_decode, store_kv = _modules()
    return {
        "_add_rms_norm_kernel": norm_rope._add_rms_norm_kernel,
        "_norm_rope_kernel": norm_rope._norm_rope_kernel,
        "_store_kv_kernel": store_kv._store_kv_kernel,
        "_decode_split_kernel": paged_decode._decode_split_kernel,
        "_decode_fp8_probs_kernel": paged_decode._decode_fp8_probs_kernel,
        "_decode_merge_kernel": paged_decode._decode_merge_kernel,
        "_fp8_dot_kernel": fp8_linear._fp8_dot_kernel,
        "_fp8_dot_tma_kernel": fp8_linear._fp8_dot_tma_kernel,
        "_quantize_rows_kernel": fp8_linear._quantize_rows_kernel,
        "_silu_mul_quantize_kernel": fp8_linear._silu_mul_quantize_kernel,
    }


def test_pdl_turns_on_only_where_asked_and_the_device_has_it(monkeypatch):
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(common, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(common, "gdc_wait", object())  # a Triton with grid dependency control
    monkeypatch.setattr(common, "PDL", False)
    assert common.pdl_launch(gpu) == {}
    monkeypatch.setattr(common, "PDL", True)
    monkeypatch.setattr(common, "PDL_EARLY_TRIGGER", True)
    assert common.pdl_launch(gpu) == {"PDL": 1, "launch_pdl": True}
    assert common.pdl_launch(torch.device("cpu")) == {}  # the interpreter never sees the arguments
    monkeypatch.setattr(common, "PDL_EARLY_TRIGGER", False)  # the next kernel launches as this one exits
    assert common.pdl_launch(gpu) == {"PDL": 2, "launch_pdl": True}
    monkeypatch.setattr(common, "device_capability", lambda device: (8, 9))  # Ada: no PDL
    assert common.pdl_launch(gpu) == {}
    monkeypatch.setattr(common, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(common, "gdc_wait", None)
    assert common.pdl_launch(gpu) == {}
    assert common.split_pdl({}) == ({"PDL": False}, {})
    assert common.split_pdl(PDL_ARGS) == ({"PDL": True}, {"launch_pdl": True})


def test_every_step_kernel_waits_for_the_kernel_before_it_first():
    """Each step kernel takes ``PDL`` and, before anything else (its docstring aside), calls
    ``wait_for_previous_kernel(PDL)``: no load or store can come before the wait."""
    require_triton()
    for name, kernel in _step_kernels().items():
        assert "PDL" in kernel.arg_names, name
        body = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn))).body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        first = body[0]
        assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Call), name
        assert ast.unparse(first.value) == "wait_for_previous_kernel(PDL)", name


class _Recorder:
    """Stands for a Triton kernel: records the keyword arguments of each launch, runs nothing."""

    def __init__(self, name, launches):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.name, kwargs))


def test_the_step_kernels_launch_with_pdl_when_it_is_on(monkeypatch):
    """With PDL on, each wrapper passes its kernel ``PDL=True`` and Triton's ``launch_pdl``: the
    norms (plain and quantizing), query/key norm and RoPE, the KV store, decode attention and its
    merge, the activation quantizers and both fp8 matmul kernels."""
    require_triton()
    from zipage.kernels.fp8_linear import W8A16Config

    fp8_linear, norm_rope, paged_decode, store_kv = _modules()
    launched = []
    for module in (fp8_linear, norm_rope, paged_decode, store_kv):
        monkeypatch.setattr(module, "pdl_launch", lambda device: dict(PDL_ARGS))
    for name in _step_kernels():
        for module in (fp8_linear, norm_rope, paged_decode, store_kv):
            if hasattr(module, name) and name != "_decode_fp8_probs_kernel":
                monkeypatch.setattr(module, name, _Recorder(name, launched))

    x, weight = torch.randn(3, 64), torch.ones(64)
    norm_rope._add_rms_norm(x, x.clone(), weight, 1e-6)
    norm_rope._add_rms_norm(x, None, weight, 1e-6, quantize=True)
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    norm_rope.norm_rope_triton(torch.arange(3), q, k, torch.randn(8, 16), torch.ones(16), torch.ones(16), 1e-6)
    store_kv.store_kv(*kt.make_store_inputs(torch.float32, torch.int64))
    q, k_cache, v_cache, tables, lens = kt.make_decode_inputs(4, 16, torch.float32)
    paged_decode.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, num_splits=3, min_split_tokens=1)
    xq, x_scale = fp8_linear.quantize_rows_fp8(torch.randn(3, 64))
    fp8_linear.silu_mul_quantize(torch.randn(3, 128))
    w8 = torch.zeros(32, 64, dtype=torch.float8_e4m3fn)
    scale = torch.ones(32)
    fp8_linear.w8a8_linear_quantized(xq, x_scale, w8, scale, None, torch.float32, W8A16Config(16, 32, 64, 1))
    if fp8_linear.TensorDescriptor is not None:
        fp8_linear.w8a8_linear_quantized(xq, x_scale, w8, scale, None, torch.float32,
                                         W8A16Config(16, 32, 64, 1, swap_ab=True, tma=True))
    names = {name for name, _ in launched}
    expected = set(_step_kernels()) - {"_decode_fp8_probs_kernel"}
    if fp8_linear.TensorDescriptor is None:
        expected.discard("_fp8_dot_tma_kernel")
    assert names == expected
    assert all(kwargs.get("PDL") is True and kwargs.get("launch_pdl") is True for _, kwargs in launched), launched


# ---------------------------------------------------------------- CUDA (skipped on the CPU)


@cuda
@pytest.mark.parametrize("early", [True, False], ids=["early-trigger", "trigger-at-exit"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_cuda_engine_tokens_are_the_same_with_pdl(checkpoint_dir, monkeypatch, fp8, early):
    """An engine with CUDA graphs (the decode step's kernels captured with their programmatic
    dependencies) and eagerly: the same greedy tokens with PDL as without, whichever the trigger."""
    from zipage import SamplingParams

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    model_dir = checkpoint_dir("qwen3")
    options = dict(dtype="bfloat16", max_model_len=160)
    if fp8:
        options.update(quantization="fp8", kv_cache_dtype="fp8")
    prompts = [list(range(5, 40)), [3, 1, 4, 1, 5, 9, 2, 6], list(range(100, 120))]
    tokens = {}
    monkeypatch.setattr(common, "PDL_EARLY_TRIGGER", early)
    for pdl in (False, True):
        monkeypatch.setattr(common, "PDL", pdl)
        for eager in (False, True):
            with make_llm(model_dir, enforce_eager=eager, **options) as llm:
                outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                                       use_tqdm=False)
            tokens[pdl, eager] = [o.outputs[0].token_ids for o in outputs]
    assert tokens[True, False] == tokens[False, False]
    assert tokens[True, True] == tokens[False, True]
