"""``dcr doctor``: probe what a store can do and say which ways of using it are safe."""

from __future__ import annotations

import hashlib
import os
import uuid
from urllib.parse import urlsplit
from urllib.request import url2pathname

from dcr_format.chain.chain import Chain
from dcr_format.errors import DcrError, StoreNotInitializedError
from dcr_format.store.store import Store, open_store
from dcr_format.tools._common import Row, object_infos

PROBE_PREFIX = "doctor/"
S3_LARGE_BYTES = (128 << 20) + 1  # past the S3 backend's multipart threshold
LOCAL_LARGE_BYTES = 8 << 20


class Check(Row):
    """One probe of the store."""

    name: str
    ok: bool | None
    """None: not tested."""
    detail: str


class Verdict(Row):
    """Whether one way of using the store is safe, and why."""

    use: str
    safe: bool | None
    """None: not known (the checks it needs could not run)."""
    reason: str


class DoctorReport(Row):
    """Result of :func:`doctor`: ``ok`` is False when a basic operation failed."""

    store: str
    chain_id: str | None
    ok: bool
    checks: list[Check]
    verdicts: list[Verdict]


def _refuse_missing_directory(store: Store) -> None:
    """A local store whose directory does not exist is a mistyped path: probing it would
    create the directory and call an empty place safe."""
    if store.kind != "local":
        return
    root = url2pathname(urlsplit(store.url).path)  # the directory of a file:// store
    if not os.path.isdir(root):
        raise StoreNotInitializedError(
            f"store directory {root} does not exist; check the path, or create the directory "
            "to probe a new store there"
        )


def doctor(
    store: Store | str | os.PathLike[str], *, large_bytes: int | None = None
) -> DoctorReport:
    """Probe the store with temporary objects under ``doctor/`` (deleted afterwards).

    Checks create-if-absent (the store's conditional-write probe), read-after-write,
    listing right after a write and after a delete, overwrite, delete, object ages
    in listings (gc's grace period), and one large put (``large_bytes``; default
    128 MiB + 1 on S3, past the multipart threshold, else 8 MiB; 0 skips it).
    """
    store = open_store(store)
    _refuse_missing_directory(store)
    checks: dict[str, Check] = {}

    def record(name: str, ok: bool | None, detail: str) -> None:
        checks[name] = Check(name=name, ok=ok, detail=detail)

    chain_id = None
    try:
        chain = Chain(store)
        if chain.exists():
            header = chain.header
            chain_id = header.chain_id
            recorded = header.conditional_writes
            note = "" if recorded is None else f"; recorded at creation: {recorded}"
            record("chain", True, f"holds chain {chain_id}{note}")
        else:
            record("chain", None, "no chain yet (no dcr.json)")
    except DcrError as exc:
        record("chain", False, f"{type(exc).__name__}: {exc}")
    try:
        atomic = store.probe_conditional_writes()
        capabilities = store.capabilities
        record(
            "atomic-create",
            atomic,
            "create-if-absent refuses an existing object"
            if atomic
            else "create-if-absent is not atomic (a second create overwrote, or is unsupported)",
        )
    except DcrError as exc:
        capabilities = None
        record("atomic-create", False, f"{type(exc).__name__}: {exc}")
    if capabilities is not None and not capabilities.writable:
        return _read_only(store, chain_id, checks, capabilities.read_only)
    base = f"{PROBE_PREFIX}{uuid.uuid4().hex}/"
    probe = base + "probe"
    written: list[str] = []
    try:
        _basic_checks(store, probe, base, written, record)
        size = large_bytes
        if size is None:
            size = S3_LARGE_BYTES if store.kind == "s3" else LOCAL_LARGE_BYTES
        if size > 0:
            big = base + "large"
            data = os.urandom(1 << 20) * (size >> 20) + os.urandom(size & ((1 << 20) - 1))
            try:
                written.append(big)
                store.put(big, data)
                same = hashlib.sha256(store.get(big)).digest() == hashlib.sha256(data).digest()
                record("large-put", same, f"{size} bytes " + ("round-trip" if same else "differ"))
            except DcrError as exc:
                record("large-put", False, f"{size} bytes: {type(exc).__name__}: {exc}")
        else:
            record("large-put", None, "skipped")
    finally:
        try:
            store.delete_many(written)
        except DcrError:
            pass
    verdicts = _verdicts(checks, capabilities is not None and capabilities.atomic_create)
    ok = all(c.ok is not False for n, c in checks.items() if n not in ("atomic-create",))
    return DoctorReport(
        store=store.url,
        chain_id=chain_id,
        ok=ok,
        checks=list(checks.values()),
        verdicts=verdicts,
    )


def _read_only(
    store: Store, chain_id: str | None, checks: dict[str, Check], why: str
) -> DoctorReport:
    """The report on a store these credentials may only read: what reads show, and no
    verdict on what needs a write to probe."""
    untested = f"not tested: {why}"
    checks["atomic-create"] = Check(name="atomic-create", ok=None, detail=untested)
    try:
        store.list("commits/")
        checks["list"] = Check(name="list", ok=True, detail="listing works")
    except DcrError as exc:
        checks["list"] = Check(name="list", ok=False, detail=f"{type(exc).__name__}: {exc}")
    checks["put"] = Check(name="put", ok=None, detail=untested)
    unknown = "the checks write, and these credentials may not; run dcr doctor with a writer's"
    verdicts = [
        Verdict(use=use, safe=None, reason=unknown)
        for use in ("readers", "single writer", "multiple writers", "gc")
    ]
    ok = all(c.ok is not False for c in checks.values())
    return DoctorReport(
        store=store.url, chain_id=chain_id, ok=ok, checks=list(checks.values()), verdicts=verdicts
    )


def _basic_checks(store: Store, probe: str, base: str, written: list[str], record) -> None:  # type: ignore[no-untyped-def]
    first, second = b"dcr doctor 1", b"dcr doctor 2"
    try:
        written.append(probe)
        store.put(probe, first)
        record("put", True, "plain put works")
    except DcrError as exc:
        record("put", False, f"{type(exc).__name__}: {exc}")
        return
    try:
        same = store.get(probe) == first
        record("read-after-write", same, "a new object reads back at once" if same else "stale")
    except DcrError as exc:
        record("read-after-write", False, f"{type(exc).__name__}: {exc}")
    try:
        listed = probe in store.list(base)
        record(
            "list-after-write",
            listed,
            "a new object is listed at once" if listed else "a new object is not listed at once",
        )
    except DcrError as exc:
        record("list-after-write", False, f"{type(exc).__name__}: {exc}")
    try:
        infos = object_infos(store, base)
        timed = bool(infos) and all(i.modified is not None for i in infos)
        record(
            "object-ages",
            timed,
            "listings report modification times"
            if timed
            else "listings report no modification times: gc keeps every uncommitted attempt",
        )
    except DcrError as exc:
        record("object-ages", False, f"{type(exc).__name__}: {exc}")
    try:
        store.put(probe, second)
        same = store.get(probe) == second
        record("overwrite", same, "put replaces an object" if same else "old content read back")
    except DcrError as exc:
        record("overwrite", False, f"{type(exc).__name__}: {exc}")
    try:
        store.delete(probe)
        gone = not store.exists(probe) and probe not in store.list(base)
        record(
            "delete",
            gone,
            "a deleted object is gone from reads and listings at once"
            if gone
            else "a deleted object is still visible",
        )
    except DcrError as exc:
        record("delete", False, f"{type(exc).__name__}: {exc}")


def _verdicts(checks: dict[str, Check], atomic: bool) -> list[Verdict]:
    def passed(*names: str) -> bool:
        return all(checks.get(n) is not None and checks[n].ok is not False for n in names)

    basics = passed("put", "read-after-write", "list-after-write")
    ages = checks.get("object-ages")
    gc_safe = passed("delete", "list-after-write") and ages is not None and ages.ok is True
    return [
        Verdict(
            use="readers",
            safe=passed("read-after-write", "list-after-write"),
            reason="new commits are readable and listed at once"
            if passed("read-after-write", "list-after-write")
            else "a reader could miss or misread new objects",
        ),
        Verdict(
            use="single writer",
            safe=basics and passed("large-put"),
            reason="puts, reads and listings behave"
            if basics and passed("large-put")
            else "a basic operation failed (see the checks)",
        ),
        Verdict(
            use="multiple writers",
            safe=basics and atomic,
            reason="create-if-absent is atomic: racing writers get CommitConflictError"
            if basics and atomic
            else "create-if-absent is not atomic: two writers could both commit one version; "
            "use one writer with single_writer=True",
        ),
        Verdict(
            use="gc",
            safe=gc_safe,
            reason="deletes show in listings and objects have ages"
            if gc_safe
            else "gc needs deletes that show in listings, and object ages",
        ),
    ]
