"""Steps with prompt tokens replayed as CUDA graphs, piece by piece around attention.

A step that prefills (prompt chunks, alone or beside decodes) cannot be one graph: its
attention depends on every request's lengths, known only when the step is built. The rest of
a layer works token by token, so it can: for each bucket of token counts there is a graph of
each piece between two attentions. The first piece embeds the tokens and runs the first
layer's norm and projections; each following one runs a layer's output projection and MLP
and the next layer's norm and projections; the last runs the final norm. A step copies its
tokens into static buffers, replays the first piece, and then, layer by layer, runs attention
eagerly on the queries, keys and values the piece left in static buffers, writes its output
where the next piece reads it, and replays that piece.

Without this a prefill step launches a few hundred kernels from Python, a floor of about 48 ms
for Qwen3-8B whatever the step's tokens (``docs/benchmarks.md``), which every stream decoding
beside a prompt chunk waits for. With it, a step launches one graph and the attention's few
kernels per layer.

Padding tokens (the bucket's beyond the step's) run through the pieces on stale ids and
positions, but attention never sees them and every operation in a piece is per token, so
they change nothing. The pieces touch no cache: they are captured before the KV cache is
sized, which then counts their memory (their static buffers and one shared pool, about one
piece's activations at the largest bucket).

On the CPU there are no graphs: ``capture`` keeps each piece as a function that ``run``
calls, which the tests use to check the buffers' plumbing against the plain forward.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

logger = logging.getLogger(__name__)


def piecewise_token_sizes(max_tokens: int) -> list[int]:
    """Token-count buckets: small powers of two, then every 128 tokens, up to ``max_tokens``.

    A step of many tokens is bound by its matrix products, so its padding costs time in
    proportion; steps of 128 tokens apart keep that under 20% from 640 tokens on (128
    decodes beside a chunk of 512)."""
    if max_tokens < 1:
        raise ValueError(f"piecewise graph tokens must be >= 1, got {max_tokens}")
    sizes = [s for s in (8, 16, 32, 64) if s < max_tokens] + list(range(128, max_tokens, 128))
    return sorted(set(sizes + [max_tokens]))


class _EagerPiece:
    """The CPU's stand-in for a captured piece: its code, run at each replay."""

    def __init__(self, fn):
        self.replay = fn


class PiecewiseGraphs:
    """Graphs of a decoder's pieces between attentions, for steps of up to ``max_tokens`` tokens."""

    def __init__(self, model, max_tokens: int, device: torch.device):
        self.decoder = model.model  # the DecoderModel: embed_tokens, layers, norm
        self.layers = list(self.decoder.layers)
        self.attention = model.attention_layers()
        self.device = device
        self.sizes = piecewise_token_sizes(max_tokens)
        first = self.layers[0].self_attn
        n, hidden = self.sizes[-1], model.spec.hidden_size
        dtype = self.decoder.norm.weight.dtype
        with torch.device(device):
            self.input_ids = torch.zeros(n, dtype=torch.int64)
            self.positions = torch.zeros(n, dtype=torch.int64)
            self.q = torch.zeros(n, first.num_heads, first.head_dim, dtype=dtype)
            self.k = torch.zeros(n, first.num_kv_heads, first.head_dim, dtype=dtype)
            self.v = torch.zeros_like(self.k)
            self.attn_out = torch.zeros_like(self.q)
            self.residual = torch.zeros(n, hidden, dtype=dtype)
            self.hidden = torch.zeros(n, hidden, dtype=dtype)
        self.graphs: dict[int, list] = {}

    # -- the pieces: each reads and writes only static buffers ----------------------
    def _store(self, t: int, q, k, v, residual) -> None:
        self.q[:t].copy_(q)
        self.k[:t].copy_(k)
        self.v[:t].copy_(v)
        self.residual[:t].copy_(residual)

    def _first(self, t: int) -> None:
        hidden = self.decoder.embed_tokens(self.input_ids[:t])
        self._store(t, *self.layers[0].before_attention(self.positions[:t], hidden, None))

    def _between(self, layer: int, t: int) -> None:
        """Layer ``layer``'s attention output through the next layer's projections."""
        hidden, residual = self.layers[layer].after_attention(self.attn_out[:t], self.residual[:t])
        self._store(t, *self.layers[layer + 1].before_attention(self.positions[:t], hidden, residual))

    def _last(self, t: int) -> None:
        hidden, residual = self.layers[-1].after_attention(self.attn_out[:t], self.residual[:t])
        self.hidden[:t].copy_(self.decoder.norm(hidden, residual)[0])

    def _pieces(self, t: int) -> list:
        between = [functools.partial(self._between, i, t) for i in range(len(self.layers) - 1)]
        return [functools.partial(self._first, t), *between, functools.partial(self._last, t)]

    # -- capture and replay ---------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        if self.device.type != "cuda":
            self.graphs = {t: [_EagerPiece(fn) for fn in self._pieces(t)] for t in self.sizes}
            return
        # One pool for every piece: a piece's outputs are copied to the static buffers, so all of
        # its memory is free when it ends, and pieces never run at once. Captured with the
        # low-level calls: the context manager's garbage collection before each of the hundreds
        # of captures would cost seconds.
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for t in reversed(self.sizes):  # largest first: the pool's blocks fit every later piece
            pieces = self._pieces(t)
            for fn in pieces:
                fn()  # warm-up: compiles and tunes kernels outside the capture
            torch.cuda.synchronize(self.device)
            graphs = []
            with torch.cuda.stream(stream):
                for fn in pieces:
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(pool=pool)
                    try:
                        fn()
                    finally:
                        graph.capture_end()
                    graphs.append(graph)
            self.graphs[t] = graphs
        torch.cuda.synchronize(self.device)
        logger.info("piecewise CUDA graphs: %d token sizes up to %d, %d pieces each, captured in %.1f s",
                    len(self.sizes), self.sizes[-1], len(self.layers) + 1, time.perf_counter() - start)

    def can_run(self, num_tokens: int) -> bool:
        return bool(self.graphs) and num_tokens <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The final hidden states [tokens, hidden] of a step whose attention metadata is set (a
        view of a static buffer, valid until the next ``run`` is queued)."""
        n = input_ids.shape[0]
        pieces = self.graphs[next(t for t in self.sizes if t >= n)]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        pieces[0].replay()
        for attention, piece in zip(self.attention, pieces[1:]):
            attention(self.q[:n], self.k[:n], self.v[:n], out=self.attn_out[:n])
            piece.replay()
        return self.hidden[:n]
