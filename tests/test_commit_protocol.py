"""The commit protocol on its own (dcr_format/publish/_commit.py), over the memory store:
create-if-absent with unknown outcomes, gathering the ranks' manifests, waiting for the
committer, abort markers and reader records."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dcr_format import DeltaWriter, Store
from dcr_format.chain.chain import HEAD_KEY, Chain, commit_key, manifest_key, new_id, sha256_hex
from dcr_format.errors import (
    CapabilityError,
    CommitConflictError,
    CommitStateUnknownError,
    IncompleteVersionError,
    SchemaError,
    StoreError,
)
from dcr_format.format.schema import Manifest, ReaderRecord, parse_manifest
from dcr_format.publish import _commit
from dcr_format.publish._part import Attempt
from dcr_format.store.store import Capabilities


@pytest.fixture
def store() -> Store:
    return Store(f"memory://commit-{uuid.uuid4().hex}")


def _lose_answers(store: Store, monkeypatch: pytest.MonkeyPatch, *, land: bool, times: int) -> None:
    """``put_if_absent`` fails ``times`` times with a StoreError, having landed (or not)."""
    real = store.put_if_absent
    failures = iter(range(times))

    def flaky(key: str, data: bytes) -> None:
        if next(failures, None) is None:
            return real(key, data)
        if land:
            real(key, data)
        raise StoreError("connection reset")

    monkeypatch.setattr(store, "put_if_absent", flaky)


# --- create-if-absent -------------------------------------------------------------------------


def test_create_if_absent_creates_once_and_tells_its_bytes_from_another_writers(store):
    assert _commit.create_if_absent(store, "bases/x.json", b"ours", retry="retry")
    assert store.get("bases/x.json") == b"ours"
    assert _commit.create_if_absent(store, "bases/x.json", b"ours", retry="retry")  # re-run
    assert not _commit.create_if_absent(store, "bases/x.json", b"theirs", retry="retry")
    assert store.get("bases/x.json") == b"ours"


def test_a_create_whose_answer_was_lost_is_found_by_reading_back(store, monkeypatch):
    _lose_answers(store, monkeypatch, land=True, times=1)
    assert _commit.create_if_absent(store, "k.json", b"ours", retry="retry")
    assert store.get("k.json") == b"ours"


def test_a_create_that_failed_and_did_not_land_is_retried(store, monkeypatch):
    _lose_answers(store, monkeypatch, land=False, times=1)
    assert _commit.create_if_absent(store, "k.json", b"ours", retry="retry")
    assert store.get("k.json") == b"ours"


def test_an_outcome_that_cannot_be_told_is_commit_state_unknown(store, monkeypatch):
    _lose_answers(store, monkeypatch, land=False, times=2)
    with pytest.raises(CommitStateUnknownError, match="cannot tell whether it landed; do X"):
        _commit.create_if_absent(store, "k.json", b"ours", retry="do X")

    def unreadable(key: str, **kwargs: Any) -> bytes:
        raise StoreError("timed out")

    _lose_answers(store, monkeypatch, land=False, times=2)
    monkeypatch.setattr(store, "get", unreadable)
    with pytest.raises(CommitStateUnknownError, match=r"could not create or re-read k.json"):
        _commit.create_if_absent(store, "k.json", b"ours", retry="do X")


def test_create_commit_points_head_at_it_and_refuses_a_version_taken(store):
    _commit.create_commit(store, 3, b"record")
    assert store.get(commit_key(3)) == b"record"
    assert store.get(HEAD_KEY) == b"3"
    with pytest.raises(CommitConflictError, match="committed by another writer"):
        _commit.create_commit(store, 3, b"another record")


def test_require_atomic_create_refuses_a_store_that_could_let_two_writers_win():
    def fake(atomic: bool, single_writer: bool, writable: bool = True) -> Any:
        capabilities = Capabilities(
            atomic_create=atomic,
            listing=True,
            delete=True,
            writable=writable,
            read_only="its credentials may not write there",
        )
        return SimpleNamespace(
            url="s3://bucket/run", capabilities=capabilities, single_writer=single_writer
        )

    with pytest.raises(CapabilityError, match="say why"):
        _commit.require_atomic_create(fake(False, False), "say why")
    assert _commit.require_atomic_create(fake(False, True), "-").atomic_create is False
    assert _commit.require_atomic_create(fake(True, False), "-").atomic_create is True
    # a store these credentials may only read: said so, whatever single_writer promises
    for single_writer in (False, True):
        with pytest.raises(StoreError, match="s3://bucket/run: its credentials may not write"):
            _commit.require_atomic_create(fake(False, single_writer, writable=False), "-")


# --- the committer gathers the manifests ------------------------------------------------------


def _manifest(chain_id: str, attempt: str, rank: int, world: int) -> bytes:
    return Manifest(
        chain_id=chain_id,
        version=4,
        kind="delta",
        attempt=attempt,
        rank=rank,
        world_size=world,
        shards=(),
        entries=(),
    ).to_json()


def _gather(
    store: Store,
    chain_id: str,
    attempt: str,
    own: bytes,
    *,
    world_size: int = 2,
    timeout: float = 5.0,
    check: _commit.ManifestCheck = lambda manifest, rank, key: None,
    own_manifest: Manifest | None = None,
) -> Any:
    shares = Attempt(store, chain_id, 4, "delta", attempt, 0, world_size, 1 << 20, 3, frozenset())
    return _commit.gather_manifests(
        shares, own=own, timeout=timeout, check=check, own_manifest=own_manifest
    )


def test_the_committer_gathers_every_rank_in_order_and_names_their_bytes(store):
    chain_id, attempt = new_id(), new_id()
    data = [_manifest(chain_id, attempt, r, 2) for r in range(2)]
    for rank in (1, 0):
        store.put(manifest_key(4, attempt, rank), data[rank])
    checked: list[tuple[int, str]] = []
    found = _gather(
        store, chain_id, attempt, data[0], check=lambda m, rank, key: checked.append((rank, key))
    )
    assert [m.rank for m, _ in found] == [0, 1]
    assert [ref.sha256 for _, ref in found] == [sha256_hex(d) for d in data]
    assert [ref.size for _, ref in found] == [len(d) for d in data]
    assert checked == [(r, manifest_key(4, attempt, r)) for r in range(2)]


def test_the_committer_takes_its_own_manifest_as_made_and_parses_the_others(store):
    """Our manifest, once read back as uploaded, is the object it was made from (no parse
    of our own bytes); it is still checked, and another rank's is parsed from its bytes."""
    chain_id, attempt = new_id(), new_id()
    data = [_manifest(chain_id, attempt, r, 2) for r in range(2)]
    for rank in (0, 1):
        store.put(manifest_key(4, attempt, rank), data[rank])
    mine = parse_manifest(data[0], what="ours")
    checked: list[int] = []
    found = _gather(
        store,
        chain_id,
        attempt,
        data[0],
        check=lambda m, rank, key: checked.append(rank),
        own_manifest=mine,
    )
    assert found[0][0] is mine
    assert found[1][0] is not mine and found[1][0] == parse_manifest(data[1], what="theirs")
    assert [ref.sha256 for _, ref in found] == [sha256_hex(d) for d in data]
    assert checked == [0, 1]
    # a manifest of the wrong attempt is refused whether parsed or given
    wrong = parse_manifest(_manifest(chain_id, new_id(), 0, 1), what="wrong")
    store.put(manifest_key(4, attempt, 0), wrong.to_json())
    with pytest.raises(SchemaError, match="does not belong to this version"):
        _gather(store, chain_id, attempt, wrong.to_json(), world_size=1, own_manifest=wrong)


def test_a_rank_that_abandoned_the_attempt_ends_the_wait_at_once(store):
    chain_id, attempt = new_id(), new_id()
    own = _manifest(chain_id, attempt, 0, 2)
    store.put(manifest_key(4, attempt, 0), own)
    _commit.abort(store, 4, attempt)
    assert store.exists(_commit.abort_key(4, attempt))
    started = time.monotonic()
    with pytest.raises(IncompleteVersionError, match="abandoned version 4 before its manifest"):
        _gather(store, chain_id, attempt, own, timeout=30.0)
    assert time.monotonic() - started < 5


def test_a_rank_that_never_delivers_times_out(store):
    chain_id, attempt = new_id(), new_id()
    own = _manifest(chain_id, attempt, 0, 2)
    store.put(manifest_key(4, attempt, 0), own)
    with pytest.raises(IncompleteVersionError, match=r"timed out .* all 2 manifests of version 4"):
        _gather(store, chain_id, attempt, own, timeout=0.1)


def test_our_manifest_read_back_altered_is_never_taken(store):
    """The record names the sha256 of what was read: bytes other than ours are read again."""
    chain_id, attempt = new_id(), new_id()
    own = _manifest(chain_id, attempt, 0, 1)
    store.put(manifest_key(4, attempt, 0), own.replace(b'"entries"', b' "entries"'))
    with pytest.raises(IncompleteVersionError, match="timed out"):
        _gather(store, chain_id, attempt, own, world_size=1, timeout=0.1)
    made = parse_manifest(own, what="ours")  # nor when the committer holds what it made
    with pytest.raises(IncompleteVersionError, match="timed out"):
        _gather(store, chain_id, attempt, own, world_size=1, timeout=0.1, own_manifest=made)


def test_a_manifest_of_another_attempt_or_refused_by_the_check_fails_the_gather(store):
    chain_id, attempt = new_id(), new_id()
    wrong = _manifest(chain_id, new_id(), 0, 1)  # says another attempt
    store.put(manifest_key(4, attempt, 0), wrong)
    with pytest.raises(SchemaError, match="does not belong to this version"):
        _gather(store, chain_id, attempt, wrong, world_size=1)
    own = _manifest(chain_id, attempt, 0, 1)
    store.put(manifest_key(4, attempt, 0), own)

    def refuse(manifest: Manifest, rank: int, key: str) -> None:
        raise IncompleteVersionError(f"{key} refused")

    with pytest.raises(IncompleteVersionError, match=r"manifest-00000.json refused"):
        _gather(store, chain_id, attempt, own, world_size=1, check=refuse)


# --- the other ranks wait for the committer ---------------------------------------------------


def test_the_other_ranks_wait_for_the_record_of_their_attempt(store):
    DeltaWriter(store, ids=new_id).publish({"w": torch.ones(4)})
    chain = Chain(store)
    record = chain.record(0)
    assert _commit.await_commit(chain, 0, record.record.attempt, timeout=1.0) == record
    with pytest.raises(CommitConflictError, match="committed by another writer"):
        _commit.await_commit(chain, 0, new_id(), timeout=1.0)
    attempt = new_id()
    with pytest.raises(IncompleteVersionError, match=r"timed out .* commit record of version 1"):
        _commit.await_commit(chain, 1, attempt, timeout=0.1)
    _commit.abort(store, 1, attempt)
    with pytest.raises(IncompleteVersionError, match="committer abandoned version 1"):
        _commit.await_commit(chain, 1, attempt, timeout=30.0)


def test_wait_for_returns_the_first_answer_and_backs_off():
    answers = iter([None, None, "done"])
    assert _commit.wait_for(lambda: next(answers), "x", timeout=5.0) == "done"
    with pytest.raises(IncompleteVersionError, match="waiting for the thing"):
        _commit.wait_for(lambda: None, "the thing", timeout=0.05)


def test_an_abort_that_cannot_be_written_is_not_an_error(store, monkeypatch):
    def broken(key: str, data: bytes) -> None:
        raise StoreError("down")

    monkeypatch.setattr(store, "put", broken)
    _commit.abort(store, 1, new_id())  # best effort: the committer times out instead


# --- reader records ---------------------------------------------------------------------------


def _reader(reader_id: str, *names: str, reads_baseline: bool = True) -> bytes:
    return ReaderRecord(
        reader_id=reader_id,
        updated="2026-01-01T00:00:00Z",
        overwrite=names,
        reads_baseline=reads_baseline,
    ).to_json()


def test_reader_records_are_requests_that_a_bad_record_never_breaks(store):
    assert _commit.read_reader_records(store) == _commit.ReaderWishes(frozenset(), None)
    store.put("readers/a.json", _reader("a", "x", "y"))
    store.put("readers/b.json", _reader("b", "z"))
    store.put("readers/c.json", _reader("not-c", "spoofed", reads_baseline=False))
    store.put("readers/d.json", b"{not json")
    store.put("readers/e.txt", _reader("e", "wrong-key", reads_baseline=False))
    store.put("readers/sub/f.json", _reader("f", "nested"))
    wishes = _commit.read_reader_records(store)
    assert wishes.overwrite == {"x", "y", "z"} and wishes.reads_baseline
    store.put("readers/g.json", _reader("g", reads_baseline=False))
    assert not _commit.read_reader_records(store).reads_baseline


def test_reader_records_that_cannot_be_listed_are_none(store, monkeypatch):
    def broken(prefix: str = "") -> list[str]:
        raise StoreError("down")

    monkeypatch.setattr(store, "list", broken)
    assert _commit.read_reader_records(store) == _commit.ReaderWishes()


def test_the_head_hint_is_the_committers_number_or_none(tmp_path) -> None:
    store = Store(tmp_path / "store")
    writer = DeltaWriter(store)
    chain = Chain(store)
    writer.publish({"w": torch.zeros(4)})
    writer.publish({"w": torch.ones(4)})
    assert chain.head_hint() == 1
    for junk in (b"", b"x1", b"-1", b" 1", "\u0661".encode(), b"1" * 21):
        store.put(HEAD_KEY, junk)
        assert chain.head_hint() is None, junk
    store.delete(HEAD_KEY)
    assert chain.head_hint() is None
    assert chain.versions() == [0, 1]  # a hint only: the listing is the truth
