"""Reader records' keys (FORMAT.md §3.6): ``readers/<id>.json``, the parts of a record
(``<id>.part<k>.json``), reading one within its size limit, and which ones writers honour.

Readers write them (:mod:`dcr_format.sync._commit`), writers read them
(:mod:`dcr_format.publish._commit`), ``dcr readers`` lists and removes them
(:mod:`dcr_format.tools._readers`).
"""

from __future__ import annotations

import re

from dcr_format.chain.chain import sha256_hex
from dcr_format.errors import FormatError, StoreError
from dcr_format.format.schema import MAX_READER_JSON_BYTES, ReaderRecord, parse
from dcr_format.store.store import Store

READERS_PREFIX = "readers/"
RECORD_REFRESH_SECONDS = 3600.0
"""A reader writes its record again (the same request, a new ``updated``) at its first sync
this long after it last wrote it, so that ``updated`` says a reader with these needs was
syncing within the hour: records of readers that are gone can be told apart and removed
(``dcr readers``)."""
READER_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
"""What a record id may be (a reader's, a rank's, a part's)."""
READER_KEY = re.compile(r"^readers/([A-Za-z0-9._-]{1,128})\.json$")
"""The key of a record; group 1 is its id."""
PART_ID = re.compile(r"^(.+)\.part([1-9][0-9]*)$")
"""``<record id>.part<k>``: part ``k`` of a record (group 1 the record's id unless it was
shortened, :func:`part_id`; group 2 ``k``)."""


def reader_key(record_id: str) -> str:
    """The key of the record (or part) ``record_id``."""
    return f"{READERS_PREFIX}{record_id}.json"


def part_id(record_id: str, k: int) -> str:
    """The id of part ``k`` (from 1) of the record ``record_id``: ``<record_id>.part<k>``;
    where that is past 128 characters, the end of ``record_id`` gives way to 16 hex
    digits of its sha256, so that parts of different records keep different ids."""
    suffix = f".part{k}"
    if len(record_id) + len(suffix) <= 128:
        return record_id + suffix
    digest = "-" + sha256_hex(record_id.encode())[:16]
    return record_id[: 128 - len(suffix) - len(digest)] + digest + suffix


def load_reader_record(store: Store, key: str) -> ReaderRecord:
    """The record at ``key``, read within :data:`MAX_READER_JSON_BYTES` and validated.

    Raises :class:`StoreError` (missing, unreadable) or :class:`FormatError` (too large,
    not a valid record); whether its ``reader_id`` names its key is the caller's check.
    """
    return parse(ReaderRecord, store.get(key, max_size=MAX_READER_JSON_BYTES), what=key)


def honoured_record(store: Store, key: str) -> tuple[str, ReaderRecord | None, str | None]:
    """The object at ``key`` under ``readers/`` as writers take it (FORMAT.md §3.6): (its
    record id, the record, None) where they honour it, else (its id or name, None, why they
    skip it: not a record's key, unreadable, over its size limit, not a valid record, or
    naming another reader than its key)."""
    match = READER_KEY.match(key)
    if match is None:
        return key.removeprefix(READERS_PREFIX), None, f"{key} is not a reader record's key"
    record_id = match.group(1)
    try:
        record = load_reader_record(store, key)
    except (StoreError, FormatError) as exc:
        return record_id, None, f"{type(exc).__name__}: {exc}"
    if record.reader_id != record_id:
        return record_id, None, f"{key} names reader {record.reader_id!r}, not its key"
    return record_id, record, None
