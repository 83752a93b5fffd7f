"""Batch jobs on Ray Data: one engine per actor, many actors, one output file.

``ZipageBatch`` is a callable class for ``Dataset.map_batches``: each actor builds an
engine, serves it on a loopback port of its own process (the API ``zipage serve`` runs,
so every request field behaves as served) and answers the rows of each batch through
it, many at once. A row holds ``custom_id``, ``url`` (``/v1/completions`` or
``/v1/chat/completions``) and ``body`` (a dict or its JSON text); the actor adds
``result``, the OpenAI Batch result line of that request (``zipage/batch.py``)::

    import ray
    from zipage.ray_batch import ZipageBatch

    ds = ray.data.read_json("requests.jsonl")          # custom_id, url, body per row
    results = ds.map_batches(ZipageBatch, fn_constructor_kwargs={"model": "path/to/Qwen3-8B",
                             "engine": {"compression": {"kv_budget_tokens": 2048}}},
                             concurrency=4, num_gpus=1, batch_size=256)

``zipage run-batch --data-parallel-size N [--ray-address ADDR]`` does this for a file:
the driver reads the input and the results already written (as the local command does),
hands the requests still to run to N actors, and appends each result line as its batch
comes back, so the output keeps the local command's guarantees: every finished line
stays on a stop, and a rerun runs only what has no result.

Ray is an optional dependency (``pip install "zipage[ray]"``), imported only here.
"""

from __future__ import annotations

import asyncio
import json

from zipage.batch import BatchLine, finished_ids, read_requests, result_line


class ZipageBatch:
    """One engine behind the HTTP API on a loopback port; ``__call__`` answers a batch of rows.

    ``model``: checkpoint directory; ``engine``: ``LLM`` keyword arguments (a ``compression``
    dict becomes ``CompressionConfig``); ``served_model_name``: the name bodies may give
    (default: the directory's); ``server``: ``create_app`` keyword arguments
    (``reasoning_parser``, ``tool_call_parser``, ``enable_auto_tool_choice``...);
    ``concurrency``: requests in flight at once (default: twice ``max_num_seqs``)."""

    def __init__(self, model: str, engine: dict | None = None, served_model_name: str | None = None,
                 server: dict | None = None, concurrency: int | None = None):
        import os

        from zipage import LLM
        from zipage.config import CompressionConfig
        from zipage.server.app import create_app
        from zipage.server.background import ServerThread

        engine = dict(engine or {})
        if isinstance(engine.get("compression"), dict):
            engine["compression"] = CompressionConfig(**engine["compression"])
        self.llm = LLM(model, **engine)
        self.name = served_model_name or os.path.basename(os.path.normpath(model))
        self.concurrency = concurrency or 2 * self.llm.engine.config.scheduler.max_num_seqs
        app = create_app(self.llm.engine, self.name, max_queued_requests=max(1024, self.concurrency),
                         **(server or {}))
        self.server = ServerThread(app)

    def __call__(self, batch: dict) -> dict:
        ids, urls, bodies = (list(batch[key]) for key in ("custom_id", "url", "body"))
        lines = [BatchLine(0, str(custom_id), str(url), body if isinstance(body, dict) else json.loads(body))
                 for custom_id, url, body in zip(ids, urls, bodies)]
        results = asyncio.run(self._answer(lines))
        return {"custom_id": [line.custom_id for line in lines], "result": results}

    async def _answer(self, lines: list[BatchLine]) -> list[str]:
        import httpx

        limit = asyncio.Semaphore(self.concurrency)
        async with httpx.AsyncClient(base_url=self.server.url, timeout=None,
                                     limits=httpx.Limits(max_connections=self.concurrency)) as client:
            async def one(line: BatchLine) -> str:
                body = dict(line.body)
                body.setdefault("model", self.name)
                async with limit:
                    response = await client.post(line.url, json=body)
                return result_line(line.custom_id, response.status_code, response.json())

            return await asyncio.gather(*(one(line) for line in lines))

    def __del__(self):
        server = self.__dict__.get("server")
        if server is not None:
            server.stop()


def run_batch_ray(model: str, input_path: str, output_path: str, replicas: int, engine: dict | None = None,
                  served_model_name: str | None = None, server: dict | None = None, ray_address: str | None = None,
                  gpus_per_replica: float = 0, batch_size: int = 256, show_progress: bool = True) -> dict:
    """``zipage.batch.run_batch`` on ``replicas`` Ray actors (joining ``ray_address``, or a local
    cluster). Returns the same counts."""
    import ray
    from tqdm import tqdm

    if replicas < 1 or batch_size < 1:
        raise ValueError(f"replicas and batch_size must be >= 1, got {replicas} and {batch_size}")
    lines = read_requests(input_path)
    done = finished_ids(output_path)
    todo = [line for line in lines if line.custom_id not in done]
    counts = {"ok": 0, "refused": 0, "invalid": 0, "skipped": len(lines) - len(todo)}
    valid = [line for line in todo if line.error is None]
    started = not ray.is_initialized()
    if started:
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False,
                 **({} if ray_address else {"num_cpus": replicas + 2}))  # one per replica, two for Ray Data
    try:
        with open(output_path, "a", encoding="utf-8") as out, tqdm(total=len(todo), desc="requests", unit="req",
                                                                    disable=not show_progress) as progress:
            def write(text: str) -> None:
                out.write(text)
                out.flush()
                progress.update(1)

            for line in todo:
                if line.error is not None:
                    counts["invalid"] += 1
                    write(result_line(line.custom_id, None, None, f"line {line.number}: {line.error}"))
            if valid:
                import ray.data

                rows = [{"custom_id": line.custom_id, "url": line.url, "body": json.dumps(line.body)}
                        for line in valid]
                results = ray.data.from_items(rows).map_batches(
                    ZipageBatch, fn_constructor_kwargs=dict(model=model, engine=engine,
                                                            served_model_name=served_model_name, server=server),
                    concurrency=replicas, batch_size=batch_size, num_gpus=gpus_per_replica,
                    num_cpus=0 if gpus_per_replica else 1)
                for row in results.iter_rows():
                    status = json.loads(row["result"])["response"]["status_code"]
                    counts["ok" if status == 200 else "refused"] += 1
                    write(row["result"])
    finally:
        if started:
            ray.shutdown()
    return counts
