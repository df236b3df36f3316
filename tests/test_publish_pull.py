"""End to end: writers publish chains into a local store, readers pull them bit-exactly."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    assert_same_bits,
    bits,
    flip_bits,
    make_state,
    random_tensor,
    run_ranks,
    snapshot,
    step_state,
)
from safetensors.torch import load_file

from dcr_format import (
    DeltaReader,
    DeltaWriter,
    SafetensorsDirTarget,
    StateDictTarget,
    Store,
    ThreadCoordinator,
    owner,
    replay,
)
from dcr_format.chain.chain import Chain, attempt_prefix
from dcr_format.format.dtypes import info_for


def _dense_bytes(state):
    return sum(t.numel() * t.element_size() for t in state.values())


def _numel(state):
    return sum(t.numel() for t in state.values())


def _attempt_bytes(store: Store, version: int, attempt: str) -> int:
    return sum(store.size(k) for k in store.list(attempt_prefix(version, attempt)))


# --- 1. a long chain with periodic bases ------------------------------------------------


def test_chain_with_periodic_bases_is_bit_exact_at_every_version(store_url):
    gen = torch.Generator().manual_seed(1)
    state = make_state(1)
    writer = DeltaWriter(store_url, base_every=5)
    target = StateDictTarget({})
    reader = DeltaReader(store_url, target)
    store = Store(store_url)
    pointers = None
    for version in range(22):
        changed = step_state(state, gen) if version else 0
        info = writer.publish(state, step=100 + version)
        assert info.version == version == writer.version
        assert info.step == 100 + version
        assert info.kind == ("base" if version % 5 == 0 else "delta")
        assert info.tensors == len(state)
        assert info.total_elements == _numel(state)
        assert info.dense_bytes == _dense_bytes(state)
        if info.kind == "base":
            assert info.changed_elements == info.total_elements
        else:
            assert info.changed_elements == changed
            assert 0 < info.payload_bytes < info.dense_bytes
        assert info.payload_bytes == _attempt_bytes(store, version, info.attempt)
        record = Chain(store).record(version).record
        assert (info.state_fingerprint, info.created) == (record.state_fingerprint, record.created)

        result = reader.sync()
        assert result.version == version
        assert result.previous == (None if version == 0 else version - 1)
        assert result.applied_versions == (version,)
        assert result.payload_bytes == info.payload_bytes
        assert target.resident().version == version
        assert_same_bits(target.tensors, state)
        assert_same_bits(writer.baseline, state)
        # the reader updates in place: a model holding these tensors sees every version
        now = {n: t.data_ptr() for n, t in target.tensors.items()}
        assert pointers is None or now == pointers
        pointers = now
    assert Chain(store).versions() == list(range(22))


def test_explicit_ops_are_honoured_and_bit_exact(store_url):
    gen = torch.Generator().manual_seed(2)
    state = make_state(2)
    names = sorted(state)
    ops = {names[0]: "overwrite", names[1]: "full", names[2]: "xor"}
    writer = DeltaWriter(store_url, ops=ops)
    target = StateDictTarget({})
    reader = DeltaReader(store_url, target)
    chain = Chain(Store(store_url))
    for version in range(4):
        if version:
            for name in names:
                flip_bits(state[name], gen, 2)
        writer.publish(state)
        reader.sync()
        assert_same_bits(target.tensors, state)
        if version:
            entries = {e.name: e for m in chain.manifests(chain.record(version)) for e in m.entries}
            for name, op in ops.items():
                assert entries[name].op == op


def test_many_small_shards_and_unusual_inputs(store_url):
    gen = torch.Generator().manual_seed(14)
    state = make_state(14)
    state["model.transposed.weight"] = torch.randn(16, 8, generator=gen).t()  # not contiguous
    state["model.scalar"] = torch.tensor(1.5)
    state["model.empty"] = torch.empty(0, 4)
    writer = DeltaWriter(store_url, shard_bytes=64)
    target = StateDictTarget({})
    reader = DeltaReader(store_url, target)
    chain = Chain(Store(store_url))
    for version in range(4):
        if version:
            for name in ("model.transposed.weight", "model.scalar", "lm_head.weight"):
                _flip_one_bit(state, name, gen)
            step_state({n: t for n, t in state.items() if t.is_contiguous()}, gen)
        writer.publish(iter(list(state.items())))  # pairs, not a mapping
        reader.sync()
        assert_same_bits(target.tensors, state)
        shards = [s for m in chain.manifests(chain.record(version)) for s in m.shards]
        assert len(shards) > (5 if version == 0 else 0)


def _flip_one_bit(state, name, gen):
    """Flip a bit of a possibly non-contiguous tensor, through a contiguous copy of its bits."""
    tensor = state[name]
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    copy = tensor.contiguous().clone()
    flip_bits(copy, gen, 1)
    tensor.view(as_int).copy_(copy.view(as_int))


# --- 2. late joiners and skipping readers -------------------------------------------------


def test_late_joiner_starts_from_newest_base(store_url):
    gen = torch.Generator().manual_seed(3)
    state = make_state(3)
    writer = DeltaWriter(store_url, base_every=5)
    for version in range(13):
        if version:
            step_state(state, gen)
        writer.publish(state)
    target = StateDictTarget({})
    result = DeltaReader(store_url, target).sync()
    assert result.previous is None
    assert result.version == 12
    assert result.applied_versions == (10, 11, 12)
    assert_same_bits(target.tensors, state)


def test_reader_that_skips_versions_applies_those_in_between(store_url):
    gen = torch.Generator().manual_seed(4)
    state = make_state(4)
    writer = DeltaWriter(store_url)  # no base after 0 (from one, a plan may start there)
    states = []
    for version in range(21):
        if version:
            step_state(state, gen)
        writer.publish(state)
        states.append(snapshot(state))
    target = StateDictTarget({})
    reader = DeltaReader(store_url, target)
    assert reader.sync(to=3).applied_versions == (0, 1, 2, 3)
    assert_same_bits(target.tensors, states[3])
    result = reader.sync()
    assert result.previous == 3
    assert result.applied_versions == tuple(range(4, 21))
    assert_same_bits(target.tensors, states[20])
    assert reader.sync().applied_versions == ()  # already there: nothing to do


def test_base_may_drop_and_add_tensors(store_url):
    state = make_state(5)
    writer = DeltaWriter(store_url, base_every=2)
    target = StateDictTarget({})
    reader = DeltaReader(store_url, target)
    writer.publish(state)
    writer.publish(state)
    reader.sync()
    dropped = state.pop("lm_head.weight")
    state["model.new.weight"] = torch.arange(6, dtype=torch.float32)
    info = writer.publish(state)
    assert info.kind == "base"
    reader.sync()
    assert_same_bits(target.tensors, state)
    assert "lm_head.weight" not in target.tensors
    del dropped


# --- 3. replay ---------------------------------------------------------------------------


def test_replay_of_every_version_matches_the_trainer(store_url, tmp_path):
    gen = torch.Generator().manual_seed(6)
    state = make_state(6)
    writer = DeltaWriter(store_url, base_every=4)
    states = []
    for version in range(8):
        if version:
            step_state(state, gen)
        writer.publish(state)
        states.append(snapshot(state))
    for version, expected in enumerate(states):
        out = tmp_path / f"replay-{version}"
        result = replay(store_url, version, out)
        assert result.version == version
        assert_same_bits(load_file(str(out / "model.safetensors")), expected)
    # a replay directory moves forward incrementally
    out = tmp_path / "moving"
    replay(store_url, 1, out)
    assert replay(store_url, 3, out).applied_versions == (2, 3)
    result = replay(store_url, 6, out)
    assert result.applied_versions == (4, 5, 6)
    assert_same_bits(load_file(str(out / "model.safetensors")), states[6])


# --- 4. several writer ranks ---------------------------------------------------------------


def _rank_states(seed: int, versions: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    state = make_state(seed)
    for i in range(6):
        state[f"model.extra.{i}.weight"] = torch.randn(8, 4, generator=gen).bfloat16()
    states = [snapshot(state)]
    for _ in range(versions - 1):
        step_state(state, gen)
        states.append(snapshot(state))
    return states


@pytest.mark.parametrize("handed", ["all", "own"])
def test_four_thread_ranks_publish_jointly(store_url, handed):
    world = 4
    states = _rank_states(7, 5)
    assert len({owner(n, world) for n in states[0]}) == world  # every rank owns something
    coordinator = ThreadCoordinator(world, timeout=30)
    writers = [
        DeltaWriter(store_url, rank=r, world_size=world, coordinator=coordinator, base_every=3)
        for r in range(world)
    ]

    def tensors_for(rank: int, state):
        if handed == "all":
            return state
        return {n: t for n, t in state.items() if owner(n, world) == rank}

    target = StateDictTarget({})
    reader = DeltaReader(store_url, target)
    chain = Chain(Store(store_url))
    for version, state in enumerate(states):
        results, errors = run_ranks(
            world, lambda r, s=state, v=version: writers[r].publish(tensors_for(r, s), step=v)
        )
        assert errors == [None] * world
        assert {info.version for info in results} == {version}
        assert len({info.attempt for info in results}) == 1
        assert [w.version for w in writers] == [version] * world
        for rank, w in enumerate(writers):
            assert_same_bits(
                w.baseline, {n: t for n, t in state.items() if owner(n, world) == rank}
            )

        loaded = chain.record(version)
        assert loaded.record.world_size == world
        assert sorted(ref.rank for ref in loaded.record.manifests) == list(range(world))
        listed: dict[str, int] = {}
        for manifest in chain.manifests(loaded):
            for entry in manifest.entries:
                assert entry.name not in listed, f"{entry.name} is in two manifests"
                listed[entry.name] = manifest.rank
        assert listed == {n: owner(n, world) for n in state}

        reader.sync()
        assert_same_bits(target.tensors, state)


# --- 5. every dtype, special values -----------------------------------------------------------

_SPECIALS = {
    "float16": [0x7E01, 0xFC01, 0x7C01, 0x8000, 0x7C00, 0xFC00, 0x0001, 0x83FF],
    "bfloat16": [0x7FC1, 0xFF81, 0x7F81, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x807F],
    "float32": [
        0x7FC00001,
        0xFFBADBAD,
        0x7F800001,
        0x80000000,
        0x7F800000,
        0xFF800000,
        0x00000001,
        0x807FFFFF,
    ],
    "float64": [
        0x7FF8000000000001,
        0xFFF0000000000001,
        0x7FF4000000000000,
        0x8000000000000000,
        0x7FF0000000000000,
        0xFFF0000000000000,
        0x0000000000000001,
        0x800FFFFFFFFFFFFF,
    ],
    "float8_e4m3fn": [0x7F, 0xFF, 0x7E, 0x80, 0xFE, 0x01, 0x87, 0x00],
    "float8_e5m2": [0x7D, 0xFE, 0x7F, 0x80, 0x7C, 0xFC, 0x01, 0x83],
    "int8": [0x80, 0x7F, 0xFF, 0x00],
    "uint8": [0xFF, 0x00, 0x80, 0x01],
    "int16": [0x8000, 0x7FFF, 0xFFFF],
    "int32": [0x80000000, 0x7FFFFFFF, 0xFFFFFFFF],
    "int64": [0x8000000000000000, 0x7FFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFFFF],
}
ALL_DTYPES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
    "float32", "float64", "float8_e4m3fn", "float8_e5m2",
]  # fmt: skip


def _with_specials(dtype_name: str, gen: torch.Generator) -> torch.Tensor:
    info = info_for(dtype_name)
    tensor = random_tensor(info.torch_dtype, (7, 9), gen)
    patterns = _SPECIALS.get(dtype_name, [])
    if patterns:
        bits_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[info.width]
        top = 1 << (8 * info.width)
        signed = [p - top if info.width > 1 and p >= top // 2 else p for p in patterns]
        tensor.view(bits_dtype).reshape(-1)[: len(signed)] = torch.tensor(signed, dtype=bits_dtype)
    return tensor


@pytest.mark.parametrize("op", [None, "overwrite"])
def test_every_dtype_and_special_value_reaches_both_targets(store_url, tmp_path, op):
    gen = torch.Generator().manual_seed(8)
    state = {f"t.{name}": _with_specials(name, gen) for name in ALL_DTYPES}
    assert {info_for(t.dtype).name for t in state.values()} == set(ALL_DTYPES)
    for name in ("t.float16", "t.bfloat16", "t.float32", "t.float64"):
        flat = state[name].reshape(-1)
        assert flat[0].isnan() and flat[1].isnan() and flat[3] == 0 and flat[3].signbit()
        tiny = torch.finfo(state[name].dtype).tiny  # smallest normal: below it, subnormal
        assert flat[4].isinf() and flat[6] != 0 and flat[6].abs() < tiny
    ops = dict.fromkeys(state, op) if op else None
    writer = DeltaWriter(store_url, ops=ops, base_every=4)
    dict_target = StateDictTarget({})
    dict_reader = DeltaReader(store_url, dict_target, verify="all")
    dir_target = SafetensorsDirTarget(tmp_path / "ckpt")
    dir_reader = DeltaReader(store_url, dir_target, verify="all")
    for version in range(6):
        changed = 0
        if version == 1:
            # changes a float comparison cannot see: NaN payload bits and the sign of zero
            for name in ("t.float32", "t.bfloat16", "t.float16", "t.float64"):
                flat = (
                    state[name]
                    .view(
                        {2: torch.int16, 4: torch.int32, 8: torch.int64}[state[name].element_size()]
                    )
                    .reshape(-1)
                )
                flat[0] ^= 1  # NaN -> NaN with another payload
                flat[3] ^= flat[3].clone()  # -0.0 -> +0.0
                changed += 2
        elif version:
            for tensor in state.values():
                changed += flip_bits(tensor, gen, 5)
        info = writer.publish(state)
        if info.kind == "delta":
            assert info.changed_elements == changed
        dict_reader.sync()
        dir_reader.sync()
        assert_same_bits(dict_target.tensors, state)
        assert_same_bits(load_file(str(tmp_path / "ckpt" / "model.safetensors")), state)
        assert dir_target.resident().version == version


# --- 6. unchanged versions ---------------------------------------------------------------------


def test_version_without_changes_is_still_a_version(store_url, tmp_path):
    state = make_state(9)
    writer = DeltaWriter(store_url)
    target = StateDictTarget({})
    reader = DeltaReader(store_url, target)
    dir_target = SafetensorsDirTarget(tmp_path / "ckpt")
    dir_reader = DeltaReader(store_url, dir_target)
    writer.publish(state)
    reader.sync()
    dir_reader.sync()
    for version in (1, 2):
        info = writer.publish(state)
        assert (info.version, info.kind, info.changed_elements) == (version, "delta", 0)
        assert info.total_elements == _numel(state)
        assert info.payload_bytes > 0  # the manifests still exist
        assert reader.sync().applied_versions == (version,)
        assert target.resident().version == version
        assert dir_reader.sync().applied_versions == (version,)
        assert dir_target.resident().version == version
    assert_same_bits(target.tensors, state)
    assert_same_bits(load_file(str(tmp_path / "ckpt" / "model.safetensors")), state)


# --- 7. restarting writers ---------------------------------------------------------------------


class _ShardGets:
    """Counts Store.get calls for shard objects (the replay path of a restarting writer)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = Store.get

        def get(store, key, **kwargs):
            if "/shard-" in key:
                self.count += 1
            return original(store, key, **kwargs)

        monkeypatch.setattr(Store, "get", get)


def _publish_run(writer, state, gen, versions, states):
    for _ in range(versions):
        if writer.version is not None:
            step_state(state, gen)
        writer.publish(state)
        states.append(snapshot(state))


def test_restarted_writer_continues_the_chain(store_url):
    gen = torch.Generator().manual_seed(10)
    state, states = make_state(10), []
    _publish_run(DeltaWriter(store_url, base_every=10), state, gen, 4, states)
    again = DeltaWriter(store_url, base_every=10)
    assert again.version == 3
    assert_same_bits(again.baseline, states[3])
    changed = step_state(state, gen)
    info = again.publish(state)
    assert (info.version, info.kind, info.changed_elements) == (4, "delta", changed)
    target = StateDictTarget({})
    DeltaReader(store_url, target).sync()
    assert_same_bits(target.tensors, state)


def test_restarted_writer_uses_its_cache(store_url, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    gen = torch.Generator().manual_seed(11)
    state, states = make_state(11), []
    _publish_run(DeltaWriter(store_url, cache_dir=cache), state, gen, 4, states)
    gets = _ShardGets(monkeypatch)
    again = DeltaWriter(store_url, cache_dir=cache)
    assert again.version == 3
    assert gets.count == 0, "the writer replayed the store although its cache was valid"
    assert_same_bits(again.baseline, states[3])
    step_state(state, gen)
    assert again.publish(state).kind == "delta"
    target = StateDictTarget({})
    DeltaReader(store_url, target).sync()
    assert_same_bits(target.tensors, state)


def test_restarted_writer_catches_up_a_stale_cache(store_url, tmp_path):
    cache = tmp_path / "cache"
    gen = torch.Generator().manual_seed(12)
    state, states = make_state(12), []
    _publish_run(DeltaWriter(store_url, cache_dir=cache), state, gen, 3, states)
    _publish_run(DeltaWriter(store_url), state, gen, 2, states)  # no cache: it stays at 2
    again = DeltaWriter(store_url, cache_dir=cache)
    assert again.version == 4
    assert_same_bits(again.baseline, states[4])


def test_restarted_writer_falls_back_to_replay_when_the_cache_is_corrupt(
    store_url, tmp_path, monkeypatch
):
    from safetensors.torch import save_file

    cache = tmp_path / "cache"
    gen = torch.Generator().manual_seed(13)
    state, states = make_state(13), []
    first = DeltaWriter(store_url, cache_dir=cache)
    _publish_run(first, state, gen, 4, states)
    cached = cache / first.chain.header.chain_id / "rank-00000-of-00001" / "baseline.safetensors"
    assert cached.exists()
    damaged = load_file(str(cached))
    name = sorted(damaged)[0]
    flip_bits(damaged[name], gen, 1)
    assert not torch.equal(bits(damaged[name]), bits(states[3][name]))
    save_file(damaged, str(cached))

    gets = _ShardGets(monkeypatch)
    again = DeltaWriter(store_url, cache_dir=cache)
    assert again.version == 3
    assert gets.count > 0, "the damaged cache was not replaced by a replay from the store"
    assert_same_bits(again.baseline, states[3])
    changed = step_state(state, gen)
    info = again.publish(state)
    assert (info.version, info.kind, info.changed_elements) == (4, "delta", changed)
    target = StateDictTarget({})
    DeltaReader(store_url, target).sync()
    assert_same_bits(target.tensors, state)
    # the cache was rewritten with good bits: the next restart uses it again
    gets.count = 0
    assert DeltaWriter(store_url, cache_dir=cache).version == 4
    assert gets.count == 0


def test_a_restarted_writer_reads_its_cache_for_its_check_once(store_url, tmp_path, monkeypatch):
    """The cache is written without being read back or hashed; reopening at the cached
    version computes each tensor's fingerprint lanes once, checks them against the chain and
    keeps them, so the next publish reads no tensor for its lanes; a byte changed in place
    is a miss (replayed from the store), and so is a cache of another version's bits."""
    import hashlib
    import json

    from dcr_format.publish import _canonical

    cache = tmp_path / "cache"
    gen = torch.Generator().manual_seed(14)
    state, states = make_state(14), []
    lanes_of: list[str] = []
    real_lanes, real_digest = _canonical.tensor_lanes, hashlib.file_digest
    digests: list[str] = []

    def spy_lanes(tensor):  # type: ignore[no-untyped-def]
        lanes_of.append("lanes")
        return real_lanes(tensor)

    def spy_digest(file, digest):  # type: ignore[no-untyped-def]
        digests.append(getattr(file, "name", "?"))
        return real_digest(file, digest)

    monkeypatch.setattr(_canonical, "tensor_lanes", spy_lanes)
    monkeypatch.setattr(hashlib, "file_digest", spy_digest)
    first = DeltaWriter(store_url, cache_dir=cache)
    _publish_run(first, state, gen, 2, states)
    folder = cache / first.chain.header.chain_id / "rank-00000-of-00001"
    cached, meta_path = folder / "baseline.safetensors", folder / "baseline.json"
    gets = _ShardGets(monkeypatch)

    def reopen() -> DeltaWriter:
        gets.count = 0
        lanes_of.clear()
        again = DeltaWriter(store_url, cache_dir=cache)
        assert again.version == len(states) - 1
        assert_same_bits(again.baseline, states[-1])
        return again

    again = reopen()
    # one pass over each cached tensor, checked against the chain: nothing replayed
    assert (gets.count, len(lanes_of)) == (0, len(states[-1]))
    lanes_of.clear()
    changed = step_state(state, gen)
    info = again.publish(state)  # new fingerprints from the kept lanes and the diff
    assert (info.version, info.changed_elements, lanes_of) == (2, changed, [])
    assert digests == []  # no file of the cache was read back to be hashed
    states.append(snapshot(state))
    target = StateDictTarget({})
    DeltaReader(store_url, target).sync()
    assert_same_bits(target.tensors, state)
    del again
    good = cached.read_bytes()
    damaged = bytearray(good)
    damaged[-1] ^= 0x01  # the last byte of the last tensor's data
    cached.write_bytes(bytes(damaged))
    reopen()
    assert gets.count > 0  # its fingerprints differ: replayed
    # a cache of an older writer (lanes and sha256 recorded) is checked the same way
    meta = json.loads(meta_path.read_text())
    meta.update(lanes={}, sha256="0" * 64)
    meta_path.write_text(json.dumps(meta))
    cached.write_bytes(good)
    reopen()
    assert gets.count == 0 and len(lanes_of) == len(states[2])
    # bits of another version under this version's name: refused by the chain's fingerprints
    meta_path.write_text(json.dumps({"version": 1}))
    cached.write_bytes(good)  # version 2's bits
    reopen()
    assert gets.count > 0
