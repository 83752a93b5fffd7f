"""Merge attention computed in parts over disjoint key sets, by their log-sum-exps.

Split-K attention of prompt chunks (``attention/triton_backend.py``) attends each query to
``pieces`` pieces of its prefix (rows ``j * tokens + t`` of one output) and to its chunk's own
keys (row ``t`` of another). Softmax over all keys is the parts' outputs weighted by their
shares of the exponentials' sum: with ``m`` the largest log-sum-exp of a query and head,
``out = sum_p exp(lse_p - m) * out_p / sum_p exp(lse_p - m)``. A piece with no keys (a
prefix shorter than the pieces) weighs nothing, whatever its rows hold; the chunk's own
part always has a key (each query sees itself).

One program per (token, query head) does it all in one launch, where the same in PyTorch is
a dozen small operations per layer, which a step's host otherwise spends launching. Its sizes
and strides change with every step's chunk, so none of them is specialized and the pieces are
padded to at least ``MIN_PIECES_PAD``: one compilation serves every step (a compilation in the
middle of serving stalls every stream for a tenth of a second or more).
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton for this platform: only the PyTorch twin is usable
    triton = None


MIN_PIECES_PAD = 16

if triton is not None:

    @triton.jit(do_not_specialize=["tokens", "pieces", "lse_p_stride_row", "lse_p_stride_head",
                                   "lse_c_stride_row", "lse_c_stride_head"])
    def _merge_parts_kernel(out_p_ptr, lse_p_ptr, out_c_ptr, lse_c_ptr, nonempty_ptr, out_ptr,
                            tokens, pieces,
                            out_p_stride_row, out_p_stride_head, lse_p_stride_row, lse_p_stride_head,
                            out_c_stride_row, out_c_stride_head, lse_c_stride_row, lse_c_stride_head,
                            out_stride_row, out_stride_head,
                            PIECES_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
        t = tl.program_id(0)
        head = tl.program_id(1)
        piece = tl.arange(0, PIECES_PAD)
        rows = (piece * tokens + t).to(tl.int64)
        keep = (piece < pieces) & (tl.load(nonempty_ptr + piece * tokens + t, mask=piece < pieces, other=0) != 0)
        lse_p = tl.load(lse_p_ptr + rows * lse_p_stride_row + head * lse_p_stride_head, mask=keep,
                        other=float("-inf")).to(tl.float32)
        lse_p = tl.where(keep, lse_p, float("-inf"))
        lse_c = tl.load(lse_c_ptr + t * lse_c_stride_row + head * lse_c_stride_head).to(tl.float32)
        top = tl.maximum(tl.max(lse_p, 0), lse_c)
        w_p = tl.where(keep, tl.exp(lse_p - top), 0.0)
        w_c = tl.exp(lse_c - top)
        dims = tl.arange(0, HEAD_DIM)
        out_p = tl.load(out_p_ptr + rows[:, None] * out_p_stride_row + head * out_p_stride_head + dims[None, :],
                        mask=keep[:, None], other=0.0).to(tl.float32)
        out_c = tl.load(out_c_ptr + t * out_c_stride_row + head * out_c_stride_head + dims).to(tl.float32)
        acc = tl.sum(out_p * w_p[:, None], 0) + out_c * w_c
        result = acc / (tl.sum(w_p, 0) + w_c)
        tl.store(out_ptr + t * out_stride_row + head * out_stride_head + dims, result.to(out_ptr.dtype.element_ty))


def _check(out_p, lse_p, out_c, lse_c, nonempty):
    tokens, heads, head_dim = out_c.shape
    pieces = nonempty.shape[0]
    assert out_p.shape == (pieces * tokens, heads, head_dim) and nonempty.shape == (pieces, tokens)
    assert lse_p.shape == (pieces * tokens, heads) and lse_c.shape == (tokens, heads)
    assert out_p.stride(2) == 1 and out_c.stride(2) == 1
    return tokens, heads, head_dim, pieces


def merge_parts(out_p, lse_p, out_c, lse_c, nonempty):
    """``out_p`` [pieces * tokens, heads, dim] and ``lse_p`` [pieces * tokens, heads] (any
    strides: a transposed view of a [heads, rows] log-sum-exp as it is), the pieces' parts,
    row ``j * tokens + t``; ``out_c`` [tokens, heads, dim] and ``lse_c`` [tokens, heads], the
    own parts; ``nonempty`` [pieces, tokens] (uint8) whether each piece had keys. Returns the merged
    [tokens, heads, dim] in ``out_c``'s dtype."""
    tokens, heads, head_dim, pieces = _check(out_p, lse_p, out_c, lse_c, nonempty)
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    assert nonempty.dtype == torch.uint8 and nonempty.is_contiguous()
    out = torch.empty_like(out_c)
    if tokens == 0:
        return out
    _merge_parts_kernel[(tokens, heads)](
        out_p, lse_p, out_c, lse_c, nonempty, out, tokens, pieces,
        out_p.stride(0), out_p.stride(1), lse_p.stride(0), lse_p.stride(1),
        out_c.stride(0), out_c.stride(1), lse_c.stride(0), lse_c.stride(1),
        out.stride(0), out.stride(1),
        PIECES_PAD=triton.next_power_of_2(max(pieces, MIN_PIECES_PAD)), HEAD_DIM=head_dim)
    return out


def merge_parts_torch(out_p, lse_p, out_c, lse_c, nonempty):
    """PyTorch twin of ``merge_parts`` (float32 math)."""
    tokens, heads, head_dim, pieces = _check(out_p, lse_p, out_c, lse_c, nonempty)
    lse = torch.cat([lse_p.float().reshape(pieces, tokens, heads), lse_c.float()[None]])
    lse[:-1].masked_fill_(nonempty[..., None] == 0, float("-inf"))
    weights = torch.softmax(lse, dim=0)[..., None]  # [pieces + 1, tokens, heads, 1]
    parts = torch.cat([out_p.reshape(pieces, tokens, heads, head_dim), out_c[None]])
    parts = torch.where(weights > 0, parts.float(), 0.0)
    return (parts * weights).sum(0).to(out_c.dtype)
