"""Tensor parallelism on the CPU: two processes (gloo) against one.

Layers and model: one group of two processes runs every check and reports a
verdict per check, which the tests read. Each compares float32 outputs with the
single-process result (computed before the processes start): each sharded layer
type alone, then the whole decoder forward of tiny checkpoints, one of them with
fewer KV heads than ranks (replicated).

Step ring (``runner/step_channel.py``, one process): every field of a step and every
command comes back in order, a step larger than a slot is refused before anything is
written, and a writer whose reader is gone fails instead of waiting.

Engine: ``LLM(..., tensor_parallel_size=2)`` in a subprocess (rank 0, which starts
its follower) gives the greedy tokens of size 1, with full KV and with
compression (asynchronous and synchronous), with asynchronous (launch-ahead)
scheduling and without; every block is free again at the end. Every wait is
bounded, so a hung process fails the test instead of hanging it.

Faults on rank 0 (``tests/test_engine_faults.py``'s injection, in rank 0's process):
one in its forward, after the step was posted to the follower, ends in bounded time
with an error naming it, the follower killed and later requests refused with that
error; one before posting (building the inputs), in its sampler, or between a launched
step's forward and its sampler ends only that step's requests, and the group serves
on; a follower found dead shuts the group down.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from zipage.utils.checkpoint import make_checkpoint

WORLD = 2
TIMEOUT_S = 120.0  # the whole group; a hung process is killed, not waited for
TOLERANCE = 1e-5

# name -> checkpoint options; heads 4 and KV heads 2 by default (one KV head per rank)
MODELS = {
    "qwen3": dict(arch="qwen3"),
    "qwen3-replicated-kv": dict(arch="qwen3", num_key_value_heads=1, tie_word_embeddings=True),
    "qwen2-bias": dict(arch="qwen2"),
    "qwen3-moe": dict(arch="qwen3_moe"),  # each rank: its slice of every expert's intermediate size
}
LAYER_CHECKS = ("qkv", "qkv-replicated", "gate_up", "row", "row-bias", "embedding", "lm_head", "lm_head-odd-vocab")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _random(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- the checks (run in every process; the group size decides the sharding) --------
def _layer_outputs(name: str) -> torch.Tensor:
    """The output of one layer type on fixed inputs, gathered to the full shape on every rank."""
    from zipage.distributed import all_gather, tp_size
    from zipage.layers.embedding import LMHead, VocabEmbedding
    from zipage.layers.linear import RowParallelLinear, gate_up_linear, qkv_linear

    hidden, head_dim, tokens = 16, 4, 5
    x = _random(tokens, hidden, seed=1)
    if name.startswith("qkv"):
        heads, kv_heads = (4, 1) if name == "qkv-replicated" else (4, 2)
        layer = qkv_linear(hidden, heads, kv_heads, head_dim, bias=True)
        parts = {"q": heads, "k": kv_heads, "v": kv_heads}
        for i, (part, units) in enumerate(parts.items()):
            layer.weight_loader(layer.weight, _random(units * head_dim, hidden, seed=10 + i), part)
            layer.weight_loader(layer.bias, _random(units * head_dim, seed=20 + i), part)
        q, k, v = layer(x).split([layer.shard_slices[p][1] for p in parts], dim=-1)
        # every rank holds whole KV heads; replicated ones come back once per rank that holds them
        k_all, v_all = all_gather(k), all_gather(v)
        if kv_heads < tp_size():
            k_all, v_all = _dedupe(k_all, kv_heads, head_dim), _dedupe(v_all, kv_heads, head_dim)
        return torch.cat([all_gather(q), k_all, v_all], dim=-1)
    if name == "gate_up":
        inter = 8
        layer = gate_up_linear(hidden, inter, bias=False)
        layer.weight_loader(layer.weight, _random(inter, hidden, seed=30), "gate")
        layer.weight_loader(layer.weight, _random(inter, hidden, seed=31), "up")
        gate, up = layer(x).chunk(2, dim=-1)
        return torch.cat([all_gather(gate), all_gather(up)], dim=-1)
    if name.startswith("row"):
        in_features = 12
        layer = RowParallelLinear(in_features, hidden, bias=name == "row-bias")
        layer.weight_loader(layer.weight, _random(hidden, in_features, seed=40))
        if layer.bias is not None:
            layer.weight_loader(layer.bias, _random(hidden, seed=41))
        full_in = _random(tokens, in_features, seed=42)
        return layer(full_in.narrow(1, layer.first_column, layer.in_features))
    if name == "embedding":
        vocab = 37
        layer = VocabEmbedding(vocab, hidden)
        layer.weight_loader(layer.weight, _random(vocab, hidden, seed=50))
        return layer(torch.tensor([0, 5, 18, 19, 36, 36, 2]))
    vocab = 37 if name == "lm_head-odd-vocab" else 36
    layer = LMHead(vocab, hidden, bias=True)
    layer.weight_loader(layer.weight, _random(vocab, hidden, seed=60))
    layer.weight_loader(layer.bias, _random(vocab, seed=61))
    return layer(x)


def _dedupe(gathered: torch.Tensor, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Keep one copy of each replicated KV head from an all-gather over the ranks."""
    world = gathered.shape[-1] // head_dim
    heads = gathered.view(gathered.shape[0], world, head_dim)
    return heads[:, ::world // kv_heads].flatten(1)


def _model_logits(model_dir: str) -> torch.Tensor:
    """Logits of every token of two packed prompts, through the cache-free attention path."""
    from zipage.attention.metadata import AttentionMetadata, attention_metadata
    from zipage.models.registry import build_model
    from zipage.utils.loader import load_config, load_weights

    torch.manual_seed(0)
    model = build_model(load_config(model_dir), 64).eval()
    load_weights(model, model_dir)
    lens = [7, 4]
    ids = torch.randint(0, model.spec.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.empty(0), context_lens=torch.tensor(lens),
                             block_tables=torch.empty(0), cu_seqlens_q=cu, max_seqlen_q=max(lens))
    with torch.inference_mode(), attention_metadata(meta):
        return model.compute_logits(model(ids, positions))


def _all_outputs(model_dirs: dict[str, str]) -> dict[str, torch.Tensor]:
    out = {f"layer:{name}": _layer_outputs(name) for name in LAYER_CHECKS}
    out.update({f"model:{name}": _model_logits(path) for name, path in model_dirs.items()})
    return out


def _worker(rank: int, port: int, model_dirs: dict, expected: dict, results) -> None:
    from zipage.distributed import destroy_tensor_parallel, init_tensor_parallel

    torch.set_num_threads(1)
    init_tensor_parallel(rank, WORLD, backend="gloo", init_method=f"tcp://127.0.0.1:{port}", timeout_s=60)
    verdicts = {}
    for key, reference in expected.items():
        try:
            kind, name = key.split(":")
            got = _layer_outputs(name) if kind == "layer" else _model_logits(model_dirs[name])
            error = ((got - reference).abs().max() / reference.abs().max()).item()
            verdicts[key] = "ok" if got.shape == reference.shape and error < TOLERANCE else \
                f"shape {tuple(got.shape)} vs {tuple(reference.shape)}, relative error {error:.3g}"
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            verdicts[key] = traceback.format_exc()
    results.put((rank, verdicts))
    destroy_tensor_parallel()


@pytest.fixture(scope="module")
def verdicts():
    with tempfile.TemporaryDirectory() as root:
        model_dirs = {name: make_checkpoint(os.path.join(root, name), initializer_range=0.05, seed=i, **options)
                      for i, (name, options) in enumerate(MODELS.items())}
        expected = _all_outputs(model_dirs)  # one process: nothing sharded
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(rank, port, model_dirs, expected, results), daemon=True)
                 for rank in range(WORLD)]
        for p in procs:
            p.start()
        collected, deadline = {}, time.monotonic() + TIMEOUT_S
        try:
            while len(collected) < WORLD and time.monotonic() < deadline:
                try:
                    rank, v = results.get(timeout=1.0)
                    collected[rank] = v
                except Exception:  # queue.Empty: check that no process died
                    dead = [p for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        pytest.fail(f"a tensor-parallel process exited with code {dead[0].exitcode}")
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
        if len(collected) < WORLD:
            pytest.fail(f"tensor-parallel processes did not finish within {TIMEOUT_S:.0f} s")
        yield collected


@pytest.mark.parametrize("key", [f"layer:{n}" for n in LAYER_CHECKS] + [f"model:{n}" for n in MODELS])
def test_sharded_matches_unsharded(verdicts, key):
    for rank in range(WORLD):
        assert verdicts[rank][key] == "ok", f"rank {rank}: {verdicts[rank][key]}"


# -- the step ring: rank 0's commands to the followers, through shared memory ----------
def _ring(num_slots: int, slot_bytes: int):
    """A channel with one reader, both in this process (the pipe for large payloads too)."""
    from zipage.runner.step_channel import StepChannel

    ctx = mp.get_context("spawn")
    channel = StepChannel(ctx, 1, num_slots=num_slots)
    reader = channel.reader(0)
    ours, theirs = ctx.Pipe()
    channel.open(slot_bytes, [ours])
    reader.attach(theirs)
    return channel, reader, (ours, theirs)


def _close_ring(channel, reader, pipes) -> None:
    reader.close()
    channel.close()
    for conn in pipes:
        conn.close()


def _read(reader) -> dict:
    """The next message, copied out of its slot (which is released)."""
    message = reader.receive(alive=lambda: True, poll_s=0.1)
    assert message is not None
    got = dict(seq=message.seq, command=message.command, shape=message.shape, share_tokens=message.share_tokens,
               payload=message.payload, arrays={k: v.copy() for k, v in message.arrays.items()})
    reader.release()
    return got


def _shape_strategy():
    """Any ``StepShape`` (its fields read from the class, so new ones are covered)."""
    from dataclasses import fields

    from zipage.runner.inputs import StepShape

    return st.builds(StepShape, **{f.name: st.booleans() if f.type in ("bool", bool) else st.integers(-1, 1 << 40)
                                   for f in fields(StepShape)})


_ARRAY_NAMES = ["input_ids", "positions", "slot_mapping", "block_tables", "cu_seqlens", "pending_rows"]
# int32 / int64, one or two dimensions; a column slice of a 2-D one is not contiguous (block table rows in use)
_RING_ARRAYS = st.tuples(hnp.arrays(st.sampled_from([np.int32, np.int64]),
                                    hnp.array_shapes(min_dims=1, max_dims=2, min_side=0, max_side=24)),
                         st.booleans()).map(lambda t: t[0][:, ::2] if t[1] and t[0].ndim == 2 else t[0])
_RING_STEPS = st.builds(lambda shape, arrays, share: ("step", shape, arrays, share), _shape_strategy(),
                        st.dictionaries(st.sampled_from(_ARRAY_NAMES), _RING_ARRAYS, max_size=5), st.booleans())
# payloads of other commands: small ones go in the slot, ones above a slot through the pipe
_RING_COMMANDS = st.builds(lambda command, payload: (command, None, None, payload),
                           st.sampled_from(["compress", "start_compression", "collect_compression", "close"]),
                           st.one_of(st.none(), st.lists(st.integers(), max_size=8),
                                     st.integers(0, 4000).map(lambda n: np.arange(n, dtype=np.uint8).tobytes())))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=st.lists(st.lists(st.one_of(_RING_STEPS, _RING_COMMANDS), min_size=1, max_size=3), min_size=1,
                        max_size=5))
def test_step_ring_round_trips_messages_in_order(batches):
    """Steps (every StepShape field, every array) and pickled commands come back as sent, in
    order, however they interleave; a step larger than a slot is refused and leaves the ring
    as it was."""
    from zipage.runner.step_channel import ALIGN, HEADER_BYTES, Message

    slot_bytes = HEADER_BYTES + 2048
    channel, reader, pipes = _ring(num_slots=3, slot_bytes=slot_bytes)
    try:
        seq = 0
        for batch in batches:  # at most num_slots unread at a time: one thread writes and reads
            sent = []
            for command, shape, arrays, extra in batch:
                if shape is None:
                    channel.send(Message(command, payload=extra))
                    sent.append(dict(seq=seq, command=command, shape=None, share_tokens=False, payload=extra,
                                     arrays={}))
                    seq += 1
                    continue
                needed = HEADER_BYTES + sum(-(-a.nbytes // ALIGN) * ALIGN for a in arrays.values())
                if needed > slot_bytes:
                    with pytest.raises(ValueError, match="more than a step-ring slot holds"):
                        channel.send(Message(command, shape, arrays, share_tokens=extra))
                    continue
                channel.send(Message(command, shape, arrays, share_tokens=extra))
                sent.append(dict(seq=seq, command=command, shape=shape, share_tokens=extra, payload=None,
                                 arrays=arrays))
                seq += 1
            for expected in sent:
                got = _read(reader)
                arrays, got_arrays = expected.pop("arrays"), got.pop("arrays")
                assert got == expected
                assert list(got_arrays) == list(arrays)
                for name, array in arrays.items():
                    assert got_arrays[name].dtype == array.dtype and np.array_equal(got_arrays[name], array), name
    finally:
        _close_ring(channel, reader, pipes)


@pytest.mark.parametrize("is_prefill", [True, False])
def test_step_ring_carries_the_largest_step_of_a_builder(is_prefill):
    """A slot sized by ``slot_bytes_for`` holds a step that fills every buffer the input builder
    exports, and the pending rows; loaded into a follower's builder, every array of the step is
    rank 0's."""
    from zipage.runner.inputs import InputBuilder, StepShape
    from zipage.runner.step_channel import Message, slot_bytes_for

    def builder():
        return InputBuilder(torch.device("cpu"), block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
                            max_table_blocks=16, window=4, num_query_slots=3)

    sender, follower = builder(), builder()
    rng = np.random.default_rng(0)
    for buf in vars(sender).values():
        if hasattr(buf, "np"):
            buf.np[...] = rng.integers(0, 1000, buf.np.shape)
    shape = StepShape(is_prefill, num_seqs=8, num_tokens=64 if is_prefill else 8, width=16, max_seqlen_q=8,
                      max_seqlen_k=128, has_cached_prefix=True)
    if "num_sampled" in StepShape.__dataclass_fields__:  # chunked prefill: the rows that sample
        shape = StepShape(**{**shape.__dict__, "num_sampled": 8})
    arrays = sender.export(shape)
    arrays["pending_rows"] = rng.integers(-1, 8, 8)
    channel, reader, pipes = _ring(num_slots=2, slot_bytes=slot_bytes_for(sender, arrays["pending_rows"].nbytes))
    try:
        channel.send(Message("step", shape, arrays, share_tokens=True))
        got = _read(reader)
        assert got["shape"] == shape and got["share_tokens"]
        follower.load(got["shape"], got["arrays"])
        for name, (buf, sizes) in sender._buffers(shape).items():
            region = tuple(slice(0, n) for n in sizes)
            assert np.array_equal(getattr(follower, name).np[region], buf.np[region]), name
        assert np.array_equal(got["arrays"]["pending_rows"], arrays["pending_rows"])
    finally:
        _close_ring(channel, reader, pipes)


def test_step_ring_refuses_a_step_larger_than_a_slot():
    from zipage.runner.inputs import StepShape
    from zipage.runner.step_channel import HEADER_BYTES, Message

    channel, reader, pipes = _ring(num_slots=2, slot_bytes=HEADER_BYTES + 1024)
    shape = StepShape(True, 2, 200, 4, 100, 100, False)
    try:
        channel.send(Message("step", shape, {"input_ids": np.arange(100)}))  # 800 bytes: fits
        with pytest.raises(ValueError, match=r"a step of 2 requests and 200 tokens needs \d+ bytes, more than "
                                             r"a step-ring slot holds \(\d+\); its arrays: input_ids \(200,\)"):
            channel.send(Message("step", shape, {"input_ids": np.arange(200)}))
        channel.send(Message("compress", payload=[1, 2, 3]))
        first, second = _read(reader), _read(reader)  # the refused step wrote nothing
        assert np.array_equal(first["arrays"]["input_ids"], np.arange(100)) and first["seq"] == 0
        assert second["command"] == "compress" and second["payload"] == [1, 2, 3] and second["seq"] == 1
    finally:
        _close_ring(channel, reader, pipes)


def test_step_ring_writer_fails_when_its_reader_is_gone():
    """A full ring whose reader no longer reads fails the send (no wait forever)."""
    from zipage.runner.step_channel import HEADER_BYTES, Message

    channel, reader, pipes = _ring(num_slots=1, slot_bytes=HEADER_BYTES + 256)
    try:
        channel.send(Message("collect_compression"))
        with pytest.raises(TimeoutError, match="left 1 messages unread"):
            channel.send(Message("collect_compression"), timeout_s=0.2)
        channel._alive = lambda index: False
        with pytest.raises(RuntimeError, match="rank 1 is gone"):
            channel.send(Message("collect_compression"))
        assert _read(reader)["seq"] == 0  # the failed sends posted nothing
        channel.send(Message("close"))
        assert _read(reader)["seq"] == 1
    finally:
        _close_ring(channel, reader, pipes)


# -- the engine: tensor_parallel_size=2 (gloo) gives the tokens of size 1 --------------
BLOCK = 16
# ZIPAGE_TEST_DEVICE=cuda runs the engine checks on GPUs 0 and 1 (NCCL, CUDA graphs)
ENGINE_DEVICE = os.environ.get("ZIPAGE_TEST_DEVICE", "cpu")
# On GPUs each of the three engines compiles its fused kernels and captures its graphs in both
# processes, so the bound is wider there (ZIPAGE_TP_TIMEOUT_S overrides it).
ENGINE_TIMEOUT_S = float(os.environ.get("ZIPAGE_TP_TIMEOUT_S", 180 if ENGINE_DEVICE == "cpu" else 420))
# variant -> (compression settings or None for full KV, asynchronous scheduling, other engine
# options). Asynchronous (launch-ahead) scheduling is the default: at size 2 the followers take
# the pending tokens from rank 0's broadcast. The compressed ones (a 3-block budget for 40-token
# prompts and 70 output tokens) compress every request several times between steps. The pieces
# one runs steps of up to 64 tokens as the layers' pieces between attentions (with all-reduces
# inside them; graphs on GPUs), prompts in chunks beside decodes.
ENGINE_VARIANTS = {
    "full-kv": (None, True, {}),
    "compressed-async": (dict(max_blocks_per_seq=3, asynchronous=True), True, {}),
    "compressed-sync": (dict(max_blocks_per_seq=3, asynchronous=False), True, {}),
    "full-kv-step-sync": (None, False, {}),
    "compressed-pieces": (dict(max_blocks_per_seq=3, asynchronous=True), True,
                          dict(piecewise_graph_tokens=64, max_num_batched_tokens=24)),
}
if ENGINE_DEVICE == "cuda":  # the one-shot all-reduce (GPUs only): sums fused into the norms
    ENGINE_VARIANTS["full-kv-one-shot"] = (None, True, dict(all_reduce="one-shot"))
    ENGINE_VARIANTS["compressed-one-shot"] = (dict(max_blocks_per_seq=3, asynchronous=True), True,
                                              dict(all_reduce="one-shot"))
# ZIPAGE_TP_VARIANTS (comma-separated names) runs some of them only (a GPU run with little time)
if os.environ.get("ZIPAGE_TP_VARIANTS"):
    _picked = os.environ["ZIPAGE_TP_VARIANTS"].split(",")
    _unknown = sorted(set(_picked) - set(ENGINE_VARIANTS))
    if _unknown:
        raise ValueError(f"ZIPAGE_TP_VARIANTS names unknown variants {_unknown}; known: {list(ENGINE_VARIANTS)}")
    ENGINE_VARIANTS = {name: ENGINE_VARIANTS[name] for name in _picked}


def _engine_tokens(model_dir: str, tensor_parallel_size: int, variant: str, log=lambda stage: None
                   ) -> list[list[int]]:
    """Greedy tokens of a few prompts (shared prefix, lengths across blocks), in float32;
    ``log`` hears each stage (built, generated, closed)."""
    from zipage import LLM, CompressionConfig, SamplingParams

    settings, async_scheduling, options = ENGINE_VARIANTS[variant]
    compression = CompressionConfig(**settings) if settings else None
    prompts = [list(range(5, 45)), list(range(5, 45)) + [7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6]]
    # max_num_seqs=4: three prompts, and few decode graphs to capture on a GPU
    with LLM(model_dir, device=ENGINE_DEVICE, dtype="float32", block_size=BLOCK, max_model_len=256,
             kv_cache_memory_bytes=1 << 22, tensor_parallel_size=tensor_parallel_size, max_num_seqs=4,
             compression=compression, async_scheduling=async_scheduling, **options) as llm:
        log("built")
        assert (llm.engine.runner.piecewise is not None) == ("piecewise_graph_tokens" in options)
        assert llm.engine.async_scheduling == async_scheduling  # the runner supports it at every size
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=70, ignore_eos=True),
                               use_tqdm=False)
        log("generated")
        assert (llm.stats.num_compressions > 0) == (compression is not None)
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} blocks still held"
    log("closed")
    return [o.outputs[0].token_ids for o in outputs]


# Rank 0's script. Each engine's stages go to stderr with timings, every thread's stack
# is dumped each minute, and SIGUSR1 dumps them too (followers register the same), so a
# run stopped at the bound shows where it stood.
_TP_SCRIPT = """
import faulthandler, json, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)
faulthandler.dump_traceback_later(60, repeat=True)
sys.path.insert(0, {tests!r})
from test_tensor_parallel import ENGINE_VARIANTS, _engine_tokens
tokens, start = {{}}, time.monotonic()
for v in {variants!r}:
    log = lambda stage: print(f"{{v}}: {{stage}} after {{time.monotonic() - start:.1f}} s", file=sys.stderr, flush=True)
    tokens[v] = _engine_tokens({model_dir!r}, 2, v, log)
print("TOKENS " + json.dumps(tokens))
"""


def _run_bounded(argv: list[str], env: dict, timeout_s: float, log_path: str) -> tuple[int | None, str]:
    """Run ``argv`` with its output in ``log_path``; at the bound, SIGUSR1 its whole process
    group (stack dumps), then kill it. Returns (exit code or None on timeout, the output)."""
    import signal
    import subprocess

    with open(log_path, "w+") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            os.killpg(proc.pid, signal.SIGUSR1)
            time.sleep(3)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.seek(0)
        return code, log.read()


@pytest.fixture(scope="module")
def tp2_tokens(checkpoint_dir, tmp_path_factory):
    """Every variant's tokens with tensor_parallel_size=2, from rank 0's process and its follower (a process
    for the variants with the one-shot all-reduce, each alone)."""
    import json
    import sys

    model_dir = checkpoint_dir("qwen3")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # the one-shot all-reduce allows one engine a process (distributed.check_fresh_symmetric_group)
    one_shot = [v for v, (_, _, options) in ENGINE_VARIANTS.items() if options.get("all_reduce") == "one-shot"]
    groups = [[v for v in ENGINE_VARIANTS if v not in one_shot]] + [[v] for v in one_shot]
    tokens = {}
    for variants in (g for g in groups if g):
        script = _TP_SCRIPT.format(tests=os.path.dirname(__file__), model_dir=model_dir, variants=variants)
        log_path = str(tmp_path_factory.mktemp("tp-engine") / "output.txt")
        code, output = _run_bounded([sys.executable, "-c", script], env, ENGINE_TIMEOUT_S, log_path)
        if code is None:
            pytest.fail(f"the tensor-parallel engine did not finish within {ENGINE_TIMEOUT_S:.0f} s; its output, "
                        f"with every thread's stack at the bound:\n{output[-12000:]}")
        lines = [line for line in output.splitlines() if line.startswith("TOKENS ")]
        assert code == 0 and lines, f"tensor-parallel run failed (exit code {code}):\n{output[-6000:]}"
        tokens.update(json.loads(lines[-1][len("TOKENS "):]))
    return model_dir, tokens


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_engine_tensor_parallel_greedy_equal(tp2_tokens, variant):
    model_dir, tokens = tp2_tokens
    assert tokens[variant] == _engine_tokens(model_dir, 1, variant)


def test_engine_rejects_unshardable(checkpoint_dir):
    from zipage import LLM, CompressionConfig

    model_dir = checkpoint_dir("qwen3")  # 4 query heads, 2 KV heads
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        LLM(model_dir, device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="compression needs tensor_parallel_size=4 <= num_key_value_heads=2"):
        LLM(model_dir, device="cpu", tensor_parallel_size=4, block_size=16,
            compression=CompressionConfig(max_blocks_per_seq=3))
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(model_dir, device="cpu", tensor_parallel_size=0)


# -- faults on rank 0 of a tensor_parallel_size=2 engine ----------------------------------
# Each scenario runs in rank 0's script (``tp2_faults``) and reports what its tests check.
# A step that fails must end within FAULT_BOUND_S: a follower left inside a collective
# would wait for the group's timeout (600 s), and rank 0's next steps with it.
FAULT_BOUND_S = 30.0
FAULT_PARAMS = dict(temperature=0, max_tokens=6, ignore_eos=True)
FAULT_PROMPTS = [list(range(5, 25)), [3, 1, 4, 1, 5]]


def _always(args, kwargs) -> bool:
    return True


def _fault_llm(model_dir: str, async_scheduling: bool):
    from zipage import LLM

    return LLM(model_dir, device=ENGINE_DEVICE, dtype="float32", block_size=BLOCK, max_model_len=256,
               kv_cache_memory_bytes=1 << 22, tensor_parallel_size=2, max_num_seqs=4,
               async_scheduling=async_scheduling)


def _generate(llm, prompts) -> tuple[list[list[int]], list[str | None]]:
    """Each prompt's tokens and error (a ``RequestsFailed`` is caught)."""
    from zipage import RequestsFailed, SamplingParams

    try:
        outputs = llm.generate(prompts, SamplingParams(**FAULT_PARAMS), use_tqdm=False)
    except RequestsFailed as failed:
        outputs = failed.outputs
    return [o.outputs[0].token_ids for o in outputs], [o.error for o in outputs]


def _survived(llm, expected, arm) -> dict:
    """``arm()`` arms a fault (and returns a list that is not empty once it fired); then the
    prompts run, and run again."""
    fired = arm()
    _, errors = _generate(llm, FAULT_PROMPTS)
    again, _ = _generate(llm, FAULT_PROMPTS)
    runner, bm = llm.engine.runner, llm.engine.block_manager
    return dict(fired=bool(fired), errors=errors, again=again, expected=expected, failure=runner.failure,
                followers_alive=[p.is_alive() for p in runner._procs], pool_full=bm.num_free_blocks == bm.num_blocks)


def _fault_in_forward(model_dir: str, async_scheduling: bool) -> dict:
    """First rank 0's sampler raises, after the step's forward. Then rank 0's last decoder layer
    raises in a step the follower runs too, after the collectives of the layers before it; with
    asynchronous scheduling, while the step before it is in flight. Then a new request, and the
    engine's close."""
    from tests.test_engine_faults import _arm
    from zipage import SamplingParams

    with _fault_llm(model_dir, async_scheduling) as llm:
        engine, runner = llm.engine, llm.engine.runner
        followers = list(runner._procs)
        expected, _ = _generate(llm, FAULT_PROMPTS)
        # the sampler of the first decode step (the prefill's is call 0)
        sampler = _survived(llm, expected, lambda: _arm(runner.local.sampler, "sample", _always, at=1))
        params = SamplingParams(**FAULT_PARAMS)
        engine.add_request(FAULT_PROMPTS[0], params, request_id="A")
        for _ in range(2):  # A's prefill, then its first decode step
            engine.step()
        engine.add_request(FAULT_PROMPTS[1], params, request_id="B")
        # B's prefill step runs the layers eagerly (also on a GPU, whose decode steps replay graphs)
        fired = _arm(runner.local.model.model.layers[-1], "forward", _always, at=0)
        start, errors = time.monotonic(), {}
        while engine.has_unfinished_requests():
            errors.update((o.request_id, o.error) for o in engine.step()[0] if o.finished)
        seconds = time.monotonic() - start
        exitcodes = [p.exitcode for p in followers]
        start = time.monotonic()
        _, later = _generate(llm, [[2, 7, 1, 8]])
        later_seconds = time.monotonic() - start
        start = time.monotonic()
    return dict(sampler=sampler, fired=bool(fired), seconds=seconds, errors=errors, exitcodes=exitcodes,
                later_error=later[0], later_seconds=later_seconds, close_seconds=time.monotonic() - start)


def _faults_before_posting(model_dir: str) -> dict:
    """On one engine (asynchronous scheduling): rank 0 fails to build a decode step's inputs,
    before the step is posted; a launched step is never sampled (its requests fail between its
    forward and its sampler, which would broadcast its tokens); then the follower dies."""
    from tests.engine_double import InjectedFault
    from tests.test_engine_faults import _arm

    with _fault_llm(model_dir, True) as llm:
        runner = llm.engine.runner
        followers = list(runner._procs)
        expected, _ = _generate(llm, FAULT_PROMPTS)
        unbuilt = _survived(llm, expected, lambda: _arm(runner.local.inputs, "fill_decode", _always, at=0))
        real_launch, unsampled = runner.launch, []

        def launch_unsampled(seqs, is_prefill, *args, **kwargs):  # the first decode step: its forward only
            if not unsampled and not is_prefill:
                unsampled.append(real_launch(seqs, is_prefill, *args, **dict(kwargs, defer_sampling=True)))
                raise InjectedFault("a launched step was never sampled")
            return real_launch(seqs, is_prefill, *args, **kwargs)

        def arm_unsampled():
            runner.launch = launch_unsampled
            return unsampled

        never_sampled = _survived(llm, expected, arm_unsampled)
        followers[0].kill()
        followers[0].join(timeout=10)
        start = time.monotonic()
        _, dead = _generate(llm, FAULT_PROMPTS[:1])
        return dict(unbuilt=unbuilt, never_sampled=never_sampled, dead_error=dead[0],
                    dead_seconds=time.monotonic() - start)


FAULT_SCENARIOS = {
    "before-posting": _faults_before_posting,
    "forward-async": lambda model_dir: _fault_in_forward(model_dir, True),
    "forward-sync": lambda model_dir: _fault_in_forward(model_dir, False),
}

# Rank 0's script: each scenario's result on a line of its own as soon as it is known.
_FAULT_SCRIPT = """
import faulthandler, json, signal, sys
faulthandler.register(signal.SIGUSR1, all_threads=True)
sys.path[:0] = [{tests!r}, {root!r}]
from test_tensor_parallel import FAULT_SCENARIOS
for name, scenario in FAULT_SCENARIOS.items():
    print("RESULT " + json.dumps([name, scenario({model_dir!r})]), flush=True)
"""


@pytest.fixture(scope="module")
def tp2_faults(checkpoint_dir, tmp_path_factory):
    """Each fault scenario's result (those reported before a hang or a crash), the script's exit
    code (None at the bound) and its output."""
    import json
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    script = _FAULT_SCRIPT.format(tests=tests, root=os.path.dirname(tests), model_dir=checkpoint_dir("qwen3"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log_path = str(tmp_path_factory.mktemp("tp-faults") / "output.txt")
    code, output = _run_bounded([sys.executable, "-c", script], env, ENGINE_TIMEOUT_S, log_path)
    results = dict(json.loads(line[len("RESULT "):]) for line in output.splitlines() if line.startswith("RESULT "))
    return results, code, output


def _fault_result(tp2_faults, name: str) -> dict:
    results, code, output = tp2_faults
    if name not in results:
        ended = f"did not finish within {ENGINE_TIMEOUT_S:.0f} s" if code is None else f"exited with code {code}"
        pytest.fail(f"rank 0's script {ended} before the {name!r} scenario reported; its output (with every "
                    f"thread's stack if it hung):\n{output[-12000:]}")
    return results[name]


def _check_survived(r: dict, what: str) -> None:
    """Only the fault's requests failed, with its error; the group is whole; the prompts again
    give their tokens."""
    assert r["fired"], f"{what}: the fault was not reached"
    assert all(error is None or "InjectedFault" in error and "shut down" not in error for error in r["errors"]), \
        f"{what}: {r['errors']}"
    assert any(r["errors"]), f"{what}: no request failed"
    assert r["failure"] is None and all(r["followers_alive"]), f"{what}: the group was shut down"
    assert r["again"] == r["expected"], what
    assert r["pool_full"], f"{what}: blocks still held"


@pytest.mark.parametrize("scheduling", ["async", "sync"])
def test_rank0_fault_after_posting_shuts_the_group_down(tp2_faults, scheduling):
    """A step that fails on rank 0 in its forward, after it was posted, ends in bounded time with
    an error naming the fault; the follower is gone; a later request fails at once with that
    error, and the engine closes."""
    r = _fault_result(tp2_faults, f"forward-{scheduling}")
    assert r["fired"], "the fault was not reached"
    assert r["seconds"] < FAULT_BOUND_S, f"the failed step took {r['seconds']:.0f} s"
    assert set(r["errors"]) == {"A", "B"}
    for rid, error in r["errors"].items():
        assert error and "InjectedFault" in error and "shut down" in error, f"request {rid}: {error!r}"
    assert None not in r["exitcodes"], f"a follower still runs: exit codes {r['exitcodes']}"
    later = r["later_error"]
    assert later and "TensorParallelFailed" in later and "InjectedFault" in later, later
    assert r["later_seconds"] < FAULT_BOUND_S and r["close_seconds"] < FAULT_BOUND_S


@pytest.mark.parametrize("scheduling", ["async", "sync"])
def test_rank0_sampler_fault_leaves_the_group_serving(tp2_faults, scheduling):
    """Sampling runs after the forward: a sampler fault on rank 0 ends only its step's requests
    (with asynchronous scheduling the followers still get the step's broadcast)."""
    _check_survived(_fault_result(tp2_faults, f"forward-{scheduling}")["sampler"], "sampler")


@pytest.mark.parametrize("fault", ["unbuilt", "never_sampled"])
def test_rank0_fault_before_posting_or_sampling_leaves_the_group_serving(tp2_faults, fault):
    """A step whose inputs fail to build on rank 0 never reaches the follower; a launched step
    that is never sampled still gets its broadcast, before the next message."""
    _check_survived(_fault_result(tp2_faults, "before-posting")[fault], fault)


def test_a_dead_follower_shuts_the_group_down(tp2_faults):
    """A follower found dead before a step is posted: the step fails at once, naming it."""
    r = _fault_result(tp2_faults, "before-posting")
    error = r["dead_error"]
    assert error and "TensorParallelFailed" in error and "rank 1 exited with code -9" in error, error
    assert r["dead_seconds"] < FAULT_BOUND_S


def test_allreduce_sweep_harness_on_gloo(tmp_path):
    """scripts/allreduce_sweep.py (all-reduce variants at a decode step's sizes, for GPUs) runs its
    harness on two CPU ranks: each size's sum is checked and timed, the symmetric-memory variants
    (PyTorch's and the engine's one-shot kernel) and the norm ones are reported as needing CUDA,
    and fewer than two ranks is refused."""
    import json
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "allreduce_sweep.py"
    out = tmp_path / "allreduce.json"
    done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--rows", "1,3", "--hidden", "32",
                           "--calls", "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["rows"], r["variant"]) for r in rows} == {(n, v) for n in (1, 3) for v in (
        "nccl", "one_shot", "two_shot", "zipage", "nccl+norm", "zipage+norm")}
    for r in rows:
        assert r["bytes"] == r["rows"] * 32 * 4
        if r["variant"] == "nccl":
            assert r["equal_to_nccl"] and r["us"] > 0
        else:
            assert r["unavailable"] == "needs CUDA" and "us" not in r
    refused = subprocess.run([sys.executable, str(script), "--device", "cpu", "--gpus", "1"], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "--gpus must be >= 2, got 1" in refused.stderr
