"""Engine replicas on Ray actors, for the data-parallel server.

Each replica is a Ray actor that builds an engine and serves it with the same app as
``zipage serve`` on a port of its own node, behind an internal API key that only the
router knows. Ray places the actors (one or ``tensor_parallel_size`` GPUs each, on any
node of the cluster) and restarts one whose process dies; the router
(``zipage.server.router``) finds the restarted replica's new address and routes to it
again.

Ray is an optional dependency (``pip install "zipage[ray]"``), imported only here.
"""

from __future__ import annotations

import logging
import os
import secrets

logger = logging.getLogger(__name__)


class ReplicaServer:
    """One engine and its HTTP app on this actor's node (the class Ray runs as an actor)."""

    def __init__(self, model: str, engine: dict, served_model_name: str, app_kwargs: dict, api_key: str,
                 host: str | None = None):
        from zipage import LLM
        from zipage.config import CompressionConfig
        from zipage.server.app import create_app
        from zipage.server.background import ServerThread

        engine = dict(engine)
        if isinstance(engine.get("compression"), dict):
            engine["compression"] = CompressionConfig(**engine["compression"])
        self.llm = LLM(model, **engine)
        app = create_app(self.llm.engine, served_model_name, api_key=api_key, **app_kwargs)
        if host is None:
            import ray.util
            host = ray.util.get_node_ip_address()
        self.server = ServerThread(app, host=host)

    def url(self) -> str:
        return self.server.url

    def pool(self) -> dict:
        """Free and total KV blocks, and unfinished requests (read between steps; for tests and checks)."""
        engine = self.llm.engine
        manager = engine.block_manager
        return {"free_blocks": manager.num_free_blocks, "blocks": manager.num_blocks,
                "leaked_refs": sum(1 for c in manager.ref_counts if c),
                "unfinished": int(engine.has_unfinished_requests()), "pid": os.getpid()}


class ReplicaSet:
    """``count`` replica actors of one model; ``urls[i]`` is replica i's address (None while down).

    ``ray_address``: join that cluster (``auto``, ``ray://host:10001``); None starts a local
    one (or uses the one this process already joined). ``gpus_per_replica``: GPUs each actor
    holds (its tensor-parallel size on GPUs, 0 on CPU)."""

    def __init__(self, model: str, count: int, engine: dict, served_model_name: str, app_kwargs: dict | None = None,
                 ray_address: str | None = None, gpus_per_replica: float = 0, startup_timeout: float = 600.0):
        try:
            import ray
        except ImportError:
            raise ValueError('--data-parallel-size and --ray-address run on Ray: pip install "zipage[ray]"') from None
        if count < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {count}")
        self.ray = ray
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            ray.init(address=ray_address, include_dashboard=False, log_to_driver=False,
                     **({} if ray_address else {"num_cpus": count + 1}))
        self.api_key = secrets.token_urlsafe(32)  # replicas answer only the router
        host = "127.0.0.1" if ray_address is None else None  # local: loopback; a cluster: the node's address
        actor = ray.remote(ReplicaServer).options(
            num_gpus=gpus_per_replica, num_cpus=0 if gpus_per_replica else 1,
            max_restarts=-1, max_task_retries=0, max_concurrency=4)
        self.actors = [actor.remote(model, engine, served_model_name, app_kwargs or {}, self.api_key, host)
                       for _ in range(count)]
        try:
            self.urls: list[str | None] = ray.get([a.url.remote() for a in self.actors], timeout=startup_timeout)
        except Exception:
            self.shutdown()
            raise
        logger.info("%d replicas serving at %s", count, ", ".join(self.urls))

    def __len__(self) -> int:
        return len(self.actors)

    async def resolve(self, index: int, timeout: float) -> str | None:
        """Replica ``index``'s address once it answers (after a restart: its new one), or None."""
        import asyncio
        try:
            return await asyncio.wait_for(self.actors[index].url.remote(), timeout)
        except Exception:  # noqa: BLE001 - still restarting, or dead for good
            return None

    def pool(self, index: int, timeout: float = 30.0) -> dict:
        return self.ray.get(self.actors[index].pool.remote(), timeout=timeout)

    def kill(self, index: int) -> None:
        """End replica ``index``'s process as a crash would; Ray starts it again."""
        self.ray.kill(self.actors[index], no_restart=False)

    def shutdown(self) -> None:
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        if self.started_ray:
            self.ray.shutdown()
            self.started_ray = False

