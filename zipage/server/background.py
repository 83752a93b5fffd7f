"""Run a server on a background thread of this process (tests, in-process benchmarks)."""

from __future__ import annotations

import socket
import threading
import time

from zipage.server.connections import ConnectionLimits, uvicorn_config


class ServerThread:
    """Serve ``app`` with uvicorn on ``host`` (port 0: a free one) until ``stop``, with the
    connection handling of ``zipage serve`` (``limits``: its defaults if None).

    The socket is bound before the thread starts, so ``url`` is known and free of races.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 60.0,
                 limits: ConnectionLimits | None = None):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn_config(app, limits, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="zipage-server", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + startup_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start within {startup_timeout} s")
            time.sleep(0.02)

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
