"""``dcr gc``: delete what no commit references any more (FORMAT.md §14.5).

Two kinds of garbage:

- **attempts that never committed**: ``objects/<N>/<attempt>/`` whose attempt
  is not the one ``commits/<N>.json`` names (a lost race, a retried or crashed
  publish), and ``bases/<V>/<attempt>/`` that no base record names (a crashed
  or lost compaction). An attempt may still be in flight, so it is deleted
  only when its newest object is older than the grace period. Ages are
  measured on the store's clock alone, never this machine's: an object's time
  comes from the store's listing (file modification time, S3 ``LastModified``,
  the memory store's put time) and "now" is the time the store gives a small
  probe object gc writes, lists and deletes (``doctor/gc-clock-<id>``, FORMAT.md
  §14.1), so a gc host whose clock is skewed cannot delete an attempt in
  flight. Where the probe cannot be written, "now" is the newest time of any
  object gc listed (ages then err short: gc deletes less, never more). An
  object without a time is never deleted.
- **temporary files of crashed writes** (``.dcr-tmp-*``, FORMAT.md §2.5: a local
  store's process killed while writing an object, an S3 store's killed during its
  conditional-write probe), when older than the grace period. gc asks the store for
  them (:meth:`Store.list_temporary`, :meth:`Store.delete_temporary`) and never
  looks at a directory itself.
- **the oldest versions**: gc keeps the newest ``keep_last`` versions, the
  newest base (a base version or an alternative base) at or before the oldest
  of them, ``keep_bases`` older bases, and every version after the oldest base
  kept; the versions before it are removed (commit records first, oldest first,
  so the chain left is always a contiguous run of versions starting at a base),
  then their objects and alternative bases.

gc runs in three steps. :func:`survey` reads the store into plain data
(:class:`GcSurvey`: listings with sizes and store times, the attempts the records
name, the store's clock); :func:`plan_gc` turns that and the options
(:class:`GcOptions`) into a frozen :class:`GcPlan` (every deletion and every kept
attempt with its reason) without touching a store; :func:`execute` applies a
plan. ``dcr gc --dry-run`` prints the plan and deletes nothing.
"""

from __future__ import annotations

import os
import re
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from pydantic import Field

from dcr_format.chain.bases import base_record_key, load_base, read_base_record
from dcr_format.chain.chain import Chain, commit_key, utc_now
from dcr_format.errors import (
    ArgumentError,
    CapabilityError,
    ChainBrokenError,
    DcrError,
    GraceTooShortError,
)
from dcr_format.store.store import ObjectInfo, Store, open_store
from dcr_format.system.options import duration
from dcr_format.tools._common import Row, object_infos

DEFAULT_GRACE = timedelta(hours=1)
WRITER_COMMIT_TIMEOUT = timedelta(seconds=600)
"""The reference writer's default ``commit_timeout``: the shortest grace gc accepts unless told
the writers' timeout (FORMAT.md §14.5: the grace period exceeds it)."""
_ATTEMPT = re.compile(r"^objects/([0-9]{20})/([0-9a-f]{32})/")
_BASE_ATTEMPT = re.compile(r"^bases/([0-9]{20})/([0-9a-f]{32})/")
_BASE_RECORD = re.compile(r"^bases/([0-9]{20})\.json$")
_COMMIT = re.compile(r"^commits/([0-9]{20})\.json$")
CLOCK_PROBE_PREFIX = "doctor/gc-clock-"
"""Key prefix of the probe objects gc reads the store's clock from (deleted at once)."""
_STALE_PROBE = timedelta(minutes=10)
_YOUNG = "younger than the grace period"
_UNTIMED = "the store reports no time for it"
_NEVER_COMMITTED = "never committed"

ItemKind = Literal["version", "attempt", "base", "base-attempt"]
ClockSource = Literal["store", "newest-object", "given", "none"]


class GcItem(Row):
    """One thing gc deleted (or would delete, or kept because it may still be in flight)."""

    kind: ItemKind
    """``version``: a commit record; ``attempt``: the objects of one publish attempt;
    ``base``: an alternative base record; ``base-attempt``: one compaction's objects."""
    version: int
    attempt: str | None
    objects: int
    bytes: int
    age_seconds: float | None
    reason: str
    keys: tuple[str, ...] = Field(default=(), exclude=True, repr=False)
    """The keys of its objects (not in the JSON output: a truncation may name millions)."""


class GcReport(Row):
    """Result of :func:`gc`."""

    dry_run: bool
    latest: int | None
    oldest_kept: int | None
    """The oldest version left in the chain (a base, or a version with an alternative base)."""
    bases_kept: list[int]
    """The bases gc kept as starting points, newest first."""
    deleted: list[GcItem]
    """What was deleted (with ``dry_run``: what would be)."""
    kept: list[GcItem]
    """Uncommitted attempts left alone because they may still be in flight."""
    deleted_objects: int
    deleted_bytes: int
    temp_files: list[str] = Field(default_factory=list)
    """Temporary files of crashed writes deleted (keys relative to the root, from
    :meth:`Store.list_temporary`; with ``dry_run``: that would be), older than the grace
    period."""
    now: datetime | None = None
    """The store's time that ages were measured against (None: unknown, no age known)."""
    clock: ClockSource = "store"
    """Where ``now`` came from: ``store`` (the time the store gave gc's probe object),
    ``newest-object`` (the probe could not be written: the newest object time listed),
    ``given`` (the caller's ``now``), ``none`` (the store reports no times)."""
    clock_skew_seconds: float | None = None
    """This machine's clock minus the store's (positive: this machine is ahead), measured
    with the probe; ages never depend on it. None when not measured."""


# --- plain data: the planner's input and output -----------------------------------------


@dataclass(frozen=True)
class GcOptions:
    """What gc keeps: the newest ``keep_last`` versions, ``keep_bases`` older bases, and any
    uncommitted attempt whose newest object is younger than ``grace``."""

    keep_last: int
    keep_bases: int = 0
    grace: timedelta = DEFAULT_GRACE

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ArgumentError("keep_last must be at least 1: gc never deletes the newest version")
        if self.keep_bases < 0:
            raise ArgumentError("keep_bases must be 0 or more")
        if self.grace < timedelta(0):
            raise ArgumentError("grace must be 0 or more; pass e.g. timedelta(hours=1)")


@dataclass(frozen=True)
class StoreClock:
    """The store's time now, where it came from, and this machine's clock minus it."""

    now: datetime | None
    source: ClockSource
    skew_seconds: float | None = None


@dataclass(frozen=True)
class GcSurvey:
    """Everything :func:`plan_gc` reads, as plain data (build one by hand to test a plan).

    Listings are sorted by key; times are the store's. ``base_commits`` holds the versions
    whose commit record is a base, as far as the kept range needs them (:func:`survey` reads
    commit records from the newest kept version down until it has found enough bases).
    ``committed_attempts`` names the attempt of each committed version with more than one
    attempt listed (None: its record could not be read, so every attempt of it is kept).
    ``base_records`` names the attempt of each listed alternative base record (None:
    unreadable, so its objects are left alone). ``temporary`` lists the temporary files of
    crashed writes (keys relative to the store root).
    """

    store: str
    commits: tuple[ObjectInfo, ...]
    objects: tuple[ObjectInfo, ...]
    base_objects: tuple[ObjectInfo, ...] = ()
    base_commits: frozenset[int] = frozenset()
    committed_attempts: Mapping[int, str | None] = field(default_factory=dict)
    base_records: Mapping[int, str | None] = field(default_factory=dict)
    temporary: tuple[ObjectInfo, ...] = ()
    clock: StoreClock = StoreClock(None, "none")

    @property
    def versions(self) -> list[int]:
        """The committed versions, ascending (from the ``commits/`` listing)."""
        return _versions(self.commits)


class GcPlan(Row):
    """What gc deletes and keeps, and why: the output of :func:`plan_gc`, the input of
    :func:`execute`. Deleting it in order (commit records oldest first, base records,
    objects, temporary files) leaves a chain that is a contiguous run from a base."""

    latest: int | None
    oldest_kept: int | None
    bases_kept: list[int]
    deleted: list[GcItem]
    kept: list[GcItem]
    temp_files: list[str]
    now: datetime | None
    clock: ClockSource
    clock_skew_seconds: float | None

    @property
    def deleted_objects(self) -> int:
        """Objects the plan deletes (temporary files not counted)."""
        return sum(i.objects for i in self.deleted)

    @property
    def deleted_bytes(self) -> int:
        """Stored bytes the plan frees (temporary files not counted)."""
        return sum(i.bytes for i in self.deleted)

    def report(self, *, dry_run: bool) -> GcReport:
        """The :class:`GcReport` of carrying out this plan (``dry_run``: of not doing so)."""
        fields = self.model_dump(exclude={"deleted", "kept"})
        return GcReport(
            dry_run=dry_run,
            deleted=self.deleted,
            kept=self.kept,
            deleted_objects=self.deleted_objects,
            deleted_bytes=self.deleted_bytes,
            **fields,
        )


# --- the whole run -----------------------------------------------------------------------


def gc(
    store: Store | str | os.PathLike[str],
    *,
    keep_last: int,
    keep_bases: int = 0,
    grace: timedelta | float = DEFAULT_GRACE,
    dry_run: bool = False,
    now: datetime | None = None,
    commit_timeout: timedelta | float = WRITER_COMMIT_TIMEOUT,
) -> GcReport:
    """Delete uncommitted attempts older than ``grace`` and versions older than the kept range.

    See the module docstring for what is kept. Never deletes an object of a kept
    version, nor an attempt younger than ``grace`` (so set ``grace`` well above
    the writers' commit timeout). ``dry_run`` only reports (it still writes and
    deletes its own clock probe where it can, and deletes nothing else). ``now``
    is the store's time to measure ages against (default: read from the store with
    a probe object; this machine's clock is never used). ``commit_timeout`` is the
    longest ``commit_timeout`` of the chain's writers: a ``grace`` below it is refused
    with :class:`~dcr_format.errors.GraceTooShortError` (pass ``timedelta(0)`` when no
    writer can be running, e.g. to clean up after crashed writers). Both durations are a
    ``timedelta`` or a number of seconds (as ``DeltaWriter``'s ``commit_timeout``).
    """
    grace = duration(grace, "grace")
    commit_timeout = duration(commit_timeout, "commit_timeout")
    options = GcOptions(keep_last, keep_bases, grace)
    if grace < commit_timeout:
        raise GraceTooShortError(
            f"a grace of {grace.total_seconds():g} s is shorter than the writers' commit "
            f"timeout ({commit_timeout.total_seconds():g} s): gc could delete an attempt a "
            "writer is still committing; pass a longer grace, or a shorter commit timeout "
            "where the writers use one (0 when no writer is running)"
        )
    store = open_store(store)
    chain = Chain(store)
    chain.header  # noqa: B018  # refuse a store without a chain
    capabilities = store.capabilities
    if not (capabilities.listing and (capabilities.delete or dry_run)):
        raise CapabilityError(f"store {store.url} cannot list and delete objects, which gc needs")
    clock = StoreClock(now, "given") if now is not None else _store_clock(store, tidy=not dry_run)
    found = survey(chain, options, clock)
    plan = confirm(chain, plan_gc(found, options))
    check_start_base(chain, plan, found)
    if not dry_run:
        execute(store, plan)
    return plan.report(dry_run=dry_run)


# --- survey: read the store into plain data ------------------------------------------------


def survey(chain: Chain, options: GcOptions, clock: StoreClock) -> GcSurvey:
    """Read what :func:`plan_gc` needs from ``chain``'s store (listings and a few records)."""
    store = chain.store
    commits = tuple(object_infos(store, "commits/"))
    objects = tuple(object_infos(store, "objects/"))
    base_objects = tuple(object_infos(store, "bases/"))
    if clock.now is None:  # no probe: the newest time the store gave any object listed
        times = [i.modified for i in (*commits, *objects, *base_objects) if i.modified]
        newest = max(times, default=None)
        clock = StoreClock(newest, "none" if newest is None else "newest-object")
    versions = _versions(commits)
    _check_contiguous(versions, store.url)
    alternatives = set(_base_record_versions(base_objects))
    base_commits: set[int] = set()

    def is_base(version: int) -> bool:  # reads only the records the kept range looks at
        if version in alternatives:
            return True
        if chain.record(version).record.kind == "base":
            base_commits.add(version)
        return version in base_commits

    _kept_range(versions, is_base, options)
    return GcSurvey(
        store.url,
        commits,
        objects,
        base_objects,
        base_commits=frozenset(base_commits),
        committed_attempts=_committed_attempts(chain, versions, objects),
        base_records=_base_attempts(chain, alternatives),
        temporary=tuple(store.list_temporary()),
        clock=clock,
    )


def _committed_attempts(
    chain: Chain, versions: list[int], objects: Iterable[ObjectInfo]
) -> dict[int, str | None]:
    """The attempt each committed version with several attempts listed names (None: the
    record cannot be read)."""
    attempts: dict[int, set[str]] = defaultdict(set)
    for version, attempt in _groups(objects, _ATTEMPT):
        attempts[version].add(attempt)
    committed = set(versions)
    named: dict[int, str | None] = {}
    for version, listed in sorted(attempts.items()):
        if version in committed and len(listed) > 1:
            try:
                named[version] = chain.record(version).record.attempt
            except DcrError:
                named[version] = None
    return named


def _base_attempts(chain: Chain, versions: Iterable[int]) -> dict[int, str | None]:
    """The attempt each alternative base record names (None: unreadable)."""
    named: dict[int, str | None] = {}
    for version in sorted(versions):
        try:
            named[version] = read_base_record(chain, version)[0].attempt
        except DcrError:
            named[version] = None
    return named


def _versions(commits: Iterable[ObjectInfo]) -> list[int]:
    return sorted(int(m.group(1)) for i in commits if (m := _COMMIT.match(i.key)))


def _base_record_versions(infos: Iterable[ObjectInfo]) -> list[int]:
    return sorted(int(m.group(1)) for i in infos if (m := _BASE_RECORD.match(i.key)))


# --- plan: pure, from plain data ----------------------------------------------------------


def plan_gc(found: GcSurvey, options: GcOptions) -> GcPlan:
    """What gc deletes and keeps, and why, from ``found`` alone (reads no store).

    Raises ``ChainBrokenError`` when versions are missing inside the chain.
    """
    versions = found.versions
    _check_contiguous(versions, found.store)
    alternatives = set(found.base_records)
    start, bases = _kept_range(
        versions, lambda v: v in found.base_commits or v in alternatives, options
    )
    ages = _Ages(found.clock.now, options.grace)
    deleted = _truncated_commits(found.commits, start, ages)
    kept: list[GcItem] = []
    for gone, young in (
        _publish_attempts(found, start, ages),
        _base_attempt_items(found, start, ages),
    ):
        deleted += gone
        kept += young
    return GcPlan(
        latest=versions[-1] if versions else None,
        oldest_kept=start,
        bases_kept=bases,
        deleted=deleted,
        kept=kept,
        temp_files=ages.stale_temporaries(found.temporary),
        now=found.clock.now,
        clock=found.clock.source,
        clock_skew_seconds=found.clock.skew_seconds,
    )


def _check_contiguous(versions: list[int], where: str) -> None:
    if versions and versions != list(range(versions[0], versions[-1] + 1)):
        raise ChainBrokenError(
            f"versions are missing inside the chain of {where}; gc removes only whole "
            "oldest versions: run `dcr verify` and restore the missing ones first"
        )


def _kept_range(
    versions: list[int], is_base: Callable[[int], bool], options: GcOptions
) -> tuple[int | None, list[int]]:
    """The oldest version to keep and the bases kept, newest first."""
    if not versions:
        return None, []
    version = max(versions[0], versions[-1] - options.keep_last + 1)
    bases: list[int] = []
    while version >= versions[0] and len(bases) <= options.keep_bases:
        if is_base(version):
            bases.append(version)
        version -= 1
    if not bases:  # no base to start from below the kept versions: keep the whole chain
        return versions[0], []
    return bases[-1], bases


@dataclass(frozen=True)
class _Ages:
    """Ages on the store's clock, and the grace period that protects young attempts."""

    now: datetime | None
    grace: timedelta

    def of(self, objects: Sequence[ObjectInfo]) -> float | None:
        """Seconds since the newest of ``objects`` was written (None: a time is unknown)."""
        times = [o.modified for o in objects]
        if self.now is None or not times or None in times:
            return None
        return (self.now - max(t for t in times if t is not None)).total_seconds()

    def protects(self, item: GcItem) -> str | None:
        """Why ``item`` must be kept (it may still be in flight), or None."""
        if item.age_seconds is None:
            return _UNTIMED
        return _YOUNG if item.age_seconds < self.grace.total_seconds() else None

    def stale_temporaries(self, infos: Iterable[ObjectInfo]) -> list[str]:
        """Keys of the temporary files older than the grace period (a live write renames or
        removes its own within moments)."""
        if self.now is None:
            return []
        now = self.now
        return sorted(
            i.key for i in infos if i.modified is not None and now - i.modified >= self.grace
        )


def _item(
    kind: ItemKind, version: int, attempt: str | None, objects: Sequence[ObjectInfo],
    reason: str, ages: _Ages,
) -> GcItem:  # fmt: skip
    return GcItem(
        kind=kind,
        version=version,
        attempt=attempt,
        objects=len(objects),
        bytes=sum(o.size for o in objects),
        age_seconds=ages.of(objects),
        reason=reason,
        keys=tuple(o.key for o in objects),
    )


def _groups(
    infos: Iterable[ObjectInfo], pattern: re.Pattern[str]
) -> dict[tuple[int, str], list[ObjectInfo]]:
    """Objects by (version, attempt) of the keys ``pattern`` matches, sorted."""
    groups: dict[tuple[int, str], list[ObjectInfo]] = defaultdict(list)
    for info in infos:
        match = pattern.match(info.key)
        if match:  # anything else is not ours to judge
            groups[(int(match.group(1)), match.group(2))].append(info)
    return dict(sorted(groups.items()))


def _truncated_commits(
    commits: Iterable[ObjectInfo], start: int | None, ages: _Ages
) -> list[GcItem]:
    """The commit records of the versions before ``start``, oldest first."""
    items = []
    for info in commits:
        match = _COMMIT.match(info.key)
        if start is not None and match and int(match.group(1)) < start:
            reason = f"older than the oldest kept base {start}"
            items.append(_item("version", int(match.group(1)), None, [info], reason, ages))
    return items


def _split(
    candidates: Iterable[tuple[GcItem, bool]], ages: _Ages
) -> tuple[list[GcItem], list[GcItem]]:
    """(deleted, kept): each candidate goes unless it is ``guarded`` and young."""
    deleted, kept = [], []
    for item, guarded in candidates:
        why = ages.protects(item) if guarded else None
        if why is None:
            deleted.append(item)
        else:
            kept.append(item.model_copy(update={"reason": why}))
    return deleted, kept


def _publish_attempts(
    found: GcSurvey, start: int | None, ages: _Ages
) -> tuple[list[GcItem], list[GcItem]]:
    """Publish attempts that no kept commit names: (deleted, kept while they may be live)."""
    committed = set(found.versions)
    candidates = []
    for (version, attempt), objects in _groups(found.objects, _ATTEMPT).items():
        truncated = start is not None and version < start and version in committed
        if truncated:
            reason = f"version older than the oldest kept base {start}"
        elif version not in committed:
            reason = _NEVER_COMMITTED
        elif found.committed_attempts.get(version, attempt) not in (attempt, None):
            reason = "lost the commit race or was retried"
        else:
            continue  # the committed attempt of a kept version (or its only attempt)
        item = _item("attempt", version, attempt, objects, reason, ages)
        candidates.append((item, not truncated))
    return _split(candidates, ages)


def _base_attempt_items(
    found: GcSurvey, start: int | None, ages: _Ages
) -> tuple[list[GcItem], list[GcItem]]:
    """Alternative bases whose version leaves the chain, and compactions no record names."""
    committed = set(found.versions)
    dropped = {
        v for v in found.base_records if v not in committed or (start is not None and v < start)
    }
    candidates = []
    for info in found.base_objects:
        match = _BASE_RECORD.match(info.key)
        if match and int(match.group(1)) in dropped:
            reason = "its version is no longer in the chain"
            candidates.append(
                (_item("base", int(match.group(1)), None, [info], reason, ages), False)
            )
    for (version, attempt), objects in _groups(found.base_objects, _BASE_ATTEMPT).items():
        if version in dropped:
            reason = "its base was removed"
        elif version in found.base_records and found.base_records[version] in (attempt, None):
            continue  # the attempt its record names, or a record gc cannot read
        else:
            reason = "no base record names it"
        item = _item("base-attempt", version, attempt, objects, reason, ages)
        candidates.append((item, version not in dropped))
    return _split(candidates, ages)


# --- checks against the store before deleting ----------------------------------------------


def confirm(chain: Chain, plan: GcPlan) -> GcPlan:
    """``plan`` without the never-committed attempts whose version was committed since the
    listing (with that very attempt, or with a record gc cannot read: kept to be safe)."""
    deleted = [
        i
        for i in plan.deleted
        if not (i.reason == _NEVER_COMMITTED and _committed_now(chain, i.version, i.attempt))
    ]
    if len(deleted) == len(plan.deleted):
        return plan
    return plan.model_copy(update={"deleted": deleted})


def _committed_now(chain: Chain, version: int, attempt: str | None) -> bool:
    """Whether ``attempt`` became the committed attempt of ``version`` since the listing."""
    if not chain.store.exists(commit_key(version)):
        return False
    try:
        return chain.record(version).record.attempt == attempt
    except DcrError:
        return True  # cannot tell: keep it


def check_start_base(chain: Chain, plan: GcPlan, found: GcSurvey) -> None:
    """The base the chain will start at must be whole before anything older goes."""
    start = plan.oldest_kept
    versions = found.versions
    if start is None or not versions or start <= versions[0]:
        return
    sizes = {o.key: o.size for o in (*found.objects, *found.base_objects)}
    commit = chain.record(start)
    if start in found.base_records:
        try:
            snapshot = load_base(chain, commit)
        except DcrError as exc:
            raise ChainBrokenError(
                f"the alternative base of version {start}, where the chain would start after "
                f"gc, is broken ({exc}); run `dcr verify`, remove {base_record_key(start)} or "
                "compact again"
            ) from None
        manifests = snapshot.manifests
    else:
        manifests = chain.manifests(commit)
    for shard in (s for m in manifests for s in m.shards):
        if sizes.get(shard.path) != shard.size:
            raise ChainBrokenError(
                f"{shard.path} of the base at version {start}, where the chain would start "
                "after gc, is missing or damaged; run `dcr verify` before gc"
            )


# --- execute ---------------------------------------------------------------------------------


def execute(store: Store, plan: GcPlan) -> None:
    """Delete what ``plan`` names, in the order that keeps the chain whole at every moment:
    commit records oldest first (the chain left is a contiguous run from a base), then base
    records, then the objects no record names any more, then stale temporary files."""
    records = [i for i in plan.deleted if i.kind in ("version", "base")]
    for kind in ("version", "base"):
        for item in sorted((i for i in records if i.kind == kind), key=lambda i: i.version):
            for key in item.keys:
                store.delete(key)
    objects = [k for i in plan.deleted if i.kind not in ("version", "base") for k in i.keys]
    if objects:
        store.delete_many(objects)
    store.delete_temporary(plan.temp_files)


# --- the store's clock -------------------------------------------------------------------------


def _store_clock(store: Store, *, tidy: bool = True) -> StoreClock:
    """The store's time now and this machine's clock minus it, from a probe object.

    Writes ``doctor/gc-clock-<id>``, reads its time back from a listing and deletes
    it (``tidy``: with any probe a crashed gc left). Falls back to the newest object's
    time (see :func:`survey`) where the probe cannot be written or has no time.
    """
    key = f"{CLOCK_PROBE_PREFIX}{uuid.uuid4().hex}"
    directory = CLOCK_PROBE_PREFIX.rpartition("/")[0] + "/"
    try:
        store.put(key, b"dcr gc clock probe\n")
    except DcrError:
        return StoreClock(None, "none")  # a read-only store (a dry run, read-only credentials)
    try:
        before = utc_now()
        probes = [i for i in object_infos(store, directory) if i.key.startswith(CLOCK_PROBE_PREFIX)]
        after = utc_now()
    finally:
        _quietly(store.delete, key)  # else a later gc removes it
    mine = next((i.modified for i in probes if i.key == key), None)
    if mine is None:
        return StoreClock(None, "none")
    # Probes of a gc that died between its put and its delete (a live gc's is seconds old).
    stale = [i.key for i in probes if i.modified and i.modified < mine - _STALE_PROBE]
    if stale and tidy:
        _quietly(store.delete_many, stale)
    local = before + (after - before) / 2
    return StoreClock(mine, "store", (local - mine).total_seconds())


def _quietly(delete: Callable[..., None], keys: str | list[str]) -> None:
    try:
        delete(keys)
    except DcrError:
        pass
