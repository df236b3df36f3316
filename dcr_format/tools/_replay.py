"""``dcr replay``: materialise a version as a checkpoint directory, from a local cache when it can.

The cache is one safetensors directory target (spec Appendix A) per chain under
``<cache_dir>/<chain_id>/replay/state``, kept at the newest version replayed.
A replay of version ``V`` at or after the cached version syncs the cache to
``V`` (only the versions after it are fetched; the sync checks every tensor's
fingerprint before applying anything and after, so a damaged cache is detected
and replaced by a replay from a base) and then gives ``--out`` the cache's
files (hard links where the filesystem allows, else copies). Older versions
are replayed from a base into ``--out`` as before, leaving the cache alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from dcr_format.chain.bases import read_base_record
from dcr_format.chain.chain import Chain
from dcr_format.delta.fingerprint import tensor_fingerprint
from dcr_format.errors import IntegrityError, TargetBusyError, TargetError
from dcr_format.store.store import Store, open_store
from dcr_format.sync._plan import plan_versions
from dcr_format.sync.reader import DeltaReader, SyncResult
from dcr_format.system.fsync import fsync
from dcr_format.system.options import whole
from dcr_format.targets.directory import DIR_STATE_FILE, SafetensorsDirTarget
from dcr_format.targets.protocol import Target
from dcr_format.tools._common import Row
from dcr_format.tools._progress import Progress, counting_store


class ReplayResult(Row):
    """What one :func:`replay` did."""

    version: int
    out: str
    source: Literal["base", "cache", "out"]
    """Where the replay started: a base in the store, the replay cache, or the versions
    ``out`` already held."""
    start_version: int | None
    """The version the replay started from (None: ``out`` already held ``version``)."""
    applied_versions: tuple[int, ...]
    payload_bytes: int
    fetch_seconds: float
    apply_seconds: float
    cache_version: int | None
    """The version the replay cache holds afterwards (None: no cache)."""


def replay(
    store: Store | str | os.PathLike[str],
    version: int,
    out_dir: str | os.PathLike[str],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = False,
) -> ReplayResult:
    """Write version ``version`` into ``out_dir``, every tensor's fingerprint checked.

    ``out_dir`` must be new, empty, or a directory an earlier replay or pull of the
    same chain left at an older version (then only the versions in between are
    applied). With ``cache_dir``, a new or empty ``out_dir`` starts from the
    replay cache when it holds a version at or before ``version``, and the cache
    moves to ``version`` when that is newer than what it held. ``progress``
    shows the bytes fetched so far on stderr (a bar on a terminal, lines off one).
    """
    version = whole(version, "version", low=0)
    store = open_store(store)
    chain = Chain(store)
    chain_id = chain.header.chain_id
    out = SafetensorsDirTarget(out_dir)
    resident = out.resident()
    if cache_dir is None:
        result = _sync(store, out, version, progress)
        return _result(version, out_dir, result, "out" if resident else "base", None)
    cache = _Cache(Path(cache_dir).expanduser() / chain_id / "replay")
    with cache.locked():
        cached = cache.version(chain_id)
        if cached is not None and cached <= version and resident is None:
            source: Literal["base", "cache", "out"] = "cache"
            try:
                if cached == version:
                    _check_dir(chain, cache.target, version)
                result = _sync(store, cache.target, version, progress)
            except (IntegrityError, TargetError):
                cache.wipe()  # damaged or foreign: start again from a base
                source = "base"
                result = _sync(store, cache.target, version, progress)
            _clone(cache.target.path, Path(out_dir))
            return _result(version, out_dir, result, source, version)
        result = _sync(store, out, version, progress)
        if cached is None or version > cached:
            _clone(Path(out_dir), cache.target.path)
            cached = version
        return _result(version, out_dir, result, "out" if resident else "base", cached)


def _result(
    version: int,
    out_dir: str | os.PathLike[str],
    result: SyncResult,
    source: Literal["base", "cache", "out"],
    cache_version: int | None,
) -> ReplayResult:
    if result.applied_versions and result.previous is None:
        start: int | None = result.applied_versions[0]  # the base the sync started from
    else:
        start = result.previous
    if result.applied_versions and result.previous is not None:
        # a sync that could not continue the resident version started from a base
        if result.applied_versions[0] != result.previous + 1:
            source, start = "base", result.applied_versions[0]
    return ReplayResult(
        version=version,
        out=str(out_dir),
        source=source,
        start_version=start,
        applied_versions=result.applied_versions,
        payload_bytes=result.payload_bytes,
        fetch_seconds=result.fetch_seconds,
        apply_seconds=result.apply_seconds,
        cache_version=cache_version,
    )


def _sync(store: Store, target: Target, version: int, progress: bool) -> SyncResult:
    if not progress:
        return DeltaReader(store, target, verify="all").sync(to=version)
    return sync_with_progress(store, target, version, what="replay", verify="all")


def sync_with_progress(
    store: Store,
    target: Target,
    version: int | None,
    *,
    what: str,
    verify: Literal["touched", "all"] = "touched",
) -> SyncResult:
    """Sync ``target`` to ``version`` (None: the newest when the sync starts), showing the
    payload fetched so far against the plan's on stderr (a bar on a terminal, lines off
    one, named ``what``)."""
    planned: set[int] = set()  # the versions whose payload the bar counts
    with Progress(what, unit="B") as bar:
        reading = counting_store(store, bar.add, versions=planned)
        reader = DeltaReader(reading, target, verify=verify)
        committed = reader.chain.versions()
        goal = (committed[-1] if committed else None) if version is None else version
        if goal is not None:
            bar.set_total(_planned_bytes(reader, target, goal, committed, planned))
        return reader.sync(to=goal)


def _planned_bytes(
    reader: DeltaReader, target: Target, version: int, committed: list[int], planned: set[int]
) -> int | None:
    """Payload bytes of the versions a sync to ``version`` will fetch (for the bar's total),
    those versions added to ``planned``."""
    try:
        resident = target.resident()
        if version not in committed or (resident is not None and resident.version >= version):
            return None
        plan, alternative = plan_versions(reader.chain, resident, version, committed)
        total = 0
        for v in plan:
            if v == alternative:
                total += read_base_record(reader.chain, v)[0].stats.payload_bytes
            else:
                total += reader.chain.record(v).record.stats.payload_bytes
        planned.update(plan)
        return total
    except TargetBusyError:  # the sync would wait for that holder again: say so at once
        raise
    except Exception:  # only a progress estimate
        return None


def _check_dir(chain: Chain, target: SafetensorsDirTarget, version: int) -> None:
    """Every tensor of a directory target matches ``version``'s state table."""
    from dcr_format.chain.chain import state_table

    table = state_table(chain.manifests(chain.record(version)))
    txn = target.begin()
    try:
        names = txn.names()
        if names != set(table):
            raise TargetError(f"the replay cache does not hold the tensors of version {version}")
        for name in names:
            tensor = txn.tensor(name)
            assert tensor is not None
            if tensor_fingerprint(tensor) != table[name].fingerprint:
                raise TargetError(f"tensor {name!r} in the replay cache is damaged")
    finally:
        txn.abort()


class _Cache:
    """The replay cache of one chain: a directory target and a lock beside it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.target = SafetensorsDirTarget(root / "state")

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """One replay at a time uses the cache (other processes wait)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "lock", "a+b") as handle:
            try:
                import fcntl
            except ImportError:  # pragma: no cover - not POSIX
                yield
                return
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def version(self, chain_id: str) -> int | None:
        """The cached version, or None (an unreadable cache is wiped)."""
        try:
            resident = self.target.resident()
        except TargetError:
            resident = None
            self.wipe()
        if resident is None or resident.chain_id != chain_id:
            return None
        return resident.version

    def wipe(self) -> None:
        """Forget the cache."""
        path = self.target.path
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        shutil.rmtree(path.parent / f".{path.name}.dcr", ignore_errors=True)


def _clone(source: Path, dest: Path) -> None:
    """Make ``dest`` a directory target holding ``source``'s files (hard links where possible).

    ``source`` is a directory target (a link to a versioned directory, Appendix A);
    ``dest`` is new, empty, or a directory target whose old version is replaced.
    """
    src = source.resolve()
    state = json.loads((src / DIR_STATE_FILE).read_text())
    store_dir = dest.parent / f".{dest.name}.dcr"
    store_dir.mkdir(parents=True, exist_ok=True)
    fresh = store_dir / f"v{int(state['version']):020d}-{uuid.uuid4().hex[:8]}"
    fresh.mkdir()
    for item in sorted(src.iterdir()):
        if item.is_file() and not item.is_symlink():
            try:
                os.link(item, fresh / item.name)
            except OSError:
                shutil.copy2(item, fresh / item.name)
    fsync(fresh)
    old = dest.resolve() if dest.is_symlink() else None
    if dest.is_dir() and not dest.is_symlink():
        dest.rmdir()  # empty (the target checked it)
    link = store_dir / f"link-{uuid.uuid4().hex[:8]}"
    os.symlink(os.path.relpath(fresh, dest.parent), link)
    os.replace(link, dest)
    fsync(dest.parent)
    if old is not None and old != fresh.resolve():
        shutil.rmtree(old, ignore_errors=True)
