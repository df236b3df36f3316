"""The commit's side of a sync: the reader records and what a reader keeps once its target
holds the goal.

A reader tells writers, in ``readers/<reader_id>.json`` (FORMAT.md §3.6), the tensors its
target takes only as ``overwrite``, which tensors' old bits it reads and the features it
implements. After the target's transaction commits the goal (its resident version), the
reader keeps the goal's state table, the lanes it verified and the exponent rows of the bits
it left.
"""

from __future__ import annotations

import logging
import re

from dcr_format.chain.chain import sha256_hex, timestamp, utc_now
from dcr_format.errors import StoreError
from dcr_format.format.schema import (
    KNOWN_FEATURES,
    MAX_BASELINE_NAMES,
    MAX_READER_JSON_BYTES,
    ReaderRecord,
)
from dcr_format.sync._audit import Auditing
from dcr_format.sync._state import ApplyState

READER_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_log = logging.getLogger(__name__)


_RECORD_FIXED_BYTES = 2048  # a reader record's JSON besides its lists of names, at most


def _name_bytes(name: str) -> int:
    """Bytes ``name`` takes in a record's JSON list: quoted, escaped, and a comma."""
    return len(name.encode()) + 3 + name.count('"') + name.count("\\")


def _listed(names: frozenset[str] | None, overwrite: frozenset[str]) -> tuple[str, ...]:
    """A target's :meth:`Target.baseline_names` as a record lists them: sorted, at most
    :data:`MAX_BASELINE_NAMES`, and no more than fit the record (with its ``overwrite``
    names) in :data:`MAX_READER_JSON_BYTES`, which writers read (the first in order where a
    target gives more): a record past it writers ignore, and would code every tensor
    against the old bits."""
    listed = sorted(names or ())
    room = MAX_READER_JSON_BYTES - _RECORD_FIXED_BYTES
    kept = listed[:MAX_BASELINE_NAMES]
    every = [*overwrite, *kept]
    if 4 * sum(map(len, every)) + 3 * len(every) > room:  # may not fit: count its bytes
        room -= sum(map(_name_bytes, overwrite))
        for count, name in enumerate(kept):
            room -= _name_bytes(name)
            if room < 0:
                kept = kept[:count]
                break
    if len(kept) < len(listed):
        _log.warning(
            "the target reads the old bits of %d tensors; the reader record lists the first "
            "%d (writers code the others without them)",
            len(listed),
            len(kept),
        )
    return tuple(kept)


def _ranked(reader_id: str | None, rank: int) -> str | None:
    """The record id of rank ``rank`` of a reader group named ``reader_id``: rank 0 the id
    itself, any other its own (``<id>.rank<r>``), since ranks that hold different parts of
    the model read the old bits of different tensors and one record would keep only the
    last rank's list."""
    if reader_id is None or rank == 0:
        return reader_id
    suffix = f".rank{rank}"
    return reader_id[: 128 - len(suffix)] + suffix


class Committing(Auditing):
    """The reader records, and what a commit leaves the reader."""

    def _record_overwrites(self) -> None:
        """Tell writers which tensors the target needs as ``overwrite`` (``readers/<id>.json``).

        Written when the set changes (an explicit ``reader_id`` also records an empty
        set once, so a stale list is cleared); without a ``reader_id`` the record is named
        after its content, so readers that need the same names share one record. A target
        that cannot read its old bits (:meth:`Target.reads_baseline`) always has a record
        (``reads_baseline`` false, with the names whose old bits it does read,
        :meth:`Target.baseline_names`: writers code the others without the old bits).
        """
        names = self.target.overwrite_names()
        reads_baseline = self.target.reads_baseline()
        if self.reader_id is None and not names and reads_baseline:
            return
        readable = None if reads_baseline else _listed(self.target.baseline_names(), names)
        content = "\n".join(sorted(names))
        if readable is not None:
            content += "\n(no baseline)" + "".join(f"\n+{n}" for n in readable)
        reader_id = _ranked(self.reader_id, self.group.rank) or (
            "auto-" + sha256_hex(content.encode())[:16]
        )
        if self._recorded == (reader_id, names, readable):
            return
        record = ReaderRecord(
            reader_id=reader_id,
            updated=timestamp(utc_now()),
            overwrite=tuple(sorted(names)),
            reads_baseline=reads_baseline,
            features=tuple(sorted(KNOWN_FEATURES)),
            baseline_names=readable or None,
        )
        try:
            self.store.put(f"readers/{reader_id}.json", record.to_json())
        except StoreError as exc:  # a read-only reader: writers then cannot be told
            _log.warning("could not write reader record readers/%s.json: %s", reader_id, exc)
            return
        self._recorded = (reader_id, names, readable)

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
