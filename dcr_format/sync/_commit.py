"""The commit's side of a sync: the reader records and what a reader keeps once its target
holds the goal.

A reader tells writers, in ``readers/<reader_id>.json`` (FORMAT.md §3.6), the tensors its
target takes only as ``overwrite``, which tensors' old bits it reads and the features it
implements. After the target's transaction commits the goal (its resident version), the
reader keeps the goal's state table, the lanes it verified and the exponent rows of the bits
it left.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator
from time import monotonic

from dcr_format.chain.chain import sha256_hex, timestamp, utc_now
from dcr_format.chain.readers import (
    PART_ID,
    READER_ID,
    READERS_PREFIX,
    RECORD_REFRESH_SECONDS,
    load_reader_record,
    part_id,
    reader_key,
)
from dcr_format.errors import (
    ArgumentError,
    BaselineCodingError,
    CapabilityError,
    DcrError,
    FormatError,
    OverwriteRequiredError,
    StoreError,
)
from dcr_format.format.schema import (
    KNOWN_FEATURES,
    MAX_BASELINE_NAMES,
    MAX_READER_JSON_BYTES,
    ReaderRecord,
)
from dcr_format.sync._audit import Auditing
from dcr_format.sync._state import ApplyState
from dcr_format.targets.protocol import Target

_log = logging.getLogger(__name__)


_RECORD_FIXED_BYTES = 2048  # a reader record's JSON besides its lists of names, at most
_ROOM = MAX_READER_JSON_BYTES - _RECORD_FIXED_BYTES  # bytes of names one record holds


def check_reader_id(reader_id: str) -> None:
    """Raise :class:`ArgumentError` unless ``reader_id`` can name a reader's records: it
    matches :data:`READER_ID` and does not end in ``.part<k>``, the name of part ``k`` of
    another reader's record."""
    if not READER_ID.match(reader_id):
        raise ArgumentError(f"reader_id {reader_id!r} must match {READER_ID.pattern}")
    if PART_ID.match(reader_id):
        raise ArgumentError(
            f"reader_id {reader_id!r} ends in .part<k>, which names the parts of another "
            "reader's record; choose an id without that ending"
        )


def _name_bytes(name: str) -> int:
    """Bytes ``name`` takes in a record's JSON list: quoted, escaped, and a comma."""
    return len(name.encode()) + 3 + name.count('"') + name.count("\\")


def _fit(names: list[str], overwrite: frozenset[str]) -> int:
    """How many of ``names`` (at most :data:`MAX_BASELINE_NAMES`) fit every part of a record
    within :data:`MAX_READER_JSON_BYTES`, which writers read, beside ``overwrite`` names that
    keep at least half of it (:func:`_parts`)."""
    room = _ROOM
    kept = min(len(names), MAX_BASELINE_NAMES)
    every = [*overwrite, *names[:kept]]
    if 4 * sum(map(len, every)) + 3 * len(every) > room:  # may not fit: count its bytes
        room -= min(sum(map(_name_bytes, overwrite)), room // 2)
        for count, name in enumerate(names[:kept]):
            room -= _name_bytes(name)
            if room < 0:
                return count
    return kept


def _listed(names: frozenset[str] | None, overwrite: frozenset[str]) -> tuple[str, ...]:
    """A target's :meth:`Target.baseline_names` as a record lists them: sorted, and no more
    than :func:`_fit` (the first in order where a target gives more): a record past its
    size limit writers ignore, and would code every tensor against the old bits."""
    listed = sorted(names or ())
    kept = listed[: _fit(listed, overwrite)]
    if len(kept) < len(listed):
        _log.warning(
            "the target reads the old bits of %d tensors; the reader record lists the first "
            "%d (writers code the others without them)",
            len(listed),
            len(kept),
        )
    return tuple(kept)


def _baseline(
    target: Target, names: Collection[str] | None, overwrite: frozenset[str]
) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
    """What the record of a reader whose target does not read the old bits of every tensor
    says of them: ``(baseline_names, None)``, or ``(None, baseline_except)`` where the
    target tells (:meth:`Target.baseline_except`) which of the version's ``names`` it does
    not read, that list fits a record whole, and it leaves writers more tensors to code
    against the old bits than the list of names does (an engine holding tens of thousands
    of experts whole). Only a list at :data:`MAX_BASELINE_NAMES` can leave out names the
    target reads, so only then is the target asked (a pass over its names each prepare)."""
    given = target.baseline_names()
    excluded = None
    if names is not None and len(given or ()) >= MAX_BASELINE_NAMES:
        excluded = target.baseline_except(names)
    if excluded is not None:
        unread = sorted(excluded)
        readable = len(names or ()) - len(unread)
        if readable > len(given or ()) and _fit(unread, overwrite) == len(unread):
            return None, tuple(unread)
    return _listed(given, overwrite), None


def _parts(overwrite: frozenset[str], listed: tuple[str, ...] | None) -> list[tuple[str, ...]]:
    """The ``overwrite`` names, sorted, in the parts of a record: as many in each as fit
    beside ``listed`` (its ``baseline_names`` or ``baseline_except``, which every part
    lists) within :data:`MAX_READER_JSON_BYTES`; one part (possibly empty) where they all
    fit."""
    room = _ROOM - sum(map(_name_bytes, listed or ()))
    parts: list[tuple[str, ...]] = []
    part: list[str] = []
    left = room
    for name in sorted(overwrite):
        size = _name_bytes(name)
        if part and size > left:
            parts.append(tuple(part))
            part, left = [], room
        part.append(name)
        left -= size
    parts.append(tuple(part))
    return parts


def _ranked(reader_id: str | None, rank: int) -> str | None:
    """The record id of rank ``rank`` of a reader group named ``reader_id``: rank 0 the id
    itself, any other its own (``<id>.rank<r>``), since ranks that hold different parts of
    the model read the old bits of different tensors and one record would keep only the
    last rank's list."""
    if reader_id is None or rank == 0:
        return reader_id
    suffix = f".rank{rank}"
    return reader_id[: 128 - len(suffix)] + suffix


def _record(
    record_id: str, updated: str, overwrite: tuple[str, ...], baseline: _Asked
) -> ReaderRecord:
    """One record (or part) a reader writes: it lists every feature this reader implements."""
    reads_baseline, readable, unread, changed = baseline
    return ReaderRecord(
        reader_id=record_id,
        updated=updated,
        overwrite=overwrite,
        reads_baseline=reads_baseline,
        features=tuple(sorted(KNOWN_FEATURES)),
        baseline_names=readable or None,
        baseline_except=unread,
        reads_changed=changed,
    )


_Asked = tuple[bool, tuple[str, ...] | None, tuple[str, ...] | None, bool]
"""What a record says of the old bits its reader reads: ``reads_baseline``, and without it
``baseline_names`` or ``baseline_except``, and ``reads_changed``."""


class Committing(Auditing):
    """The reader records, and what a commit leaves the reader."""

    def _record_overwrites(self, names: Collection[str] | None = None) -> None:
        """Tell writers which tensors the target needs as ``overwrite`` (``readers/<id>.json``).

        Written when the set changes (an explicit ``reader_id`` also records an empty
        set once, so a stale list is cleared), and again, unchanged but for ``updated``, at
        the first call :data:`RECORD_REFRESH_SECONDS` after this reader last wrote it;
        without a ``reader_id`` the record is named after its content, so readers that need
        the same names share one record. A target that cannot read its old bits
        (:meth:`Target.reads_baseline`) always has a record (``reads_baseline`` false, with
        the names whose old bits it does read, :meth:`Target.baseline_names`, or every name
        but those of :meth:`Target.baseline_except` where that lets writers code more of
        ``names``, the canonical names of the version staged (default: the last given)
        against the old bits: writers code the others without them). Names past what one
        record holds go on in parts, ``<id>.part<k>.json``, each a whole record (writers
        take the union of every record's ``overwrite``); parts an earlier, longer set left
        are deleted.
        """
        if names is not None:
            self._version_names = names
        overwrite = self.target.overwrite_names()
        reads_baseline = self.target.reads_baseline()
        if self.reader_id is None and not overwrite and reads_baseline:
            return
        asked: _Asked = (True, None, None, False)
        content = "\n".join(sorted(overwrite))
        if not reads_baseline:
            readable, unread = _baseline(self.target, self._version_names, overwrite)
            changed = self.target.reads_changed()
            asked = (False, readable, unread, changed)
            if changed:
                content += "\n(changed)"
            if unread is None:
                content += "\n(no baseline)" + "".join(f"\n+{n}" for n in readable or ())
            else:
                content += "\n(baseline but)" + "".join(f"\n-{n}" for n in unread)
        reader_id = _ranked(self.reader_id, self.group.rank) or (
            "auto-" + sha256_hex(content.encode())[:16]
        )
        now, last = monotonic(), self._recorded
        same = last is not None and last[:3] == (reader_id, overwrite, asked)
        if last is not None and same and now - last[3] < RECORD_REFRESH_SECONDS:
            return
        parts = _parts(overwrite, asked[1] if asked[2] is None else asked[2])
        updated = timestamp(utc_now())
        ids = [reader_id, *(part_id(reader_id, k) for k in range(1, len(parts)))]
        try:
            for record_id, part in zip(ids, parts, strict=True):
                record = _record(record_id, updated, part, asked)
                self.store.put(reader_key(record_id), record.to_json())
        except StoreError as exc:  # a read-only reader: writers then cannot be told
            _log.warning("could not write reader record %s: %s", reader_key(record_id), exc)
            return
        if not same:  # a refresh writes the same parts: none to drop
            self._drop_parts(reader_id, len(parts), asked)
        self._recorded = (reader_id, overwrite, asked, now)

    @contextlib.contextmanager
    def _explaining(self) -> Iterator[None]:
        """Within the block, a change this target cannot take as it was sent
        (:class:`OverwriteRequiredError`, :class:`BaselineCodingError`) is raised as it is,
        after this reader wrote its record again (an operator may have removed it while the
        reader ran: writers then follow it again from their next version). Where the record
        in which this reader asked for it holds another reader's request, it is raised saying
        so and the record is left as it is: readers that share a ``reader_id`` but need
        different things (engines of another configuration) replace each other's record,
        writers follow the last one written, and the others fail every version."""
        try:
            yield
        except (OverwriteRequiredError, BaselineCodingError) as exc:
            key = self._replaced_record()
            if key is None:
                self._record_again()
                raise
            what = str(exc).split("; ", 1)[0]
            raise type(exc)(
                f"{what}; {key}, in which this reader asks writers for what it can take, "
                "now holds the request of another reader with the same reader_id and other "
                "needs (an engine of another configuration): give each its own reader_id"
            ) from exc

    def _record_again(self) -> None:
        """Forget the record last written and write it now (best effort: a failure to is
        logged, and the next sync writes it)."""
        self._recorded = None
        try:
            self._record_overwrites()
        except DcrError as exc:  # the sync's own error is the one to raise
            _log.warning("could not write this reader's record again: %s", exc)

    def _replaced_record(self) -> str | None:
        """The key of this reader's record where the store holds another request there
        than the one this reader last wrote (None: the same, none written, or unreadable)."""
        if self._recorded is None:
            return None
        reader_id, overwrite, asked, _ = self._recorded
        key = reader_key(reader_id)
        try:
            record = load_reader_record(self.store, key)
        except (StoreError, FormatError):
            return None
        reads_baseline, readable, unread, changed = asked
        listed = readable if unread is None else unread
        mine = (_parts(overwrite, listed)[0], reads_baseline, readable or None, unread, changed)
        found = (
            record.overwrite,
            record.reads_baseline,
            record.baseline_names or None,
            record.baseline_except,
            record.reads_changed,
        )
        return None if found == mine else key

    def _drop_parts(self, reader_id: str, count: int, asked: _Asked) -> None:
        """Delete the parts ``count`` and on of record ``reader_id`` (written for a longer
        set), so that they no longer ask for names; one that cannot be deleted is
        rewritten asking for none."""
        try:
            keys = self.store.list(READERS_PREFIX)
        except StoreError as exc:
            _log.warning("could not list readers/ for leftover parts of %s: %s", reader_id, exc)
            return
        for key in keys:
            part = PART_ID.match(key.removeprefix(READERS_PREFIX).removesuffix(".json"))
            if part is None or int(part.group(2)) < count:
                continue
            if key != reader_key(part_id(reader_id, int(part.group(2)))):
                continue  # another record's part
            try:
                self.store.delete(key)
            except (StoreError, CapabilityError):
                empty = _record(part.group(0), timestamp(utc_now()), (), asked)
                try:
                    self.store.put(key, empty.to_json())
                except StoreError as exc:
                    _log.warning("could not delete or clear leftover %s: %s", key, exc)

    def _committed(self, sync: ApplyState, found: dict[str, tuple[int, ...]]) -> None:
        """After the target committed the goal: keep the goal's state table, the lanes the
        next sync may trust (``found``: those the apply verified) and the exponent rows of
        the bits the changes left; then release the target."""
        try:
            self._last_table = (sync.goal.plan.loaded.sha256, sync.goal.table)
            self._remember(sync, found)
            for name in sync.touched:  # rows of bits that changed otherwise are stale: dropped
                if name in sync.rows:
                    self._rows[name] = sync.rows[name]
                else:
                    self._rows.pop(name, None)
        finally:
            sync.release()
