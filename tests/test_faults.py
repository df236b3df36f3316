"""S3 faults between client and server: the fault proxy (dcr_format/testing/faultproxy.py)
in front of moto answers requests of every kind with 500, 503 SlowDown, connection resets
(before or after the server acted), truncated bodies, delays and hangs past the client's
read timeout.

Transient faults are retried away; an unknown commit outcome is resolved by re-reading; nothing
is ever committed twice (one record per version, every step once) and the chain verifies.
"""

from __future__ import annotations

import time
from datetime import timedelta

import botocore.retries.standard
import pytest
import s3fs
import torch
from conftest import assert_same_bits, flip_bits, make_state, snapshot

import dcr_format.store._s3 as s3
from dcr_format import DcrError, DeltaReader, DeltaWriter, StateDictTarget, Store, StoreError
from dcr_format.chain.chain import Chain, attempt_prefix
from dcr_format.errors import CommitConflictError, CommitStateUnknownError, ObjectExistsError
from dcr_format.testing.faultproxy import FaultProxy, Rule, classify
from dcr_format.tools import gc, verify

pytestmark = pytest.mark.s3

READ_TIMEOUT = 0.5
RANDOM_VERSIONS = 10
# (fault, after): after=True forwards the request first, so the server acted on it
TRANSIENT = [
    ("500", False),
    ("500", True),
    ("503", False),
    ("reset", False),
    ("reset", True),
    ("truncate", False),
    ("delay", False),
    ("hang", False),
    ("hang", True),
]
KINDS = ["get", "put", "put_if_absent", "head", "list", "delete"]
NAMES = {
    "get": "GET object",
    "put": "PUT object",
    "put_if_absent": "conditional PUT",
    "head": "HEAD",
    "list": "LIST",
    "delete": "DELETE",
}


def _label(fault: str, after: bool) -> str:
    text = {
        "500": "500 InternalError",
        "503": "503 SlowDown",
        "reset": "connection reset",
        "truncate": "truncated body",
        "delay": "0.2 s delay",
        "hang": f"hang past the {READ_TIMEOUT} s read timeout",
    }[fault]
    return text + (" after the server acted" if after else "")


@pytest.fixture(scope="module")
def proxy(moto_server):
    with FaultProxy(moto_server.endpoint, seed=8) as running:
        yield running


@pytest.fixture
def options(moto_server, proxy, monkeypatch):
    """s3fs options that reach moto through the proxy, with short timeouts and fast retries."""
    monkeypatch.setattr(s3, "RETRY_BASE_S", 0.005)
    monkeypatch.setattr(
        botocore.retries.standard.ExponentialBackoff, "delay_amount", lambda self, ctx: 0.005
    )
    yield {
        **moto_server.storage_options(),
        "endpoint_url": proxy.endpoint,
        "config_kwargs": {"read_timeout": READ_TIMEOUT, "connect_timeout": READ_TIMEOUT},
    }
    proxy.clear()


@pytest.fixture
def store(moto_root, options) -> Store:
    opened = Store(moto_root, storage_options=options)
    assert opened.capabilities.atomic_create  # probed before any fault
    return opened


@pytest.fixture
def direct(moto_server, moto_root) -> Store:
    """The same store without the proxy: what the server really holds."""
    return Store(moto_root, storage_options=moto_server.storage_options())


def test_requests_are_classified():
    assert classify("GET", "/b/store/commits/1.json", []).kind == "get"
    assert classify("GET", "/b?list-type=2&prefix=store/x/", []).key == "store/x/"
    assert classify("PUT", "/b/k", [("If-None-Match", "*")]).kind == "put_if_absent"
    assert classify("PUT", "/b/k", []).kind == "put"
    assert classify("HEAD", "/b/k", []).kind == "head"
    assert classify("DELETE", "/b/k", []).kind == "delete"
    assert classify("POST", "/b?delete", []).kind == "delete"
    assert classify("PUT", "/b", []).kind == "bucket"
    with pytest.raises(ValueError):
        Rule(fault="explode")
    with pytest.raises(ValueError):
        FaultProxy("http://example.com:80")


# --- every request kind, every fault ------------------------------------------------------------


def _operation(kind: str, store: Store, direct: Store, n: int):
    """Set up, then return (call, check) for one request of ``kind``."""
    data = bytes(range(256)) * 40 + b"%d" % n
    if kind == "get":
        direct.put(f"g/{n}", data)
        return lambda: store.get(f"g/{n}"), lambda out: out == data
    if kind == "put":
        return lambda: store.put(f"p/{n}", data), lambda out: direct.get(f"p/{n}") == data
    if kind == "put_if_absent":
        return lambda: store.put_if_absent(f"c/{n}", data), lambda out: direct.get(f"c/{n}") == data
    if kind == "head":
        direct.put(f"h/{n}", data)
        return lambda: store.size(f"h/{n}"), lambda out: out == len(data)
    if kind == "list":
        for i in range(3):
            direct.put(f"l/{n}/{i}", data)
        return lambda: store.list(f"l/{n}"), lambda out: out == [f"l/{n}/{i}" for i in range(3)]
    assert kind == "delete"
    direct.put(f"d/{n}", data)
    return lambda: store.delete(f"d/{n}"), lambda out: not direct.exists(f"d/{n}")


@pytest.mark.parametrize("kind", KINDS)
def test_transient_faults_of_every_request_kind_are_retried_away(
    kind, store, direct, proxy, reliability
):
    for n, (fault, after) in enumerate(TRANSIENT):
        if fault == "truncate" and kind not in ("get", "list"):
            continue  # no response body to cut
        call, check = _operation(kind, store, direct, n)
        with proxy.rule(
            fault=fault,
            kinds=(kind,),
            times=1,
            after=after,
            delay=0.2 if fault == "delay" else READ_TIMEOUT + 0.3,
        ):
            try:
                out = call()
                outcome = "recovered by retry"
            except StoreError:
                # only a conditional PUT may end unknown; a re-read settles it (FORMAT.md §10.4)
                assert kind == "put_if_absent", (fault, after)
                out, outcome = None, "unknown outcome, settled by re-read"
        assert proxy.faults[(kind, fault)] >= 1, "the fault never fired"
        proxy.faults.clear()
        assert check(out), (fault, after)
        reliability.record(
            "S3 faults (moto + proxy)", f"{NAMES[kind]}: {_label(fault, after)}", outcome
        )


@pytest.mark.parametrize("kind", KINDS)
def test_persistent_faults_end_in_a_store_error_in_bounded_time(
    kind, store, direct, proxy, reliability, monkeypatch
):
    # plain PUTs go through s3fs, which retries SlowDown 5 times with its own sleeps (1.9 s)
    # under our 4 tries: 4 x 5 x 3 (botocore) requests; 2 of its tries keep the test short
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 2)
    call, _ = _operation(kind, store, direct, 99)
    with proxy.rule(fault="503", kinds=(kind,)):
        started = time.monotonic()
        with pytest.raises(StoreError) as caught:
            call()
        assert time.monotonic() - started < 10
    assert not isinstance(caught.value, ObjectExistsError)
    reliability.record(
        "S3 faults (moto + proxy)",
        f"{NAMES[kind]}: 503 on every try",
        f"StoreError after {proxy.requests[kind]} tries",
    )


def test_a_conditional_put_resent_under_the_client_is_its_own_create(store, direct, proxy):
    """aiohttp re-sends a PUT whose connection dropped, below botocore: the server then answers
    412 to our own create. The nonce in the object's metadata tells it apart from a rival's."""
    proxy.clear()
    with proxy.rule(fault="reset", kinds=("put_if_absent",), times=1, after=True):
        store.put_if_absent("mine", b"ours")  # landed, answer lost, re-sent: 412, but ours
    assert proxy.requests["put_if_absent"] == 2 and proxy.requests["head"] == 1
    direct.put_if_absent("theirs", b"a rival's")
    with proxy.rule(fault="reset", kinds=("put_if_absent",), times=1, after=True):
        with pytest.raises(ObjectExistsError):
            store.put_if_absent("theirs", b"ours")
    assert direct.get("theirs") == b"a rival's"


# --- publish and sync through faults ------------------------------------------------------------


def _step(state: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    for name in sorted(state):
        flip_bits(state[name], gen, 2)
    return snapshot(state)


def _steps_of_chain(store: Store) -> list[int | None]:
    chain = Chain(store)
    return [chain.record(v).record.step for v in chain.versions()]


def _assert_chain_sound(direct: Store, steps: int) -> None:
    """One record per version, every step once and in order, and a deep verify passes."""
    assert _steps_of_chain(direct) == list(range(steps))
    report = verify(direct, deep=True)
    assert report.ok, report.problems


COMMIT_FAULTS = [
    ("reset", True),
    ("500", True),
    ("hang", True),
    ("reset", False),
    ("503", False),
    ("hang", False),
]


@pytest.mark.parametrize(("fault", "after"), COMMIT_FAULTS)
def test_commit_faults_are_resolved_and_commit_once(
    fault, after, store, direct, proxy, reliability
):
    gen = torch.Generator().manual_seed(1)
    state = make_state(1)
    writer = DeltaWriter(store)
    writer.publish(snapshot(state), step=0)
    expected = _step(state, gen)
    with proxy.rule(
        fault=fault,
        kinds=("put_if_absent",),
        key="/commits/",
        times=1,
        after=after,
        delay=READ_TIMEOUT + 0.3,
    ):
        info = writer.publish(expected, step=1)
    assert proxy.faults[("put_if_absent", fault)] == 1
    assert info.version == writer.version == 1
    assert Chain(direct).record(1).record.attempt == info.attempt
    tensors: dict = {}
    DeltaReader(direct, StateDictTarget(tensors)).sync()
    assert_same_bits(tensors, expected)
    _assert_chain_sound(direct, 2)
    reliability.record(
        "S3 faults: commit (create-if-absent of commits/N)",
        _label(fault, after),
        "committed once; writer knows it",
    )


@pytest.mark.parametrize("landed", [True, False])
def test_unknown_commit_outcome_is_never_committed_twice(
    landed, store, direct, proxy, moto_root, options, reliability
):
    gen = torch.Generator().manual_seed(2)
    state = make_state(2)
    writer = DeltaWriter(store)
    writer.publish(snapshot(state), step=0)
    baseline = snapshot(writer.baseline)
    wanted = _step(state, gen)
    # the create lands (or not) and its answer is lost; every re-read of commits/ fails too
    with (
        proxy.rule(fault="reset", kinds=("put_if_absent",), key="/commits/", after=landed),
        proxy.rule(fault="503", kinds=("get", "head"), key="/commits/"),
    ):
        with pytest.raises(CommitStateUnknownError):
            writer.publish(wanted, step=1)
    assert writer.version == 0
    assert_same_bits(writer.baseline, baseline)
    attempts = direct.list(attempt_prefix(1, "x")[: -len("x/")])
    assert any(k.endswith("manifest-00000.json") for k in attempts), (
        "an unknown attempt was deleted"
    )

    # what an application does next: publish the same step again
    try:
        info = writer.publish(wanted, step=1)
        assert not landed
        assert info.version == 1
        outcome = "not landed: the retry committed the step"
    except CommitConflictError:
        assert landed  # the first create had landed: reopen and find our own step there
        writer = DeltaWriter(Store(moto_root, storage_options=options))
        assert writer.version == 1 and Chain(direct).record(1).record.step == 1
        assert_same_bits(writer.baseline, wanted)
        outcome = "landed: the retry conflicted, the reopened writer found the step committed"
    following = _step(state, gen)
    assert writer.publish(following, step=2).version == 2
    tensors: dict = {}
    DeltaReader(direct, StateDictTarget(tensors)).sync()
    assert_same_bits(tensors, following)
    _assert_chain_sound(direct, 3)
    reliability.record(
        "S3 faults: commit (create-if-absent of commits/N)",
        "answer lost and every re-read failing (CommitStateUnknownError)",
        outcome,
    )


def test_random_faults_on_every_request_kind_publish_sync_and_gc(
    store, direct, proxy, moto_root, options, reliability
):
    """A writer, a reader and gc through 15% faulty requests of every kind and fault."""
    gen = torch.Generator().manual_seed(3)
    state = make_state(3)
    states = [snapshot(state)]
    writer = DeltaWriter(store, base_every=5)
    writer.publish(states[0], step=0)  # before the faults
    tensors: dict = {}
    reader = DeltaReader(Store(moto_root, storage_options=options), StateDictTarget(tensors))
    for fault, after in TRANSIENT:
        proxy.add(
            Rule(
                fault=fault,
                after=after,
                probability=0.15 / len(TRANSIENT),
                delay=0.2 if fault == "delay" else READ_TIMEOUT + 0.3,
            )
        )
    errors: dict[str, int] = {}
    step = 1
    while step <= RANDOM_VERSIONS:
        if len(states) <= step:
            states.append(_step(state, gen))
        try:
            writer.publish(states[step], step=step)
            step += 1
        except (CommitConflictError, CommitStateUnknownError) as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            try:  # learn the outcome from the chain, as an application would
                writer = DeltaWriter(Store(moto_root, storage_options=options), base_every=5)
                if Chain(direct).record(writer.version).record.step == step:
                    step += 1
            except DcrError as reopen:
                errors[type(reopen).__name__] = errors.get(type(reopen).__name__, 0) + 1
        except DcrError as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
        try:
            version = reader.sync().version
        except DcrError as exc:
            errors["reader " + type(exc).__name__] = (
                errors.get("reader " + type(exc).__name__, 0) + 1
            )
        else:
            assert_same_bits(tensors, states[version])  # any version it lands on is exact
    # an abandoned attempt for gc to remove, then gc's listing and deletes through faults
    direct.put(attempt_prefix(99, "f" * 32) + "shard-00000-00000.dcrs", b"orphan")
    for _ in range(10):
        try:
            report = gc(store, keep_last=100, grace=timedelta(0), commit_timeout=timedelta(0))
            break
        except DcrError as exc:
            errors["gc " + type(exc).__name__] = errors.get("gc " + type(exc).__name__, 0) + 1
    else:
        pytest.fail("gc never got through 15% faults in 10 tries")
    fired = dict(proxy.faults)
    proxy.remove_rules()
    assert report.deleted_objects >= 1 and not direct.list("objects/00000000000000000099")
    reader.sync()
    assert_same_bits(tensors, states[RANDOM_VERSIONS])
    _assert_chain_sound(direct, RANDOM_VERSIONS + 1)
    assert sum(fired.values()) >= 10, fired
    kinds = sorted({kind for kind, _ in fired})
    reliability.record(
        "S3 faults: random 15% of requests",
        f"{sum(fired.values())} faults, {len(kinds)} kinds: {RANDOM_VERSIONS} versions, sync, gc",
        "every version committed once; reader exact; chain verifies deep",
        cases=sum(fired.values()),
    )


def _other_digit(body: bytes) -> bytes:
    """A manifest altered in transit so that it still parses: one digit of encoded_bytes."""
    at = body.index(b'"encoded_bytes":') + len(b'"encoded_bytes":')
    return body[:at] + (b"7" if body[at : at + 1] != b"7" else b"8") + body[at + 1 :]


@pytest.mark.parametrize("checksums", [True, False])
def test_bodies_altered_in_transit_are_never_taken(
    checksums, moto_root, options, direct, proxy, reliability
):
    """A response body altered in transit, length kept. botocore checks S3's CRC32 where the
    server sends one (moto does); AWS sends none for ranged GETs, which every size-limited
    read is: ``checksums=False`` turns the check off to cover that case."""
    if not checksums:
        options["config_kwargs"]["response_checksum_validation"] = "when_required"
    store = Store(moto_root, storage_options=options)
    store.capabilities  # noqa: B018
    gen = torch.Generator().manual_seed(4)
    state = make_state(4)
    writer = DeltaWriter(store)
    writer.publish(snapshot(state), step=0)
    wanted = _step(state, gen)
    # the committer reads its manifest back to sign it: altered, it must not be signed
    with proxy.rule(fault="corrupt", kinds=("get",), key="manifest-", times=1, mutate=_other_digit):
        writer.publish(wanted, step=1)
    outcome = (
        "CRC32 mismatch retried; the commit names the true bytes"
        if checksums
        else "committer read it again; the commit names the true bytes"
    )
    assert proxy.faults[("get", "corrupt")] == 1
    reliability.record(
        "S3 faults: body altered in transit",
        "committer's read-back of a manifest" + ("" if checksums else " (no transport checksum)"),
        outcome,
    )
    # a reader whose shard arrives altered refuses the sync and stays where it was
    tensors: dict = {}
    reader = DeltaReader(store, StateDictTarget(tensors))
    reader.sync(to=0)
    before = snapshot(tensors)
    with proxy.rule(fault="corrupt", kinds=("get",), key="shard-", times=1):
        try:
            reader.sync()
            assert checksums  # botocore's CRC32 check failed the read; it was retried
            outcome = "CRC32 mismatch retried; the sync exact"
        except DcrError as exc:
            assert not checksums
            assert_same_bits(tensors, before)
            outcome = f"{type(exc).__name__}, target untouched; the next sync exact"
            reader.sync()
    assert proxy.faults[("get", "corrupt")] == 2
    assert_same_bits(tensors, wanted)
    _assert_chain_sound(direct, 2)
    reliability.record(
        "S3 faults: body altered in transit",
        "a shard read by a reader" + ("" if checksums else " (no transport checksum)"),
        outcome,
    )


def _garbled_timestamp(body: bytes) -> bytes:
    """A listing whose first LastModified no longer parses (botocore raised a bare ValueError)."""
    at = body.index(b"<LastModified>") + len(b"<LastModified>") + 19
    return body[:at] + b"n" + body[at + 1 :]


@pytest.mark.parametrize("times", [1, None])
def test_a_garbled_listing_is_a_store_error_never_a_bare_exception(
    times, store, direct, proxy, reliability
):
    direct.put("l/a", b"1")
    rule = Rule(fault="corrupt", kinds=("list",), times=times, mutate=_garbled_timestamp)
    with proxy.rule(rule):
        if times == 1:
            assert store.list("l") == ["l/a"]
            outcome = "recovered by retry"
        else:
            with pytest.raises(StoreError):
                store.list("l")
            outcome = "StoreError after every try"
    assert rule.fired >= 1
    reliability.record(
        "S3 faults (moto + proxy)",
        "LIST: a timestamp garbled in transit" + (" on every try" if times is None else ""),
        outcome,
    )
