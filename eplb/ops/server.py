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
  * requests are logged at DEBUG level on the "eplb.ops.server" logger, except an
    accepted POST /rebalance, logged at INFO with the client's address.

The client side (`eplb trigger`, `eplb record`) is `eplb.ops.client`.

The routes and EplbServer are here; the plumbing each hardening point needs (the
connection cap, the request deadline, the header budget, the body limits, the token
check) is eplb.ops.http_base, which knows nothing of EPLB.
"""
from __future__ import annotations

import gzip
import ipaddress
import json
import logging
import os
import re
import socket
import stat
import threading
import urllib.parse
from http.server import ThreadingHTTPServer
from typing import TYPE_CHECKING, NamedTuple

from eplb.ops.http_base import (MAX_BODY, MAX_CONNECTIONS, MAX_HEADER_BYTES, MAX_REQUEST_LINE,
                                REQUEST_TIMEOUT, STATE_CHANGING, HardenedHandler, HardenedServer,
                                json_default)

if TYPE_CHECKING:
    from eplb.ops.metrics import EplbMetrics
    from eplb.runtime import EplbRuntime

log = logging.getLogger("eplb.ops.server")

_ERROR_TEXT_LIMIT = 300  # characters of a failed rebalance's reason in GET /rebalance/<id>

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
        httpd = HardenedServer((self.host, self.port), _Handler, ipv6=":" in self.host)
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


class _Handler(HardenedHandler):
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
        body = (json.dumps(snap, default=json_default) + "\n").encode()
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
