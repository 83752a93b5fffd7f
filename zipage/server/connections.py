"""How the HTTP server treats connections: how many, how long each may take to send its
request, how long one may idle, and what it answers past those limits.

uvicorn's own settings cover the keep-alive timeout, the header size (h11's largest
incomplete event) and the listen backlog. What it lacks is added by a subclass of its h11
protocol: a timeout for a request's headers (uvicorn lets a client send them a byte at a
time forever), a timeout for a client that stops reading its response, a cap on open
connections enforced when a connection is made (uvicorn's ``limit_concurrency`` answers
503 only once a request's headers have come in, so idle connections still pile up and use
file descriptors), and answering a client that half-closes its socket after its request
(uvicorn treats that as a disconnect). The request body's timeout is the app's
(``RequestLimits.body_timeout_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import socket
import time
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

FD_RESERVE = 256  # file descriptors kept for the process itself (model files, logs, the engine)
LOG_INTERVAL_S = 10.0  # refused connections and accept errors are logged at most this often


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 2048  # open client connections; past this, a new one gets 503 and is closed
    header_timeout_s: float = 10.0  # from connecting (or the previous response) to a request's full headers
    keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    write_timeout_s: float = 60.0  # a client that reads none of its response for this long is cut off
    max_header_bytes: int = 16 * 1024  # a request line and headers; past this, 431
    backlog: int = 2048  # connections the kernel queues before they are accepted

    def __post_init__(self):
        for name in ("max_connections", "max_header_bytes", "backlog"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("header_timeout_s", "keep_alive_timeout_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


def uvicorn_config(app, limits: ConnectionLimits | None = None, **options):
    """A ``uvicorn.Config`` serving ``app`` within ``limits`` (``options``: host, port, log_level...)."""
    import uvicorn

    limits = limits or ConnectionLimits()
    max_connections = _fit_file_descriptors(limits.max_connections)

    class Protocol(GuardedH11Protocol):
        pass

    Protocol.max_connections, Protocol.header_timeout_s = max_connections, limits.header_timeout_s
    Protocol.write_timeout_s, Protocol.max_header_bytes = limits.write_timeout_s, limits.max_header_bytes
    options.setdefault("timeout_graceful_shutdown", 5)
    return uvicorn.Config(app, http=Protocol, timeout_keep_alive=limits.keep_alive_timeout_s,
                          h11_max_incomplete_event_size=limits.max_header_bytes, backlog=limits.backlog,
                          **options)


def _no_delay(transport) -> None:
    """Send each write at once (TCP_NODELAY). asyncio sets it only on sockets created with an explicit
    IPPROTO_TCP, which a listening socket bound the usual way is not, and then a response's body,
    written after its headers, waited for the client's delayed acknowledgement of them: about 40 ms
    added to every call that follows another on the same connection."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _fit_file_descriptors(max_connections: int) -> int:
    """Raise the process's file-descriptor limit to fit ``max_connections`` (up to the hard limit);
    if it cannot, serve fewer connections, and say so."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < wanted:
        fitted = max(1, soft - FD_RESERVE)
        logger.warning("max_connections=%d needs %d file descriptors but the limit is %d (ulimit -n): serving at "
                       "most %d connections", max_connections, wanted, soft, fitted)
        return fitted
    return max_connections


class _RateLimitedLog:
    """Counts events; logs the first, then at most one line (with the count) per interval."""

    def __init__(self, message: str, interval: float = LOG_INTERVAL_S):
        self.message, self.interval = message, interval
        self.count, self.last = 0, -float("inf")

    def __call__(self, *args) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.interval:
            logger.warning(self.message + " (%d since the last report)", *args, self.count)
            self.count, self.last = 0, now


_log_refused = _RateLimitedLog("refused a connection: max_connections=%d are open")
_accept_errors = _RateLimitedLog("accepting a connection failed: %s")

def _reply(status: str, message: str, error_type: str, code: str, headers: str = "") -> bytes:
    """A whole HTTP response with an OpenAI-style error body, for a connection about to be closed."""
    body = json.dumps({"error": {"message": message, "type": error_type, "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n{headers}"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


BUSY = _reply("503 Service Unavailable", "the server has too many open connections; retry later", "server_error",
              "too_many_connections", "retry-after: 1\r\n")
TOO_LARGE = _reply("431 Request Header Fields Too Large", "the request line and headers exceed the server's limit",
                   "invalid_request_error", "headers_too_large")
TOO_SLOW = _reply("408 Request Timeout", "the request headers did not arrive in time", "invalid_request_error",
                  "request_timeout")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection cap, header and write timeouts, and half-close support."""

    max_connections = ConnectionLimits.max_connections
    header_timeout_s = ConnectionLimits.header_timeout_s
    write_timeout_s = ConnectionLimits.write_timeout_s
    max_header_bytes = ConnectionLimits.max_header_bytes

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._refused = False  # over the connection cap: never served
        self._ignoring = False  # answered early (headers too large): what more comes is dropped
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._half_closed = False
        self._head = b""  # the start of a request whose headers have not ended yet (up to max_header_bytes)

    def connection_made(self, transport) -> None:
        if len(self.connections) >= self.max_connections:
            self._refused = True
            _log_refused(self.max_connections)
            _answer_and_close(transport, BUSY)
            return
        super().connection_made(transport)
        _no_delay(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._refused or self._ignoring:
            return
        if self._awaiting_request() and not self._head_fits(data):
            self._ignoring = True
            _answer_and_close(self.transport, TOO_LARGE)
            return
        super().data_received(data)
        if self._awaiting_request():
            self._arm_header_timer()  # a request's first bytes: its headers now have a deadline
        else:
            self._disarm_header_timer()

    def _head_fits(self, data: bytes) -> bool:
        """Whether the headers that ``data`` continues end within ``max_header_bytes`` (or may still).
        h11 bounds only what it buffers between reads, so headers that arrive in one read of any
        size would pass it."""
        head = self._head + data
        end = head.find(b"\r\n\r\n")
        if end >= 0:
            self._head = b""
            return end + 4 <= self.max_header_bytes
        self._head = head
        return len(head) <= self.max_header_bytes

    def eof_received(self) -> bool | None:
        """A client may shut down its sending side once its request is in: keep the connection
        open to answer it, then close it."""
        if self._refused or self.cycle is None or self.cycle.response_complete or self.conn.their_state is not h11.DONE:
            return None  # nothing to answer (or a request cut short): close, which reads as a disconnect
        self._half_closed = True
        return True

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._half_closed and not self.transport.is_closing():
            self._unset_keepalive_if_required()
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self.resume_writing()
        if not self._refused:
            super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The client reads slower than we write: give it ``write_timeout_s`` to catch up."""
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.write_timeout_s, self._reader_too_slow)

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        if self.flow is not None:
            super().resume_writing()

    def _reader_too_slow(self) -> None:
        self._write_timer = None
        self.transport.abort()  # close() would wait for the buffer to drain: it never does

    def _awaiting_request(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._awaiting_request():
            return
        _answer_and_close(self.transport, TOO_SLOW)


def _answer_and_close(transport, reply: bytes) -> None:
    transport.write(reply)
    transport.close()


def log_accept_errors_at_a_bounded_rate(loop: asyncio.AbstractEventLoop):
    """Route the loop's accept errors (out of file descriptors, say) through a rate-limited log;
    return the handler it had, to restore."""
    previous = loop.get_exception_handler()

    def handler(loop, context):
        message = context.get("message", "")
        if "accept" in message or ("socket" in context and isinstance(context.get("exception"), OSError)):
            _accept_errors(context.get("exception") or message)
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    return previous
