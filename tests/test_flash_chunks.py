"""Prompt chunks behind a cached prefix through flash attention: the context gathered from
the paged cache, then varlen attention with its diagonal aligned at the end.

On the CPU, torch has no varlen flash attention: a stand-in with the same signature (one
masked SDPA per sequence, the mask aligned at the end) checks the gathering, the packing
of unequal contexts and the float8 dequantization against the paged-prefill twin. The
CUDA test runs torch's varlen attention itself against the Triton paged-prefill kernel,
which checks the end alignment the stand-in assumes.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import zipage.attention.triton_backend as tb  # noqa: E402
from zipage.attention.metadata import AttentionMetadata  # noqa: E402
from zipage.kernels.common import FP8_DTYPE, quantize_fp8_torch  # noqa: E402
from zipage.kernels.merge_parts import merge_parts, merge_parts_torch  # noqa: E402
from zipage.kernels.paged_prefill import paged_prefill_attention, paged_prefill_attention_torch  # noqa: E402
from tests.conftest import relative_error, require_triton  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 32, 8
# Where Triton kernels run: the interpreter on CPU tensors, else (TRITON_INTERPRET=0) a GPU.
KERNEL_DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def require_kernel_device():
    require_triton()
    if KERNEL_DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 runs Triton kernels on a GPU, and none is visible")


def varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """Causal varlen attention, each sequence's diagonal aligned at its last key."""
    assert window_size == (-1, 0) and enable_gqa
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        n, c = qs.stop - qs.start, ks.stop - ks.start
        assert n <= max_q and c <= max_k
        visible = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
        queries = q[qs].transpose(0, 1).float()
        keys = k[ks].transpose(0, 1).float().repeat_interleave(group, 0)
        values = v[ks].transpose(0, 1).float().repeat_interleave(group, 0)
        out[qs] = F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible,
                                                 scale=scale).transpose(0, 1).to(q.dtype)
    return out


def varlen_without_gqa(tokens_first):
    """A stand-in for a torch whose varlen attention cannot group query heads but returns its
    log-sum-exp ([tokens, heads] if ``tokens_first``, else [heads, tokens]) and takes a window.
    A sequence without keys gets NaN rows, the worst an implementation could leave there."""

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        assert k.shape[1] == q.shape[1] and window_size in ((-1, 0), (-1, -1))
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:2], float("nan"))
        for i in range(len(cu_q) - 1):
            qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
            n, c = qs.stop - qs.start, ks.stop - ks.start
            assert n <= max_q and c <= max_k
            if c == 0:
                continue
            scores = (q[qs].transpose(0, 1).double() @ k[ks].permute(1, 2, 0).double()) * scale
            if window_size == (-1, 0):
                visible = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
                scores = scores.masked_fill(~visible, float("-inf"))
            out[qs] = (scores.softmax(-1) @ v[ks].transpose(0, 1).double()).transpose(0, 1).to(q.dtype)
            lse[qs] = scores.logsumexp(-1).transpose(0, 1).float()
        if return_aux is None:
            return out
        return out, lse if tokens_first else lse.transpose(0, 1).contiguous()

    return attend


def flash_operator_stand_in(calls):
    """A stand-in for ``torch.ops.aten._flash_attention_forward`` (causal calls only): its
    keys and values keep their fewer heads, as the kernel takes them."""

    def operator(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale,
                 window_size_left, window_size_right):
        assert dropout_p == 0.0 and is_causal and not return_debug_mask
        assert (window_size_left, window_size_right) == (-1, 0) and k.shape[1] < q.shape[1]
        calls.append(k.shape[0])
        out = varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0), enable_gqa=True)
        return out, None, None, None, None

    return operator


def chunk_step(device, dtype, chunks, seed=0, fp8=False):
    """A prefill step of chunks (queries, context) over random paged caches: (q, caches,
    scales, metadata)."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-context // BLOCK) for _, context in chunks]
    num_blocks = sum(pages) + 3
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(chunks), max(pages), dtype=torch.int32)
    used = 0
    for i, p in enumerate(pages):
        tables[i, :p] = order[used:used + p]
        used += p
    cu_q = torch.tensor([0] + [n for n, _ in chunks]).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), HEADS, HEAD_DIM, generator=g).to(device, dtype)
    scales = {}
    if fp8:
        k_cache, k_scale = quantize_fp8_torch(k_cache)
        v_cache, v_scale = quantize_fp8_torch(v_cache)
        scales = dict(k_scale=k_scale.to(device), v_scale=v_scale.to(device))
    else:
        k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    lens = torch.tensor([c for _, c in chunks], dtype=torch.int32)
    meta = AttentionMetadata(
        is_prefill=True, slot_mapping=torch.empty(0, device=device), context_lens=lens.to(device),
        block_tables=tables.to(device), cu_seqlens_q=cu_q.to(device), max_seqlen_q=max(n for n, _ in chunks),
        max_seqlen_k=int(lens.max()), has_cached_prefix=True, total_seqlen_k=int(lens.sum()))
    return q, k_cache.to(device), v_cache.to(device), scales, meta


def paged_reference(q, k_cache, v_cache, meta, **scales):
    """The paged-prefill twin's attention of a chunk step, in float64."""
    return paged_prefill_attention_torch(q.double(), k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                         meta.context_lens, meta.max_seqlen_q, HEAD_DIM ** -0.5, **scales)


CHUNKS = [(5, 21), (1, 9), (8, 8), (3, 40)]  # (queries, context): prefixes of 16, 8, 0 and 37 tokens


@pytest.mark.parametrize("fp8", [False, True])
def test_gathered_context_through_varlen_equals_paged_prefill(monkeypatch, fp8):
    if fp8 and FP8_DTYPE is None:
        pytest.skip("this torch has no float8")
    monkeypatch.setattr(tb, "varlen_attn", varlen_stand_in)
    monkeypatch.setattr(tb, "_VARLEN_PARAMS", {"scale", "window_size", "enable_gqa"})
    dtype = torch.float16
    q, k_cache, v_cache, scales, meta = chunk_step("cpu", dtype, CHUNKS, fp8=fp8)
    backend = tb.TritonBackend(use_flash_prefill=True)
    out = backend.prefill(q, None, None, k_cache, v_cache, meta, HEAD_DIM ** -0.5, **scales)
    assert meta.context_slots is not None  # kept for the next layers
    ref = paged_prefill_attention_torch(q.float(), k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                        meta.context_lens, meta.max_seqlen_q, HEAD_DIM ** -0.5, **scales)
    assert relative_error(out, ref) < 2e-3
    # The second layer reuses the slots and agrees.
    again = backend.prefill(q, None, None, k_cache, v_cache, meta, HEAD_DIM ** -0.5, **scales)
    assert torch.equal(again, out)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tokens_first", [True, False])
def test_two_part_attention_without_grouped_varlen_equals_paged_prefill(monkeypatch, fp8, tokens_first):
    if fp8 and FP8_DTYPE is None:
        pytest.skip("this torch has no float8")
    monkeypatch.setattr(tb, "varlen_attn", varlen_without_gqa(tokens_first))
    monkeypatch.setattr(tb, "_VARLEN_PARAMS", {"scale", "window_size", "return_aux"})
    monkeypatch.setattr(tb, "_LSE_TOKENS_FIRST", {})
    gathered = []
    monkeypatch.setattr(tb, "gather_context", lambda *a, **k: gathered.append(1))  # the other path
    q, k_cache, v_cache, scales, meta = chunk_step("cpu", torch.float16, CHUNKS, seed=1, fp8=fp8)
    backend = tb.TritonBackend(use_flash_prefill=True)
    out = backend.prefill(q, None, None, k_cache, v_cache, meta, HEAD_DIM ** -0.5, **scales)
    assert not gathered and meta.split_slots is not None
    assert torch.isfinite(out).all()  # the sequence without a prefix took its own part alone
    ref = paged_reference(q, k_cache, v_cache, meta, **scales)
    assert relative_error(out, ref) < 2e-3
    again = backend.prefill(q, None, None, k_cache, v_cache, meta, HEAD_DIM ** -0.5, **scales)
    assert torch.equal(again, out)


@pytest.mark.parametrize("fp8", [False, True])
def test_the_flash_operator_called_directly_takes_the_grouped_heads_as_they_are(monkeypatch, fp8):
    if fp8 and FP8_DTYPE is None:
        pytest.skip("this torch has no float8")
    calls = []
    monkeypatch.setattr(tb, "_flash_op", lambda: flash_operator_stand_in(calls))
    monkeypatch.setitem(tb._direct_flash, "device_types", ("cpu", "cuda"))
    monkeypatch.setitem(tb._direct_flash, "usable", True)
    # A wrapper that could only do the two parts: the direct call must come first.
    monkeypatch.setattr(tb, "varlen_attn", None)
    monkeypatch.setattr(tb, "_VARLEN_PARAMS", {"scale", "window_size", "return_aux"})
    q, k_cache, v_cache, scales, meta = chunk_step("cpu", torch.float16, CHUNKS, seed=2, fp8=fp8)
    backend = tb.TritonBackend(use_flash_prefill=True)
    backend.use_flash_prefill = True  # this torch's varlen wrapper was patched away
    out = backend.prefill(q, None, None, k_cache, v_cache, meta, HEAD_DIM ** -0.5, **scales)
    assert calls == [sum(context for _, context in CHUNKS)] and meta.split_slots is None
    ref = paged_reference(q, k_cache, v_cache, meta, **scales)
    assert relative_error(out, ref) < 2e-3


def flash_operator_with_lse(calls, tokens_first=False):
    """A stand-in for the operator with both masks and its log-sum-exp ([heads, tokens] as
    FlashAttention-2 returns it, or [tokens, heads]); a sequence without keys gets NaN rows."""

    def operator(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale,
                 window_size_left, window_size_right):
        assert dropout_p == 0.0 and not return_debug_mask and window_size_left == -1
        assert window_size_right == (0 if is_causal else -1) and k.shape[1] <= q.shape[1]
        if q.shape[:2] != (3, 1):  # not the layout probe
            calls.append((is_causal, k.shape[0], q.shape[0]))
        group = q.shape[1] // k.shape[1]
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:2], float("nan"))
        for i in range(len(cu_q) - 1):
            qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
            n, c = qs.stop - qs.start, ks.stop - ks.start
            assert n <= max_q and c <= max_k, (n, max_q, c, max_k)
            if c == 0 or n == 0:
                continue
            keys = k[ks].permute(1, 2, 0).double().repeat_interleave(group, 0)
            scores = (q[qs].transpose(0, 1).double() @ keys) * scale
            if is_causal:
                visible = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
                scores = scores.masked_fill(~visible, float("-inf"))
            values = v[ks].transpose(0, 1).double().repeat_interleave(group, 0)
            out[qs] = (scores.softmax(-1) @ values).transpose(0, 1).to(q.dtype)
            lse[qs] = scores.logsumexp(-1).transpose(0, 1).float()
        return out, lse if tokens_first else lse.transpose(0, 1).contiguous(), None, None, None

    return operator


# Prefixes of 16, 8, 0, 37 and 2 tokens: with 3 to 5 pieces, some pieces are empty.
PIECE_CHUNKS = CHUNKS + [(2, 4)]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("pieces,tokens_first,kernel", [(2, False, False), (3, True, True), (5, False, True)])
def test_split_k_chunk_attention_equals_paged_prefill(monkeypatch, fp8, pieces, tokens_first, kernel):
    """Prefixes split into pieces attended to without a mask, the chunks' own keys causally, the
    parts merged by their log-sum-exps (the Triton kernel, or its twin): the float64 paged
    reference, also where pieces are empty."""
    if fp8 and FP8_DTYPE is None:
        pytest.skip("this torch has no float8")
    if kernel:
        if KERNEL_DEVICE != "cpu":
            pytest.skip("the kernel on CPU tensors runs in the interpreter; on a GPU, see the CUDA test")
        require_triton()
        monkeypatch.setattr(tb, "merge_parts_torch", merge_parts)  # CPU tensors: the kernel, interpreted
    calls = []
    monkeypatch.setattr(tb, "_flash_op", lambda: flash_operator_with_lse(calls, tokens_first))
    monkeypatch.setitem(tb._direct_flash, "device_types", ("cpu", "cuda"))
    monkeypatch.setitem(tb._direct_flash, "usable", True)
    monkeypatch.setattr(tb, "prefix_pieces", lambda meta, heads, device: pieces)
    monkeypatch.setattr(tb, "_DIRECT_LSE_TOKENS_FIRST", {})
    q, k_cache, v_cache, scales, meta = chunk_step("cpu", torch.float16, PIECE_CHUNKS, seed=6, fp8=fp8)
    backend = tb.TritonBackend(use_flash_prefill=True)
    backend.use_flash_prefill = True
    out = backend.prefill(q, None, None, k_cache, v_cache, meta, HEAD_DIM ** -0.5, **scales)
    tokens, prefix = q.shape[0], sum(c - n for n, c in PIECE_CHUNKS)
    assert calls == [(False, prefix, pieces * tokens), (True, tokens, tokens)]
    assert torch.isfinite(out).all()
    ref = paged_reference(q, k_cache, v_cache, meta, **scales)
    assert relative_error(out, ref) < 2e-3
    again = backend.prefill(q, None, None, k_cache, v_cache, meta, HEAD_DIM ** -0.5, **scales)
    assert torch.equal(again, out) and len(calls) == 4  # the next layer reuses the slots


def _merge_reference(out_p, lse_p, out_c, lse_c, nonempty):
    """Float64 softmax over the parts' keys: each part's output weighted by exp(lse)."""
    pieces, tokens = nonempty.shape
    lse = torch.cat([lse_p.double().reshape(pieces, tokens, -1), lse_c.double()[None]])
    keep = torch.cat([nonempty.bool(), torch.ones(1, tokens, dtype=torch.bool)])[..., None]
    weights = torch.where(keep, lse.exp(), 0.0)[..., None]
    parts = torch.cat([out_p.double().reshape(pieces, tokens, *out_c.shape[1:]), out_c.double()[None]])
    parts = torch.where(weights > 0, parts, 0.0)
    return (parts * weights).sum(0) / weights.sum(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("pieces,tokens,heads_first", [(2, 5, True), (3, 1, False), (6, 7, True)])
def test_merge_parts_kernel_matches_its_twin_and_float64(dtype, pieces, tokens, heads_first):
    """Fresh random parts; empty pieces hold NaN (what an operator may leave there) and +inf
    log-sum-exps; the pieces' log-sum-exp as a transposed view of [heads, rows], as the flash
    operator returns it."""
    require_kernel_device()
    g = torch.Generator().manual_seed(pieces * 10 + tokens)
    heads, dim = 3, 16
    out_p = torch.randn(pieces * tokens, heads, dim, generator=g).to(dtype)
    out_c = torch.randn(tokens, heads, dim, generator=g).to(dtype)
    lse_p = torch.randn(pieces * tokens, heads, generator=g) * 4
    lse_c = torch.randn(tokens, heads, generator=g) * 4
    nonempty = (torch.rand(pieces, tokens, generator=g) > 0.3).to(torch.uint8)
    empty_rows = (nonempty == 0).flatten()
    out_p[empty_rows] = float("nan")
    lse_p[empty_rows] = float("inf")
    if heads_first:
        lse_p, lse_c = lse_p.t().contiguous().t(), lse_c.t().contiguous().t()
    ref = _merge_reference(out_p, lse_p, out_c, lse_c, nonempty)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    twin = merge_parts_torch(out_p, lse_p, out_c, lse_c, nonempty)
    out = merge_parts(*(t.to(KERNEL_DEVICE) for t in (out_p, lse_p, out_c, lse_c, nonempty))).cpu()
    assert out.dtype == twin.dtype == dtype and torch.isfinite(out).all()
    assert relative_error(twin, ref) < tolerance and relative_error(out, ref) < tolerance


def test_cuda_merge_parts_compiles_once_for_every_step():
    """Steps' chunks differ in tokens, pieces and log-sum-exp strides; a compilation for a new
    combination would stall every stream mid-serving, so one binary must serve them all."""
    if KERNEL_DEVICE != "cuda" or not torch.cuda.is_available():
        pytest.skip("compiled kernels need a GPU (TRITON_INTERPRET=0)")
    from zipage.kernels import merge_parts as module

    kernel = module._merge_parts_kernel
    kernel.device_caches.clear()
    heads, dim = 32, 128
    for pieces, tokens in [(2, 1), (2, 16), (3, 33), (5, 48), (16, 7), (9, 128)]:
        for heads_first in (False, True):
            out_p = torch.randn(pieces * tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
            out_c = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
            lse_p = torch.randn(pieces * tokens, heads, device="cuda")
            lse_c = torch.randn(tokens, heads, device="cuda")
            if heads_first:
                lse_p, lse_c = lse_p.t().contiguous().t(), lse_c.t().contiguous().t()
            nonempty = torch.ones(pieces, tokens, dtype=torch.uint8, device="cuda")
            merge_parts(out_p, lse_p, out_c, lse_c, nonempty)
    binaries = sum(len(entry[0]) for entry in kernel.device_caches.values())
    assert binaries == 1


@pytest.mark.parametrize("tokens_first", [False, True])
def test_split_k_with_as_many_rows_as_heads(monkeypatch, tokens_first):
    """Two one-query chunks in two pieces: 4 rows of 4 heads, whose log-sum-exp's layout its
    shape cannot tell (the probe does)."""
    calls = []
    monkeypatch.setattr(tb, "_flash_op", lambda: flash_operator_with_lse(calls, tokens_first))
    monkeypatch.setitem(tb._direct_flash, "device_types", ("cpu", "cuda"))
    monkeypatch.setitem(tb._direct_flash, "usable", True)
    monkeypatch.setattr(tb, "prefix_pieces", lambda meta, heads, device: 2)
    monkeypatch.setattr(tb, "_DIRECT_LSE_TOKENS_FIRST", {})
    q, k_cache, v_cache, _, meta = chunk_step("cpu", torch.float16, [(1, 30), (1, 20)], seed=9)
    assert 2 * q.shape[0] == HEADS
    out = tb.TritonBackend(use_flash_prefill=True).prefill(q, None, None, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    assert calls[0] == (False, 48, 4)
    assert relative_error(out, paged_reference(q, k_cache, v_cache, meta)) < 2e-3


def test_piece_slots_list_pieces_by_piece_then_the_chunks():
    q, _, _, _, meta = chunk_step("cpu", torch.float32, PIECE_CHUNKS)
    slots, cu_rep, cu_k, nonempty = tb.piece_slots(meta, BLOCK, q.shape[0], 3)
    prefixes = [c - n for n, c in PIECE_CHUNKS]  # 16, 8, 0, 37, 2
    sizes = [-(-p // 3) for p in prefixes]  # 6, 3, 0, 13, 1
    lens = [[max(0, min(size, p - j * size)) for p, size in zip(prefixes, sizes)] for j in range(3)]
    assert cu_k.tolist() == [0, *torch.tensor(lens).flatten().cumsum(0).tolist()]
    tokens = q.shape[0]
    cu_q = meta.cu_seqlens_q.tolist()
    assert cu_rep.tolist() == [j * tokens + c for j in range(3) for c in cu_q[:-1]] + [3 * tokens]

    def slot(i, pos):
        return int(meta.block_tables[i, pos // BLOCK]) * BLOCK + pos % BLOCK
    expected = [slot(i, j * sizes[i] + t) for j in range(3) for i in range(len(prefixes)) for t in range(lens[j][i])]
    expected += [slot(i, p + t) for i, ((n, _), p) in enumerate(zip(PIECE_CHUNKS, prefixes)) for t in range(n)]
    assert slots.tolist() == expected
    rows = [i for i, (n, _) in enumerate(PIECE_CHUNKS) for _ in range(n)]
    assert nonempty.tolist() == [[lens[j][i] > 0 for i in rows] for j in range(3)]


def test_prefix_pieces_fill_the_gpu_only_where_the_chunks_do_not(monkeypatch):
    monkeypatch.setattr(tb, "multiprocessor_count", lambda device: 132)

    def meta(max_q, max_k, batch=1):
        return AttentionMetadata(is_prefill=True, slot_mapping=torch.empty(0), context_lens=torch.zeros(batch),
                                 block_tables=torch.empty(0), max_seqlen_q=max_q, max_seqlen_k=max_k)
    # 90 queries, 32 heads, 40K keys deep: 32 programs, 8 pieces fill two per SM
    assert tb.prefix_pieces(meta(90, 40_000), 32, "cuda") == 8
    assert tb.prefix_pieces(meta(512, 40_000), 32, "cuda") == 2  # four query tiles
    assert tb.prefix_pieces(meta(90, 26_000), 32, "cuda") == 6  # pieces of at least 4,096 keys
    assert tb.prefix_pieces(meta(90, 8_000), 32, "cuda") == 1
    assert tb.prefix_pieces(meta(2048, 26_000), 32, "cuda") == 1  # the chunk fills the GPU itself
    assert tb.prefix_pieces(meta(1, 500_000), 1, "cuda") == tb.FLASH_MAX_PIECES


@pytest.mark.parametrize("split", [False, True])
def test_a_refused_direct_call_falls_back_to_the_wrapper_for_good(monkeypatch, caplog, split):
    """The operator refusing a call (the one causal call, or split-K's first, unmasked, call):
    a warning, then torch's varlen wrapper for this call and every later one."""
    def refuse(*args, **kwargs):
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")

    monkeypatch.setattr(tb, "_flash_op", lambda: refuse)
    monkeypatch.setitem(tb._direct_flash, "device_types", ("cpu", "cuda"))
    monkeypatch.setitem(tb._direct_flash, "usable", True)
    monkeypatch.setattr(tb, "prefix_pieces", lambda meta, heads, device: 2 if split else 1)
    monkeypatch.setattr(tb, "varlen_attn", varlen_stand_in)
    monkeypatch.setattr(tb, "_VARLEN_PARAMS", {"scale", "window_size", "enable_gqa"})
    q, k_cache, v_cache, _, meta = chunk_step("cpu", torch.float16, PIECE_CHUNKS if split else CHUNKS, seed=4)
    with caplog.at_level("WARNING", logger="zipage.attention.triton_backend"):
        out = tb.TritonBackend(use_flash_prefill=True).prefill(q, None, None, k_cache, v_cache, meta,
                                                               HEAD_DIM ** -0.5)
    assert not tb._direct_flash["usable"] and "refused a direct call" in caplog.text
    assert (meta.piece_slots is not None) == split
    assert relative_error(out, paged_reference(q, k_cache, v_cache, meta)) < 2e-3


def test_two_part_slots_list_prefixes_then_chunks():
    q, k_cache, v_cache, _, meta = chunk_step("cpu", torch.float32, CHUNKS)
    slots, cu_p, has_prefix = tb.split_context_slots(meta, BLOCK, q.shape[0])
    prefixes = [context - n for n, context in CHUNKS]
    assert cu_p.tolist() == [0, 16, 24, 24, 61]
    assert has_prefix.flatten().tolist() == [p > 0 for (n, _), p in zip(CHUNKS, prefixes) for _ in range(n)]

    def slot(i, pos):
        return int(meta.block_tables[i, pos // BLOCK]) * BLOCK + pos % BLOCK
    expected = [slot(i, pos) for i, p in enumerate(prefixes) for pos in range(p)]
    expected += [slot(i, p + j) for i, ((n, _), p) in enumerate(zip(CHUNKS, prefixes)) for j in range(n)]
    assert slots.tolist() == expected


def test_context_slots_follow_the_block_tables():
    q, k_cache, v_cache, _, meta = chunk_step("cpu", torch.float32, CHUNKS)
    slots, cu_k = tb.context_slots(meta, BLOCK)
    assert cu_k.tolist() == [0, 21, 30, 38, 78]
    for i, (_, context) in enumerate(CHUNKS):
        for pos in (0, context // 2, context - 1):
            expected = int(meta.block_tables[i, pos // BLOCK]) * BLOCK + pos % BLOCK
            assert int(slots[int(cu_k[i]) + pos]) == expected


def test_a_context_too_large_to_gather_reads_the_cache_in_place(monkeypatch):
    calls = []
    monkeypatch.setattr(tb, "varlen_attn", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(tb, "_VARLEN_PARAMS", {"scale", "window_size", "enable_gqa"})
    monkeypatch.setattr(tb, "FLASH_GATHER_MAX_BYTES", 100)
    monkeypatch.setattr(tb, "paged_prefill_attention", paged_prefill_attention_torch)  # CPU tensors on any run
    q, k_cache, v_cache, _, meta = chunk_step("cpu", torch.float16, CHUNKS)
    out = tb.TritonBackend(use_flash_prefill=True).prefill(q, None, None, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    ref = paged_prefill_attention_torch(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                                        meta.max_seqlen_q, HEAD_DIM ** -0.5)
    assert not calls and torch.equal(out, ref)


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
                    or tb.varlen_attn is None, reason="needs a CUDA GPU with varlen flash attention")
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("direct", [True, False])
def test_cuda_flash_chunks_equal_the_paged_prefill_kernel(monkeypatch, fp8, direct):
    # Realistic sizes: chunks of 64-512 queries behind prefixes of up to 3,000 tokens; the flash
    # operator called directly, or (direct=False) torch's varlen wrapper: with grouped heads where
    # it has them, else the two-part attention.
    monkeypatch.setitem(tb._direct_flash, "usable", direct)
    global HEADS, KV_HEADS, HEAD_DIM, BLOCK
    saved = HEADS, KV_HEADS, HEAD_DIM, BLOCK
    HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 256
    try:
        chunks = [(512, 3000), (64, 64), (200, 1300), (1, 777)]
        q, k_cache, v_cache, scales, meta = chunk_step("cuda", torch.bfloat16, chunks, seed=3, fp8=fp8)
        out = tb.TritonBackend(use_flash_prefill=True).prefill(q, None, None, k_cache, v_cache, meta,
                                                               HEAD_DIM ** -0.5, **scales)
        ref = paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                                      meta.max_seqlen_q, HEAD_DIM ** -0.5, **scales)
        assert relative_error(out, ref) < 1e-2
        assert tb._direct_flash["usable"] == direct  # a direct call was not refused
    finally:
        HEADS, KV_HEADS, HEAD_DIM, BLOCK = saved


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
                    or tb.varlen_attn is None, reason="needs a CUDA GPU with varlen flash attention")
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_deep_chunks_split_k_equal_the_paged_prefill_kernel(fp8):
    """Chunks of few queries deep into their prompts: split into pieces by the operator's own
    calls (the real operator's log-sum-exp layout and unmasked call), against the Triton kernel."""
    global HEADS, KV_HEADS, HEAD_DIM, BLOCK
    saved = HEADS, KV_HEADS, HEAD_DIM, BLOCK
    HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 256
    try:
        chunks = [(90, 20_000), (1, 3_000), (7, 7)]
        q, k_cache, v_cache, scales, meta = chunk_step("cuda", torch.bfloat16, chunks, seed=8, fp8=fp8)
        assert tb.prefix_pieces(meta, HEADS, q.device) > 1
        out = tb.TritonBackend(use_flash_prefill=True).prefill(q, None, None, k_cache, v_cache, meta,
                                                               HEAD_DIM ** -0.5, **scales)
        assert meta.piece_slots is not None and tb._direct_flash["usable"]
        ref = paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                                      meta.max_seqlen_q, HEAD_DIM ** -0.5, **scales)
        assert relative_error(out, ref) < 1e-2
    finally:
        HEADS, KV_HEADS, HEAD_DIM, BLOCK = saved


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
                    or tb.varlen_attn is None, reason="needs a CUDA GPU with varlen flash attention")
@pytest.mark.parametrize("direct", [True, False])
def test_cuda_first_chunks_attend_to_themselves_causally(monkeypatch, direct):
    """Prompt chunks with no cached prefix: flash attention on the step's own grouped keys and
    values, against the masked-SDPA stand-in on the CPU."""
    monkeypatch.setitem(tb._direct_flash, "usable", direct)
    g = torch.Generator().manual_seed(5)
    lens = [300, 1, 77, 512]
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), 32, 128, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(int(cu[-1]), 8, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.empty(0, device="cuda"),
                             context_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
                             block_tables=torch.zeros(len(lens), 1, dtype=torch.int32, device="cuda"),
                             cu_seqlens_q=cu.cuda(), max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    out = tb.TritonBackend(use_flash_prefill=True).prefill(q.cuda(), k.cuda(), v.cuda(), None, None, meta,
                                                           128 ** -0.5)
    ref = varlen_stand_in(q.float(), k.float(), v.float(), cu, cu, max(lens), max(lens), scale=128 ** -0.5,
                          window_size=(-1, 0), enable_gqa=True)
    assert relative_error(out.cpu(), ref) < 1e-2
    assert tb._direct_flash["usable"] == direct


def test_running_out_of_memory_is_not_taken_for_a_refusal(monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(tb, "_flash_op", lambda: out_of_memory)
    monkeypatch.setitem(tb._direct_flash, "device_types", ("cpu", "cuda"))
    monkeypatch.setitem(tb._direct_flash, "usable", True)
    q, k_cache, v_cache, _, meta = chunk_step("cpu", torch.float16, CHUNKS)
    monkeypatch.setattr(tb, "_VARLEN_PARAMS", {"scale", "window_size", "enable_gqa"})
    with pytest.raises(torch.OutOfMemoryError):
        tb.TritonBackend(use_flash_prefill=True).prefill(q, None, None, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    assert tb._direct_flash["usable"]
