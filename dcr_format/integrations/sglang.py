"""SGLang integration: a weight loader for SGLang's ``--custom-weight-loader`` hook and the
trainer helper that drives it.

Import-light: nothing of SGLang is imported (the trainer side needs only ``requests`` for a
server, or the ``sglang.Engine`` it is given).

- Rollout side: start SGLang with ``--custom-weight-loader
  dcr_format.integrations.sglang.load_weights`` on a checkpoint that ``dcr replay`` wrote.
  SGLang calls :func:`load_weights` inside each scheduler with its own model object for
  ``update_weights_from_tensor(..., load_format="dcr_format.integrations.sglang.load_weights")``;
  the named tensors it receives carry a dcr request in their name (the tensor is empty).
  The first request opens the store and learns how the model's own ``load_weights`` places
  every tensor (:class:`~dcr_format.ModuleTarget`), then prepares each newly committed
  version in the background while the engine generates; each update request only applies
  the prepared version, in place, all of it or nothing. With tensor parallelism the
  schedulers' readers form a reader group over SGLang's own gloo group of the
  tensor-parallel ranks: each prepares its own shards in the background, the update
  checks that every rank holds the version (else they fetch and verify it together
  inside the update), and every rank applies it or none does. The loader never
  raises into SGLang (an exception there stops the server): a refused update leaves the
  weights as they were, is logged, and is reported back in a report file the request
  names (SGLang answers "Success" to any custom loader, whatever it did, and carries
  nothing back from it).
- Trainer side: :class:`DcrSGLangSync` publishes with :class:`~dcr_format.DeltaWriter` and
  brings the engine behind a server URL or an ``sglang.Engine`` to the version it
  committed, through ``begin_weight_update``, ``update_weights_from_tensor`` and
  ``end_weight_update``, raising :class:`~dcr_format.errors.EngineUpdateError` when the
  engine refused (it keeps its weights and keeps serving).
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dcr_format.errors import EngineUpdateError, GroupAbortError, TargetError
from dcr_format.integrations.vllm import (
    DcrInitInfo,
    DcrUpdateInfo,
    UpdateReport,
    _parse,
    _Publisher,
    _Syncer,
)
from dcr_format.sync.group import ReaderGroup

__all__ = [
    "LOAD_FORMAT",
    "DcrSGLangSync",
    "SyncOutcome",
    "load_weights",
    "request_tensors",
]

LOAD_FORMAT = "dcr_format.integrations.sglang.load_weights"
REQUEST_PREFIX = "dcr-request:"
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncOutcome:
    """What one request did on one scheduler (tensor-parallel rank): ``ok`` and the version
    the model holds afterwards; ``error`` says why a request was refused; ``report`` is the
    update's :class:`~dcr_format.integrations.vllm.UpdateReport` as a dict; ``ranks`` is the
    number of tensor-parallel ranks that answer the same request."""

    ok: bool
    op: str
    version: int | None
    rank: int = 0
    error: str | None = None
    report: dict[str, Any] | None = None
    ranks: int = 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (the report file)."""
        return asdict(self)


# --- the rollout side: SGLang's custom weight loader ----------------------------------------

_SYNCERS: weakref.WeakKeyDictionary[torch.nn.Module, _Syncer] = weakref.WeakKeyDictionary()
_LAST: weakref.WeakKeyDictionary[torch.nn.Module, SyncOutcome] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def load_weights(model: torch.nn.Module, named_tensors: Sequence[tuple[str, Any]]) -> None:
    """SGLang's custom weight loader: carry out the dcr requests named in ``named_tensors``.

    A request is ``("dcr-request:" + JSON, empty tensor)`` (:func:`request_tensors` makes
    them): ``{"op": "init", "init_info": {...}}`` opens the store (fields of
    :class:`~dcr_format.integrations.vllm.DcrInitInfo`) and learns the loader's placements;
    ``{"op": "sync", "version": N}`` brings the model to version ``N`` (default: the newest)
    in place. ``"report"`` names a directory where each rank writes
    ``rank-<k>.json`` (:class:`SyncOutcome`). Never raises: SGLang stops its scheduler on an
    exception from a loader, so a refusal is reported instead and the weights stay as they
    were. Every tensor-parallel rank receives the same requests; their readers agree over
    SGLang's tensor-parallel gloo group (an init opens a reader on every rank or on none).
    """
    for name, _ in named_tensors:
        rank = _tp_rank()
        try:
            request = _request(name)
        except ValueError as exc:
            outcome = SyncOutcome(False, "?", _held(model), rank, _one_line(exc))
            _log.error("dcr: refused a request: %s", outcome.error)
            _LAST[model] = outcome
            continue
        outcome = _carry_out(model, request, rank)
        _LAST[model] = outcome
        report = request.get("report")
        if isinstance(report, str) and report:
            _write_report(Path(report), outcome)


def last_outcome(model: torch.nn.Module) -> SyncOutcome | None:
    """What the last request did to ``model`` in this process (None before any)."""
    return _LAST.get(model)


def _carry_out(model: torch.nn.Module, request: dict[str, Any], rank: int) -> SyncOutcome:
    op = str(request.get("op"))
    try:
        ranks = _tp_size()
        if op == "init":
            return _init(model, request, rank, ranks)
        if op == "sync":
            found = _SYNCERS.get(model)
            if found is None:
                raise TargetError(
                    "this engine has no dcr reader yet: send the init request first "
                    "(DcrSGLangSync.init)"
                )
            update = DcrUpdateInfo(
                version=request.get("version"), audit=bool(request.get("audit", False))
            )
            report = found.update(update)
            return SyncOutcome(True, op, report.version, rank, report=report.to_dict(), ranks=ranks)
        raise ValueError(f"unknown dcr request op {op!r}; the ops are 'init' and 'sync'")
    except Exception as exc:  # never into SGLang: the weights are as they were
        return _refused(model, op, rank, exc)


def _refused(model: torch.nn.Module, op: str, rank: int, exc: BaseException) -> SyncOutcome:
    message = f"{type(exc).__name__}: {_one_line(exc)}"
    _log.error("dcr: %s request refused, the engine keeps its weights: %s", op, message)
    return SyncOutcome(False, op, _held(model), rank, message, ranks=_tp_size())


def _init(model: torch.nn.Module, request: dict[str, Any], rank: int, ranks: int) -> SyncOutcome:
    """Open a reader on every tensor-parallel rank, or on none: the ranks agree at the end (a
    rank that could not open its reader makes every rank drop its own)."""
    group = _tp_group()
    try:
        info = _parse(DcrInitInfo, request.get("init_info"), "init_info")
        syncer = _open(model, info, group)
    except Exception as exc:
        if group is not None:
            ReaderGroup(group).failed_ranks(False)
        return _refused(model, "init", rank, exc)
    failed = [] if group is None else ReaderGroup(group).failed_ranks(True)
    if failed:
        _drop(model)
        return _refused(
            model,
            "init",
            rank,
            GroupAbortError(
                f"tensor-parallel rank(s) {failed} could not start dcr, so no rank did: see "
                "their errors, then send the init request again"
            ),
        )
    return SyncOutcome(True, "init", syncer.version(), rank, ranks=ranks)


def _open(model: torch.nn.Module, info: DcrInitInfo, group: Any) -> _Syncer:
    """A reader for ``model`` (again on a second init, keeping the version it holds)."""
    with _LOCK:
        previous = _SYNCERS.pop(model, None)
        if previous is not None:
            previous.close()
        config = getattr(model, "config", None)
        model_dir = getattr(config, "name_or_path", None) or None
        syncer = _Syncer(model, info, model_dir=model_dir, group=group, previous=previous)
        _SYNCERS[model] = syncer
        return syncer


def _drop(model: torch.nn.Module) -> None:
    with _LOCK:
        syncer = _SYNCERS.pop(model, None)
    if syncer is not None:
        syncer.close()


def _held(model: torch.nn.Module) -> int | None:
    found = _SYNCERS.get(model)
    return None if found is None else found.version()


def _request(name: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name.startswith(REQUEST_PREFIX):
        raise ValueError(
            f"tensor {str(name)[:80]!r} is not a dcr request; this loader takes only "
            "requests made by dcr_format.integrations.sglang.request_tensors"
        )
    try:
        request = json.loads(name[len(REQUEST_PREFIX) :])
    except json.JSONDecodeError as exc:
        raise ValueError(f"a dcr request is not JSON ({exc})") from None
    if not isinstance(request, dict):
        raise ValueError("a dcr request must be a JSON object")
    return request


def _write_report(directory: Path, outcome: SyncOutcome) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        final = directory / f"rank-{outcome.rank}.json"
        tmp = directory / f".rank-{outcome.rank}.json.tmp"
        tmp.write_text(json.dumps(outcome.to_dict()))
        os.replace(tmp, final)
    except OSError as exc:
        _log.error("dcr: could not write the report into %s: %s", directory, exc)


def _tp_rank() -> int:
    return int(_parallel("tp_rank", 0))


def _tp_size() -> int:
    return int(_parallel("tp_size", 1))


def _tp_group() -> Any:
    """SGLang's gloo group of this scheduler's tensor-parallel ranks (None without tensor
    parallelism): the group SGLang itself coordinates its schedulers over, on CPU and GPU.
    Pipeline parallelism is refused, with one tensor-parallel rank too (a stage holds only
    its layers)."""
    if int(_parallel("pp_size", 1)) > 1:
        raise TargetError(
            "dcr's SGLang loader does not run with pipeline parallelism; start the engine "
            "with --pp-size 1"
        )
    if _tp_size() <= 1:
        return None
    from sglang.srt.distributed.parallel_state import get_tp_group

    group = get_tp_group().cpu_group
    if group is None:
        raise TargetError("this SGLang engine has no tensor-parallel gloo group for dcr's readers")
    return group


def _parallel(attribute: str, default: int) -> Any:
    try:
        from sglang.srt.runtime_context import get_parallel

        return getattr(get_parallel(), attribute, default)
    except Exception:  # outside an SGLang scheduler
        return default


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:2000]


# --- the trainer side -------------------------------------------------------------------------


def request_tensors(request: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """``named_tensors`` carrying one dcr request for ``update_weights_from_tensor``: the
    request travels in the name, the tensor is empty (so no tensor data is shared)."""
    return [(REQUEST_PREFIX + json.dumps(dict(request), sort_keys=True), torch.empty(0))]


def _serialized(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's wire form of named tensors (its ``MultiprocessingSerializer``, base64)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class _HTTPClient:
    """An SGLang server's weight-update endpoints."""

    def __init__(self, url: str, *, timeout: float, api_key: str | None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._ranks: int | None = None

    def ranks(self) -> int:
        """The server's tensor-parallel size: each rank reads its own payload of a tensor
        update (its ``/server_info``, asked once)."""
        if self._ranks is None:
            import requests

            reply = requests.get(
                f"{self.url}/server_info", headers=self.headers, timeout=self.timeout
            )
            try:
                size = int(reply.json().get("tp_size") or 1) if reply.ok else 1
            except (ValueError, TypeError, AttributeError):
                size = 1
            self._ranks = max(1, size)
        return self._ranks

    def _post(self, path: str, body: dict[str, Any]) -> tuple[bool, str]:
        import requests

        reply = requests.post(
            f"{self.url}{path}", json=body, headers=self.headers, timeout=self.timeout
        )
        try:
            data = reply.json()
        except ValueError:
            data = {}
        if not isinstance(data, dict):
            data = {}
        ok = reply.ok and bool(data.get("success", reply.ok))
        return ok, str(data.get("message") or reply.text[:2000])

    def begin(self) -> tuple[bool, str]:
        return self._post("/begin_weight_update", {})

    def load(self, named: list[tuple[str, torch.Tensor]]) -> tuple[bool, str]:
        body = {
            "serialized_named_tensors": [_serialized(named)] * self.ranks(),
            "load_format": LOAD_FORMAT,
            "flush_cache": True,
        }
        return self._post("/update_weights_from_tensor", body)

    def end(self) -> tuple[bool, str]:
        return self._post("/end_weight_update", {})


class _EngineClient:
    """An in-process ``sglang.Engine`` (its scheduler runs in a child process)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def begin(self) -> tuple[bool, str]:
        return _pair(self.engine.begin_weight_update())

    def load(self, named: list[tuple[str, torch.Tensor]]) -> tuple[bool, str]:
        return _pair(
            self.engine.update_weights_from_tensor(named, load_format=LOAD_FORMAT, flush_cache=True)
        )

    def end(self) -> tuple[bool, str]:
        return _pair(self.engine.end_weight_update())


def _pair(result: Any) -> tuple[bool, str]:
    if isinstance(result, tuple) and len(result) == 2:
        return bool(result[0]), str(result[1])
    return True, ""


@dataclass
class DcrSGLangSync(_Publisher):
    """Trainer side: publish each step with a :class:`~dcr_format.DeltaWriter`, then bring
    the SGLang engine behind ``engine`` (a server URL such as ``"http://127.0.0.1:30000"``,
    or an ``sglang.Engine``) to that version.

    ``init_info`` is what the engine's loader opens (the store as *it* reaches it).
    ``report_dir``: a directory both sides reach (the same host, or a shared filesystem)
    where the engine's loader writes what each request did (SGLang's own reply to a custom
    loader is always "Success"); by default a temporary directory of this process, for an
    engine on the same host, removed by :meth:`close` (or at the end of a ``with`` block).
    With tensor parallelism every rank writes its own report there, so an engine spanning
    hosts needs a directory on a filesystem they share.
    """

    writer: Any
    engine: Any
    init_info: DcrInitInfo
    report_dir: str | None = None
    timeout: float = 600.0
    api_key: str | None = None
    timings: list[dict[str, float]] = field(default_factory=list)
    outcomes: list[SyncOutcome] = field(default_factory=list, init=False)
    """What the last request did on each tensor-parallel rank, by rank."""

    def __post_init__(self) -> None:
        if isinstance(self.engine, str):
            self._client: Any = _HTTPClient(self.engine, timeout=self.timeout, api_key=self.api_key)
        elif callable(getattr(self.engine, "update_weights_from_tensor", None)):
            self._client = _EngineClient(self.engine)
        else:
            raise TypeError(
                f"{type(self.engine).__name__} is not an SGLang engine: pass the server's URL "
                "or an sglang.Engine"
            )
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if self.report_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="dcr-sglang-")
            self.report_dir = self._tmp.name

    def close(self) -> None:
        """Remove the report directory this object made (a ``report_dir`` given is kept)."""
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> DcrSGLangSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def init(self) -> int | None:
        """Open the store in the engine and learn its loader's placements; returns the version
        the engine holds."""
        outcome = self._request({"op": "init", "init_info": self.init_info.to_dict()}, "init")
        return outcome.version

    def _update_published(self, version: int) -> None:
        self.update(version)

    def update(self, version: int | None = None, *, audit: bool = False) -> UpdateReport:
        """Bring the engine to ``version`` (default: the newest committed one).

        A refused update leaves the engine at its previous version and still serving;
        :class:`~dcr_format.errors.EngineUpdateError` says why.
        """
        request: dict[str, Any] = {"op": "sync", "audit": audit}
        if version is not None:
            request["version"] = int(version)
        outcome = self._request(request, "sync")
        assert outcome.report is not None
        fields: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in outcome.report.items()
        }
        return UpdateReport(**fields)

    def _request(self, request: dict[str, Any], op: str) -> SyncOutcome:
        assert self.report_dir is not None
        report = Path(self.report_dir) / f"{op}-{time.monotonic_ns()}"
        ok, message = self._client.begin()
        if not ok:
            raise EngineUpdateError(f"the engine refused to begin a weight update: {message}")
        try:
            ok, message = self._client.load(request_tensors({**request, "report": str(report)}))
        finally:
            closed, closing = self._client.end()
        if not ok:
            raise EngineUpdateError(f"the engine did not take the dcr request: {message}")
        if not closed:
            raise EngineUpdateError(f"the engine did not end the weight update: {closing}")
        self.outcomes = _read_reports(report)
        outcome = _summary(self.outcomes)
        if not outcome.ok:
            goal = request.get("version")
            what = "start dcr" if op == "init" else f"reach version {goal or 'newest'}"
            raise EngineUpdateError(
                f"the engine did not {what} and kept its weights (at version "
                f"{outcome.version}): {outcome.error}"
            )
        return outcome


def _read_reports(directory: Path) -> list[SyncOutcome]:
    """Every tensor-parallel rank's outcome, by rank (each rank must have answered)."""
    files = sorted(directory.glob("rank-*.json"))
    if not files:
        raise EngineUpdateError(
            f"the engine wrote no report into {directory}: start it with "
            f"--custom-weight-loader {LOAD_FORMAT}, and give DcrSGLangSync a report_dir "
            "the engine reaches"
        )
    outcomes = sorted((SyncOutcome(**json.loads(f.read_text())) for f in files), key=_rank)
    for f in files:
        f.unlink()
    directory.rmdir()
    ranks = max(o.ranks for o in outcomes)
    if len(outcomes) < ranks:
        answered = [o.rank for o in outcomes]
        raise EngineUpdateError(
            f"only tensor-parallel ranks {answered} of {ranks} reported into {directory}: "
            "give DcrSGLangSync a report_dir that every rank's host reaches (a shared "
            "filesystem)"
        )
    return outcomes


def _rank(outcome: SyncOutcome) -> int:
    return outcome.rank


def _summary(outcomes: list[SyncOutcome]) -> SyncOutcome:
    """The engine's outcome: a refusal wins, the rank whose own failure stopped the group
    before the ranks it stopped."""
    refused = [o for o in outcomes if not o.ok]
    refused.sort(key=lambda o: str(o.error).startswith(GroupAbortError.__name__))
    return refused[0] if refused else outcomes[0]
