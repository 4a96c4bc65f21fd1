"""HTTP endpoint of an EPLB job: Prometheus metrics, health, placement and an
authenticated rebalance trigger. Started on rank 0 only (rank 0 aggregates the metrics,
see `eplb.ops.metrics`), so a job is one scrape target.

    metrics = EplbMetrics(runtime)                       # every rank
    if runtime.rank == 0:
        server = EplbServer(runtime, metrics, port=9400).start()   # 127.0.0.1 unless told
        print(server.url)

    GET  /metrics          Prometheus exposition (text 0.0.4, or OpenMetrics if asked for)
    GET  /healthz          200 {"status": "ok", "step", "rank", "world_size"}
    GET  /placement        the placement in force: physical_to_logical [L][P], replica_count
                           [L][N], logical_to_physical (slots of each expert), sizes, policy
    GET  /load             the recorded load as of the last metrics update (rank 0's host
                           copy, see EplbMetrics.load_snapshot): logical_count [L][N] (the
                           planner's window), gpu_load [L][M], steps, step, time, ...,
                           total_logical_count [L][N]; 503 before the first update, 404
                           without EplbMetrics(export_load=True)
    POST /rebalance        bearer token required; 202 {"id", "status_url"}: every rank
                           rebalances at the next control check (config.control_interval)
    GET  /rebalance/<id>   {"id", "state": pending|running|done|failed, "step", "result",
                           "error", ...}; 404 if unknown

The token comes from `token=`, `token_file=`, the environment variable EPLB_TOKEN or the
file named by EPLB_TOKEN_FILE (in that order).

Hardening (each point has a test in tests/test_server.py):
  * every state-changing method (POST, PUT, DELETE, PATCH) on ANY path needs the bearer
    token, checked before routing with `hmac.compare_digest`: 401 on a missing or wrong
    token, 403 when no token is configured (the trigger is off, not open); GET/HEAD are
    read-only and need none;
  * the server binds 127.0.0.1 by default; another address must be passed explicitly
    (`host=`, the demo's `--metrics-host`) and logs a warning; "" (every interface by
    accident) is refused;
  * limits: request line `max_request_line` bytes (414), request headers
    `max_header_bytes` in all (431), body `max_body` bytes (413; chunked bodies 411),
    `max_connections` connections at once (503 beyond, answered without a thread);
  * slow clients: the whole request (line, headers, body) must arrive within
    `request_timeout` seconds, however slowly it trickles, and each read within 10 s;
    then the connection is closed;
  * no stack traces or exception text in any response: errors are JSON
    {"error": "..."} with a fixed message (500: "internal error (see the server log)");
    the one exception is a failed rebalance's reason in GET /rebalance/<id>, a single
    line of at most 300 characters, which the operator asked for with the token;
  * requests are logged only at DEBUG level on the "eplb.ops.server" logger.

The client side (`eplb trigger`, `eplb record`) is `eplb.ops.client`.

Longer than 400 lines because each hardening point above needs its own plumbing (the
connection cap, the request deadline, the header budget) next to the handler it guards.
"""
from __future__ import annotations

import gzip
import hmac
import io
import ipaddress
import json
import logging
import os
import re
import socket
import stat
import threading
import time
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from eplb.ops.metrics import EplbMetrics
    from eplb.runtime import EplbRuntime

log = logging.getLogger("eplb.ops.server")

MAX_BODY = 4096  # bytes; POST /rebalance takes no body, this only bounds what we read
MAX_REQUEST_LINE = 2048  # bytes of "METHOD /path HTTP/1.x\r\n" (414 beyond)
MAX_HEADER_BYTES = 8192  # bytes of all request header lines together (431 beyond)
REQUEST_TIMEOUT = 10.0  # seconds for the whole request to arrive, however slowly it trickles
MAX_CONNECTIONS = 32  # connections served at once (503 beyond)
STATE_CHANGING = ("POST", "PUT", "DELETE", "PATCH")
_ERROR_TEXT_LIMIT = 300  # characters of a failed rebalance's reason in GET /rebalance/<id>
_DRAIN_LIMIT = 1 << 20  # bytes of an oversized body read and dropped so the client sees 413

class _Route(NamedTuple):
    methods: tuple[str, ...]  # allowed methods (HEAD is allowed wherever GET is)
    handler: str  # name of the _Handler method that answers


# the route table: path -> methods and handler; GET /rebalance/<id> is matched by _STATUS_ROUTE
_ROUTES = {"/": _Route(("GET",), "_index"), "/metrics": _Route(("GET",), "_metrics"),
           "/healthz": _Route(("GET",), "_healthz"), "/placement": _Route(("GET",), "_placement"),
           "/load": _Route(("GET",), "_load"), "/rebalance": _Route(("POST",), "_rebalance")}
_STATUS_ROUTE = re.compile(r"/rebalance/([0-9]{1,18})")
_GZIP_MIN = 1024  # bytes of a /load answer above which it is gzipped for clients that accept it


def load_token(token: str | None = None, token_file: str | os.PathLike | None = None) -> str | None:
    """The bearer token: `token`, else the contents of `token_file`, else $EPLB_TOKEN, else
    the file named by $EPLB_TOKEN_FILE; None if none is set. Surrounding whitespace is
    stripped; an empty token or an unreadable file is a ValueError."""
    if token is not None:
        if not token.strip():
            raise ValueError("token is empty")
        return token.strip()
    if token_file is None:
        env = os.environ.get("EPLB_TOKEN", "").strip()
        if env:
            return env
        token_file = os.environ.get("EPLB_TOKEN_FILE") or None
        if token_file is None:
            return None
    try:
        with open(token_file, encoding="utf-8") as f:
            value = f.read().strip()
        mode = os.stat(token_file).st_mode
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"token file {token_file}: cannot read it "
                         f"({getattr(e, 'strerror', None) or type(e).__name__})") from None
    if not value:
        raise ValueError(f"token file {token_file} is empty")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("token file %s is readable by group or others (chmod 600 it)", token_file)
    return value


def is_loopback(host: str) -> bool:
    """True when every address `host` names (an IP literal, "localhost" or a name that
    resolves) is a loopback address; unresolvable names count as not loopback."""
    name = host.strip("[]")
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback
                               for i in infos)


def _positive(name: str, value, kind=int):
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) \
            or not value > 0:
        raise ValueError(f"{name} must be a positive {kind.__name__}, got {value!r}")
    return value


def _json_default(o):
    if hasattr(o, "tolist"):  # numpy arrays and scalars
        return o.tolist()
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


class EplbServer:
    """The HTTP endpoint (stdlib ThreadingHTTPServer in a daemon thread).

    `metrics`: an EplbMetrics (or a prometheus CollectorRegistry) served at /metrics;
    None answers /metrics with 404. `port=0` picks a free port (read `.url`).
    `host`: 127.0.0.1 unless told otherwise; any address that is not loopback is an
    explicit opt-in and logs a warning. The limits are described in the module docstring.
    """

    def __init__(self, runtime: "EplbRuntime", metrics: "EplbMetrics | None" = None,
                 host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 token_file: str | os.PathLike | None = None, max_body: int = MAX_BODY, *,
                 max_request_line: int = MAX_REQUEST_LINE, max_header_bytes: int = MAX_HEADER_BYTES,
                 request_timeout: float = REQUEST_TIMEOUT, max_connections: int = MAX_CONNECTIONS):
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}")
        if not isinstance(host, str) or not host.strip():
            raise ValueError(f"host must be an address; got {host!r} (pass '0.0.0.0' explicitly "
                             "to listen on every interface)")
        self.max_body = _positive("max_body", max_body)
        self.max_request_line = _positive("max_request_line", max_request_line)
        self.max_header_bytes = _positive("max_header_bytes", max_header_bytes)
        self.request_timeout = float(_positive("request_timeout", request_timeout, float))
        self.max_connections = _positive("max_connections", max_connections)
        self.runtime = runtime
        self.metrics = metrics
        self.registry = getattr(metrics, "registry", metrics)
        self.host, self.port = host, port
        self.token = load_token(token, token_file)
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        if not is_loopback(host):
            log.warning(
                "eplb server will listen on %s, which is not a loopback address: GET /metrics, "
                "/healthz, /placement and /load are readable by anyone who can reach it, and the "
                "bearer token travels in clear text (plain HTTP); %s", host,
                "POST /rebalance needs that token" if self.token is not None
                else "no token is configured, so POST /rebalance is refused")

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:9400 (the bound port once started)."""
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self.port}"

    @property
    def trigger_enabled(self) -> bool:
        return self.token is not None

    def start(self) -> "EplbServer":
        """Bind and serve in a daemon thread; OSError if the address is taken."""
        if self._httpd is not None:
            return self
        httpd = _Server((self.host, self.port), _Handler, ipv6=":" in self.host)
        httpd.eplb = self
        httpd.slots = threading.BoundedSemaphore(self.max_connections)
        self.port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="eplb-http", daemon=True)
        self._thread.start()
        log.info("eplb server listening on %s", self.url)
        return self

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "EplbServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
         b"Content-Length: 41\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
         b'{"error": "too many connections at once"}')


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # stop() does not wait for slow clients (their threads are daemons)
    allow_reuse_address = True
    eplb: EplbServer
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


class _HTTPHandler(BaseHTTPRequestHandler):
    """Request plumbing: deadlines and size limits, JSON answers and errors, the body, the
    bearer token. `_Handler` adds the routes."""

    server: _Server
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
        body = (json.dumps(obj, default=_json_default) + "\n").encode()
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
                             "(set EPLB_TOKEN or EPLB_TOKEN_FILE on the job)")
            return False
        scheme, _, credentials = self.headers.get("Authorization", "").strip().partition(" ")
        given = credentials.strip() if scheme.lower() == "bearer" else ""
        if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                   srv.token.encode("utf-8")):
            self._error(401, "missing or wrong bearer token",
                        {"WWW-Authenticate": 'Bearer realm="eplb"'})
            return False
        return True


class _Handler(_HTTPHandler):
    """The routes (`_ROUTES`): every request goes through `_dispatch`."""

    def _dispatch(self, method: str) -> None:
        try:
            if self._read_body() is None:
                return
            self.connection.settimeout(self.timeout)  # the request is in: writes get the idle timeout
            if method in STATE_CHANGING and not self._authorized():
                return
            self._route(method)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            log.debug("eplb server: client went away", exc_info=True)
        except Exception:
            log.exception("eplb server: internal error on %s %s", method, self.path)
            try:
                self._error(500, "internal error (see the server log)")
            except OSError:
                pass

    def _route(self, method: str) -> None:
        """Answer 404 / 405 or call the route's handler."""
        path = urllib.parse.urlsplit(self.path).path
        if path != "/":
            path = path.rstrip("/") or "/"
        status = _STATUS_ROUTE.fullmatch(path)
        route = _Route(("GET",), "_status") if status else _ROUTES.get(path)
        if route is None:
            self._error(404, f"no such endpoint: {path}")
            return
        allowed = route.methods
        effective = "GET" if method == "HEAD" and "GET" in allowed else method
        if effective not in allowed:
            self._error(405, f"{method} is not allowed on {path} (use {', '.join(allowed)})",
                        {"Allow": ", ".join(allowed + (("HEAD",) if "GET" in allowed else ()))})
            return
        handler = getattr(self, route.handler)
        handler(int(status.group(1))) if status else handler()

    # ---- endpoints -------------------------------------------------------------------
    def _index(self) -> None:
        self._json(200, {"endpoints": ["GET /metrics", "GET /healthz", "GET /placement",
                                       "GET /load", "POST /rebalance", "GET /rebalance/<id>"]})

    def _metrics(self) -> None:
        registry = self.server.eplb.registry
        if registry is None:
            self._error(404, "metrics are not enabled on this server")
            return
        from prometheus_client.exposition import choose_encoder

        encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
        body = encoder(registry)
        headers = {}
        if "gzip" in self.headers.get("Accept-Encoding", "") and len(body) > 1024:
            body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
        self._send(200, body, content_type, headers)

    def _healthz(self) -> None:
        rt = self.server.eplb.runtime
        self._json(200, {"status": "ok", "step": rt.steps, "rank": rt.rank,
                         "world_size": rt.world_size})

    def _placement(self) -> None:
        rt = self.server.eplb.runtime
        placement = rt.placement  # one read: a rebalance replaces the object, never mutates it
        d = placement.to_dict()
        counts = placement.replica_count()  # [L, N]
        d["replica_count"] = counts.tolist()
        l2p = placement.logical_to_physical()  # [L, N, R], -1 padded
        d["logical_to_physical"] = [[[int(s) for s in row if s >= 0] for row in layer]
                                    for layer in l2p]
        d["step"] = rt.steps
        self._json(200, d)

    def _load(self) -> None:
        """The metrics' last load snapshot (a host copy on rank 0, replaced whole at every
        metrics update): no collective and no device access on this thread."""
        metrics = self.server.eplb.metrics
        if not getattr(metrics, "export_load", False):
            self._error(404, "load export is not enabled on this server "
                             "(EplbMetrics(..., export_load=True))")
            return
        snap = metrics.load_snapshot()
        if snap is None:
            self._error(503, f"no load recorded yet: the first snapshot is taken at step "
                             f"{metrics.interval} (the first metrics update)", {"Retry-After": "1"})
            return
        body = (json.dumps(snap, default=_json_default) + "\n").encode()
        headers = {}
        if "gzip" in self.headers.get("Accept-Encoding", "") and len(body) > _GZIP_MIN:
            body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
        self._send(200, body, "application/json", headers)

    def _rebalance(self) -> None:
        srv = self.server.eplb  # _dispatch authorized this POST already
        rt = srv.runtime
        if not rt.config.control_interval:
            self._error(409, "this runtime never serves rebalance requests (control_interval=0)")
            return
        rid = rt.request_rebalance("http")
        status_url = f"/rebalance/{rid}"
        log.info("eplb server: rebalance %d requested by %s", rid, self.address_string())
        self._json(202, {"id": rid, "status_url": status_url, "state": "pending"},
                   {"Location": status_url})

    def _status(self, rid: int) -> None:
        status = self.server.eplb.runtime.rebalance_status(rid)
        if status is None:
            self._error(404, f"no rebalance request with id {rid}")
            return
        if status.get("error"):  # the reason of a failure: one bounded line, never a traceback
            text = " ".join(str(status["error"]).split())
            status = dict(status, error=text if len(text) <= _ERROR_TEXT_LIMIT
                          else text[:_ERROR_TEXT_LIMIT - 3] + "...")
        self._json(200, status)
