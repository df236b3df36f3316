"""vLLM integration: a ``dcr`` weight-transfer backend, a worker extension and trainer helpers.

Import-light: nothing of vLLM (or transformers) is imported until it is used.

- Rollout side, through vLLM's weight-transfer API: the ``dcr`` backend is registered in
  every vLLM process by the ``vllm.general_plugins`` entry point (:func:`register`), so an
  engine started with ``weight_transfer_config={"backend": "dcr"}`` (``vllm serve
  --weight-transfer-config '{"backend": "dcr"}'``) takes ``init_weight_transfer_engine``
  with :class:`DcrInitInfo` fields and ``update_weights`` with :class:`DcrUpdateInfo`
  fields. It keeps the model's own parameters at a version of the chain, in place, through
  the model's ``load_weights`` (:class:`~dcr_format.ModuleTarget`); tensor-parallel ranks
  form a reader group.
- Rollout side, without that API: ``worker_extension_cls=
  "dcr_format.integrations.vllm.DcrWorkerExtension"`` and ``collective_rpc("dcr_init",
  kwargs={"init_info": ...})``, ``collective_rpc("dcr_sync", kwargs={"version": N})``.
- Trainer side: :class:`DcrWeightSync` publishes with :class:`~dcr_format.DeltaWriter` and
  drives any weight-sync client (vLLM's ``HTTPVLLMWeightSyncClient``, an ``LLM``, Ray
  actors holding an ``LLM``: their handles or a ``RayVLLMWeightSyncClient``) to the version
  it committed;
  :func:`dcr_trainer_callback` makes a ``transformers.TrainerCallback`` that does so after
  every optimizer step.

The engine starts on a checkpoint that ``dcr replay`` (or :func:`dcr_format.replay`) wrote:
its ``dcr-state.json`` names the version the engine holds. docs/vllm.md has the details.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from dcr_format.errors import (
    DcrError,
    EngineUpdateError,
    TargetError,
    TargetNotUpdatableError,
    VersionNotFoundError,
)
from dcr_format.integrations._vllm_clients import as_client, engine_message
from dcr_format.system.collector import collector_off
from dcr_format.targets.directory import DIR_STATE_FILE

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from dcr_format.targets.module import ModuleTarget

__all__ = [
    "DcrInitInfo",
    "DcrUpdateInfo",
    "DcrWeightSync",
    "DcrWorkerExtension",
    "UpdateReport",
    "canonical_state",
    "dcr_trainer_callback",
    "engine_report",
    "register",
    "trainer_state",
]

BACKEND = "dcr"
_log = logging.getLogger(__name__)
# a worker's background preparation lists the commit records at least this often, and
# otherwise only where the committer's HEAD hint names a newer version
LIST_SECONDS = 10.0
# a CPU ``cpu_linear`` computing from a prepacked copy of the weight (vLLM's CPU build)
_PREPACKED_KERNELS = ("onednn_mm", "weight_packed_linear_cpu", "zentorch_linear_unary")


def register() -> None:
    """Register the ``dcr`` backend in vLLM's ``WeightTransferEngineFactory`` (idempotent).

    vLLM calls this in every process through the ``vllm.general_plugins`` entry point
    ``dcr``; call it yourself only where plugins are disabled.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # vLLM refuses a name registered before with ValueError: then it is registered
    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine(
            BACKEND, "dcr_format.integrations._vllm_engine", "DcrWeightTransferEngine"
        )


# --- what the trainer sends ------------------------------------------------------------


@dataclass
class DcrInitInfo:
    """``init_weight_transfer_engine`` info of the ``dcr`` backend.

    ``store``: the chain's URL or path, as the rollout node reaches it; ``storage_options``
    for fsspec/S3; ``reader_id`` names the reader record in which this engine tells writers
    the tensors its loader transforms (they then send them as ``overwrite``); ``verify``:
    ``"touched"`` or ``"all"`` (see :class:`~dcr_format.DeltaReader`). ``version``: the
    version the engine's checkpoint holds (default: read from the ``dcr-state.json`` that
    ``dcr replay`` wrote into the model directory). ``prefetch``: prepare (fetch, verify,
    decode) each newly committed version in the background while the engine generates, so
    that an update only applies it; polled every ``poll_seconds`` (a poll reads the small
    ``HEAD`` object the committer writes, and lists the commit records only where it names
    a newer version, or every ten seconds, since it is a hint). With tensor parallelism
    every rank prepares its own shards in the background, and the ranks prepare together
    inside ``update_weights`` only where one of them has not prepared the version asked.
    ``host_cache``: the workers of one host (tensor-parallel ranks, engines of one run) read
    each object from the store once between them, through ``host_cache_dir`` (default: a
    directory of this user in ``/dev/shm``; :class:`~dcr_format.store.host_cache.HostCache`).
    """

    store: str
    storage_options: dict[str, Any] | None = None
    reader_id: str | None = None
    verify: Literal["touched", "all"] = "touched"
    version: int | None = None
    prefetch: bool = True
    poll_seconds: float = 0.5
    host_cache: bool = True
    host_cache_dir: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.store, str) or not self.store:
            raise ValueError("dcr init_info needs 'store': the chain's URL or path")
        if self.verify not in ("touched", "all"):
            raise ValueError("dcr init_info 'verify' must be 'touched' or 'all'")
        if self.version is not None and (
            not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 0
        ):
            raise ValueError("dcr init_info 'version' must be a version number (int >= 0)")
        if self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise ValueError("dcr init_info 'storage_options' must be a dict")
        if not isinstance(self.poll_seconds, (int, float)) or self.poll_seconds <= 0:
            raise ValueError("dcr init_info 'poll_seconds' must be a positive number")
        if not isinstance(self.host_cache, bool):
            raise ValueError("dcr init_info 'host_cache' must be true or false")
        if self.host_cache_dir is not None and (
            not isinstance(self.host_cache_dir, str) or not self.host_cache_dir
        ):
            raise ValueError("dcr init_info 'host_cache_dir' must be a directory path")

    def to_dict(self) -> dict[str, Any]:
        """The JSON-safe dict that ``init_weight_transfer_engine`` takes."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class DcrUpdateInfo:
    """``update_weights`` info of the ``dcr`` backend: the version to reach (default: the
    newest committed one); ``audit`` reads every resident tensor in full before applying."""

    version: int | None = None
    audit: bool = False

    def __post_init__(self) -> None:
        if self.version is not None and (
            not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 0
        ):
            raise ValueError("dcr update_info 'version' must be a version number (int >= 0)")
        if not isinstance(self.audit, bool):
            raise ValueError("dcr update_info 'audit' must be true or false")


@dataclass(frozen=True)
class UpdateReport:
    """What one update did on one worker: the version reached, the preparation (fetch,
    verify, decode; in the background when prefetched) and the pause (the apply).
    ``store_reads`` and ``host_cache_hits``: the verified objects the worker has read from
    the store and taken from the host's cache since it was initialised (both 0 without a
    host cache)."""

    version: int
    previous: int | None
    applied_versions: tuple[int, ...]
    payload_bytes: int
    prepare_seconds: float
    apply_seconds: float
    prefetched: bool
    unverified: tuple[str, ...] = ()
    store_reads: int = 0
    host_cache_hits: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (collective_rpc results)."""
        return asdict(self)


# --- the rollout side, shared by the backend and the worker extension -------------------


def check_updatable(model: torch.nn.Module) -> None:
    """Fail closed (:class:`~dcr_format.TargetNotUpdatableError`) when a layer computes from
    a copy of its weights that ``load_weights`` cannot reach: vLLM's CPU build prepacks
    unquantized linear weights into oneDNN/SGL handles after loading, and the stacked
    weights of mixture-of-experts layers into its grouped-GEMM layout (docs/vllm.md)."""
    for name, module in model.named_modules():
        if _prepacked_experts(module):
            raise TargetNotUpdatableError(
                f"vLLM's CPU backend repacked the expert weights of {name or 'the model'!r} "
                "for its MoE kernel, so they cannot be updated in place; keep CPU expert "
                "weights unpacked (docs/vllm.md) or run the engine on a GPU"
            )
        kernel = getattr(module, "cpu_linear", None)
        if kernel is None:
            continue
        weight = getattr(module, "weight", None)
        code = getattr(kernel, "__code__", None)
        packed = code is not None and any(k in code.co_names for k in _PREPACKED_KERNELS)
        if packed or (isinstance(weight, torch.Tensor) and weight.numel() == 0):
            raise TargetNotUpdatableError(
                f"vLLM's CPU backend prepacked the weight of {name or 'the model'!r} for its "
                "GEMM kernel, so it cannot be updated in place; keep CPU linear weights "
                "unpacked (docs/vllm.md) or run the engine on a GPU"
            )


def _prepacked_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a vLLM MoE layer whose experts' kernel repacked its stacked
    weights after loading (vLLM's CPU experts: ``cpu_prepack_moe_weight``,
    ``convert_weight_packed``), unless it kept them for zentorch's kernel."""
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(getattr(kernel, "impl", kernel), "fused_experts", None)
    if experts is None or getattr(experts, "_use_zentorch", False):
        return False
    process = getattr(type(experts), "process_weights_after_loading", None)
    names = getattr(getattr(process, "__code__", None), "co_names", ())
    return any("prepack" in n or n == "convert_weight_packed" for n in names)


def resident_version(model_dir: str | None, chain_id: str) -> int:
    """The version a checkpoint written by ``dcr replay`` holds (its ``dcr-state.json``)."""
    state = Path(model_dir) / DIR_STATE_FILE if model_dir else None
    if state is None or not state.is_file():
        raise TargetError(
            f"the engine's model {model_dir!r} has no {DIR_STATE_FILE}: start vLLM on a "
            "checkpoint written by `dcr replay`, or pass the version it holds as "
            "init_info 'version'"
        )
    try:
        data = json.loads(state.read_text())
        held_chain, version = str(data["chain_id"]), int(data["version"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TargetError(
            f"{state} is unreadable ({exc}); replay the checkpoint again with `dcr replay`"
        ) from None
    if held_chain != chain_id:
        raise TargetError(
            f"the engine's checkpoint holds chain {held_chain}, the store chain {chain_id}; "
            "start the engine on a `dcr replay` of this store"
        )
    return version


class _Syncer:
    """One worker's reader: keeps the worker's model at a version through its loader.

    ``group``: a gloo process group of this model replica's tensor-parallel ranks (None
    alone). ``previous``: the syncer this one replaces (an engine initialised again), whose
    resident version the model holds. Preparation runs in a background thread when
    ``prefetch``, each rank on its own (:meth:`DeltaReader.prepare` ``alone``: no call on
    the group from that thread); an update applies the prepared version where every rank
    holds it, else the ranks prepare together. A lock keeps the preparation and the apply
    apart.
    """

    target: ModuleTarget

    def __init__(
        self,
        model: torch.nn.Module,
        info: DcrInitInfo,
        *,
        model_dir: str | None,
        group: Any = None,
        previous: _Syncer | None = None,
    ) -> None:
        from dcr_format import DeltaReader, ModuleTarget, Store
        from dcr_format.chain.chain import Chain
        from dcr_format.store.host_cache import HostCache
        from dcr_format.targets.module import all_reduce_lanes

        check_updatable(model)
        load_weights = getattr(model, "load_weights", None)
        if not callable(load_weights):
            raise TargetError(
                f"the engine's model {type(model).__name__} has no load_weights; dcr applies "
                "changes through the model's own loader"
            )
        store = Store(
            info.store,
            storage_options=info.storage_options,
            host_cache=HostCache(info.host_cache_dir) if info.host_cache else None,
        )
        chain = Chain(store)
        if not chain.exists():
            raise VersionNotFoundError(
                f"{store.url} holds no chain; publish a version with DeltaWriter first"
            )
        chain_id = chain.header.chain_id
        version = info.version
        held = None if previous is None else previous.target.resident()
        if version is None and held is not None and held.chain_id == chain_id:
            version = held.version  # initialised again: the model holds what was applied
        if version is None:
            version = resident_version(model_dir, chain_id)
        if version not in chain.versions():
            raise VersionNotFoundError(
                f"the engine's checkpoint holds version {version}, which is not committed in "
                f"{store.url}; start the engine on a `dcr replay` of a committed version"
            )
        self.model = model
        self.target = ModuleTarget(
            model,
            load_weights=load_weights,
            version=version,
            chain_id=chain_id,
            reduce_lanes=all_reduce_lanes(group) if group is not None else None,
        )
        self.reader = DeltaReader(
            store, self.target, verify=info.verify, reader_id=info.reader_id, group=group
        )
        with _for_engine():
            self.reader.prewarm(version)  # learn the loader's placements; record overwrites
            self.target.warm()  # the apply kernels compiled now, not in the first update's pause
            # the weights are the claimed version's (read in full once, off any update's
            # pause); else the engine reports and builds on a version it does not hold
            self.reader.audit()
        self.prefetch = info.prefetch
        self.poll_seconds = float(info.poll_seconds)
        self._lock = threading.Lock()
        self._prepared: Any = None
        self._prepared_seconds = 0.0
        self._listed = -LIST_SECONDS  # when the background thread last listed the commits
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last: UpdateReport | None = None
        if self.prefetch:
            self._thread = threading.Thread(target=self._prefetch_loop, name="dcr-prefetch")
            self._thread.daemon = True
            self._thread.start()

    # --- background preparation (fetching and verifying while the engine generates) -----

    def _prefetch_loop(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self._prefetch_once()
            except Exception as exc:  # a bad version is reported by the update that asks
                _log.debug("dcr prefetch: %s", exc)
                self._stop.wait(self.poll_seconds * 4)

    def _prefetch_once(self) -> None:
        resident = self.target.resident()
        if resident is None:
            return
        held = self._prepared
        known = max(resident.version, -1 if held is None else held.version)
        now = time.monotonic()
        if now - self._listed < LIST_SECONDS:
            # one small read a poll; the commit records are listed only where the committer's
            # hint names a newer version, and at least every LIST_SECONDS (a hint may lag)
            hint = self.reader.chain.head_hint()
            if hint is not None and hint <= known:
                return
        self._listed = now
        committed = self.reader.versions()
        if not committed or committed[-1] <= resident.version:
            return
        with self._lock:
            held = self._prepared
            if held is not None and held.version >= committed[-1]:
                return
            self._prepared = self.reader.prepare(committed[-1], alone=True)

    # --- the update ------------------------------------------------------------------

    def update(self, update: DcrUpdateInfo) -> UpdateReport:
        """Reach ``update.version`` (default: the newest): prepare unless prefetched, apply."""
        from dcr_format.errors import StalePreparedError

        group, cache = self.reader.group, self.reader.store.host_cache
        with self._lock:
            goal, failure = self._goal(update.version)
            prepared = self._prepared  # kept where the update fails before it starts
            if not group.alone:  # the ranks' goal, and whether all hold it prepared
                rows = group.rows(_NO_GOAL if failure else goal, _held(prepared))
                failed = [rank for rank, (wanted, _) in enumerate(rows) if wanted == _NO_GOAL]
                if failed:  # every rank raises (none waits in a later exchange)
                    raise failure or group.aborted(failed, "listing the versions")
                goal = min(wanted for wanted, _ in rows)
                prefetched = all(held == goal for _, held in rows)
            elif failure is not None:
                raise failure
            else:
                prefetched = prepared is not None and prepared.version == goal
            self._prepared = None
            # the engine is paused: no collection walks its whole heap meanwhile (a full
            # pass over a large process takes tens to hundreds of milliseconds)
            with _for_engine(), collector_off():
                if not prefetched:
                    prepared = self.reader.prepare(goal)
                try:
                    result = self.reader.apply(prepared, audit=update.audit)
                except StalePreparedError:
                    # the target moved since the prefetch (in a group, on every rank that
                    # failed, and every rank raises it): prepare again, every rank
                    if not prefetched:
                        raise
                    prefetched = False
                    prepared = self.reader.prepare(goal)
                    result = self.reader.apply(prepared, audit=update.audit)
            report = UpdateReport(
                version=result.version,
                previous=result.previous,
                applied_versions=tuple(result.applied_versions),
                payload_bytes=result.payload_bytes,
                prepare_seconds=prepared.fetch_seconds,
                apply_seconds=result.apply_seconds,
                prefetched=prefetched,
                unverified=tuple(result.unverified),
                store_reads=0 if cache is None else cache.reads,
                host_cache_hits=0 if cache is None else cache.hits,
            )
            _log.info("dcr: %s", report)
            self.last = report
            return report

    def _goal(self, asked: int | None) -> tuple[int, Exception | None]:
        """The version an update asked for ``asked`` reaches (the newest committed where it
        names none), or the failure to list the versions (raised once the group knows)."""
        if asked is not None:
            return asked, None
        try:
            committed = self.reader.versions()
            if not committed:
                raise VersionNotFoundError(f"{self.reader.store.url} has no version yet")
        except Exception as exc:  # every rank must still reach the group's exchange
            return _NO_GOAL, exc
        return committed[-1], None

    def version(self) -> int | None:
        """The version the model holds."""
        resident = self.target.resident()
        return None if resident is None else resident.version

    def close(self) -> None:
        """Stop the background preparation."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._prepared = None


# remedies the reader gives for a target it can replace; an engine is restarted instead
_FILE_REMEDIES = (
    "replay older versions into a fresh target",
    "use a fresh target for this store",
    "store and pull into a fresh target",
    "pull into a fresh target",
    "sync from a base",
)
_ENGINE_REMEDY = (
    "restart the engine on a `dcr replay` of the version it should hold (or initialise "
    "it with init_info 'version' set to the version its checkpoint holds)"
)


_NO_GOAL = -2  # a rank's goal where it could not list the versions


def _held(prepared: Any) -> int:
    """The version ``prepared`` holds, -1 for none."""
    return -1 if prepared is None else int(prepared.version)


@contextlib.contextmanager
def _for_engine() -> Iterator[None]:
    """A dcr error raised inside says what to do on an engine, not on a file target."""
    try:
        yield
    except DcrError as exc:
        message = str(exc)
        for remedy in _FILE_REMEDIES:
            if remedy in message:
                try:
                    changed = type(exc)(message.replace(remedy, _ENGINE_REMEDY, 1))
                except Exception:
                    raise exc from None
                raise changed.with_traceback(exc.__traceback__) from None
        raise


def tensor_parallel_group(vllm_config: Any) -> Any:
    """A gloo group of this worker's tensor-parallel ranks (None without tensor parallelism)."""
    if vllm_config.parallel_config.tensor_parallel_size <= 1:
        return None
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    # every rank of the world creates every group, in the same order (torch requirement)
    world = dist.get_world_size()
    size = vllm_config.parallel_config.tensor_parallel_size
    mine = None
    for start in range(0, world, size):
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks, backend="gloo")
        if dist.get_rank() in ranks:
            mine = group
    if mine is None or tp.world_size != size:
        raise TargetError("could not form the tensor-parallel reader group of this engine")
    return mine


def _model_dir(vllm_config: Any) -> str | None:
    model = getattr(vllm_config.model_config, "model", None)
    return str(model) if model else None


def worker_syncer(
    model: torch.nn.Module, info: DcrInitInfo, vllm_config: Any, previous: _Syncer | None
) -> _Syncer:
    """A vLLM worker's reader of ``model``, replacing ``previous`` (stopped first; the model
    holds the version it applied)."""
    if previous is not None:
        previous.close()
    return _Syncer(
        model,
        info,
        model_dir=_model_dir(vllm_config),
        group=tensor_parallel_group(vllm_config),
        previous=previous,
    )


class DcrWorkerExtension:
    """A vLLM ``worker_extension_cls`` for engines started without the weight-transfer API:
    ``LLM(..., worker_extension_cls="dcr_format.integrations.vllm.DcrWorkerExtension")``,
    then ``llm.collective_rpc("dcr_init", kwargs={"init_info": {...}})`` once and
    ``llm.collective_rpc("dcr_sync", kwargs={"version": N})`` per update (both return one
    dict per worker). Init info and update info as in :class:`DcrInitInfo` /
    :class:`DcrUpdateInfo`.
    """

    _dcr: _Syncer | None = None

    def dcr_init(self, init_info: dict[str, Any]) -> dict[str, Any]:
        """Open the store and prewarm this worker's loader; returns the resident version."""
        info = _parse(DcrInitInfo, init_info, "init_info")
        previous, self._dcr = self._dcr, None
        worker: Any = self
        self._dcr = worker_syncer(
            worker.model_runner.get_model(), info, worker.vllm_config, previous
        )
        return {"version": self._dcr.version()}

    def dcr_sync(self, version: int | None = None, audit: bool = False) -> dict[str, Any]:
        """Bring this worker's model to ``version`` (default: the newest) in place."""
        if self._dcr is None:
            raise RuntimeError("call collective_rpc('dcr_init', ...) before 'dcr_sync'")
        return self._dcr.update(DcrUpdateInfo(version=version, audit=audit)).to_dict()

    def _active(self) -> _Syncer | None:
        """This extension's reader, else the ``dcr`` backend's on an engine that has one."""
        if self._dcr is not None:
            return self._dcr
        engine = getattr(self, "weight_transfer_engine", None)
        return getattr(engine, "_syncer", None)

    def dcr_version(self) -> int | None:
        """The version this worker's model holds (None before any initialisation)."""
        syncer = self._active()
        return None if syncer is None else syncer.version()

    def dcr_report(self) -> dict[str, Any] | None:
        """What the last update on this worker did (:class:`UpdateReport` as a dict), by
        ``dcr_sync`` or, on an engine with the ``dcr`` backend, by ``update_weights``."""
        syncer = self._active()
        last = None if syncer is None else syncer.last
        return None if last is None else last.to_dict()


def engine_report(worker: Any) -> dict[str, Any]:
    """What the ``dcr`` backend of one worker holds, for ``collective_rpc`` on an engine
    without :class:`DcrWorkerExtension`: ``llm.collective_rpc(engine_report)`` gives, per
    worker, ``{"version": the version its model holds (None before the backend is
    initialised), "last": what its last update did (:class:`UpdateReport` as a dict, or
    None)}``."""
    engine = getattr(worker, "weight_transfer_engine", None)
    syncer = getattr(engine, "_syncer", None)
    if not isinstance(syncer, _Syncer):
        return {"version": None, "last": None}
    return {
        "version": syncer.version(),
        "last": None if syncer.last is None else syncer.last.to_dict(),
    }


_Info = TypeVar("_Info", bound="DataclassInstance")


def _parse(cls: type[_Info], data: object, what: str) -> _Info:
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ValueError(f"dcr {what} must be a dict, not {type(data).__name__}")
    names = {f for f in cls.__dataclass_fields__}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(
            f"dcr {what} has unknown field {unknown[0]!r}; the fields are {', '.join(names)}"
        )
    return cls(**data)


# --- the trainer side ------------------------------------------------------------------


class _Publisher:
    """Trainer side of an engine integration: publish with the writer, then update the
    engines; ``timings`` holds, per version, the seconds of each."""

    writer: Any
    timings: list[dict[str, float]]

    def publish(
        self,
        tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        step: int | None = None,
    ) -> int:
        """Publish ``tensors`` as the next version and update the engines to it."""
        started = time.perf_counter()
        info = self.writer.publish(tensors, step=step)
        published = time.perf_counter()
        self._update_published(int(info.version))
        self.timings.append(
            {
                "version": float(info.version),
                "publish_seconds": published - started,
                "update_seconds": time.perf_counter() - published,
            }
        )
        return int(info.version)

    def _update_published(self, version: int) -> None:
        """Bring the engines to the ``version`` just published."""
        raise NotImplementedError


@dataclass
class DcrWeightSync(_Publisher):
    """Trainer side: publish each step with a :class:`~dcr_format.DeltaWriter`, then bring
    the engines behind ``client`` to that version through vLLM's weight-sync protocol.
    ``client``: vLLM's ``HTTPVLLMWeightSyncClient``, an ``LLM``, or Ray actors of
    ``LLM``/``AsyncLLM`` (a handle, a list of handles, or ``RayVLLMWeightSyncClient``).

    ``init_info`` is what the engines are initialised with (the store as *they* reach it);
    :meth:`init` sends it once. Only the publishing rank (or rank 0 of several writer
    ranks) should drive the client: pass ``client=None`` on the others.
    """

    writer: Any
    client: Any
    init_info: DcrInitInfo
    timings: list[dict[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.client is not None:
            self.client = as_client(self.client)

    def init(self) -> None:
        """``init_weight_transfer_engine`` on every engine (opens the store, prewarms).

        An engine that cannot start dcr (the store unreachable, weights it cannot update in
        place, a checkpoint that is not a version of the chain) raises
        :class:`~dcr_format.errors.EngineUpdateError` with the engine's message.
        """
        if self.client is None:
            return
        try:
            self.client.init_weight_transfer_engine(self.init_info.to_dict())
        except Exception as exc:
            raise EngineUpdateError(
                f"the engines did not start dcr and kept their weights: {engine_message(exc)}"
            ) from exc

    def _update_published(self, version: int) -> None:
        if self.client is not None:
            self.update(version)

    def publish_model(
        self,
        model: torch.nn.Module,
        *,
        step: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> int:
        """Publish ``model`` as this rank holds it (:func:`trainer_state`: a sharded model's
        own shards, nothing gathered) and update the engines; every writer rank calls it."""
        with torch.no_grad():
            return self.publish(trainer_state(model, dtype), step=step)

    def update(self, version: int | None = None, *, audit: bool = False) -> None:
        """start, update and finish: the engines reach ``version`` (default: the newest the
        writer's chain holds, named to the engines, so that vLLM's ``/weight_info`` reports
        it).

        A failed update (an engine that refuses to start it, such as one not initialised, or
        one that refuses the version) leaves every engine at its previous version and still
        serving (vLLM ends the update session itself):
        :class:`~dcr_format.errors.EngineUpdateError` with the engine's message.
        """
        if self.client is None:
            raise RuntimeError("this rank has no weight-sync client; rank 0 updates")
        if version is None:
            version = _newest(self.writer)
        payload: dict[str, Any] = {"audit": audit}
        if version is not None:
            payload["version"] = int(version)
        try:
            self.client.start_weight_update()
            self.client.update_weights(payload)
        except Exception as exc:
            goal = "the newest version" if version is None else f"version {version}"
            raise EngineUpdateError(
                f"the engines did not reach {goal} and kept their weights: {engine_message(exc)}"
            ) from exc
        self.client.finish_weight_update(str(version) if version is not None else None)


def _newest(writer: Any) -> int | None:
    """The newest version committed in the writer's chain (None when it cannot tell)."""
    chain = getattr(writer, "chain", None)
    return None if chain is None else chain.latest()


def _state(model: torch.nn.Module, dtype: torch.dtype, *, gather: bool) -> dict[str, torch.Tensor]:
    """The model's state dict in ``dtype``, each tied alias once; DTensors gathered or kept."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[str, int, int]] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        to_local = getattr(tensor, "to_local", None)  # a DTensor: this rank's shard
        local = to_local() if callable(to_local) else tensor
        key = (str(local.device), local.untyped_storage().data_ptr(), local.storage_offset())
        if local.numel() and key in seen:
            continue  # a tied alias of a tensor already exported
        seen.add(key)
        full = getattr(tensor, "full_tensor", None) if gather else None
        value = full() if callable(full) else tensor
        out[name] = value.detach().to(dtype) if value.is_floating_point() else value.detach()
    return out


def trainer_state(
    model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """What each rank of a trainer publishes: the model's state dict in ``dtype``, with
    sharded parameters (FSDP2, tensor parallelism: ``DTensor`` objects) kept as this rank's
    shards. Nothing is gathered; every rank passes its own to its
    :class:`~dcr_format.DeltaWriter`, which publishes the shards in canonical coordinates.

    A tied weight is published once, under its first name (as ``save_pretrained`` does:
    ``lm_head.weight`` of a tied model is ``model.embed_tokens.weight``), since vLLM's
    loader refuses the tied name on its own.
    """
    return _state(model, dtype, gather=False)


def canonical_state(
    model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """The model's state dict as whole canonical tensors of ``dtype``, for a model that is not
    sharded (a sharded one's DTensors would be gathered with ``full_tensor()`` on every rank:
    the whole model on each and a collective of all of it; use :func:`trainer_state` there).
    Tied weights are published once, as by :func:`trainer_state`.
    """
    return _state(model, dtype, gather=True)


def dcr_trainer_callback(
    sync: DcrWeightSync,
    *,
    every: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    state: Callable[[torch.nn.Module], Mapping[str, torch.Tensor]] | None = None,
) -> Any:
    """A ``transformers.TrainerCallback`` that publishes the model after every ``every``-th
    optimizer step through ``sync`` (and updates the engines behind its client).

    ``state`` turns the model into the tensors each rank publishes (default:
    :func:`trainer_state`: a sharded model's DTensors stay this rank's shards, published
    without a gather; every rank of a sharded trainer runs the callback with its writer).
    """
    from transformers import TrainerCallback

    if every < 1:
        raise ValueError("every must be a positive number of optimizer steps")
    export = state or (lambda model: trainer_state(model, dtype))

    class DcrTrainerCallback(TrainerCallback):
        """Publishes the model with dcr after optimizer steps."""

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._pending = True

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if not getattr(self, "_pending", False):
                return
            self._pending = False
            if state.global_step % every:
                return
            model = kwargs["model"]
            with torch.no_grad():
                sync.publish(export(model), step=int(state.global_step))

    return DcrTrainerCallback()
