"""Conformance tests for dcr_format.store.store, subclassed per backend.

``StoreConformance`` holds the behaviour every backend must show; each
``Test...`` subclass supplies a ``store`` fixture (and the capability it
expects). Backend-specific checks (symlinks, temp files, fsspec capability
fallbacks) live in their own classes below.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from dcr_format.errors import (
    CapabilityError,
    InvalidKeyError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    StoreError,
)
from dcr_format.store.store import TEMP_PREFIX, Capabilities, Store, check_key, open_store

FIVE_MB = 5 * 1024 * 1024


class _GenericMemoryFileSystem(MemoryFileSystem):
    """A memory filesystem under a test protocol: the store must treat it as a generic backend."""

    protocol = "dcrtest"
    store: ClassVar[dict[str, Any]] = {}  # its own objects, apart from memory://
    pseudo_dirs: ClassVar[list[str]] = [""]

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str):
            path = path.removeprefix("dcrtest://")
        return super()._strip_protocol(path)


fsspec.register_implementation("dcrtest", _GenericMemoryFileSystem, clobber=True)


@pytest.fixture
def generic_fs() -> Iterator[type[_GenericMemoryFileSystem]]:
    yield _GenericMemoryFileSystem
    _GenericMemoryFileSystem.store.clear()
    _GenericMemoryFileSystem.pseudo_dirs[:] = [""]


@pytest.fixture
def memory_url() -> Iterator[str]:
    name = f"dcr-test-{uuid.uuid4().hex}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


INVALID_KEYS = [
    "",
    "/abs",
    "a\\b",
    "a//b",
    "a/",
    ".",
    "..",
    "a/./b",
    "a/../b",
    "../escape",
    "a\x00b",
    "a\nb",
    "a\x7fb",
    "C:",
    "C:/windows",
    "x/d:y",
    "a" * 1025,
    "é" * 513,  # 1026 bytes of UTF-8
    f"{TEMP_PREFIX}x",
    f"a/{TEMP_PREFIX}1",
]

METHODS: dict[str, Callable[[Store, str], object]] = {
    "get": lambda s, k: s.get(k),
    "get_max_size": lambda s, k: s.get(k, max_size=10),
    "put": lambda s, k: s.put(k, b"x"),
    "put_if_absent": lambda s, k: s.put_if_absent(k, b"x"),
    "exists": lambda s, k: s.exists(k),
    "size": lambda s, k: s.size(k),
    "delete": lambda s, k: s.delete(k),
    "delete_many": lambda s, k: s.delete_many(["ok", k]),
}


class StoreConformance:
    """Behaviour every store backend must show. Subclasses provide the ``store`` fixture."""

    expect_atomic_create: ClassVar[bool] = True

    @pytest.fixture
    def store(self) -> Store:
        raise NotImplementedError

    # --- put / get --------------------------------------------------------------

    @pytest.mark.parametrize("size", [0, 1, 1000, FIVE_MB])
    def test_put_get_round_trip(self, store: Store, size: int) -> None:
        data = os.urandom(size)
        store.put("objects/1/shard.bin", data)
        got = store.get("objects/1/shard.bin")
        assert type(got) is bytes
        assert got == data
        assert store.size("objects/1/shard.bin") == size

    def test_put_overwrites(self, store: Store) -> None:
        store.put("HEAD", b"1")
        store.put("HEAD", b"22")
        assert store.get("HEAD") == b"22"

    def test_put_accepts_bytearray_and_memoryview(self, store: Store) -> None:
        store.put("a", bytearray(b"abc"))
        store.put("b", memoryview(b"defg"))
        assert store.get("a") == b"abc"
        assert store.get("b") == b"defg"

    def test_get_missing(self, store: Store) -> None:
        with pytest.raises(ObjectNotFoundError, match="nothere") as info:
            store.get("dir/nothere")
        assert isinstance(info.value, FileNotFoundError)
        assert store.url in str(info.value)
        assert "\n" not in str(info.value)

    def test_get_directory_is_missing(self, store: Store) -> None:
        store.put("dir/x", b"x")
        with pytest.raises(ObjectNotFoundError):
            store.get("dir")
        with pytest.raises(ObjectNotFoundError):
            store.size("dir")
        assert not store.exists("dir")

    # --- put_if_absent ------------------------------------------------------------

    def test_put_if_absent_twice(self, store: Store) -> None:
        store.put_if_absent("commits/00000000000000000001.json", b"first")
        with pytest.raises(ObjectExistsError, match="00000000000000000001") as info:
            store.put_if_absent("commits/00000000000000000001.json", b"second")
        assert isinstance(info.value, FileExistsError)
        assert store.get("commits/00000000000000000001.json") == b"first"

    def test_put_if_absent_empty(self, store: Store) -> None:
        store.put_if_absent("empty", b"")
        assert store.get("empty") == b""
        with pytest.raises(ObjectExistsError):
            store.put_if_absent("empty", b"")

    def test_put_if_absent_race(self, store: Store) -> None:
        if not store.capabilities.atomic_create:
            pytest.skip("backend has no atomic create")
        writers = 8
        for round_ in range(5):
            key = f"race/{round_}"
            barrier = threading.Barrier(writers)
            outcomes: list[object] = [None] * writers

            def write(
                i: int,
                key: str = key,
                barrier: threading.Barrier = barrier,
                outcomes: list[object] = outcomes,
            ) -> None:
                barrier.wait()
                try:
                    store.put_if_absent(key, b"writer-%d" % i)
                    outcomes[i] = "won"
                except ObjectExistsError:
                    outcomes[i] = "lost"
                except BaseException as exc:
                    outcomes[i] = exc

            threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert outcomes.count("won") == 1, outcomes
            assert outcomes.count("lost") == writers - 1, outcomes
            assert store.get(key) == b"writer-%d" % outcomes.index("won")

    # --- list -----------------------------------------------------------------------

    def test_list_empty_store(self, store: Store) -> None:
        assert store.list() == []
        assert store.list("objects/") == []

    def test_list_recursive_sorted(self, store: Store) -> None:
        keys = ["b", "a/2", "a/1", "a/10/x", "c/d/e/f", "dcr.json"]
        for key in keys:
            store.put(key, key.encode())
        assert store.list() == sorted(keys)
        assert store.list("a") == ["a/1", "a/10/x", "a/2"]
        assert store.list("a/") == ["a/1", "a/10/x", "a/2"]
        assert store.list("c/d") == ["c/d/e/f"]
        # A prefix matches whole segments: 'a/1' is an object, not a directory.
        assert store.list("a/1") == []
        assert store.list("a/10/") == ["a/10/x"]
        assert store.list("nope/") == []
        assert store.list("b") == []

    def test_list_sees_writes_of_another_store_instance(self, store: Store) -> None:
        assert store.list() == []
        other = open_store(store)
        other.put("late", b"1")
        assert store.list() == ["late"]

    @pytest.mark.parametrize("prefix", ["/", "/a", "a//", "a//b/", "../", "a/../b", "x\x00/"])
    def test_list_invalid_prefix(self, store: Store, prefix: str) -> None:
        with pytest.raises(InvalidKeyError):
            store.list(prefix)

    # --- delete -----------------------------------------------------------------------

    def test_delete(self, store: Store) -> None:
        store.put("a/x", b"1")
        store.delete("a/x")
        assert not store.exists("a/x")
        assert store.list() == []
        store.delete("a/x")  # missing is fine
        store.delete("never/was")

    def test_delete_many(self, store: Store) -> None:
        for key in ["a", "b/c", "d"]:
            store.put(key, b"1")
        store.delete_many(["a", "missing", "b/c"])
        assert store.list() == ["d"]
        store.delete_many([])
        store.delete_many(iter(["d"]))
        assert store.list() == []

    def test_delete_many_checks_every_key_first(self, store: Store) -> None:
        store.put("a", b"1")
        with pytest.raises(InvalidKeyError):
            store.delete_many(["a", "../b"])
        assert store.exists("a")

    # --- exists / size -----------------------------------------------------------------

    def test_exists_and_size(self, store: Store) -> None:
        assert not store.exists("k")
        with pytest.raises(ObjectNotFoundError):
            store.size("k")
        store.put("k", b"12345")
        assert store.exists("k")
        assert store.size("k") == 5

    # --- max_size ---------------------------------------------------------------------

    def test_max_size(self, store: Store) -> None:
        store.put("k", b"x" * 100)
        assert store.get("k", max_size=100) == b"x" * 100
        assert store.get("k", max_size=10**9) == b"x" * 100
        with pytest.raises(ObjectTooLargeError, match="100 bytes") as info:
            store.get("k", max_size=99)
        assert isinstance(info.value, ValueError)
        assert store.url in str(info.value)
        store.put("empty", b"")
        assert store.get("empty", max_size=0) == b""
        with pytest.raises(ObjectTooLargeError):
            store.get("k", max_size=0)

    def test_max_size_missing(self, store: Store) -> None:
        with pytest.raises(ObjectNotFoundError):
            store.get("nope", max_size=10)

    # --- keys ---------------------------------------------------------------------------

    @pytest.mark.parametrize("method", sorted(METHODS))
    @pytest.mark.parametrize("key", INVALID_KEYS, ids=lambda k: repr(k)[:24])
    def test_invalid_keys(self, store: Store, method: str, key: str) -> None:
        with pytest.raises(InvalidKeyError) as info:
            METHODS[method](store, key)
        assert isinstance(info.value, ValueError)
        assert "\n" not in str(info.value)
        assert store.list() == []

    def test_non_str_key(self, store: Store) -> None:
        with pytest.raises(InvalidKeyError):
            store.get(b"a")  # type: ignore[arg-type]

    # --- capabilities / opening -----------------------------------------------------------

    def test_capabilities(self, store: Store) -> None:
        caps = store.capabilities
        assert isinstance(caps, Capabilities)
        assert caps.atomic_create is self.expect_atomic_create
        assert caps.listing is True
        assert caps.delete is True
        with pytest.raises(dataclasses.FrozenInstanceError):
            caps.atomic_create = not caps.atomic_create  # type: ignore[misc]

    def test_open_store_returns_store(self, store: Store) -> None:
        assert open_store(store) is store
        assert store.url in repr(store)


class TestLocalPathStore(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return Store(str(tmp_path / "refit-store"))


class TestFileUrlStore(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return Store(f"file://{tmp_path}/refit-store")


class TestMemoryStore(StoreConformance):
    @pytest.fixture
    def store(self, memory_url: str) -> Store:
        return Store(memory_url)


class TestGenericFsspecSingleWriterStore(StoreConformance):
    """A backend fsspec serves that is not known to create atomically, with single_writer."""

    expect_atomic_create = False

    @pytest.fixture
    def store(self, generic_fs: type[MemoryFileSystem]) -> Store:
        return Store("dcrtest://conformance", single_writer=True)


# --- check_key ------------------------------------------------------------------------


@pytest.mark.parametrize("key", INVALID_KEYS, ids=lambda k: repr(k)[:24])
def test_check_key_rejects(key: str) -> None:
    with pytest.raises(InvalidKeyError):
        check_key(key)


@pytest.mark.parametrize(
    "key", ["a", "dcr.json", "commits/00000000000000000001.json", "a/b.c/d-e_f", "é", "a" * 1024]
)
def test_check_key_accepts(key: str) -> None:
    assert check_key(key) == key


# --- local backend ------------------------------------------------------------------------


@pytest.fixture
def local_store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store")


def _files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())


class TestLocalBackend:
    def test_url_forms_normalise_to_one_root(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.chdir(tmp_path)
        expected = f"file://{tmp_path}/s"
        for url in ["s", "./s", "s/", tmp_path / "s", f"file://{tmp_path}/s", f"{tmp_path}/s"]:
            assert Store(url).url == expected
        assert Store(f"file:{tmp_path}/s").url == expected  # file:/abs, one slash (RFC 8089)
        assert Store("./s3:/b").url == f"file://{tmp_path}/s3:/b"  # a local directory "s3:"
        for typo, fix in [("s3:/bucket/run", "s3://bucket/run"), ("memory:/m", "memory://m")]:
            with pytest.raises(StoreError, match=f"one slash after .*; write {fix}, or ./"):
                Store(typo)
        assert not (tmp_path / "s3:").exists()
        Store("s").put("k", b"v")
        assert open_store(expected).get("k") == b"v"

    def test_root_is_created_on_first_write_only(self, tmp_path: Path) -> None:
        store = Store(tmp_path / "new")
        assert store.list() == []
        assert not store.exists("k")
        assert not (tmp_path / "new").exists()
        store.put("a/b/c", b"1")
        assert (tmp_path / "new" / "a" / "b" / "c").read_bytes() == b"1"

    def test_deletes_leave_no_empty_directories(self, local_store: Store, tmp_path: Path) -> None:
        root = tmp_path / "store"
        local_store.put("objects/1/a/shard-0", b"1")
        local_store.put("objects/1/a/shard-1", b"1")
        local_store.put("objects/2/b/shard-0", b"2")
        local_store.delete("objects/1/a/shard-0")
        assert (root / "objects" / "1" / "a").is_dir()  # not empty yet
        local_store.delete_many(["objects/1/a/shard-1"])
        assert sorted(p.name for p in (root / "objects").iterdir()) == ["2"]
        local_store.delete("objects/2/b/shard-0")
        assert list(root.iterdir()) == []  # the root stays, empty
        local_store.put("objects/2/b/shard-0", b"3")  # and is written into again
        assert local_store.get("objects/2/b/shard-0") == b"3"

    def test_a_write_racing_a_prune_makes_its_directory_again(
        self, local_store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from dcr_format.store import _local

        pruned = tmp_path / "store" / "objects" / "1"
        real_open, raced = os.open, []

        def pruned_first(path: str, *args: Any) -> int:
            if not raced and os.path.dirname(path) == str(pruned):
                raced.append(path)  # a delete empties and removes the directory just made
                os.rmdir(pruned)
            return real_open(path, *args)

        monkeypatch.setattr(_local.os, "open", pruned_first)
        local_store.put("objects/1/shard-0", b"1")
        assert raced and local_store.get("objects/1/shard-0") == b"1"

    def test_no_temp_files_left(self, local_store: Store, tmp_path: Path) -> None:
        local_store.put("a/x", b"1")
        local_store.put("a/x", b"2")
        local_store.put_if_absent("a/y", b"3")
        with pytest.raises(ObjectExistsError):
            local_store.put_if_absent("a/y", b"4")
        assert _files_under(tmp_path / "store") == ["a/x", "a/y"]

    def test_temp_files_never_listed(self, local_store: Store, tmp_path: Path) -> None:
        local_store.put("a/x", b"1")
        (tmp_path / "store" / f"{TEMP_PREFIX}stale").write_bytes(b"junk")
        (tmp_path / "store" / "a" / f"{TEMP_PREFIX}0123").write_bytes(b"junk")
        (tmp_path / "store" / f"{TEMP_PREFIX}dir").mkdir()
        (tmp_path / "store" / f"{TEMP_PREFIX}dir" / "y").write_bytes(b"junk")
        assert local_store.list() == ["a/x"]
        assert local_store.list("a/") == ["a/x"]

    def test_failed_put_keeps_old_object_and_leaves_no_temp(
        self, local_store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        local_store.put("k", b"old")

        def broken_replace(src: str, dst: str) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(os, "replace", broken_replace)
        with pytest.raises(StoreError, match="Input/output error"):
            local_store.put("k", b"new")
        monkeypatch.undo()
        assert local_store.get("k") == b"old"
        assert _files_under(tmp_path / "store") == ["k"]

    def test_a_refused_read_or_write_says_which_the_credentials_must_allow(
        self, local_store: Store, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        local_store.put("k", b"1")

        def refused(*args: object) -> None:
            raise PermissionError(13, "Access Denied")

        backend = type(local_store._backend)
        monkeypatch.setattr(backend, "get", refused)
        monkeypatch.setattr(backend, "put", refused)
        with pytest.raises(StoreError, match="credentials allow reading"):
            local_store.get("k")
        with pytest.raises(StoreError, match="credentials allow writing"):
            local_store.put("k", b"2")

    def test_written_files_are_not_private(self, local_store: Store, tmp_path: Path) -> None:
        old = os.umask(0o022)
        try:
            local_store.put("a", b"1")
            local_store.put_if_absent("b", b"1")
        finally:
            os.umask(old)
        for name in ["a", "b"]:
            assert stat.S_IMODE((tmp_path / "store" / name).stat().st_mode) == 0o644

    def test_get_reads_at_most_max_size_plus_one(
        self, local_store: Store, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        local_store.put("big", b"x" * 1_000_000)
        read_sizes: list[int] = []
        real_read = os.read

        def counting_read(fd: int, n: int) -> bytes:
            data = real_read(fd, n)
            read_sizes.append(len(data))
            return data

        monkeypatch.setattr(os, "read", counting_read)
        with pytest.raises(ObjectTooLargeError):
            local_store.get("big", max_size=1000)
        assert sum(read_sizes) == 0  # the size was checked before reading

        # Even if the size reported by fstat is wrong (file growing), the read is bounded.
        real_fstat = os.fstat

        def shrunk_fstat(fd: int) -> os.stat_result:
            st = real_fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return st
            fields = list(st[:10])
            fields[stat.ST_SIZE] = 10
            return os.stat_result(fields)

        monkeypatch.setattr(os, "fstat", shrunk_fstat)
        with pytest.raises(ObjectTooLargeError):
            local_store.get("big", max_size=1000)
        monkeypatch.undo()
        assert sum(read_sizes) <= 1001

    def test_symlink_leaving_root_is_refused(self, local_store: Store, tmp_path: Path) -> None:
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "secret").write_bytes(b"secret")
        local_store.put("a/x", b"1")
        root = tmp_path / "store"
        (root / "link").symlink_to(outside / "secret")
        (root / "a" / "dirlink").symlink_to(outside)
        for key in ["link", "a/dirlink/secret", "a/dirlink/new"]:
            with pytest.raises(InvalidKeyError, match="symlink"):
                local_store.get(key)
            with pytest.raises(InvalidKeyError):
                local_store.size(key)
            with pytest.raises(InvalidKeyError):
                local_store.exists(key)
            with pytest.raises(InvalidKeyError):
                local_store.put(key, b"overwrite")
            with pytest.raises(InvalidKeyError):
                local_store.put_if_absent(key, b"overwrite")
        with pytest.raises(InvalidKeyError):
            local_store.list("a/dirlink/")
        with pytest.raises(InvalidKeyError):
            local_store.delete("a/dirlink/secret")
        assert sorted(p.name for p in outside.iterdir()) == ["secret"]
        assert (outside / "secret").read_bytes() == b"secret"
        # Listing does not follow symlinked directories nor report links leaving the root.
        assert local_store.list() == ["a/x"]
        # Deleting a symlink removes the link, never its target.
        local_store.delete("link")
        assert not (root / "link").is_symlink()
        assert (outside / "secret").read_bytes() == b"secret"

    def test_symlink_inside_root_is_followed(self, local_store: Store, tmp_path: Path) -> None:
        local_store.put("real/x", b"data")
        (tmp_path / "store" / "alias").symlink_to(tmp_path / "store" / "real" / "x")
        assert local_store.get("alias") == b"data"
        assert local_store.list() == ["alias", "real/x"]

    def test_symlinked_root(self, tmp_path: Path) -> None:
        (tmp_path / "real").mkdir()
        (tmp_path / "root-link").symlink_to(tmp_path / "real")
        store = Store(tmp_path / "root-link")
        store.put("a/b", b"1")
        assert store.get("a/b") == b"1"
        assert store.list() == ["a/b"]

    def test_fifo_is_not_an_object(self, local_store: Store, tmp_path: Path) -> None:
        local_store.put("a", b"1")
        os.mkfifo(tmp_path / "store" / "fifo")
        with pytest.raises(ObjectNotFoundError):
            local_store.get("fifo")
        with pytest.raises(ObjectNotFoundError):
            local_store.size("fifo")
        assert not local_store.exists("fifo")
        assert local_store.list() == ["a"]

    def test_parent_is_an_object(self, local_store: Store) -> None:
        local_store.put("a", b"1")
        with pytest.raises(StoreError) as info:
            local_store.put("a/b", b"2")
        assert not isinstance(info.value, ObjectExistsError)
        with pytest.raises(StoreError) as info:
            local_store.put_if_absent("a/b", b"2")
        assert not isinstance(info.value, ObjectExistsError)
        with pytest.raises(ObjectNotFoundError):
            local_store.get("a/b")
        assert not local_store.exists("a/b")
        local_store.delete("a/b")

    @pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
    def test_permission_error_is_store_error(self, local_store: Store, tmp_path: Path) -> None:
        local_store.put("ro/x", b"1")
        (tmp_path / "store" / "ro").chmod(0o500)
        try:
            with pytest.raises(StoreError, match="ro/y") as info:
                local_store.put("ro/y", b"2")
            assert isinstance(info.value, OSError)
        finally:
            (tmp_path / "store" / "ro").chmod(0o700)

    def test_no_hard_links_is_capability_error(
        self, local_store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        def no_link(src: str, dst: str) -> None:
            raise OSError(1, "Operation not permitted")

        monkeypatch.setattr(os, "link", no_link)
        with pytest.raises(CapabilityError, match="hard links"):
            local_store.put_if_absent("k", b"1")
        monkeypatch.undo()
        assert _files_under(tmp_path / "store") == []


# --- memory backend ----------------------------------------------------------------------


class TestMemoryBackend:
    def test_instances_share_objects(self, memory_url: str) -> None:
        Store(memory_url).put("k", b"v")
        assert Store(memory_url).get("k") == b"v"
        assert Store(memory_url + "/").url == memory_url

    def test_too_large_is_refused_before_reading(
        self, memory_url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        store = Store(memory_url)
        store.put("big", b"x" * 1000)
        calls: list[tuple[Any, ...]] = []
        monkeypatch.setattr(MemoryFileSystem, "cat_file", lambda *a, **k: calls.append(a))
        with pytest.raises(ObjectTooLargeError):
            store.get("big", max_size=10)
        assert calls == []

    def test_stores_are_isolated_by_name(self, memory_url: str) -> None:
        Store(memory_url).put("k", b"v")
        other = Store(memory_url + "-other")
        assert other.list() == []


# --- generic fsspec backends -------------------------------------------------------------


class TestGenericFsspecBackend:
    def test_no_atomic_create_without_single_writer(
        self, generic_fs: type[_GenericMemoryFileSystem]
    ) -> None:
        store = Store("dcrtest://plain")
        assert store.capabilities == Capabilities(atomic_create=False, listing=True, delete=True)
        with pytest.raises(CapabilityError, match="single_writer") as info:
            store.put_if_absent("commits/1.json", b"x")
        assert store.url in str(info.value)
        assert not store.exists("commits/1.json")
        store.put("commits/1.json", b"x")  # plain writes still work
        assert store.get("commits/1.json") == b"x"

    def test_single_writer_check_then_write(
        self, generic_fs: type[_GenericMemoryFileSystem]
    ) -> None:
        store = Store("dcrtest://plain", single_writer=True)
        assert store.capabilities.atomic_create is False
        store.put_if_absent("k", b"1")
        with pytest.raises(ObjectExistsError):
            store.put_if_absent("k", b"2")
        assert store.get("k") == b"1"

    def test_reopen_by_url(self, generic_fs: type[_GenericMemoryFileSystem]) -> None:
        store = Store("dcrtest://plain/")
        store.put("a/b", b"1")
        assert open_store(store.url).list() == ["a/b"]

    def test_backend_errors_are_store_errors(
        self, generic_fs: type[_GenericMemoryFileSystem], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        store = Store("dcrtest://plain")

        def failing(*args: Any, **kwargs: Any) -> None:
            raise ConnectionResetError(104, "Connection reset by peer")

        monkeypatch.setattr(_GenericMemoryFileSystem, "pipe_file", failing)
        with pytest.raises(StoreError, match="Connection reset by peer") as info:
            store.put("k", b"1")
        assert "'k'" in str(info.value)
        assert store.url in str(info.value)

    def test_unknown_protocol(self) -> None:
        with pytest.raises(CapabilityError, match="no-such-proto"):
            Store("no-such-proto://x")
