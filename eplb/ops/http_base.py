"""The hardened HTTP plumbing under EplbServer (eplb.ops.server): the stdlib's
ThreadingHTTPServer and BaseHTTPRequestHandler with every limit of the server's
hardening list, and nothing of EPLB.

- HardenedServer: a daemon thread per connection, at most `max_connections` at once (a
  fixed 503 beyond, written from the accept loop, no thread), no tracebacks on stderr;
- HardenedHandler: the whole request within `request_timeout` (_DeadlineReader), the
  request line and the headers bounded (414, 431), the body bounded (413; chunked: 411)
  and drained so the client reads the answer, JSON answers and errors only, the bearer
  token of state-changing requests checked with hmac.compare_digest (401/403).

The limits and the token are read from `server.eplb` (the EplbServer); a subclass adds
`_dispatch(method)`, the routes.
"""
from __future__ import annotations

import hmac
import io
import json
import logging
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eplb.ops.server import EplbServer

log = logging.getLogger("eplb.ops.server")  # one logger for the endpoint (its docs name it)

MAX_BODY = 4096  # bytes; POST /rebalance takes no body, this only bounds what we read
MAX_REQUEST_LINE = 2048  # bytes of "METHOD /path HTTP/1.x\r\n" (414 beyond)
MAX_HEADER_BYTES = 8192  # bytes of all request header lines together (431 beyond)
REQUEST_TIMEOUT = 10.0  # seconds for the whole request to arrive, however slowly it trickles
MAX_CONNECTIONS = 32  # connections served at once (503 beyond)
STATE_CHANGING = ("POST", "PUT", "DELETE", "PATCH")
_DRAIN_LIMIT = 1 << 20  # bytes of an oversized body read and dropped so the client sees 413


def json_default(o):
    if hasattr(o, "tolist"):  # numpy arrays and scalars
        return o.tolist()
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


_BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
         b"Content-Length: 41\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
         b'{"error": "too many connections at once"}')


class HardenedServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # stop() does not wait for slow clients (their threads are daemons)
    allow_reuse_address = True
    eplb: "EplbServer"  # the limits (max_*, request_timeout) and the token
    slots: threading.BoundedSemaphore  # one per connection being served

    def __init__(self, address, handler, ipv6: bool = False):
        if ipv6:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        """A thread per connection, at most `max_connections` at once; beyond that a fixed
        503 is written from the accept loop (a few bytes, no thread) and the socket closed."""
        if not self.slots.acquire(blocking=False):
            try:
                request.settimeout(0.5)
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address) -> None:  # no tracebacks on stderr
        log.debug("eplb server: error while handling a request from %s", client_address,
                  exc_info=True)


class _HeadersTooLarge(Exception):
    pass


class _HeaderBudget:
    """A file wrapper for header parsing: `readline` fails with _HeadersTooLarge once the
    lines read exceed `limit` bytes in all (the stdlib allows 100 lines of 64 KiB)."""

    def __init__(self, f, limit: int):
        self._f, self.left = f, limit

    def readline(self, size: int = -1) -> bytes:
        cap = self.left + 1 if size is None or size < 0 else min(size, self.left + 1)
        line = self._f.readline(cap)
        self.left -= len(line)
        if self.left < 0:
            raise _HeadersTooLarge
        return line

    def __getattr__(self, name):
        return getattr(self._f, name)


class _DeadlineReader(io.RawIOBase):
    """The socket as a raw stream whose reads fail with TimeoutError once `deadline`
    (time.monotonic) has passed, so a client that trickles bytes cannot hold a
    connection longer than the request timeout; each read also waits at most `idle` s."""

    def __init__(self, sock: socket.socket, deadline: float, idle: float):
        super().__init__()
        self._sock, self._deadline, self._idle = sock, deadline, idle

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive within the request timeout")
        self._sock.settimeout(min(left, self._idle))
        return self._sock.recv_into(b)


class HardenedHandler(BaseHTTPRequestHandler):
    """Request plumbing: deadlines and size limits, JSON answers and errors, the body, the
    bearer token. A subclass adds `_dispatch(method)` (eplb.ops.server._Handler: the routes)."""

    server: HardenedServer
    server_version = "eplb"
    sys_version = ""
    timeout = 10  # seconds one read or write may stall before the socket is closed
    protocol_version = "HTTP/1.0"  # one request per connection

    # ---- plumbing -----------------------------------------------------------------
    def setup(self) -> None:
        super().setup()
        deadline = time.monotonic() + self.server.eplb.request_timeout
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline, self.timeout))

    def parse_request(self) -> bool:
        """The stdlib's parsing with tighter limits on the request line and the headers."""
        srv = self.server.eplb
        if len(self.raw_requestline) > srv.max_request_line:
            self.requestline, self.request_version, self.command = "", "HTTP/1.0", ""
            self.send_error(414, f"request line too long (at most {srv.max_request_line} bytes)")
            return False
        rfile = self.rfile
        self.rfile = _HeaderBudget(rfile, srv.max_header_bytes)
        try:
            return super().parse_request()
        except _HeadersTooLarge:
            self.command = ""
            self.send_error(431, f"request headers too large (at most {srv.max_header_bytes} "
                                 "bytes in all)")
            return False
        finally:
            self.rfile = rfile

    def version_string(self) -> str:
        return self.server_version

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (stdlib signature)
        log.debug("%s %s", self.address_string(), format % args)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Malformed requests caught by the stdlib (bad request line, 414, 431, 501): JSON."""
        self.close_connection = True
        if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":
            self.request_version = "HTTP/1.0"  # unparsable request line: answer with a status line
        if not hasattr(self, "command"):
            self.command = ""
        try:
            self.connection.settimeout(self.timeout)
            self._json(code, {"error": message or HTTPStatus(code).phrase})
        except OSError:
            pass

    def _send(self, code: int, body: bytes, content_type: str, headers: dict | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, obj: dict, headers: dict | None = None) -> None:
        body = (json.dumps(obj, default=json_default) + "\n").encode()
        self._send(code, body, "application/json", headers)

    def _error(self, code: int, message: str, headers: dict | None = None) -> None:
        self._json(code, {"error": message}, headers)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_OPTIONS(self) -> None:
        self._dispatch("OPTIONS")

    def _read_body(self) -> bytes | None:
        """The request body, or None after answering 400/411/413."""
        self.close_connection = True
        if self.headers.get("Transfer-Encoding"):
            self._error(411, "send a Content-Length, not a chunked body")
            self._drain_chunked()
            return None
        length = self.headers.get("Content-Length")
        if length is None:
            return b""
        if not length.strip().isdigit():
            self._error(400, "invalid Content-Length")
            return None
        n = int(length)
        limit = self.server.eplb.max_body
        if n > limit:
            self._error(413, f"request body too large ({n} bytes, at most {limit})")
            self._drain(n)
            return None
        return self.rfile.read(n) if n else b""

    def _drain(self, n: int) -> None:
        """Read (and drop) a rejected body so the client can finish sending and read our
        answer instead of a connection reset; bounded in bytes and time."""
        try:
            self.wfile.flush()
            self.connection.settimeout(1.0)
            left = min(n, _DRAIN_LIMIT)
            while left > 0:
                chunk = self.rfile.read1(min(65536, left))
                if not chunk:
                    break
                left -= len(chunk)
        except OSError:
            pass

    def _drain_chunked(self) -> None:
        """As `_drain`, for a chunked body: read (and drop) chunks up to the last one and
        its trailer, so a client still sending them is not cut off (a closed socket with
        unread data resets the connection, and the client's next send fails with a broken
        pipe before it reads our 411); bounded in bytes and time."""
        try:
            self.wfile.flush()
            self.connection.settimeout(1.0)
            left = _DRAIN_LIMIT
            while left > 0:
                line = self.rfile.readline(1024)
                left -= len(line)
                size = line.split(b";", 1)[0].strip()
                if not line.endswith(b"\n") or not size or not all(
                        c in b"0123456789abcdefABCDEF" for c in size):
                    return  # closed, or not chunked framing: nothing more to wait for
                n = int(size, 16)
                if n == 0:  # the last chunk: then trailer lines up to an empty one
                    while left > 0:
                        line = self.rfile.readline(1024)
                        left -= len(line)
                        if line in (b"\r\n", b"\n", b""):
                            return
                    return
                n = min(n + 2, left)  # the chunk and its CRLF
                while n > 0:
                    chunk = self.rfile.read1(min(65536, n))
                    if not chunk:
                        return
                    n -= len(chunk)
                    left -= len(chunk)
        except OSError:
            pass

    def _authorized(self) -> bool:
        """The bearer token check of every state-changing request, before routing: False
        after answering 403 (no token configured) or 401 (missing or wrong token)."""
        srv = self.server.eplb
        if srv.token is None:
            self._error(403, "state-changing requests are disabled: no token is configured "
                             "(set EPLB_TOKEN or EPLB_TOKEN_FILE on the job, pass EplbServer "
                             "token= or token_file=, or eplb demo --token-file)")
            return False
        scheme, _, credentials = self.headers.get("Authorization", "").strip().partition(" ")
        given = credentials.strip() if scheme.lower() == "bearer" else ""
        if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                   srv.token.encode("utf-8")):
            self._error(401, "missing or wrong bearer token",
                        {"WWW-Authenticate": 'Bearer realm="eplb"'})
            return False
        return True
