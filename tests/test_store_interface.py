"""The store interface: every backend implements the Backend protocol, each reports the right
kind, local root and capabilities, the Store is a thin layer over any backend, tools ask the
interface (never the URL), and the store modules import only downward."""

from __future__ import annotations

import ast
import errno
import inspect
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from fsspec.spec import AbstractFileSystem
from test_store import _GenericMemoryFileSystem  # noqa: F401 (registers dcrtest://)

import dcr_format
from dcr_format.errors import (
    ArgumentError,
    CapabilityError,
    InvalidKeyError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    StoreError,
)
from dcr_format.store._base import (
    TEMP_PREFIX,
    Backend,
    ObjectExists,
    ObjectInfo,
    ObjectTooLarge,
    RetryPolicy,
    temporary_key_problem,
)
from dcr_format.store.relay import RelayStore
from dcr_format.store.store import Capabilities, Store, open_store
from dcr_format.tools import _doctor, doctor

PACKAGE = Path(dcr_format.__file__).parent


def _protocol_members() -> tuple[list[str], list[str]]:
    """(data members, methods) the Backend protocol declares."""
    data = sorted(Backend.__annotations__)
    methods = sorted(
        name
        for name, value in vars(Backend).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    )
    return data, methods


def _one_member_group() -> Any:
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))


@pytest.fixture
def memory_store() -> Iterator[Store]:
    store = Store("memory://dcr-interface-test")
    yield store
    store.delete_many(store.list())


def _backends(tmp_path: Path) -> dict[str, Any]:
    """One instance of every backend (S3 needs no server to be constructed)."""
    s3 = pytest.importorskip("dcr_format.store._s3")
    return {
        "local": Store(tmp_path / "s")._backend,
        "memory": Store("memory://dcr-interface-proto")._backend,
        "fsspec": Store("dcrtest://proto")._backend,
        "s3": s3.S3Backend(
            "s3://bkt/p", {"endpoint_url": "http://127.0.0.1:9"}, single_writer=False
        ),
        "relay": RelayStore(Store(tmp_path / "r"), _one_member_group())._backend,
    }


def test_every_backend_implements_the_protocol(tmp_path: Path) -> None:
    data, methods = _protocol_members()
    assert data == ["kind", "local_root", "single_writer", "url"]
    assert {"capabilities", "retry", "list_info", "delete_many"} <= set(methods)
    assert {"list_temporary", "delete_temporary"} <= set(methods)
    for kind, backend in _backends(tmp_path).items():
        assert backend.kind == kind
        for name in data:
            # getattr_static: S3's capabilities would probe the server if evaluated
            assert inspect.getattr_static(backend, name, None) is not None or name == "local_root"
        for name in methods:
            declared = inspect.getattr_static(Backend, name)
            implemented = inspect.getattr_static(backend, name)
            if isinstance(declared, property):
                value_types = {"capabilities": Capabilities, "retry": (RetryPolicy, type(None))}
                assert isinstance(implemented, (property, value_types[name])), (kind, name)
                continue
            want = list(inspect.signature(declared).parameters)
            got = list(inspect.signature(getattr(backend, name)).parameters)
            assert got == want[1:], (kind, name, got)  # same parameters, self bound


def test_capabilities_kind_and_local_root_per_backend(tmp_path: Path) -> None:
    local = Store(tmp_path / "s")
    assert local.kind == "local"
    assert local.local_root == str(tmp_path / "s")
    assert local.capabilities == Capabilities(atomic_create=True, listing=True, delete=True)
    assert local.capabilities.writable and not local.capabilities.batch_delete
    assert Store(f"file://{tmp_path}/s").local_root == str(tmp_path / "s")
    for url in (tmp_path / "s", "memory://dcr-interface-caps", "dcrtest://caps"):
        assert Store(url).single_writer is False
        assert Store(url, single_writer=True).single_writer is True  # the caller's promise

    memory = Store("memory://dcr-interface-caps")
    assert (memory.kind, memory.local_root) == ("memory", None)
    assert memory.capabilities == Capabilities(atomic_create=True, listing=True, delete=True)

    generic = Store("dcrtest://caps")
    assert (generic.kind, generic.local_root) == ("fsspec", None)
    assert generic.capabilities == Capabilities(atomic_create=False, listing=True, delete=True)

    relay = RelayStore(local, _one_member_group())
    assert (relay.kind, relay.local_root, relay.single_writer) == ("relay", None, False)
    assert relay.capabilities == Capabilities(
        atomic_create=False, listing=True, delete=False, writable=False
    )
    assert relay.probe_conditional_writes() is False


class _BareFileSystem(AbstractFileSystem):
    """An fsspec filesystem that can neither list nor delete."""

    protocol = "dcrbare"

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> bytes:
        raise FileNotFoundError(path)


def test_fsspec_capabilities_follow_what_the_filesystem_implements() -> None:
    import fsspec

    fsspec.register_implementation("dcrbare", _BareFileSystem, clobber=True)
    store = Store("dcrbare://x")
    assert store.capabilities == Capabilities(atomic_create=False, listing=False, delete=False)
    with pytest.raises(CapabilityError, match="does not support listing"):
        store.list()
    with pytest.raises(CapabilityError, match="does not support delete"):
        store.delete("k")


def test_only_a_relay_has_epochs_and_a_reader_closes_them(
    tmp_path: Path, memory_store: Store
) -> None:
    from dcr_format import DeltaReader, StateDictTarget

    assert not hasattr(Store, "end_epoch")  # a plain store knows nothing of relays
    for store in (Store(tmp_path / "s"), memory_store):
        store.put("k", b"1")
        assert DeltaReader(store, StateDictTarget({})).group._before_agreeing is None
    relay = RelayStore(Store(tmp_path / "r"), _one_member_group())
    reader = DeltaReader(relay, StateDictTarget({}))
    before = relay.stats.epochs
    reader.group.min(0)  # an agreement point closes the relay's epoch
    assert relay.stats.epochs == before + 1


# --- a Store over any backend ---------------------------------------------------------------


class _DictBackend:
    """The smallest backend: a dict, atomic under the GIL."""

    kind = "memory"
    local_root = None
    single_writer = False
    capabilities = Capabilities(atomic_create=True, listing=True, delete=True)

    def __init__(self, retry: RetryPolicy | None = None, failures: int = 0) -> None:
        self.url = "memory://dict"
        self.objects: dict[str, bytes] = {}
        self.temporaries: dict[str, bytes] = {}  # what list_temporary reports
        self.retry = retry
        self.failures = failures  # the next requests that fail with ConnectionResetError
        self.calls: list[str] = []

    def _request(self, name: str) -> None:
        self.calls.append(name)
        if self.failures:
            self.failures -= 1
            raise ConnectionResetError(104, "Connection reset by peer")

    def probe_conditional_writes(self) -> bool:
        return True

    def get(self, key: str, max_size: int | None) -> bytes:
        self._request("get")
        data = self.objects.get(key)
        if data is None:
            raise FileNotFoundError(key)
        if max_size is not None and len(data) > max_size:
            raise ObjectTooLarge(len(data))
        return data

    def put(self, key: str, data: bytes) -> None:
        self._request("put")
        self.objects[key] = bytes(data)

    def put_if_absent(self, key: str, data: bytes) -> None:
        self._request("put_if_absent")
        if key in self.objects:
            raise ObjectExists
        self.objects[key] = bytes(data)

    def exists(self, key: str) -> bool:
        return key in self.objects

    def size(self, key: str) -> int:
        return len(self.objects[key])

    def list(self, prefix: str) -> list[str]:
        self._request("list")
        return sorted(k for k in self.objects if k.startswith(prefix))

    def list_info(self, prefix: str) -> list[ObjectInfo]:
        return [ObjectInfo(k, len(self.objects[k]), None) for k in self.list(prefix)]

    def delete(self, key: str) -> None:
        self._request("delete")
        self.objects.pop(key, None)

    def delete_many(self, keys: list[str]) -> None:
        for key in keys:
            self.delete(key)

    def list_temporary(self) -> list[ObjectInfo]:
        self._request("list_temporary")
        return sorted(ObjectInfo(k, len(v), None) for k, v in self.temporaries.items())

    def delete_temporary(self, keys: list[str]) -> None:
        self._request("delete_temporary")
        for key in keys:
            self.temporaries.pop(key, None)


def test_a_store_over_any_backend_checks_keys_limits_and_translates_errors() -> None:
    backend = _DictBackend()
    store = Store(backend)
    assert store.url == "memory://dict" and open_store(store) is store
    store.put_if_absent("a/b", b"12345")
    with pytest.raises(ObjectExistsError, match="a/b"):
        store.put_if_absent("a/b", b"x")
    with pytest.raises(ObjectTooLargeError, match="5 bytes, larger than the 4-byte limit"):
        store.get("a/b", max_size=4)
    with pytest.raises(ObjectNotFoundError, match="memory://dict"):
        store.get("missing")
    with pytest.raises(InvalidKeyError):
        store.put("../escape", b"x")
    assert "../escape" not in backend.objects
    assert store.list("a") == ["a/b"]
    store.delete_many(["a/b"])
    assert backend.objects == {}


@pytest.mark.parametrize(
    ("code", "says"),
    [
        (errno.ENOSPC, r"disk or quota is full: free space \(`dcr gc --keep-last K`"),
        (errno.EDQUOT, "disk or quota is full"),
        (errno.EROFS, "mounted read-only: use a writable store"),
        (errno.EACCES, "credentials allow writing"),
    ],
)
def test_a_write_the_filesystem_refuses_says_why_in_the_users_terms(
    code: int, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _DictBackend()

    def refused(key: str, data: bytes) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(backend, "put", refused)
    with pytest.raises(StoreError, match=says):
        Store(backend).put("a", b"x")


def test_temporary_files_go_through_the_store_with_their_own_key_rules() -> None:
    backend = _DictBackend()
    store = Store(backend)
    stale, other = f"a/{TEMP_PREFIX}1", f"{TEMP_PREFIX}2"
    backend.temporaries = {stale: b"half", other: b"x"}
    assert store.list_temporary() == [ObjectInfo(other, 1, None), ObjectInfo(stale, 4, None)]
    for key in ("a/b", f"{TEMP_PREFIX}d/x", f"../{TEMP_PREFIX}3", f"a//{TEMP_PREFIX}4", ""):
        with pytest.raises(InvalidKeyError, match="invalid temporary file key"):
            store.delete_temporary([stale, key])  # every key is checked before any deletion
    assert set(backend.temporaries) == {stale, other}
    with pytest.raises(InvalidKeyError):
        store.get(stale)  # not an object key
    backend.calls = []
    store.delete_temporary([])
    assert backend.calls == []  # nothing to delete: no request
    store.delete_temporary([stale, f"b/{TEMP_PREFIX}gone"])  # a missing one is no error
    assert backend.calls == ["delete_temporary"] and set(backend.temporaries) == {other}
    backend.temporaries["a/b"] = b"not a temporary file"  # a broken or hostile backend
    with pytest.raises(StoreError, match="listed temporary file 'a/b'"):
        store.list_temporary()


def test_temporary_key_rules() -> None:
    assert temporary_key_problem(f"{TEMP_PREFIX}x") is None
    assert temporary_key_problem(f"objects/1/{TEMP_PREFIX}{'0' * 32}") is None
    assert "not a temporary file" in str(temporary_key_problem("objects/x"))
    assert "not a temporary file" in str(temporary_key_problem(f"{TEMP_PREFIX}dir/x"))
    assert temporary_key_problem(f"{TEMP_PREFIX}dir/{TEMP_PREFIX}x") is not None
    assert temporary_key_problem(f"/{TEMP_PREFIX}x") is not None
    assert temporary_key_problem(f"a/../{TEMP_PREFIX}x") is not None
    assert temporary_key_problem(f"{TEMP_PREFIX}\x00") is not None
    assert temporary_key_problem(3) is not None


def test_a_relay_has_no_temporary_files_and_deletes_none(tmp_path: Path) -> None:
    relay = RelayStore(Store(tmp_path / "r"), _one_member_group())
    assert relay.list_temporary() == []
    with pytest.raises(StoreError, match="read-only"):
        relay.delete_temporary([f"{TEMP_PREFIX}x"])


def test_the_store_retries_what_the_backends_policy_calls_transient() -> None:
    policy = RetryPolicy(lambda exc: isinstance(exc, ConnectionError), 3, 0.0, 0.0)
    backend = _DictBackend(policy, failures=2)
    store = Store(backend)
    store.put("k", b"v")  # two resets, then it lands
    assert backend.calls == ["put"] * 3
    backend.failures, backend.calls = 3, []
    with pytest.raises(StoreError, match="Connection reset by peer"):
        store.get("k")  # three tries, then the error
    assert backend.calls == ["get"] * 3
    backend.failures, backend.calls = 1, []
    with pytest.raises(StoreError, match="Connection reset by peer"):
        store.put_if_absent("new", b"v")  # an unknown outcome is never retried
    assert backend.calls == ["put_if_absent"]
    backend.failures, backend.calls = 2, []
    assert store.list() == ["k"]
    store.delete_many(["k"])
    assert backend.calls == ["list"] * 3 + ["delete"]
    no_retry = Store(_DictBackend(None, failures=1))
    with pytest.raises(StoreError):
        no_retry.put("k", b"v")


def test_backends_without_transient_failures_never_retry(tmp_path: Path) -> None:
    for store in (Store(tmp_path / "s"), Store("memory://dcr-no-retry"), Store("dcrtest://r")):
        assert store._backend.retry is None
    s3 = pytest.importorskip("dcr_format.store._s3")
    backend = s3.S3Backend(
        "s3://bkt/p", {"endpoint_url": "http://127.0.0.1:9"}, single_writer=False
    )
    policy = backend.retry
    assert policy.transient is s3.retryable and policy.attempts == s3.RETRY_ATTEMPTS


def test_options_for_urls_are_refused_with_a_backend() -> None:
    with pytest.raises(ArgumentError, match="a backend carries its own"):
        Store(_DictBackend(), single_writer=True)
    with pytest.raises(ArgumentError, match="must be a str or path"):
        Store(42)  # type: ignore[arg-type]


# --- tools ask the interface ------------------------------------------------------------


def test_doctor_sizes_its_large_put_by_kind_not_by_url(
    memory_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    class S3Kind(Store):
        """A memory store that says it is S3 (doctor must not read the URL)."""

        @property
        def kind(self) -> Any:
            return "s3"

    monkeypatch.setattr(_doctor, "S3_LARGE_BYTES", (1 << 20) + 3)
    report = doctor(S3Kind(memory_store.url))
    large = next(check for check in report.checks if check.name == "large-put")
    assert large.ok and large.detail.startswith(f"{(1 << 20) + 3} bytes")
    report = doctor(memory_store)
    large = next(check for check in report.checks if check.name == "large-put")
    assert large.detail.startswith(f"{_doctor.LOCAL_LARGE_BYTES} bytes")


def test_nothing_outside_the_store_modules_reaches_into_a_backend() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if PACKAGE / "store" in path.parents:
            continue
        text = path.read_text()
        if "._backend" in text or 'url.startswith("s3://")' in text:
            offenders.append(str(path.relative_to(PACKAGE)))
    assert offenders == []


def test_tools_find_temporary_files_through_the_store_never_in_a_directory() -> None:
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in sorted((PACKAGE / "tools").rglob("*.py"))
        if any(name in path.read_text() for name in ("local_root", "TEMP_PREFIX", "os.walk"))
    ]
    assert offenders == []  # Store.list_temporary / delete_temporary answer for every backend


# --- imports only downward --------------------------------------------------------------------


def _imported(path: Path) -> list[tuple[str, bool]]:
    """(module, at top level) of every ``dcr_format`` import in ``path``."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(name, id(node) in top) for name in names if name.startswith("dcr_format")]
    return found


def test_store_modules_import_only_downward() -> None:
    for path in sorted((PACKAGE / "store").glob("_*.py")):
        for module, _ in _imported(path):
            allowed = ("dcr_format.store._", "dcr_format.errors", "dcr_format.system.fsync")
            assert module.startswith(allowed), (path, module)
    base = _imported(PACKAGE / "store" / "_base.py")
    assert base == []  # the base module depends on nothing of ours
    # store.py imports what it uses at the top; only the optional S3 extra and the fsspec
    # backends (which a local store, and every quick command on one, does not need) late
    assert all(top for _, top in _imported(PACKAGE / "store" / "store.py"))
    late = [m for m, top in _imported(PACKAGE / "store" / "_backends.py") if not top]
    assert sorted(late) == [
        "dcr_format.store._fsspec",
        "dcr_format.store._memory",
        "dcr_format.store._s3",
    ]
