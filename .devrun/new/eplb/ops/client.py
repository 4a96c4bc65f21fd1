"""HTTP client of an EPLB job's server (`eplb.ops.server`), used by the CLI: `eplb trigger`
(`trigger_rebalance`, `rebalance_status`, `wait_for_rebalance`, `describe_status`) and
`eplb record` (`fetch_load`). Standard library only; never goes through a proxy. Every
failure to get an answer is a `TriggerError` with a one-line reason.
"""
from __future__ import annotations

import gzip
import io
import json
import re
import socket
import time
import urllib.error
import urllib.request
from http import HTTPStatus

class TriggerError(Exception):
    """A one-line reason the request did not get through (unreachable, refused, timeout)."""


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy


def _base(url: str) -> str:
    u = url.strip().rstrip("/")
    if not re.match(r"https?://", u):
        raise TriggerError(f"URL must start with http:// or https://, got {url!r}")
    if u.endswith("/rebalance"):
        u = u[: -len("/rebalance")]
    return u


def _call(method: str, url: str, token: str | None = None, timeout: float = 10.0,
          max_bytes: int = 1 << 20) -> dict:
    headers = {"Accept": "application/json", "Accept-Encoding": "gzip"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=b"" if method == "POST" else None, method=method,
                                 headers=headers)
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            raw = r.read(max_bytes + 1)
            if r.headers.get("Content-Encoding") == "gzip":
                with gzip.GzipFile(fileobj=io.BytesIO(raw)) as z:
                    raw = z.read(max_bytes + 1)
            if len(raw) > max_bytes:
                raise TriggerError(f"{method} {url}: the answer is larger than {max_bytes} bytes")
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read(65536) or b"{}").get("error") or e.reason
        except (ValueError, AttributeError, OSError):
            msg = e.reason
        try:
            phrase = f" {HTTPStatus(e.code).phrase}"
        except ValueError:
            phrase = ""
        raise TriggerError(f"{method} {url}: {e.code}{phrase}: {msg}") from None
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, (TimeoutError, socket.timeout)):
            raise TriggerError(f"{method} {url}: no answer within {timeout:g} s") from None
        text = getattr(reason, "strerror", None) or str(reason)
        raise TriggerError(f"{method} {url}: cannot connect ({text})") from None
    except (TimeoutError, socket.timeout):
        raise TriggerError(f"{method} {url}: no answer within {timeout:g} s") from None
    except (OSError, ValueError, EOFError) as e:  # connection reset, bad port, bad gzip, ...
        raise TriggerError(f"{method} {url}: {getattr(e, 'strerror', None) or e}") from None
    try:
        d = json.loads(raw)
    except ValueError:
        raise TriggerError(f"{method} {url}: the answer is not JSON (is this an eplb server?)") from None
    if not isinstance(d, dict):
        raise TriggerError(f"{method} {url}: unexpected answer {d!r:.80}")
    return d


def trigger_rebalance(url: str, token: str | None = None, timeout: float = 10.0) -> dict:
    """POST /rebalance at the server `url` (its base URL); returns {"id", "status_url", ...}."""
    d = _call("POST", _base(url) + "/rebalance", token, timeout)
    if not isinstance(d.get("id"), int):
        raise TriggerError(f"POST {url}: the answer has no request id")
    return d


def rebalance_status(url: str, request_id: int, timeout: float = 10.0) -> dict:
    """GET /rebalance/<id>: the request's state dict."""
    return _call("GET", f"{_base(url)}/rebalance/{int(request_id)}", None, timeout)


def wait_for_rebalance(url: str, request_id: int, wait: float, poll: float = 0.05) -> dict:
    """Poll the request until it is done or failed; TriggerError after `wait` seconds."""
    deadline = time.monotonic() + wait
    status: dict = {}
    while True:
        left = deadline - time.monotonic()
        status = rebalance_status(url, request_id, timeout=max(0.5, min(10.0, left + 0.5)))
        if status.get("state") in ("done", "failed"):
            return status
        left = deadline - time.monotonic()
        if left <= 0:
            raise TriggerError(f"rebalance {request_id} still {status.get('state', 'unknown')} "
                               f"after {wait:g} s")
        time.sleep(min(poll, left))
        poll = min(1.0, poll * 1.5)


MAX_LOAD_BYTES = 1 << 28  # bytes of a /load answer the client reads at most (256 MiB)


def fetch_load(url: str, timeout: float = 10.0) -> dict:
    """GET /load at the server `url` (its base URL): the job's recorded load as a dict with
    `logical_count` [L][N], `gpu_load` [L][M], `total_logical_count` [L][N], `steps`,
    `step`, `time`, ... (see EplbMetrics.load_snapshot). TriggerError with one line when
    the server is unreachable, does not answer JSON, or has no GET /load."""
    base = _base(url)
    if base.endswith("/load"):
        base = base[: -len("/load")]
    target = base + "/load"
    try:
        d = _call("GET", target, None, timeout, max_bytes=MAX_LOAD_BYTES)
    except TriggerError as e:
        if " 404 " in str(e) and "no such endpoint" in str(e):
            raise TriggerError(f"{e} (this server has no GET /load: an eplb older than "
                               "the load export?)") from None
        raise
    counts = d.get("logical_count")
    if not isinstance(counts, list) or not counts or not isinstance(counts[0], list):
        raise TriggerError(f"GET {target}: the answer has no logical_count [L][N] "
                           "(is this an eplb server?)")
    return d


def describe_status(status: dict) -> str:
    """One line for a finished request, e.g. 'done at step 40: balancedness 0.87 -> 0.99 ...'."""
    step = status.get("step")
    at = f" at step {step}" if step is not None else ""
    if status.get("state") == "failed":
        return f"failed{at}: {status.get('error') or 'unknown error'}"
    r = status.get("result") or {}
    try:
        if r.get("skipped"):
            gain, floor = r["predicted_gain"], r["min_gain"]
            why = r.get("skip_reason") or (
                f"nothing to gain (predicted gain {gain:+.4f})" if gain <= 0 else
                f"predicted gain {gain:+.4f} < min gain {floor:.4f}")
            return f"skipped{at}: {why}; balancedness {r['balancedness_before']:.4f}, nothing moved"
        seconds = r["seconds_plan"] + r["seconds_transfer"] + r["seconds_commit"]
        return (f"done{at}: balancedness {r['balancedness_before']:.3f} -> "
                f"{r['balancedness_after']:.3f} (predicted), {r['experts_moved']} experts moved, "
                f"{r['bytes_moved'] / 1e6:.2f} MB, {seconds * 1e3:.1f} ms")
    except (KeyError, TypeError):
        return f"{status.get('state', 'unknown')}{at}"
