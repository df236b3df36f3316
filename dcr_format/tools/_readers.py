"""``dcr readers``: the reader records of a store (FORMAT.md §3.6), and removing those of
readers that are gone.

Every record is a request writers honour: one asking for ``overwrite`` names, for no
codings against the old bits (``reads_baseline`` false) or for fewer features makes every
writer send larger deltas. A reader writes its record again every hour it syncs
(:data:`~dcr_format.chain.readers.RECORD_REFRESH_SECONDS`), so a record not written for
longer belongs to a reader that stopped (or was reconfigured under another id), and can
be removed. A reader whose record is removed while it runs writes it again within the hour,
or at once when a version arrives in a coding it cannot take.

:func:`readers` lists them, one row per reader: a record with its parts
(``<id>.part<k>.json``); the records of a group's other ranks (``<id>.rank<r>.json``)
are readers of their own. :func:`remove_readers` deletes the records of the readers named,
or of those not written for longer than an age.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Literal

from dcr_format.chain.chain import utc_now
from dcr_format.chain.readers import (
    PART_ID,
    READERS_PREFIX,
    RECORD_REFRESH_SECONDS,
    honoured_record,
    part_id,
)
from dcr_format.errors import ArgumentError, CapabilityError
from dcr_format.format.features import WRITER_FEATURES
from dcr_format.format.schema import ReaderRecord
from dcr_format.store.store import ObjectInfo, Store, open_store
from dcr_format.tools._common import Row, object_infos

ReadsOldBits = Literal["all", "listed", "all-but", "none"]


class ReaderInfo(Row):
    """One reader's record (with its parts), as :func:`readers` lists it."""

    reader_id: str
    keys: tuple[str, ...]
    """Its record, then its parts: what removing it deletes."""
    written: datetime | None
    """When its reader last wrote it: the record's ``updated`` (the reader's clock), else,
    for a record that cannot be read, the store's time of the object; None: unknown."""
    age_seconds: float | None
    """Seconds from ``written`` to the listing's ``now``."""
    live: bool
    """A valid record written within the hour in which a syncing reader writes it again: its
    reader is probably running."""
    overwrite: int
    """Tensors it asks writers to send as ``overwrite`` (every part's names)."""
    reads_old_bits: ReadsOldBits
    """Whose old bits its reader reads: ``all`` tensors', the ``listed`` ones'
    (``baseline_names``), ``all-but`` the listed ones (``baseline_except``), or ``none``
    (writers send it no coding against the old bits)."""
    baseline_names: int
    """With ``listed`` or ``all-but``: how many tensors it lists."""
    reads_changed: bool = False
    """Whether, of the other tensors, its reader reads the old bits of each changed element
    it holds (a tensor-parallel engine): writers may send them ``ulp`` values."""
    features: tuple[str, ...] | None
    """The features it lists (writers use no other); None: it does not say (every one)."""
    lacks: tuple[str, ...]
    """The writer features its list leaves out (sorted): writers' defaults do without them."""
    problem: str | None
    """Why writers skip (some of) it: a record that cannot be read, does not validate or
    names another reader than its key. None: they honour it."""


class ReadersReport(Row):
    """Result of :func:`readers`."""

    store: str
    now: datetime
    """The time ages were measured against."""
    readers: list[ReaderInfo]


class RemovedReaders(Row):
    """Result of :func:`remove_readers`."""

    dry_run: bool
    removed: list[ReaderInfo]
    """The readers whose records were deleted (with ``dry_run``: would be)."""
    deleted_keys: int
    live: list[str]
    """The ids of those written within the refresh interval: their readers are probably
    running and write their records again within the hour."""


def _written(record: ReaderRecord | None, info: ObjectInfo) -> datetime | None:
    if record is None:
        return info.modified
    return datetime.fromisoformat(record.updated)


def _owner(record_id: str, ids: set[str]) -> str | None:
    """The record ``record_id`` is a part of, where that record is listed (``ids``)."""
    match = PART_ID.match(record_id)
    if match is None:
        return None
    k = int(match.group(2))
    owners = [match.group(1), *(i for i in ids if len(i) + len(f".part{k}") > 128)]
    return next((i for i in owners if i in ids and part_id(i, k) == record_id), None)


def _info(
    reader_id: str,
    members: list[tuple[str, ObjectInfo, ReaderRecord | None, str | None]],
    now: datetime,
) -> ReaderInfo:
    """One reader's row from its record and parts (record first)."""
    valid = [record for _, _, record, _ in members if record is not None]
    first = valid[0] if valid else None
    times = [t for _, info, record, _ in members if (t := _written(record, info)) is not None]
    written = max(times) if times else None
    problem = next((p for _, _, _, p in members if p is not None), None)
    if first is None or first.reads_baseline:
        reads: ReadsOldBits = "all"
    elif first.baseline_except is not None:
        reads = "all-but"
    else:
        reads = "listed" if first.baseline_names else "none"
    age = None if written is None else (now - written).total_seconds()
    features = first.features if first is not None else None
    return ReaderInfo(
        reader_id=reader_id,
        keys=tuple(info.key for _, info, _, _ in members),
        written=written,
        age_seconds=age,
        live=first is not None and age is not None and age < RECORD_REFRESH_SECONDS,
        overwrite=sum(len(record.overwrite) for record in valid),
        reads_old_bits=reads,
        baseline_names=(
            len(first.baseline_names or first.baseline_except or ()) if first is not None else 0
        ),
        reads_changed=first is not None and not first.reads_baseline and first.reads_changed,
        features=features,
        lacks=tuple(sorted(WRITER_FEATURES - set(features or WRITER_FEATURES))),
        problem=problem,
    )


def readers(store: Store | str, *, now: datetime | None = None) -> ReadersReport:
    """The reader records of ``store``, one :class:`ReaderInfo` per reader, sorted by id.

    One listing of ``readers/`` and one small get per record. ``now``: the time ages are
    measured against (default: this machine's clock). Raises :class:`CapabilityError`
    where the store cannot list.
    """
    store = open_store(store)
    if not store.capabilities.listing:
        raise CapabilityError(f"store {store.url} cannot list objects, which listing readers needs")
    now = now or utc_now()
    found = {}
    for info in object_infos(store, READERS_PREFIX):
        record_id, record, problem = honoured_record(store, info.key)
        found[record_id] = (record_id, info, record, problem)
    ids = set(found)
    groups: dict[str, list[tuple[str, ObjectInfo, ReaderRecord | None, str | None]]] = {}
    for record_id in sorted(found):
        groups.setdefault(_owner(record_id, ids) or record_id, []).append(found[record_id])
    for members in groups.values():  # the record first, then its parts in order
        members.sort(key=lambda m: _part_number(m[0]))
    rows = [_info(reader_id, members, now) for reader_id, members in sorted(groups.items())]
    return ReadersReport(store=store.url, now=now, readers=rows)


def _part_number(record_id: str) -> int:
    match = PART_ID.match(record_id)
    return 0 if match is None else int(match.group(2))


def remove_readers(
    store: Store | str,
    ids: Iterable[str] = (),
    *,
    older_than: timedelta | None = None,
    now: datetime | None = None,
    dry_run: bool = False,
) -> RemovedReaders:
    """Delete the records (with their parts) of the readers ``ids`` and of every reader
    whose record was not written for longer than ``older_than`` (a record without a known
    time is kept).

    Raises :class:`ArgumentError` for an id :func:`readers` does not list, a negative age or
    neither ids nor an age, and :class:`CapabilityError` where the store cannot list and
    delete. A reader still running writes its record again within the hour.
    """
    wanted = list(dict.fromkeys(ids))
    if not wanted and older_than is None:
        raise ArgumentError("name the readers to remove (their ids) or an age (older_than)")
    if older_than is not None and older_than < timedelta(0):
        raise ArgumentError(f"older_than must be 0 or more, not {older_than}; pass e.g. 7 days")
    store = open_store(store)
    capabilities = store.capabilities
    if not (capabilities.listing and (dry_run or (capabilities.delete and capabilities.writable))):
        raise CapabilityError(
            f"store {store.url} cannot list and delete objects, which removing reader records "
            "needs; delete the keys dcr readers lists with the store's own tools"
        )
    listed = {row.reader_id: row for row in readers(store, now=now).readers}
    unknown = [i for i in wanted if i not in listed]
    if unknown:
        raise ArgumentError(
            f"no reader {unknown[0]!r} in {store.url}; `dcr readers --store URL` lists the "
            "reader ids there"
        )
    chosen = dict.fromkeys(wanted)
    if older_than is not None:
        limit = older_than.total_seconds()
        old = (r.reader_id for r in listed.values() if (r.age_seconds or 0) > limit)
        chosen.update(dict.fromkeys(old))
    removed = [listed[i] for i in sorted(chosen)]
    keys = [key for row in removed for key in row.keys]
    if keys and not dry_run:
        store.delete_many(keys)
    return RemovedReaders(
        dry_run=dry_run,
        removed=removed,
        deleted_keys=len(keys),
        live=[row.reader_id for row in removed if row.live],
    )
