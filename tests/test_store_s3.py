"""The S3 store against real servers on 127.0.0.1: moto (honours If-None-Match) and the
JuiceFS S3 gateway (ignores it). The conformance suite of test_store.py runs unchanged on
both; the rest checks the probe, the refusals, retries, multipart and writer round trips.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from typing import Any

import botocore.exceptions
import pytest
import torch
from click.testing import CliRunner
from conftest import assert_same_bits, make_state, snapshot, step_state
from fsspec.asyn import sync
from test_store import StoreConformance

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget, Store, StoreError
from dcr_format.chain.chain import Chain, commit_key
from dcr_format.cli.main import cli
from dcr_format.errors import (
    CapabilityError,
    CommitConflictError,
    InvalidKeyError,
    ObjectExistsError,
    ObjectNotFoundError,
)
from dcr_format.store.store import Capabilities
from dcr_format.testing.processes import free_port
from dcr_format.testing.servers import ACCESS_KEY, REGION, SECRET_KEY, S3Server
from dcr_format.tools import doctor

pytestmark = pytest.mark.s3

s3 = pytest.importorskip("dcr_format.store._s3")
S3Backend = s3.S3Backend


def _client(store: Store) -> Any:
    """The aiobotocore client the store's backend sends its requests with."""
    backend = store._backend
    assert isinstance(backend, S3Backend)
    return sync(backend.fs.loop, backend._client)


def _server_keys(server: S3Server, root: str) -> list[str]:
    """Every key under ``root``, as the server lists it (no Store in between)."""
    bucket, _, prefix = root.removeprefix("s3://").partition("/")
    response = server.client().list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    return sorted(item["Key"][len(prefix) + 1 :] for item in response.get("Contents", ()))


def _client_error(status: int, code: str, *, resent: int = 0) -> botocore.exceptions.ClientError:
    return botocore.exceptions.ClientError(
        {
            "Error": {"Code": code, "Message": f"injected {code}"},
            "ResponseMetadata": {"HTTPStatusCode": status, "RetryAttempts": resent},
        },
        "Injected",
    )


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3, "RETRY_BASE_S", 0.001)


@pytest.fixture
def moto_store(moto_server: S3Server, moto_root: str) -> Store:
    return Store(moto_root, storage_options=moto_server.storage_options())


@pytest.fixture
def juicefs_store(juicefs_gateway: S3Server, juicefs_root: str) -> Store:
    return Store(juicefs_root, storage_options=juicefs_gateway.storage_options())


# --- the conformance suite, unchanged ------------------------------------------------------


class TestMotoStore(StoreConformance):
    expect_atomic_create = True

    @pytest.fixture
    def store(self, moto_store: Store) -> Store:
        return moto_store


class TestJuiceFSStore(StoreConformance):
    """JuiceFS ignores If-None-Match: usable only with the single-writer promise."""

    expect_atomic_create = False

    @pytest.fixture
    def store(self, juicefs_gateway: S3Server, juicefs_root: str) -> Store:
        return Store(
            juicefs_root, storage_options=juicefs_gateway.storage_options(), single_writer=True
        )


# --- opening --------------------------------------------------------------------------------


def test_urls_normalise(moto_server: S3Server) -> None:
    options = moto_server.storage_options()
    assert Store("s3://bkt/a/b/", storage_options=options).url == "s3://bkt/a/b"
    assert Store("s3://bkt", storage_options=options).url == "s3://bkt"
    assert Store("s3a://bkt/p", storage_options=options).url == "s3://bkt/p"
    for bad in ["s3://", "s3:///x", "s3://bkt/a/../b", "s3://bkt/a//b"]:
        with pytest.raises(StoreError, match="cannot open store"):
            Store(bad, storage_options=options)


def test_missing_s3_extra_is_capability_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "dcr_format.store._s3", None)  # import fails as without s3fs
    with pytest.raises(CapabilityError, match=r"dcr-format\[s3\]"):
        Store("s3://bkt/p")


def test_endpoint_and_credentials_from_the_aws_environment(
    moto_server: S3Server, moto_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    store = Store(moto_root, storage_options={"skip_instance_cache": True})
    store.put("k", b"from the environment")
    assert Store(moto_root, storage_options=moto_server.storage_options()).get("k") == (
        b"from the environment"
    )


def test_storage_options_override_the_environment(
    moto_server: S3Server, moto_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    store = Store(moto_root, storage_options={**moto_server.storage_options()})
    store.put("k", b"v")
    assert store.list() == ["k"]


# --- the conditional-write probe ------------------------------------------------------------


def test_probe_on_moto_is_true(moto_server: S3Server, moto_root: str, moto_store: Store) -> None:
    assert moto_store.probe_conditional_writes() is True
    assert moto_store.capabilities.atomic_create is True
    assert moto_store.capabilities.conditional_writes is True
    assert _server_keys(moto_server, moto_root) == []  # the probe key was deleted


def test_probe_on_juicefs_is_false(
    juicefs_gateway: S3Server, juicefs_root: str, juicefs_store: Store
) -> None:
    assert juicefs_store.probe_conditional_writes() is False
    assert juicefs_store.capabilities.atomic_create is False
    assert juicefs_store.capabilities.conditional_writes is False
    assert _server_keys(juicefs_gateway, juicefs_root) == []


def test_local_and_memory_need_no_probe(tmp_path: Any) -> None:
    for store in (Store(tmp_path / "s"), Store("memory://dcr-no-probe")):
        assert store.probe_conditional_writes() is True
        assert store.capabilities.conditional_writes is None
        assert store.list() == []


def test_juicefs_refuses_put_if_absent_without_single_writer(juicefs_store: Store) -> None:
    with pytest.raises(CapabilityError, match="conditional writes are not honoured") as info:
        juicefs_store.put_if_absent("commits/00000000000000000000.json", b"x")
    assert "single_writer=True" in str(info.value)
    assert juicefs_store.url in str(info.value)
    assert not juicefs_store.exists("commits/00000000000000000000.json")


def test_kind_and_capabilities_of_s3_stores(moto_store: Store, juicefs_store: Store) -> None:
    assert (moto_store.kind, moto_store.local_root) == ("s3", None)
    assert moto_store.capabilities == Capabilities(
        atomic_create=True, listing=True, delete=True, conditional_writes=True, batch_delete=True
    )
    assert juicefs_store.kind == "s3"
    assert juicefs_store.capabilities == Capabilities(
        atomic_create=False, listing=True, delete=True, conditional_writes=False, batch_delete=True
    )


def test_read_only_credentials_read_the_chain_and_are_refused_writes(
    moto_server: S3Server, moto_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rollout node whose credentials may only read: the probe's conditional PUT is
    denied, and the store still lists, reads and syncs; a write is refused up front saying
    why; another store of the process, with credentials that may write, is not affected."""
    options = moto_server.storage_options()
    state = make_state(0)
    DeltaWriter(Store(moto_root, storage_options=options)).publish(state, step=0)
    monkeypatch.setattr(s3, "_probe_cache", {})  # the next store probes again
    sent: list[str] = []

    async def denied(self: Any, key: str, *args: Any) -> Any:
        sent.append(key.rpartition("/")[2][:14])
        raise _client_error(403, "AccessDenied")

    for method in ("_create", "_put", "_delete"):
        monkeypatch.setattr(S3Backend, method, denied)
    reader_store = Store(moto_root, storage_options=options)
    tensors = {name: torch.zeros_like(t) for name, t in state.items()}
    assert DeltaReader(reader_store, StateDictTarget(tensors)).sync().version == 0
    assert_same_bits(tensors, state)
    assert reader_store.list("commits/") == [commit_key(0)]
    assert sent == [".dcr-tmp-probe"]  # probed once, nothing else sent
    capabilities = reader_store.capabilities
    assert (capabilities.writable, capabilities.atomic_create) == (False, False)
    with pytest.raises(StoreError, match=r"its credentials may not write there .*AccessDenied"):
        reader_store.put("k", b"1")
    with pytest.raises(StoreError, match="may not write"):
        DeltaWriter(reader_store).publish(state, step=1)
    assert sent == [".dcr-tmp-probe"]
    report = doctor(reader_store)  # what reads show; nothing it cannot know claimed
    checks = {c.name: c.ok for c in report.checks}
    assert report.ok and checks == {"chain": True, "atomic-create": None, "list": True, "put": None}
    assert {v.safe for v in report.verdicts} == {None}
    assert sent == [".dcr-tmp-probe"] * 2  # doctor asks the server again, once
    for name, value in (
        ("AWS_ENDPOINT_URL", moto_server.endpoint),
        ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
        ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
        ("AWS_DEFAULT_REGION", REGION),
    ):
        monkeypatch.setenv(name, value)
    shown = CliRunner().invoke(cli, ["doctor", "--store", moto_root])
    assert shown.exit_code == 0, shown.output
    assert "--  put: not tested: its credentials may not write there" in shown.output
    assert "readers: not known (the checks write" in shown.output
    assert sent == [".dcr-tmp-probe"] * 3  # the command's own store probed once
    monkeypatch.undo()
    assert Store(moto_root, storage_options=options).capabilities.atomic_create is True


def test_probe_and_put_if_absent_share_one_conditional_put(
    moto_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe tests the very request put_if_absent sends (S3Backend._create), twice."""
    backend = moto_store._backend
    assert isinstance(backend, S3Backend)
    outcomes: list[tuple[str, str]] = []
    real_create = S3Backend._create

    async def recording(self: Any, key: str, data: bytes) -> Any:
        outcome = await real_create(self, key, data)
        outcomes.append((key.rpartition("/")[2][:14], outcome))
        return outcome

    monkeypatch.setattr(S3Backend, "_create", recording)
    assert moto_store.probe_conditional_writes() is True
    assert outcomes == [(".dcr-tmp-probe", "created"), (".dcr-tmp-probe", "exists")]
    outcomes.clear()
    moto_store.put_if_absent("k", b"1")
    with pytest.raises(ObjectExistsError):
        moto_store.put_if_absent("k", b"2")
    assert outcomes == [("k", "created"), ("k", "exists")]


def test_a_server_without_conditional_writes_is_store_error(
    moto_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert moto_store.capabilities.atomic_create
    client = _client(moto_store)

    async def not_implemented(**kwargs: Any) -> Any:
        raise _client_error(501, "NotImplemented")

    monkeypatch.setattr(client, "put_object", not_implemented)
    with pytest.raises(StoreError, match="does not implement conditional writes") as info:
        moto_store.put_if_absent("k", b"v")
    assert not isinstance(info.value, ObjectExistsError)
    assert moto_store.probe_conditional_writes() is False


def test_probe_key_is_reserved(moto_store: Store) -> None:
    with pytest.raises(InvalidKeyError):
        moto_store.put(".dcr-tmp-probe-1", b"x")


# --- conditional writes on moto ------------------------------------------------------------


def test_put_if_absent_after_a_resent_request_is_its_own_create(moto_store: Store) -> None:
    """The first PUT lands but its answer is lost; botocore re-sends it and gets 412: the
    object carries this call's nonce, so the create succeeded (it was an unknown outcome,
    a StoreError, before nonces; a CI probe failed on it)."""
    assert moto_store.capabilities.atomic_create
    client = _client(moto_store)
    resent: list[int] = []

    def lose_first_answer(attempts: int, response: Any = None, **_: Any) -> float | None:
        if attempts == 1 and response is not None and response[0].status_code == 200:
            resent.append(attempts)
            return 0.0  # retry at once, as after a dropped connection
        return None

    client.meta.events.register("needs-retry.s3.PutObject", lose_first_answer)
    try:
        moto_store.put_if_absent("commits/1.json", b"mine")  # no error: it is ours
        assert resent == [1]  # its first answer was lost and botocore re-sent it
        moto_store.put("other/x", b"theirs")
        resent.clear()
        with pytest.raises(ObjectExistsError):  # a 412 at once: another writer's nonce
            moto_store.put_if_absent("other/x", b"mine")
    finally:
        client.meta.events.unregister("needs-retry.s3.PutObject", lose_first_answer)
    assert resent == []  # the second call's first answer was a 412, not a lost 200
    assert moto_store.get("commits/1.json") == b"mine"
    assert moto_store.get("other/x") == b"theirs"


def test_conflict_409_is_retried(moto_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    assert moto_store.capabilities.atomic_create
    client = _client(moto_store)
    real_put = client.put_object
    calls: list[dict[str, Any]] = []

    async def conflicting_once(**kwargs: Any) -> Any:
        calls.append(kwargs)
        if len(calls) == 1:
            raise _client_error(409, "ConditionalRequestConflict")
        return await real_put(**kwargs)

    monkeypatch.setattr(s3, "RETRY_BASE_S", 0.001)
    monkeypatch.setattr(client, "put_object", conflicting_once)
    moto_store.put_if_absent("k", b"v")
    assert len(calls) == 2
    assert all(call["IfNoneMatch"] == "*" for call in calls)
    with pytest.raises(ObjectExistsError):
        moto_store.put_if_absent("k", b"w")
    assert moto_store.get("k") == b"v"


def test_put_if_absent_is_not_retried_after_a_5xx(
    moto_store: Store, monkeypatch: pytest.MonkeyPatch, fast_retries: None
) -> None:
    assert moto_store.capabilities.atomic_create
    client = _client(moto_store)
    calls: list[dict[str, Any]] = []

    async def unavailable(**kwargs: Any) -> Any:
        calls.append(kwargs)
        raise _client_error(503, "ServiceUnavailable")

    monkeypatch.setattr(client, "put_object", unavailable)
    with pytest.raises(StoreError, match="ServiceUnavailable") as info:
        moto_store.put_if_absent("k", b"v")
    assert not isinstance(info.value, ObjectExistsError)
    assert len(calls) == 1


# --- retries, multipart, deletes, threads ----------------------------------------------------


def _flaky(
    monkeypatch: pytest.MonkeyPatch, method: str, error: Exception, failures: int
) -> list[str]:
    """Make ``S3Backend.<method>`` fail ``failures`` times with ``error`` before working."""
    real: Callable[..., Any] = getattr(S3Backend, method)
    calls: list[str] = []

    async def flaky(self: Any, *args: Any) -> Any:
        calls.append(method)
        if len(calls) <= failures:
            raise error
        return await real(self, *args)

    monkeypatch.setattr(S3Backend, method, flaky)
    return calls


@pytest.mark.parametrize(
    "error",
    [
        _client_error(503, "SlowDown"),
        _client_error(500, "InternalError"),
        _client_error(400, "RequestTimeout"),
        botocore.exceptions.ConnectionClosedError(endpoint_url="http://127.0.0.1"),
        ConnectionResetError(104, "Connection reset by peer"),
        TimeoutError("read timed out"),
    ],
    ids=["slowdown", "500", "request-timeout", "closed", "reset", "timeout"],
)
@pytest.mark.parametrize("method", ["_get", "_put", "_list", "_head"])
def test_transient_errors_are_retried(
    moto_store: Store,
    monkeypatch: pytest.MonkeyPatch,
    fast_retries: None,
    method: str,
    error: Exception,
) -> None:
    moto_store.put("k", b"v")
    calls = _flaky(monkeypatch, method, error, failures=2)
    if method == "_get":
        assert moto_store.get("k") == b"v"
    elif method == "_put":
        moto_store.put("k", b"w")
    elif method == "_list":
        assert moto_store.list() == ["k"]
    else:
        assert moto_store.exists("k")
    assert len(calls) == 3


def test_retries_are_bounded(
    moto_store: Store, monkeypatch: pytest.MonkeyPatch, fast_retries: None
) -> None:
    calls = _flaky(monkeypatch, "_get", _client_error(503, "SlowDown"), failures=100)
    with pytest.raises(StoreError, match="SlowDown"):
        moto_store.get("k")
    assert len(calls) == s3.RETRY_ATTEMPTS


def test_permanent_errors_are_not_retried(
    moto_store: Store, monkeypatch: pytest.MonkeyPatch, fast_retries: None
) -> None:
    calls = _flaky(monkeypatch, "_get", _client_error(403, "AccessDenied"), failures=100)
    with pytest.raises(StoreError, match="AccessDenied"):
        moto_store.get("k")
    assert len(calls) == 1


def test_unreachable_endpoint_is_store_error(
    moto_root: str, fast_retries: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3, "RETRY_ATTEMPTS", 2)
    options = {
        "endpoint_url": f"http://127.0.0.1:{free_port()}",  # nothing listens there
        "key": ACCESS_KEY,
        "secret": SECRET_KEY,
        "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}},
    }
    store = Store(moto_root, storage_options=options)
    with pytest.raises(StoreError, match="store s3://"):
        store.get("k")
    with pytest.raises(StoreError):
        store.list()


def test_missing_bucket(moto_server: S3Server) -> None:
    store = Store("s3://dcr-no-such-bucket/x", storage_options=moto_server.storage_options())
    with pytest.raises(ObjectNotFoundError):
        store.get("k")
    with pytest.raises(StoreError):
        store.put("k", b"v")


def test_large_object_goes_up_in_parts(
    moto_server: S3Server, moto_root: str, moto_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3, "PART_SIZE", 5 << 20)  # the S3 minimum part size
    data = torch.randint(0, 256, (12_000_000,), dtype=torch.uint8).numpy().tobytes()
    moto_store.put("objects/big.dcrs", memoryview(data))
    bucket, _, prefix = moto_root.removeprefix("s3://").partition("/")
    head = moto_server.client().head_object(Bucket=bucket, Key=f"{prefix}/objects/big.dcrs")
    assert head["ETag"].strip('"').endswith("-3")  # a multipart upload of 3 parts
    assert moto_store.size("objects/big.dcrs") == len(data)
    assert moto_store.get("objects/big.dcrs") == data
    assert moto_store.get("objects/big.dcrs", max_size=len(data)) == data


def test_delete_many_in_batches(moto_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3, "_DELETE_BATCH", 3)
    keys = [f"objects/{i}" for i in range(8)]
    for key in keys:
        moto_store.put(key, b"x")
    moto_store.put("keep", b"x")
    moto_store.delete_many([*keys, "objects/missing", keys[0]])
    assert moto_store.list() == ["keep"]


def test_juicefs_delete_many_sends_content_md5(juicefs_store: Store) -> None:
    for key in ["a/1", "a/2", "b"]:
        juicefs_store.put(key, b"x")
    juicefs_store.delete_many(["a/1", "a/2", "missing"])
    assert juicefs_store.list() == ["b"]


@pytest.mark.parametrize("backend", ["moto", "juicefs"])
def test_many_threads_share_one_store(backend: str, request: pytest.FixtureRequest) -> None:
    store: Store = request.getfixturevalue(f"{backend}_store")
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for i in range(6):
                key = f"t/{worker}/{i}"
                data = bytes([worker, i]) * (1000 + 97 * i)
                store.put(key, data)
                assert store.get(key, max_size=len(data)) == data
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert len(store.list("t/")) == 72


# --- writers and readers --------------------------------------------------------------------


def _header(store: Store) -> dict[str, Any]:
    return json.loads(store.get("dcr.json"))


def test_publish_and_sync_on_moto(moto_server: S3Server, moto_root: str) -> None:
    options = moto_server.storage_options()
    gen = torch.Generator().manual_seed(3)
    state = make_state(3)
    writer = DeltaWriter(Store(moto_root, storage_options=options), base_every=3)
    target = StateDictTarget({})
    reader = DeltaReader(Store(moto_root, storage_options=options), target)
    for version in range(5):
        if version:
            step_state(state, gen)
        info = writer.publish(state, step=version)
        assert info.version == version
        result = reader.sync()
        assert result.version == version
        assert_same_bits(target.tensors, state)
    store = Store(moto_root, storage_options=options)
    assert _header(store)["conditional_writes"] is True
    assert Chain(store).versions() == [0, 1, 2, 3, 4]
    late = StateDictTarget({})
    DeltaReader(store, late).sync()
    assert_same_bits(late.tensors, state)


def test_racing_writers_on_moto_exactly_one_commits(moto_server: S3Server, moto_root: str) -> None:
    options = moto_server.storage_options()
    state = make_state(4)
    DeltaWriter(Store(moto_root, storage_options=options)).publish(state)
    writers = [DeltaWriter(Store(moto_root, storage_options=options)) for _ in range(2)]
    for writer in writers:
        assert writer.version == 0
    states = []
    for seed in range(2):
        changed = snapshot(state)
        step_state(changed, torch.Generator().manual_seed(10 + seed))
        states.append(changed)
    barrier = threading.Barrier(2)
    outcomes: list[object] = [None, None]

    def publish(i: int) -> None:
        barrier.wait()
        try:
            outcomes[i] = writers[i].publish(states[i]).version
        except BaseException as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    won = [i for i, outcome in enumerate(outcomes) if outcome == 1]
    lost = [i for i, outcome in enumerate(outcomes) if isinstance(outcome, CommitConflictError)]
    assert len(won) == 1 and len(lost) == 1, outcomes
    winner = won[0]
    assert writers[1 - winner].version == 0  # the loser's baseline did not move
    target = StateDictTarget({})
    DeltaReader(Store(moto_root, storage_options=options), target).sync()
    assert_same_bits(target.tensors, states[winner])


def test_writer_survives_a_lost_commit_answer(moto_store: Store) -> None:
    """put_if_absent reports 'unknown'; the writer re-reads, finds its own record, goes on."""
    assert moto_store.capabilities.atomic_create
    client = _client(moto_store)
    state = make_state(5)
    writer = DeltaWriter(moto_store)
    writer.publish(state)
    lost: list[str] = []

    def lose_commit_answer(
        attempts: int, request_dict: Any = None, response: Any = None, **_: Any
    ) -> float | None:
        url = str((request_dict or {}).get("url", ""))
        if not lost and attempts == 1 and "/commits/" in url and response is not None:
            lost.append(url)
            return 0.0
        return None

    client.meta.events.register("needs-retry.s3.PutObject", lose_commit_answer)
    try:
        step_state(state, torch.Generator().manual_seed(5))
        info = writer.publish(state)
    finally:
        client.meta.events.unregister("needs-retry.s3.PutObject", lose_commit_answer)
    assert lost and info.version == 1
    assert moto_store.exists(commit_key(1))


def test_writer_on_juicefs_needs_single_writer(
    juicefs_gateway: S3Server, juicefs_root: str
) -> None:
    options = juicefs_gateway.storage_options()
    state = make_state(6)
    with pytest.raises(CapabilityError, match="conditional writes are not honoured") as info:
        DeltaWriter(Store(juicefs_root, storage_options=options)).publish(state)
    assert "single_writer=True" in str(info.value)
    assert _server_keys(juicefs_gateway, juicefs_root) == []  # refused before writing

    writer = DeltaWriter(Store(juicefs_root, storage_options=options, single_writer=True))
    gen = torch.Generator().manual_seed(6)
    target = StateDictTarget({})
    reader = DeltaReader(Store(juicefs_root, storage_options=options), target)
    for version in range(3):
        if version:
            step_state(state, gen)
        assert writer.publish(state).version == version
        assert reader.sync().version == version
        assert_same_bits(target.tensors, state)
    assert _header(Store(juicefs_root, storage_options=options))["conditional_writes"] is False
