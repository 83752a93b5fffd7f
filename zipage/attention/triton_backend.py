"""GPU attention: Triton kernels for the cache and decode, flash attention for prefill.

Prefill goes through torch's variable-length flash attention when this torch has it.
Without a cached prefix it reads the keys and values straight from the step's
projections. With one (a prompt chunk after the first, or a prefix-cache hit), every
sequence's context is first gathered from the paged cache into one packed tensor (a
float8 cache dequantized to the queries' dtype), which costs a copy of the context's
keys and values per layer: for a chunk of n queries over c keys, 4 * c * kv_heads *
head_dim bytes against 4 * n * c * heads * head_dim FLOPs of attention, small beside
them from a few dozen queries on. Without flash attention (or in float32) the Triton
kernel reads the paged cache itself.

On a GPU the flash-attention operator is called directly
(``torch.ops.aten._flash_attention_forward``, which the varlen wrapper calls too): the
kernel groups query heads over fewer KV heads itself, which torch 2.11's wrapper does not
let through, and the call skips the wrapper's custom-operator layer, about 70 us of host
time a call, 36 calls a step. Should the operator refuse a call, the wrapper serves every
later one. Through a wrapper without a grouped-query option the context's keys and values
would have to be repeated for every query head of a group: for Qwen3-8B's groups of 4, eight
times the gathered bytes written and read again per layer, about 15 ms of a step with a
chunk 23K tokens into its prompt on an H200, more than its matrix products. There a chunk
behind a prefix attends in two parts whose softmaxes are merged by their log-sum-exps:
over its prefix without a causal mask, where each group's query heads can be folded into
the query rows of their shared KV head (no repeat), and over its own tokens causally (a
repeat of the chunk's keys only).

A chunk of few queries deep into its prompt makes few flash programs (one per 128 queries and
query head), each streaming the whole prefix: on an H200 a chunk of about 90 queries 26K tokens
deep took 0.8 ms a layer, at a small share of the copy bandwidth. With the operator called
directly, such a chunk's prefix is split into pieces (``prefix_pieces``), attended to as
sequences of their own by one call without a mask (the queries repeated once per piece), its
own keys by a causal call, and the parts merged by their log-sum-exps in one kernel
(``kernels/merge_parts.py``): split-K for prompt chunks, so that the step fills the GPU.
"""

from __future__ import annotations

import inspect
import logging

import torch

from zipage.attention.backend import AttentionBackend
from zipage.kernels.common import multiprocessor_count, token_major
from zipage.kernels.merge_parts import merge_parts, merge_parts_torch
from zipage.kernels.paged_decode import paged_decode_attention
from zipage.kernels.paged_prefill import paged_prefill_attention
from zipage.kernels import norm_rope
from zipage.kernels.store_kv import store_kv
from zipage.layers.fusion import fusion_enabled

logger = logging.getLogger(__name__)

# Each layer's query/key norm and RoPE and its KV store in one launch (``kernels/norm_rope.py``) instead
# of two; the same numbers (docs/design.md). False: two launches.
FUSE_ROPE_STORE = True

try:
    from torch.nn.attention.varlen import AuxRequest, varlen_attn
    _VARLEN_PARAMS = set(inspect.signature(varlen_attn).parameters)
except ImportError:  # torch < 2.10
    AuxRequest, varlen_attn, _VARLEN_PARAMS = None, None, set()


def _flash_with_lse(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    """Varlen flash attention (equal head counts) and its log-sum-exp per row, [tokens, heads] float32."""
    kwargs = {"scale": scale} if "scale" in _VARLEN_PARAMS else {}
    out, lse = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, return_aux=AuxRequest(lse=True),
                           window_size=(-1, 0) if causal else (-1, -1), **kwargs)
    return out, lse if _lse_is_tokens_first(q) else lse.transpose(0, 1)


_LSE_TOKENS_FIRST: dict[tuple, bool] = {}


def _lse_is_tokens_first(q) -> bool:
    """Whether this torch's varlen attention returns its log-sum-exp as [tokens, heads] (newer)
    rather than [heads, tokens]; found once per device and dtype by a call of 3 tokens, 1 head."""
    key = (q.device.type, q.dtype, q.shape[-1])
    if key not in _LSE_TOKENS_FIRST:
        probe = torch.zeros(3, 1, q.shape[-1], dtype=q.dtype, device=q.device)
        cu = torch.tensor([0, 3], dtype=torch.int32, device=q.device)
        _, lse = varlen_attn(probe, probe, probe, cu, cu, 3, 3, return_aux=AuxRequest(lse=True))
        _LSE_TOKENS_FIRST[key] = tuple(lse.shape) == (3, 1)
    return _LSE_TOKENS_FIRST[key]


def split_flash_available(q, k_cache) -> bool:
    """Whether a chunk behind a prefix attends in two merged parts (see the module's note): the
    query heads are grouped over fewer KV heads and this torch's varlen attention cannot group
    them itself, but can return its log-sum-exp and take a window."""
    return (q.shape[1] != k_cache.shape[2] and "enable_gqa" not in _VARLEN_PARAMS
            and {"return_aux", "window_size"} <= _VARLEN_PARAMS and AuxRequest is not None)


def split_context_slots(meta, block_size: int, num_tokens: int):
    """For the two-part attention: (the cache slots of every sequence's prefix, packed in
    sequence order, then of every sequence's chunk, in the queries' order; cu_seqlens of the
    prefixes; [tokens, 1] whether each query's sequence has a prefix), without a host sync."""
    lens = meta.context_lens.long()
    cu_q = meta.cu_seqlens_q.long()
    q_lens = cu_q[1:] - cu_q[:-1]
    prefix_lens = lens - q_lens
    cu_p = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    torch.cumsum(prefix_lens, 0, out=cu_p[1:])
    total_prefix = meta.total_seqlen_k - num_tokens
    seqs = torch.arange(lens.shape[0], device=lens.device)
    seq_p = torch.repeat_interleave(seqs, prefix_lens, output_size=total_prefix)
    pos_p = torch.arange(total_prefix, device=lens.device) - cu_p[:-1].long()[seq_p]
    seq_q = torch.repeat_interleave(seqs, q_lens, output_size=num_tokens)
    pos_q = prefix_lens[seq_q] + torch.arange(num_tokens, device=lens.device) - cu_q[:-1][seq_q]
    seq, pos = torch.cat([seq_p, seq_q]), torch.cat([pos_p, pos_q])
    slots = meta.block_tables.long()[seq, pos // block_size] * block_size + pos % block_size
    return slots, cu_p, (prefix_lens[seq_q] > 0)[:, None]


def _attend_split(q, k_cache, v_cache, meta, scale, k_scale, v_scale):
    """Chunks behind a cached prefix in two parts, merged: see the module's note."""
    tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    if meta.split_slots is None:
        meta.split_slots = split_context_slots(meta, k_cache.shape[1], tokens)
    slots, cu_p, has_prefix = meta.split_slots
    keys, values = _gather(k_cache, v_cache, slots, q.dtype, k_scale, v_scale)
    prefix = meta.total_seqlen_k - tokens
    # Over the prefix: row t * group + j is query t's j-th head of its KV head's group, so a
    # sequence's rows stay contiguous and every row sees its sequence's whole prefix.
    folded = q.reshape(tokens, kv_heads, group, head_dim).transpose(1, 2).reshape(tokens * group, kv_heads, head_dim)
    out_p, lse_p = _flash_with_lse(folded, keys[:prefix], values[:prefix], meta.cu_seqlens_q * group, cu_p,
                                   meta.max_seqlen_q * group, meta.max_seqlen_k, scale, causal=False)
    out_p = out_p.view(tokens, group, kv_heads, head_dim).transpose(1, 2).reshape(tokens, heads, head_dim)
    lse_p = lse_p.reshape(tokens, group, kv_heads).transpose(1, 2).reshape(tokens, heads)
    # Over the chunk itself, causally.
    own_k = keys[prefix:].repeat_interleave(group, 1)
    own_v = values[prefix:].repeat_interleave(group, 1)
    cu = meta.cu_seqlens_q
    out_c, lse_c = _flash_with_lse(q, own_k, own_v, cu, cu, meta.max_seqlen_q, meta.max_seqlen_q, scale, causal=True)
    # softmax over both = the parts weighted by their shares of the exponentials' sum; a query
    # whose sequence has no prefix takes its chunk part alone (an empty part's values are undefined).
    weight = torch.sigmoid(torch.where(has_prefix, lse_p, float("-inf")) - lse_c)[..., None]
    out_p = torch.where(has_prefix[..., None], out_p, out_c)
    return torch.lerp(out_c.float(), out_p.float(), weight).to(q.dtype)


# Whether the flash-attention operator is called directly (see the module's note), and on which
# devices (the tests add the CPU, with a stand-in operator). "usable" turns False, with a
# warning, the first time the operator refuses a call.
_direct_flash = {"usable": True, "device_types": ("cuda",)}


def _flash_op():
    # The overload itself: calling the overload packet costs tens of microseconds of Python per
    # call (its checks of every argument), 36 times a step.
    return torch.ops.aten._flash_attention_forward.default


def _direct_flash_usable(q) -> bool:
    return _direct_flash["usable"] and q.device.type in _direct_flash["device_types"]


def _flash_call(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=True):
    """(output, log-sum-exp) of flash attention through torch's operator itself (keys and values
    with fewer heads than the queries as they are; causal with the diagonal at the end, or no
    mask), or None where it cannot run."""
    if not _direct_flash_usable(q):
        return None
    try:
        return _flash_op()(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
                           window_size_left=-1, window_size_right=0 if causal else -1)[:2]
    except torch.OutOfMemoryError:  # the step's failure, not the operator's refusal
        raise
    except (AttributeError, RuntimeError, TypeError) as error:
        _direct_flash["usable"] = False
        logger.warning("torch's flash-attention operator refused a direct call (%s); prompt chunks now go "
                       "through torch's varlen attention", error)
        return None


_DIRECT_LSE_TOKENS_FIRST: dict[tuple, bool] = {}


def _lse_rows(lse, q):
    """The operator's log-sum-exp as [rows, heads] (a view), whichever way round this torch
    returns it (found once per device, dtype and head size by a call of 3 tokens, 1 head: the
    shape of a real call cannot tell when it has as many rows as heads)."""
    key = (q.device.type, q.dtype, q.shape[-1])
    if key not in _DIRECT_LSE_TOKENS_FIRST:
        probe = torch.zeros(3, 1, q.shape[-1], dtype=q.dtype, device=q.device)
        cu = torch.tensor([0, 3], dtype=torch.int32, device=q.device)
        probe_lse = _flash_op()(probe, probe, probe, cu, cu, 3, 3, 0.0, True, False, scale=1.0,
                                window_size_left=-1, window_size_right=0)[1]
        _DIRECT_LSE_TOKENS_FIRST[key] = tuple(probe_lse.shape) == (3, 1)
    return lse if _DIRECT_LSE_TOKENS_FIRST[key] else lse.transpose(0, 1)


# Split-K for prompt chunks (see the module's note): pieces of at least this many prefix keys,
# at most this many pieces, enough for this many flash programs per SM. Flash attention cuts the
# queries into tiles of FLASH_QUERY_TILE rows, one program per tile and query head. The split
# costs host time, which a step saves on the device only deep into a prompt: with the merge as a
# dozen PyTorch operations per layer (about 13 ms a Qwen3-8B step on an H200's host), chunks of
# 80-300 queries beside 128 decoding streams ran 20-23 ms a step unsplit up to 8K tokens deep
# and 25 ms split; from 16K deep 34-48 ms unsplit and 26-35 ms split (pieces of at least 1,024
# keys then). With the merge as one kernel and pieces of at least 4,096 keys (prefixes from 8K
# on), every depth ran 20-26 ms a step (docs/benchmarks.md, "Long prompts among decoding streams").
FLASH_PIECE_MIN_KEYS = 4096
FLASH_MAX_PIECES = 16
FLASH_PROGRAMS_PER_SM = 2
FLASH_QUERY_TILE = 128


def prefix_pieces(meta, heads: int, device: torch.device) -> int:
    """Into how many pieces the prefixes of a step's chunks are split: 1 (no split) unless the
    step's chunks alone make too few flash programs to fill the GPU, from host-known sizes only."""
    programs = -(-meta.max_seqlen_q // FLASH_QUERY_TILE) * meta.context_lens.shape[0] * heads
    wanted = FLASH_PROGRAMS_PER_SM * multiprocessor_count(device) // max(programs, 1)
    longest_prefix = meta.max_seqlen_k - 1
    return max(1, min(FLASH_MAX_PIECES, wanted, longest_prefix // FLASH_PIECE_MIN_KEYS))


def piece_slots(meta, block_size: int, num_tokens: int, pieces: int):
    """For split-K chunk attention, without a host sync: (the cache slots of the keys of every
    prefix piece, piece by piece and, within a piece, sequence by sequence, then of every
    sequence's chunk, in the queries' order; cu_seqlens of the repeated queries and of the
    pieces' keys, sequence (piece j, sequence i) at j * batch + i; [pieces, tokens] whether the
    piece of each query's sequence holds keys)."""
    lens = meta.context_lens.long()
    batch, device = lens.shape[0], lens.device
    cu_q = meta.cu_seqlens_q.long()
    q_lens = cu_q[1:] - cu_q[:-1]
    prefix_lens = lens - q_lens
    size = (prefix_lens + pieces - 1) // pieces  # keys per piece of each sequence's prefix
    first = torch.arange(pieces, device=device)[:, None] * size[None, :]
    piece_lens = (prefix_lens[None, :] - first).clamp(min=0).minimum(size[None, :])  # [pieces, batch]
    flat = piece_lens.flatten()
    cu_k = torch.zeros(pieces * batch + 1, dtype=torch.int32, device=device)
    torch.cumsum(flat, 0, out=cu_k[1:])
    total_prefix = meta.total_seqlen_k - num_tokens
    segment = torch.repeat_interleave(torch.arange(pieces * batch, device=device), flat, output_size=total_prefix)
    seq_p = segment % batch
    pos_p = first.flatten()[segment] + torch.arange(total_prefix, device=device) - cu_k[:-1].long()[segment]
    seq_q = torch.repeat_interleave(torch.arange(batch, device=device), q_lens, output_size=num_tokens)
    pos_q = prefix_lens[seq_q] + torch.arange(num_tokens, device=device) - cu_q[:-1][seq_q]
    seq, pos = torch.cat([seq_p, seq_q]), torch.cat([pos_p, pos_q])
    slots = meta.block_tables.long()[seq, pos // block_size] * block_size + pos % block_size
    starts = torch.arange(pieces, device=device)[:, None] * num_tokens + cu_q[None, :-1]
    cu_rep = torch.cat([starts.flatten(), cu_q.new_full((1,), pieces * num_tokens)]).to(torch.int32)
    return slots, cu_rep, cu_k, (piece_lens > 0)[:, seq_q].to(torch.uint8)


def _attend_pieces(q, k_cache, v_cache, meta, scale, pieces, k_scale, v_scale):
    """Chunks behind a cached prefix, split-K (see the module's note); None where the operator
    refused a call."""
    tokens = q.shape[0]
    if meta.piece_slots is None or meta.piece_slots[0] != pieces:
        meta.piece_slots = (pieces, piece_slots(meta, k_cache.shape[1], tokens, pieces))
    slots, cu_rep, cu_k, nonempty = meta.piece_slots[1]
    keys, values = _gather(k_cache, v_cache, slots, q.dtype, k_scale, v_scale)
    prefix = meta.total_seqlen_k - tokens
    longest_piece = -(-(meta.max_seqlen_k - 1) // pieces)
    over_prefix = _flash_call(q.repeat(pieces, 1, 1), keys[:prefix], values[:prefix], cu_rep, cu_k,
                              meta.max_seqlen_q, longest_piece, scale, causal=False)
    own = over_prefix and _flash_call(q, keys[prefix:], values[prefix:], meta.cu_seqlens_q, meta.cu_seqlens_q,
                                      meta.max_seqlen_q, meta.max_seqlen_q, scale)
    if not own:
        return None
    merge = merge_parts if q.is_cuda else merge_parts_torch
    return merge(over_prefix[0], _lse_rows(over_prefix[1], q), own[0], _lse_rows(own[1], q), nonempty)


def _attend_flash(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """Causal varlen flash attention; with more keys than queries the diagonal is aligned at
    the end (query i of a sequence of n queries over c keys sees keys 0..c - n + i)."""
    direct = _flash_call(q, k, v, cu_q, cu_k, max_q, max_k, scale)
    if direct is not None:
        return direct[0]
    kwargs = {}
    if "scale" in _VARLEN_PARAMS:
        kwargs["scale"] = scale
    if "window_size" in _VARLEN_PARAMS:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            kwargs["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


# The packed context of a step is gathered only up to this size (its keys and values); past it
# the Triton kernel reads the paged cache in place, so that a long context never needs a
# large transient next to a cache that fills the rest of the memory.
FLASH_GATHER_MAX_BYTES = 1 << 30


def context_slots(meta, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the cache slot of every key of every sequence's context, packed in sequence order;
    cu_seqlens_k) for a prefill step's metadata, on the device without a host sync."""
    lens = meta.context_lens.long()
    cu_k = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    torch.cumsum(lens, 0, out=cu_k[1:])
    total = meta.total_seqlen_k
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens, output_size=total)
    pos = torch.arange(total, device=lens.device) - cu_k[:-1].long()[seq]
    page = meta.block_tables.long()[seq, pos // block_size]
    return page * block_size + pos % block_size, cu_k


def gather_context(k_cache, v_cache, meta, dtype, k_scale=None, v_scale=None):
    """(keys, values, cu_seqlens_k): every sequence's context [total_seqlen_k, kv_heads,
    head_dim] in ``dtype``, packed; a float8 cache times its scales (each product rounded
    once to ``dtype``). The slots are computed at a step's first layer and kept in
    ``meta.context_slots`` for the others."""
    if meta.context_slots is None:
        meta.context_slots = context_slots(meta, k_cache.shape[1])
    slots, cu_k = meta.context_slots
    return (*_gather(k_cache, v_cache, slots, dtype, k_scale, v_scale), cu_k)


def _gather(k_cache, v_cache, slots, dtype, k_scale=None, v_scale=None):
    """The keys and values at cache ``slots`` [n, kv_heads, head_dim] in ``dtype`` (a float8
    cache times its scales, each product rounded once to ``dtype``)."""
    kv_heads, head_dim = k_cache.shape[2:]
    keys = k_cache.view(-1, kv_heads, head_dim).index_select(0, slots)
    if token_major(v_cache):  # a float8 cache's values: gathered element by element
        block_size = v_cache.shape[1]
        values = v_cache[slots // block_size, slots % block_size]
    else:
        values = v_cache.view(-1, kv_heads, head_dim).index_select(0, slots)
    if k_scale is not None:  # float8 -> dtype is exact; the in-place products run in float32
        keys = keys.to(dtype).mul_(k_scale.view(-1, kv_heads).index_select(0, slots)[..., None])
        values = values.to(dtype).mul_(v_scale.view(-1, kv_heads).index_select(0, slots)[..., None])
    return keys, values


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, use_flash_prefill: bool | None = None):
        available = varlen_attn is not None
        self.use_flash_prefill = available if use_flash_prefill is None else use_flash_prefill and available

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, query=None, query_cache=None, query_slots=None,
                 *, k_scale=None, v_scale=None, launches=None):
        store_kv(key, value, k_cache, v_cache, slot_mapping, query, query_cache, query_slots,
                 k_scale=k_scale, v_scale=v_scale, launches=launches)

    @property
    def fuses_rope_store(self) -> bool:
        # the norm and RoPE run as a Triton kernel only with fusion on (CUDA, not enforce_eager)
        return FUSE_ROPE_STORE and norm_rope.AVAILABLE and fusion_enabled()

    def norm_rope_store_kv(self, rope, q, k, v, k_cache, v_cache, slot_mapping, query_cache=None,
                           query_slots=None, *, k_scale=None, v_scale=None, launches=None):
        if not self.fuses_rope_store:
            return super().norm_rope_store_kv(rope, q, k, v, k_cache, v_cache, slot_mapping, query_cache,
                                              query_slots, k_scale=k_scale, v_scale=v_scale, launches=launches)
        return norm_rope.norm_rope_store_kv(rope.positions, q, k, v, rope.cos_sin, rope.q_weight, rope.k_weight,
                                            rope.eps, k_cache, v_cache, slot_mapping, query_cache, query_slots,
                                            k_scale=k_scale, v_scale=v_scale, launches=launches)

    def prefill(self, q, k, v, k_cache, v_cache, meta, scale, *, k_scale=None, v_scale=None):
        flash_ok = (self.use_flash_prefill and q.dtype != torch.float32
                    and ("scale" in _VARLEN_PARAMS or abs(scale - q.shape[-1] ** -0.5) < 1e-12))
        if flash_ok and not meta.has_cached_prefix:
            # The step's keys and values as computed (also with a float8 cache: later steps
            # read them quantized).
            cu = meta.cu_seqlens_q
            return _attend_flash(q, k, v, cu, cu, meta.max_seqlen_q, meta.max_seqlen_q, scale)
        gathered_bytes = 2 * meta.total_seqlen_k * k_cache.shape[2] * k_cache.shape[3] * q.element_size()
        if flash_ok and 0 < gathered_bytes <= FLASH_GATHER_MAX_BYTES:
            if meta.total_seqlen_k > q.shape[0] and _direct_flash_usable(q):
                pieces = prefix_pieces(meta, q.shape[1], q.device)
                out = _attend_pieces(q, k_cache, v_cache, meta, scale, pieces, k_scale, v_scale) if pieces > 1 else None
                if out is not None:
                    return out
            if (meta.total_seqlen_k > q.shape[0] and split_flash_available(q, k_cache)
                    and not _direct_flash_usable(q)):
                return _attend_split(q, k_cache, v_cache, meta, scale, k_scale, v_scale)
            keys, values, cu_k = gather_context(k_cache, v_cache, meta, q.dtype, k_scale, v_scale)
            return _attend_flash(q, keys, values, meta.cu_seqlens_q, cu_k, meta.max_seqlen_q, meta.max_seqlen_k,
                                 scale)
        return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                       meta.context_lens, meta.max_seqlen_q, scale, k_scale=k_scale, v_scale=v_scale)

    def warm_up(self, head_dim, dtype, device):
        """The split-K merge kernel and the log-sum-exp layout probe, which prompt chunks need only
        from 8K tokens deep (``prefix_pieces``)."""
        if not (self.use_flash_prefill and dtype != torch.float32 and torch.device(device).type == "cuda"):
            return
        q = torch.zeros(2, 1, head_dim, dtype=dtype, device=device)
        if _direct_flash_usable(q):
            _lse_rows(torch.zeros(1, 2, device=device), q)
        lse = torch.zeros(2, 1, device=device)
        merge_parts(q.repeat(2, 1, 1), lse.repeat(2, 1), q, lse, torch.ones(2, 2, dtype=torch.uint8, device=device))

    def decode(self, q, k_cache, v_cache, meta, scale, *, k_scale=None, v_scale=None, out=None, launches=None):
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, out,
                                      k_scale=k_scale, v_scale=v_scale, launches=launches)
