"""The readers of one host read each verified object from the store once between them,
through a shared directory (HostCache): a reader waits for the one already reading an
object, an entry that is not the recorded bytes is replaced, the directory stays within
its bound, and a directory that cannot be used or written leaves every read to the
store."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import assert_same_bits, snapshot

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget, Store
from dcr_format.errors import ArgumentError
from dcr_format.integrations.vllm import DcrInitInfo
from dcr_format.store import host_cache as module
from dcr_format.store.host_cache import HostCache
from dcr_format.testing.processes import in_threads


def _object(text: str) -> tuple[bytes, str]:
    data = text.encode() * 100
    return data, hashlib.sha256(data).hexdigest()


def test_readers_of_a_host_read_each_object_of_a_version_from_the_store_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    gen = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randn(256, 128, generator=gen).bfloat16() for i in range(6)}
    writer = DeltaWriter(root)
    writer.publish(state)
    for tensor in state.values():
        hit = torch.rand(tensor.shape, generator=gen) < 0.03
        tensor[hit] = (tensor[hit].float() * 1.01 + 1e-3).bfloat16()
    writer.publish(state)

    gets: Counter[str] = Counter()
    real_get = Store.get

    def counted(self, key, **kwargs):  # type: ignore[no-untyped-def]
        if key.startswith("objects/"):
            gets[key] += 1
        return real_get(self, key, **kwargs)

    monkeypatch.setattr(Store, "get", counted)
    shared = tmp_path / "host"
    caches = [HostCache(shared) for _ in range(3)]
    held = [{n: torch.zeros_like(t) for n, t in state.items()} for _ in caches]

    def reader(r: int) -> int:
        store = Store(root, host_cache=caches[r])
        return DeltaReader(store, StateDictTarget(held[r])).sync().version

    assert in_threads(reader, len(caches), timeout=120) == [1, 1, 1]
    for tensors in held:
        assert_same_bits(tensors, snapshot(state))
    assert gets and set(gets.values()) == {1}, gets  # every object once for the host
    assert sum(c.reads for c in caches) == len(gets)
    assert sum(c.hits for c in caches) == 2 * len(gets)


def test_a_reader_waits_for_the_one_reading_an_object(tmp_path: Path) -> None:
    data, sha = _object("a")
    reads = []

    def slow() -> bytes:
        reads.append(threading.get_ident())
        time.sleep(0.3)
        return data

    got = in_threads(lambda _: HostCache(tmp_path).fetch(sha, len(data), slow), 4, timeout=30)
    assert got == [data] * 4 and len(reads) == 1


def test_an_entry_that_is_not_the_recorded_bytes_is_replaced(tmp_path: Path) -> None:
    data, sha = _object("b")
    cache = HostCache(tmp_path)
    (tmp_path / sha).write_bytes(b"x" * len(data))  # corrupt, or planted
    assert cache.fetch(sha, len(data), lambda: data) == data
    assert cache.reads == 1 and cache.hits == 0
    assert (tmp_path / sha).read_bytes() == data
    assert HostCache(tmp_path).fetch(sha, len(data), lambda: b"") == data  # a hit now


def test_the_directory_keeps_within_its_bound_the_entries_used_last(tmp_path: Path) -> None:
    cache = HostCache(tmp_path, max_bytes=250)
    objects = [_object(c) for c in "cdef"]  # 100 bytes each
    for data, sha in objects:
        cache.fetch(sha, len(data), lambda data=data: data)
        time.sleep(0.01)
    kept = sorted(p.name for p in tmp_path.iterdir() if len(p.name) == 64)
    assert kept == sorted(sha for _, sha in objects[2:])
    big, sha = _object("g" * 3)  # larger than the bound: read, never kept
    assert cache.fetch(sha, len(big), lambda: big) == big
    assert not (tmp_path / sha).exists()
    assert (cache.reads, cache.hits) == (5, 0)


def test_a_directory_that_cannot_be_used_or_written_leaves_reads_to_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, sha = _object("h")
    (tmp_path / "file").write_bytes(b"")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for path in (tmp_path / "file", tmp_path / "link"):
        cache = HostCache(path)
        assert not cache.usable
        assert cache.fetch(sha, len(data), lambda: data) == data
    assert list((tmp_path / "real").iterdir()) == []

    full = HostCache(tmp_path / "full")

    def no_room(src: object, dst: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(module.os, "replace", no_room)
    assert full.fetch(sha, len(data), lambda: data) == data
    assert list((tmp_path / "full").iterdir()) == []  # neither a partial entry nor a lock


def test_bounds_are_checked_and_engines_take_the_cache_by_default(tmp_path: Path) -> None:
    with pytest.raises(ArgumentError, match="max_bytes must be a number of bytes"):
        HostCache(tmp_path, max_bytes=-1)
    assert DcrInitInfo(store="s").host_cache
    with pytest.raises(ValueError, match="'host_cache' must be true or false"):
        DcrInitInfo(store="s", host_cache="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'host_cache_dir' must be a directory path"):
        DcrInitInfo(store="s", host_cache_dir="")
    assert module.default_directory().name == f"dcr-host-cache-{os.getuid()}"
