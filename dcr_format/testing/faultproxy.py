"""A fault-injecting HTTP proxy on 127.0.0.1 in front of an S3 server, for tests and the soak.

Point an S3 client's ``endpoint_url`` at :attr:`FaultProxy.endpoint` and it
reaches the upstream server (moto, a gateway) through this proxy, which can
answer any request with a fault instead of, or after, forwarding it. Rules
select requests by kind (:data:`KINDS`) and by a regular expression on the
object key; each rule fires for a number of matching requests or with a
probability, and every request and every fault is counted.

Faults (:data:`FAULTS`):

- ``"500"`` / ``"503"``: an S3 error document (``InternalError`` /
  ``SlowDown``) with that status;
- ``"reset"``: the connection is reset (TCP RST), nothing answered;
- ``"truncate"``: the real response's headers, then half its body, then the
  connection closes (a body cut short in transit);
- ``"corrupt"``: the real response with its body altered in transit, length kept
  (one random bit flipped, or the rule's ``mutate``);
- ``"delay"``: the request waits ``delay`` seconds, then goes through normally;
- ``"hang"``: nothing is answered for ``delay`` seconds (past the client's
  read timeout), then the connection is reset;
- ``"callback"``: the rule's ``action`` runs (a test kills a process there),
  then the connection is reset.

With ``after=True`` the request is forwarded first and the fault replaces the
server's answer: the request took effect, the client cannot know (the unknown
outcome of a conditional PUT). ``"truncate"`` and ``"corrupt"`` always forward first.

Nothing here listens on or connects to anything but 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import http.client
import random
import re
import socket
import struct
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["FAULTS", "KINDS", "FaultProxy", "Request", "Rule", "classify"]

KINDS = ("get", "put", "put_if_absent", "head", "list", "delete", "multipart", "bucket", "other")
"""Request kinds: GET object, PUT object, conditional PUT (``If-None-Match``), HEAD, LIST
(GET on the bucket), DELETE (one object, or a batch ``POST ?delete``), multipart upload
requests, other bucket requests, anything else."""
FAULTS = ("500", "503", "reset", "truncate", "corrupt", "delay", "hang", "callback")

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "expect",
    }
)
_ERRORS = {
    "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error."),
    "503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
}


@dataclass(frozen=True)
class Request:
    """What a rule sees of one request."""

    method: str
    kind: str
    bucket: str
    key: str  # the object key ('' for bucket requests; a listing's prefix for "list")
    query: str


def classify(method: str, target: str, headers: Iterable[tuple[str, str]]) -> Request:
    """The kind, bucket and key of a path-style S3 request."""
    parsed = urllib.parse.urlsplit(target)
    query = urllib.parse.parse_qs(parsed.query, keep_blank_values=True)
    bucket, _, key = urllib.parse.unquote(parsed.path).lstrip("/").partition("/")
    names = {name.lower() for name, _ in headers}
    if "uploads" in query or "uploadId" in query:
        kind = "multipart"
    elif method == "POST" and "delete" in query:
        kind = "delete"
    elif not key:
        if method == "GET" and ("list-type" in query or "prefix" in query or not query):
            kind = "list"
            key = query.get("prefix", [""])[0]
        else:
            kind = "bucket"
    elif method == "GET":
        kind = "get"
    elif method == "PUT":
        kind = "put_if_absent" if "if-none-match" in names else "put"
    elif method == "HEAD":
        kind = "head"
    elif method == "DELETE":
        kind = "delete"
    else:
        kind = "other"
    return Request(method, kind, bucket, key, parsed.query)


@dataclass
class Rule:
    """Which requests get which fault.

    ``kinds``: request kinds it applies to (empty: all); ``key``: a regular
    expression searched in the object key (None: any); ``times``: fire for the
    first N matching requests only (None: unlimited); ``probability``: the
    chance that a matching request gets the fault; ``after``: forward the
    request before answering with the fault; ``delay``: seconds for ``"delay"``
    and ``"hang"``; ``action``: called with the :class:`Request` when a
    ``"callback"`` rule fires; ``mutate``: how ``"corrupt"`` alters a body.
    """

    fault: str
    kinds: tuple[str, ...] = ()
    key: str | None = None
    times: int | None = None
    probability: float = 1.0
    after: bool = False
    delay: float = 0.0
    action: Callable[[Request], None] | None = None
    mutate: Callable[[bytes], bytes] | None = None
    fired: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"fault {self.fault!r} is not one of {', '.join(FAULTS)}")
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown request kinds {sorted(unknown)}; use {', '.join(KINDS)}")
        if self.fault == "callback" and self.action is None:
            raise ValueError("a 'callback' rule needs an action")
        self._pattern = re.compile(self.key) if self.key is not None else None

    def matches(self, request: Request) -> bool:
        if self.kinds and request.kind not in self.kinds:
            return False
        return self._pattern is None or self._pattern.search(request.key) is not None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet: tests read the counters instead

    def _body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is not None:
            return self.rfile.read(int(length))
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        return b""

    def _relay(self) -> None:
        body = self._body()
        request = classify(self.command, self.path, self.headers.items())
        proxy = self.server.proxy
        rule = proxy._pick(request)
        if rule is None:
            self._send(*self._forward(body))
            return
        fault = rule.fault
        if fault == "delay":
            time.sleep(rule.delay)
            self._send(*self._forward(body))
            return
        if rule.after or fault in ("truncate", "corrupt"):
            response = self._forward(body)
        if fault == "callback":
            assert rule.action is not None
            rule.action(request)
            self._reset()
        elif fault == "hang":
            time.sleep(rule.delay)
            self._reset()
        elif fault == "reset":
            self._reset()
        elif fault == "corrupt":
            status, reason, headers, data = response
            if data and self.command != "HEAD":
                data = rule.mutate(data) if rule.mutate else proxy._flip(data)
            self._send(status, reason, headers, data)
        elif fault == "truncate":
            status, reason, headers, data = response
            if self.command == "HEAD" or len(data) < 2:
                self._send(status, reason, headers, data)  # nothing to cut: a clean answer
                return
            self._send(status, reason, headers, data[: len(data) // 2], length=len(data))
            self._close()
        else:
            status, reason, code, message = _ERRORS[fault]
            xml = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{code}</Code><Message>{message}</Message>"
                f"<Key>{request.key}</Key><RequestId>dcr-fault</RequestId></Error>"
            ).encode()
            self._send(status, reason, [("Content-Type", "application/xml")], xml)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _relay

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """Send the request upstream as it came (Host included, so signatures still hold)."""
        host, port = self.server.proxy.upstream
        upstream = http.client.HTTPConnection(host, port, timeout=60)  # one per request
        try:
            upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                    upstream.putheader(name, value)
            if body or self.command in ("PUT", "POST"):
                upstream.putheader("Content-Length", str(len(body)))
            upstream.endheaders(body or None)
            response = upstream.getresponse()
            data = response.read()
            headers = response.getheaders()
            status, reason = response.status, response.reason
        finally:
            upstream.close()
        return status, reason, headers, data

    def _send(
        self,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        data: bytes,
        *,
        length: int | None = None,
    ) -> None:
        self.send_response_only(status, reason)
        declared = None
        for name, value in headers:
            lowered = name.lower()
            if lowered == "content-length":
                declared = value
            elif lowered not in _HOP_BY_HOP:
                self.send_header(name, value)
        if self.command == "HEAD" and declared is not None:
            self.send_header("Content-Length", declared)  # the object's size, no body follows
        else:
            self.send_header("Content-Length", str(len(data) if length is None else length))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self.wfile.flush()

    def _reset(self) -> None:
        """Close with a TCP RST: the client sees 'connection reset by peer'."""
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._close()

    def _close(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.flush()
        with contextlib.suppress(OSError):
            self.connection.close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: FaultProxy

    def handle_error(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
        pass  # a client that went away mid-request is expected here


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of ``upstream`` (``http://127.0.0.1:PORT``).

    Use as a context manager, or call :meth:`start` and :meth:`stop`. Rules are
    tried in the order they were added; the first that matches and fires wins.
    Thread-safe: rules may change while requests flow.
    """

    def __init__(self, upstream: str, *, seed: int | None = None) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or parsed.hostname not in ("127.0.0.1", "localhost"):
            raise ValueError(f"upstream must be http://127.0.0.1:PORT, not {upstream!r}")
        self.upstream = (parsed.hostname, parsed.port or 80)
        self._lock = threading.Lock()
        self._rules: list[Rule] = []
        self._random = random.Random(seed)
        self.requests: Counter[str] = Counter()
        """Requests seen, by kind."""
        self.faults: Counter[tuple[str, str]] = Counter()
        """Faults injected, by (kind, fault)."""
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.proxy = self
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread: threading.Thread | None = None

    # --- life cycle ---

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- rules ---

    def add(self, rule: Rule | None = None, /, **kwargs: object) -> Rule:
        """Add a rule (a :class:`Rule`, or its fields as keywords); returns it."""
        rule = rule if rule is not None else Rule(**kwargs)  # type: ignore[arg-type]
        with self._lock:
            self._rules.append(rule)
        return rule

    def remove_rules(self) -> None:
        """Remove every rule; the counters stay."""
        with self._lock:
            self._rules.clear()

    def clear(self) -> None:
        """Remove every rule and zero the counters."""
        with self._lock:
            self._rules.clear()
            self.requests.clear()
            self.faults.clear()

    @contextlib.contextmanager
    def rule(self, rule: Rule | None = None, /, **kwargs: object) -> Iterator[Rule]:
        """A rule in force for the ``with`` block."""
        added = self.add(rule, **kwargs)
        try:
            yield added
        finally:
            with self._lock:
                if added in self._rules:
                    self._rules.remove(added)

    def _flip(self, data: bytes) -> bytes:
        with self._lock:
            index, bit = self._random.randrange(len(data)), self._random.randrange(8)
        return data[:index] + bytes([data[index] ^ (1 << bit)]) + data[index + 1 :]

    def _pick(self, request: Request) -> Rule | None:
        with self._lock:
            self.requests[request.kind] += 1
            for rule in self._rules:
                if not rule.matches(request):
                    continue
                if rule.times is not None and rule.fired >= rule.times:
                    continue
                if rule.probability < 1.0 and self._random.random() >= rule.probability:
                    continue
                rule.fired += 1
                self.faults[(request.kind, rule.fault)] += 1
                return rule
        return None
