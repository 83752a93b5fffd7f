"""Per-step attention metadata, set once per forward instead of threaded through layers."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens go and what each sequence attends to.

    Prefill: ``cu_seqlens_q`` splits the packed tokens by sequence; the new tokens
    are the last ones of each sequence (earlier ones may come from the prefix cache).
    Decode: one token per sequence. In both, ``context_lens[i]`` counts the KV
    tokens sequence ``i`` attends to, the new ones included.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token; -1 = skip
    context_lens: torch.Tensor  # [batch] int32
    block_tables: torch.Tensor  # [batch, max_blocks] int32
    cu_seqlens_q: torch.Tensor | None = None  # [batch + 1] int32, prefill only
    max_seqlen_q: int = 1
    max_seqlen_k: int = 0
    has_cached_prefix: bool = False  # some prefill sequence reads KV it did not compute this step
    total_seqlen_k: int = 0  # prefill: context_lens summed (known on the host), for gathering the context
    query_slots: torch.Tensor | None = None  # [num_tokens] query-cache row of each token (compression)
    # A step mixing decodes with prompt chunks (chunked prefill): its leading one-token decode
    # rows and its chunks, each as a step of its own, so that the decodes attend through the
    # decode kernel (which reads each KV head once for its group of query heads) and the chunks
    # through the prefill path. None otherwise.
    decode_part: "AttentionMetadata | None" = None
    chunk_part: "AttentionMetadata | None" = None
    # Flash prefill behind a cached prefix: (the cache slot of every key of every sequence's
    # context, cu_seqlens_k), computed at a step's first layer and reused by the others.
    context_slots: tuple[torch.Tensor, torch.Tensor] | None = None
    # The same for the two-part attention of a torch without grouped-query varlen attention
    # (``triton_backend.split_context_slots``).
    split_slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # The same for split-K chunk attention: (pieces, ``triton_backend.piece_slots``).
    piece_slots: tuple | None = None
    # A step that runs attention eagerly on a GPU: its Triton kernels' binaries and scratch
    # buffers, found at its first layer and used by the others (``kernels/common.StepLaunches``).
    launches: object | None = None


_current: AttentionMetadata | None = None


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention metadata is only available inside a model forward")
    return _current


def set_attention_metadata(metadata: AttentionMetadata | None) -> None:
    global _current
    _current = metadata


@contextmanager
def attention_metadata(metadata: AttentionMetadata):
    set_attention_metadata(metadata)
    try:
        yield metadata
    finally:
        set_attention_metadata(None)
