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
- **temporary files of crashed writes** in a local store (``.dcr-tmp-*``, FORMAT.md
  §2.5; a process killed while writing an object leaves one behind), when older
  than the grace period.
- **the oldest versions**: gc keeps the newest ``keep_last`` versions, the
  newest base (a base version or an alternative base) at or before the oldest
  of them, ``keep_bases`` older bases, and every version after the oldest base
  kept; the versions before it are removed (commit records first, oldest first,
  so the chain left is always a contiguous run of versions starting at a base),
  then their objects and alternative bases.
"""

from __future__ import annotations

import os
import re
import uuid
from collections import defaultdict
from datetime import datetime, timedelta, timezone
from typing import Literal

from pydantic import Field

from dcr_format.bases import (
    alternative_bases,
    base_record_key,
    load_base,
    read_base_record,
)
from dcr_format.chain import Chain, commit_key, utc_now
from dcr_format.errors import CapabilityError, ChainBrokenError, DcrError
from dcr_format.store import _TEMP_PREFIX, Store, open_store
from dcr_format.tools._common import ObjectInfo, Row, object_infos

DEFAULT_GRACE = timedelta(hours=1)
_ATTEMPT = re.compile(r"^objects/([0-9]{20})/([0-9a-f]{32})/")
_BASE_ATTEMPT = re.compile(r"^bases/([0-9]{20})/([0-9a-f]{32})/")
_BASE_RECORD = re.compile(r"^bases/([0-9]{20})\.json$")
_COMMIT = re.compile(r"^commits/([0-9]{20})\.json$")
CLOCK_PROBE_PREFIX = "doctor/gc-clock-"
"""Key prefix of the probe objects gc reads the store's clock from (deleted at once)."""
_STALE_PROBE = timedelta(minutes=10)

ItemKind = Literal["version", "attempt", "base", "base-attempt"]
ClockSource = Literal["store", "newest-object", "given", "none"]


class GcItem(Row):
    """One thing gc deleted (or would delete, or kept because it is too young)."""

    kind: ItemKind
    """``version``: a commit record; ``attempt``: the objects of one publish attempt;
    ``base``: an alternative base record; ``base-attempt``: one compaction's objects."""
    version: int
    attempt: str | None
    objects: int
    bytes: int
    age_seconds: float | None
    reason: str


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
    """Local stores: temporary files of crashed writes deleted (paths relative to the root;
    with ``dry_run``: that would be), older than the grace period."""
    now: datetime | None = None
    """The store's time that ages were measured against (None: unknown, no age known)."""
    clock: ClockSource = "store"
    """Where ``now`` came from: ``store`` (the time the store gave gc's probe object),
    ``newest-object`` (the probe could not be written: the newest object time listed),
    ``given`` (the caller's ``now``), ``none`` (the store reports no times)."""
    clock_skew_seconds: float | None = None
    """This machine's clock minus the store's (positive: this machine is ahead), measured
    with the probe; ages never depend on it. None when not measured."""


def gc(
    store: Store | str | os.PathLike[str],
    *,
    keep_last: int,
    keep_bases: int = 0,
    grace: timedelta = DEFAULT_GRACE,
    dry_run: bool = False,
    now: datetime | None = None,
) -> GcReport:
    """Delete uncommitted attempts older than ``grace`` and versions older than the kept range.

    See the module docstring for what is kept. Never deletes an object of a kept
    version, nor an attempt younger than ``grace`` (so set ``grace`` well above
    the writers' commit timeout). ``dry_run`` only reports (it still writes and
    deletes the clock probe where it can). ``now`` is the store's time to measure
    ages against (default: read from the store with a probe object; this
    machine's clock is never used).
    """
    if keep_last < 1:
        raise ValueError("keep_last must be at least 1: gc never deletes the newest version")
    if keep_bases < 0:
        raise ValueError("keep_bases must be 0 or more")
    store = open_store(store)
    chain = Chain(store)
    chain.header  # noqa: B018  # refuse a store without a chain
    capabilities = store.capabilities
    if not (capabilities.listing and (capabilities.delete or dry_run)):
        raise CapabilityError(f"store {store.url} cannot list and delete objects, which gc needs")
    clock: ClockSource = "given"
    skew: float | None = None
    moment: datetime | None = now
    if moment is None:
        moment, skew = _store_clock(store)
        clock = "store"
    committed = chain.versions()
    if committed and committed != list(range(committed[0], committed[-1] + 1)):
        raise ChainBrokenError(
            f"versions are missing inside the chain of {store.url}; gc removes only whole "
            "oldest versions: run `dcr verify` and restore the missing ones first"
        )
    alternatives = set(alternative_bases(store))
    start, bases = _kept_range(chain, committed, alternatives, keep_last, keep_bases)
    infos = object_infos(store, "objects/")
    commit_infos = object_infos(store, "commits/")
    base_infos = object_infos(store, "bases/")
    if moment is None:  # no probe: the newest time the store gave any object listed
        times = [i.modified for i in (*infos, *commit_infos, *base_infos) if i.modified]
        moment = max(times, default=None)
        clock = "newest-object" if moment is not None else "none"
    if start is not None and committed and start > committed[0]:
        _check_start_base(chain, start, alternatives, infos)

    deleted: list[GcItem] = []
    kept: list[GcItem] = []
    record_keys: list[str] = []  # commit and base records, deleted first in this order
    object_keys: list[str] = []

    def age_of(objects: list[ObjectInfo]) -> float | None:
        times = [o.modified for o in objects]
        if moment is None or not times or any(t is None for t in times):
            return None
        return (moment - max(t for t in times if t is not None)).total_seconds()

    def young(objects: list[ObjectInfo]) -> bool:
        age = age_of(objects)
        return age is None or age < grace.total_seconds()

    # --- the oldest versions -------------------------------------------------------------
    have = set(committed)
    if start is not None:
        for info in commit_infos:
            match = _COMMIT.match(info.key)
            if match and int(match.group(1)) < start:
                version = int(match.group(1))
                record_keys.append(info.key)
                deleted.append(
                    GcItem(
                        kind="version",
                        version=version,
                        attempt=None,
                        objects=1,
                        bytes=info.size,
                        age_seconds=age_of([info]),
                        reason=f"older than the oldest kept base {start}",
                    )
                )

    # --- attempts of publishes -------------------------------------------------------------
    groups: dict[tuple[int, str], list[ObjectInfo]] = defaultdict(list)
    for info in infos:
        match = _ATTEMPT.match(info.key)
        if match:  # anything else under objects/ is not ours to judge
            groups[(int(match.group(1)), match.group(2))].append(info)
    by_version: dict[int, list[str]] = defaultdict(list)
    for version, attempt in groups:
        by_version[version].append(attempt)
    committed_attempt: dict[int, str] = {}
    for version, attempts in by_version.items():
        if version in have and (start is None or version >= start) and len(attempts) > 1:
            committed_attempt[version] = chain.record(version).record.attempt
    for (version, attempt), objects in sorted(groups.items()):
        truncated = start is not None and version < start and version in have
        if version in have and not truncated:
            named = committed_attempt.get(version)
            if named is None or named == attempt:
                continue  # the committed attempt of a kept version (or its only attempt)
            reason = "lost the commit race or was retried"
        elif truncated:
            reason = f"version older than the oldest kept base {start}"
        else:
            reason = "never committed"
        item = GcItem(
            kind="attempt",
            version=version,
            attempt=attempt,
            objects=len(objects),
            bytes=sum(o.size for o in objects),
            age_seconds=age_of(objects),
            reason=reason,
        )
        if not truncated and young(objects):
            kept.append(item.model_copy(update={"reason": "younger than the grace period"}))
            continue
        if version not in have and _committed_now(chain, version, attempt):
            continue  # committed while gc looked (an attempt older than the grace period)
        deleted.append(item)
        object_keys.extend(o.key for o in objects)

    # --- alternative bases -----------------------------------------------------------------
    base_groups: dict[tuple[int, str], list[ObjectInfo]] = defaultdict(list)
    base_records: dict[int, ObjectInfo] = {}
    for info in base_infos:
        match = _BASE_RECORD.match(info.key)
        if match:
            base_records[int(match.group(1))] = info
            continue
        match = _BASE_ATTEMPT.match(info.key)
        if match:
            base_groups[(int(match.group(1)), match.group(2))].append(info)
    named_base: dict[int, str | None] = {}
    for version, info in sorted(base_records.items()):
        dropped = version not in have or (start is not None and version < start)
        if dropped:
            record_keys.append(info.key)
            deleted.append(
                GcItem(
                    kind="base",
                    version=version,
                    attempt=None,
                    objects=1,
                    bytes=info.size,
                    age_seconds=age_of([info]),
                    reason="its version is no longer in the chain",
                )
            )
            named_base[version] = None
            continue
        try:
            named_base[version] = read_base_record(chain, version)[0].attempt
        except DcrError:
            named_base[version] = "?"  # unreadable: leave its objects alone
    for (version, attempt), objects in sorted(base_groups.items()):
        if version in named_base and named_base[version] in (attempt, "?"):
            continue
        dropped = version in base_records and named_base.get(version) is None
        item = GcItem(
            kind="base-attempt",
            version=version,
            attempt=attempt,
            objects=len(objects),
            bytes=sum(o.size for o in objects),
            age_seconds=age_of(objects),
            reason="its base was removed" if dropped else "no base record names it",
        )
        if not dropped and young(objects):
            kept.append(item.model_copy(update={"reason": "younger than the grace period"}))
            continue
        deleted.append(item)
        object_keys.extend(o.key for o in objects)

    if not dry_run:
        for key in sorted(k for k in record_keys if k.startswith("commits/")):
            store.delete(key)  # oldest first: the chain left is always a contiguous run
        for key in sorted(k for k in record_keys if k.startswith("bases/")):
            store.delete(key)
        if object_keys:
            store.delete_many(object_keys)
    temp_files = [] if moment is None else _stale_temp_files(store, moment, grace, dry_run)
    return GcReport(
        dry_run=dry_run,
        latest=committed[-1] if committed else None,
        oldest_kept=start,
        bases_kept=bases,
        deleted=deleted,
        kept=kept,
        deleted_objects=sum(i.objects for i in deleted),
        deleted_bytes=sum(i.bytes for i in deleted),
        temp_files=temp_files,
        now=moment,
        clock=clock,
        clock_skew_seconds=skew,
    )


def _store_clock(store: Store) -> tuple[datetime | None, float | None]:
    """The store's time now and this machine's clock minus it, from a probe object.

    Writes ``doctor/gc-clock-<id>``, reads its time back from a listing and deletes
    it (with any probe a crashed gc left). (None, None) where the probe cannot be
    written or the store reports no time for it.
    """
    key = f"{CLOCK_PROBE_PREFIX}{uuid.uuid4().hex}"
    directory = CLOCK_PROBE_PREFIX.rpartition("/")[0] + "/"
    try:
        store.put(key, b"dcr gc clock probe\n")
    except DcrError:
        return None, None  # a read-only store (a dry run with read-only credentials)
    try:
        before = utc_now()
        probes = [i for i in store.list_info(directory) if i.key.startswith(CLOCK_PROBE_PREFIX)]
        after = utc_now()
    finally:
        try:
            store.delete(key)
        except DcrError:
            pass  # a later gc removes it
    mine = next((i.modified for i in probes if i.key == key), None)
    if mine is None:
        return None, None
    # Probes of a gc that died between its put and its delete (a live gc's is seconds old).
    stale = [i.key for i in probes if i.modified and i.modified < mine - _STALE_PROBE]
    if stale:
        try:
            store.delete_many(stale)
        except DcrError:
            pass
    local = before + (after - before) / 2
    return mine, (local - mine).total_seconds()


def _stale_temp_files(store: Store, moment: datetime, grace: timedelta, dry_run: bool) -> list[str]:
    """Temporary files (FORMAT.md §2.5) of a local store older than ``grace``: left by writes
    that were killed, since a live write renames or removes its own within moments."""
    if not store.url.startswith("file://"):
        return []
    root = store.url[len("file://") :]
    found = []
    for directory, _, names in os.walk(root):  # symlinked directories are not followed
        for name in names:
            if not name.startswith(_TEMP_PREFIX):
                continue
            path = os.path.join(directory, name)
            try:
                modified = datetime.fromtimestamp(os.lstat(path).st_mtime, timezone.utc)
                if (moment - modified) < grace:
                    continue
                if not dry_run:
                    os.unlink(path)
            except FileNotFoundError:
                continue  # renamed or removed by its writer meanwhile
            found.append(os.path.relpath(path, root).replace(os.sep, "/"))
    return sorted(found)


def _kept_range(
    chain: Chain, committed: list[int], alternatives: set[int], keep_last: int, keep_bases: int
) -> tuple[int | None, list[int]]:
    """The oldest version to keep and the bases kept, newest first."""
    if not committed:
        return None, []
    oldest_kept = max(committed[0], committed[-1] - keep_last + 1)
    bases: list[int] = []
    version = oldest_kept
    while version >= committed[0] and len(bases) <= keep_bases:
        if version in alternatives or chain.record(version).record.kind == "base":
            bases.append(version)
        version -= 1
    if not bases:  # no base to start from below the kept versions: keep the whole chain
        return committed[0], []
    return bases[-1], bases


def _check_start_base(
    chain: Chain, start: int, alternatives: set[int], infos: list[ObjectInfo]
) -> None:
    """The base the chain will start at must be whole before anything older goes."""
    sizes = {o.key: o.size for o in infos}
    commit = chain.record(start)
    if start in alternatives:
        try:
            snapshot = load_base(chain, commit)
        except DcrError as exc:
            raise ChainBrokenError(
                f"the alternative base of version {start}, where the chain would start after "
                f"gc, is broken ({exc}); run `dcr verify`, remove {base_record_key(start)} or "
                "compact again"
            ) from None
        shards = [s for m in snapshot.manifests for s in m.shards]
        sizes.update({o.key: o.size for o in object_infos(chain.store, "bases/")})
    else:
        manifests = chain.manifests(commit)
        shards = [s for m in manifests for s in m.shards]
    for shard in shards:
        if sizes.get(shard.path) != shard.size:
            raise ChainBrokenError(
                f"{shard.path} of the base at version {start}, where the chain would start "
                "after gc, is missing or damaged; run `dcr verify` before gc"
            )


def _committed_now(chain: Chain, version: int, attempt: str) -> bool:
    """Whether ``attempt`` became the committed attempt of ``version`` since the listing."""
    if not chain.store.exists(commit_key(version)):
        return False
    try:
        return chain.record(version).record.attempt == attempt
    except DcrError:
        return True  # cannot tell: keep it
