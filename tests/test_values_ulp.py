"""The ``values-ulp`` feature end to end (FORMAT.md §7.5): zigzag ulp differences against the
old bits, rANS-coded, where that is shorter than the XOR values; readers turn them back into
XOR bits against the tensor they apply to, and refuse what they cannot check. The refusals
are checked for ``values-ulp-shift`` (§7.6) alike; its own tests are in
``test_values_ulp_shift.py``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_positions_classed import SHAPES, Trainer, entries, equal, shard_bytes

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget
from dcr_format.chain.chain import Chain, check_manifest
from dcr_format.codings import ulp, values
from dcr_format.errors import (
    BaselineMismatchError,
    FingerprintMismatchError,
    SchemaError,
    UnsupportedFeatureError,
    ValuesError,
)
from dcr_format.format import features, schema
from dcr_format.store.store import open_store

FEATURES = ["values-rans", "values-ulp"]


def value_codings(store: Path, version: int) -> dict[str, str | None]:
    chain = Chain(open_store(store))
    return {
        e.name: e.values.coding if e.values else None
        for m in chain.manifests(chain.record(version))
        for e in m.entries
    }


@pytest.mark.parametrize("width", [2, 4, 8])
def test_differences_are_a_bijection_of_every_pattern(width: int) -> None:
    rng = np.random.default_rng(width)
    kind = {2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    top = 1 << (8 * width - 1)
    special = np.array([0, top, top - 1, 2 * top - 1, 1, top + 1], dtype=np.uint64).astype(kind)
    old = np.concatenate([special, rng.integers(0, 2**63, 5000, dtype=np.uint64).astype(kind)])
    new = np.concatenate(
        [special[::-1], rng.integers(0, 2**63, 5000, dtype=np.uint64).astype(kind)]
    )
    z = ulp.to_ulp(old, new)
    assert z.dtype == kind and np.array_equal(ulp.from_ulp(old, z), new)
    # the compiled loops against the numpy reference, both ways (random z included)
    assert np.array_equal(z, ulp._to_ulp_reference(old, new))
    noise = rng.integers(0, 2**63, old.size, dtype=np.uint64).astype(kind)
    assert np.array_equal(ulp.from_ulp(old, noise), ulp._from_ulp_reference(old, noise))
    # the writer's fused loop: read at positions, no gathered copies
    positions = np.sort(rng.choice(old.size, 700, replace=False)).astype(np.int64)
    after = old.copy()
    after[positions] = new[positions]
    xor = old[positions] ^ new[positions]
    z_at = ulp.ulp_of_change(after, positions, xor)
    assert np.array_equal(z_at, ulp._to_ulp_reference(old[positions], new[positions]))
    assert np.array_equal(old[positions] ^ ulp.from_ulp(old[positions], z_at), xor)
    # one step in value order is 1 (down) or 2 (up), whatever the sign; -0.0 and +0.0 are
    # neighbours
    floats = {2: np.float16, 4: np.float32, 8: np.float64}[width]
    x = np.array([1.0, -1.0, 3e-5, -7.5, 65000.0], dtype=floats)
    up = np.nextafter(x, floats(np.inf)).view(kind)
    down = np.nextafter(x, floats(-np.inf)).view(kind)
    assert set(ulp.to_ulp(x.view(kind), up).tolist()) == {2}
    assert set(ulp.to_ulp(x.view(kind), down).tolist()) == {1}
    zeros = np.array([-0.0, 0.0], dtype=floats).view(kind)
    assert ulp.to_ulp(zeros[:1], zeros[1:]).tolist() == [2]
    with pytest.raises(ValuesError):
        ulp.to_ulp(np.zeros(2, np.uint8), np.zeros(2, np.uint8))


def test_the_writer_codes_only_the_coding_of_smaller_estimate() -> None:
    rng = np.random.default_rng(21)
    old = (rng.normal(size=20_000).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    # one-ulp steps: the XOR bits carry through the mantissa (1, 3, 7, ...), the ulp
    # differences are 1 and 2 only
    steps = rng.choice(np.array([1, -1], dtype=np.int64), old.size)
    stepped = ulp._unorder(
        ((ulp._order(old, 2).astype(np.int64) + steps) % 65536).astype(np.uint16), 2
    )
    # the last bit flipped everywhere: one XOR value, ulp differences of both signs
    flipped = old ^ np.uint16(1)
    allowed = ("rans", "ulp")
    for new, expected in ((stepped, "ulp"), (flipped, "rans")):
        xor, z = old ^ new, ulp.to_ulp(old, new)
        coding, stream = values.encode_xor_values(xor, z, codings=allowed)
        assert coding == expected
        other = values.encode_values(z if expected == "rans" else xor, codings=("rans",))
        assert other[0] == "rans" and len(stream) <= len(other[1])  # the shorter one
        decoded = values.decode_values("rans", stream, count=old.size, width=2)
        assert np.array_equal(decoded, z if expected == "ulp" else xor)
    # without values-rans the XOR bits are planes: ulp must beat them compressed
    stepped_z, flipped_z = ulp.to_ulp(old, stepped), ulp.to_ulp(old, flipped)
    assert values.encode_xor_values(old ^ stepped, stepped_z, codings=("ulp",))[0] == "ulp"
    planes = values.encode_xor_values(old ^ flipped, flipped_z, codings=("ulp",))
    assert planes[0] == "planes"


@pytest.mark.parametrize(
    ("smaller_than", "allowed", "coding", "lr", "seed"),
    [
        pytest.param(("values-rans",), tuple(FEATURES), "ulp", 2e-6, 6, id="ulp-vs-rans"),
        pytest.param(
            tuple(FEATURES),
            (*FEATURES, "values-ulp-shift"),
            "ulp-shift",
            1e-4,
            16,
            id="ulp-shift-vs-ulp",
        ),
    ],
)
def test_the_chain_is_smaller_and_reads_back_exactly(
    tmp_path: Path,
    smaller_than: tuple[str, ...],
    allowed: tuple[str, ...],
    coding: str,
    lr: float,
    seed: int,
) -> None:
    plain_store, coded_store = tmp_path / "plain", tmp_path / "coded"
    plain = DeltaWriter(plain_store, features=smaller_than)
    coded = DeltaWriter(coded_store, features=allowed)
    trainer = Trainer(seed, SHAPES, lr=lr)
    states = [trainer.state()]
    for writer in (plain, coded):
        writer.publish(states[0])
    reader = DeltaReader(coded_store, target := StateDictTarget({}))
    reader.sync()
    for version in range(1, 4):
        states.append(trainer.step())
        for writer in (plain, coded):
            writer.publish(states[-1])
        if version == 2:
            reader.apply(reader.prepare())  # staged: the differences resolved before the pause
        else:
            reader.sync()
        assert equal(target.tensors, states[-1])
    assert value_codings(coded_store, 3)["a.weight"] == coding
    record = Chain(open_store(coded_store)).record(3).record
    assert features.CODING_FEATURES[coding] in record.required_features
    assert shard_bytes(coded_store, 3) < 0.95 * shard_bytes(plain_store, 3)
    fresh = StateDictTarget({})
    DeltaReader(coded_store, fresh).sync(to=0)
    assert DeltaReader(coded_store, fresh).sync().applied_versions == (1, 2, 3)
    assert equal(fresh.tensors, states[-1])


def test_all_codings_against_the_old_bits_together(tmp_path: Path) -> None:
    store = tmp_path / "store"
    writer = DeltaWriter(store, features=[*FEATURES, "positions-classed", "manifest-zstd"])
    trainer = Trainer(7, SHAPES)
    states = [trainer.state()]
    writer.publish(states[0])
    for _ in range(2):
        states.append(trainer.step())
        writer.publish(states[-1])
    assert entries(store, 2)["a.weight"]["positions"] == "classed"
    assert value_codings(store, 2)["a.weight"] == "ulp"
    target = StateDictTarget({})
    DeltaReader(store, target).sync()
    assert equal(target.tensors, states[-1])


# each coding against the old bits of values: its writer features, the coding, and a step
# size that makes the writer pick it (one-ulp steps for ulp; larger ones, scaled by the old
# exponent, for ulp-shift)
CODINGS = [
    pytest.param(tuple(FEATURES), "ulp", 2e-6, id="ulp"),
    pytest.param((*FEATURES, "values-ulp-shift"), "ulp-shift", 1e-4, id="ulp-shift"),
]


@pytest.mark.parametrize("audit", [True, False])
@pytest.mark.parametrize(("allowed", "coding", "lr"), CODINGS)
def test_an_edited_target_is_refused_and_left_as_it_was(
    tmp_path: Path, audit: bool, allowed: tuple[str, ...], coding: str, lr: float
) -> None:
    store = tmp_path / "store"
    writer = DeltaWriter(store, features=allowed)
    trainer = Trainer(8, SHAPES, lr=lr)
    writer.publish(trainer.state())
    target = StateDictTarget({})
    reader = DeltaReader(store, target)
    reader.sync()
    writer.publish(trainer.step())
    assert value_codings(store, 1)["a.weight"] == coding
    tensor = target.tensors["a.weight"]
    tensor.view(-1)[:4096] *= 8  # outside dcr (for ulp-shift: other exponents, so shifts)
    edited = tensor.clone()
    with pytest.raises((BaselineMismatchError, FingerprintMismatchError)):
        reader.sync(audit=audit)
    assert torch.equal(target.tensors["a.weight"].view(torch.int16), edited.view(torch.int16))
    assert target.resident().version == 0


@pytest.mark.parametrize(("allowed", "coding", "lr"), CODINGS)
def test_manifests_that_break_the_rules_are_refused(
    tmp_path: Path, allowed: tuple[str, ...], coding: str, lr: float
) -> None:
    store = tmp_path / "store"
    writer = DeltaWriter(store, features=allowed)
    trainer = Trainer(9, {"a.weight": (64, 512)}, lr=lr)
    writer.publish(trainer.state())
    writer.publish(trainer.step())
    loaded = Chain(open_store(store)).record(1)
    ref = loaded.record.manifests[0]
    raw = json.loads(open_store(store).get(ref.path))
    assert raw["entries"][0]["values"]["coding"] == coding
    feature = features.CODING_FEATURES[coding]

    def check(tree: dict[str, object]) -> None:
        manifest = schema.parse(schema.Manifest, json.dumps(tree).encode(), what="m")
        record = loaded.record
        check_manifest(manifest, record.chain_id, 1, "delta", record.attempt, 0, 1, "m")

    check(raw)
    for field, value, match in (
        ("required_features", [f for f in raw["required_features"] if f != feature], feature),
        ("op", "overwrite", "only xor entries"),
        ("dtype", "int16", "only xor entries"),
    ):
        broken = json.loads(json.dumps(raw))
        if field == "required_features":
            broken[field] = value
        else:
            broken["entries"][0][field] = value
        with pytest.raises(SchemaError, match=match):
            check(broken)


@pytest.mark.parametrize(("allowed", "coding", "lr"), CODINGS)
def test_a_reader_without_the_feature_refuses_the_version(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    allowed: tuple[str, ...],
    coding: str,
    lr: float,
) -> None:
    store = tmp_path / "store"
    writer = DeltaWriter(store, features=allowed)
    trainer = Trainer(10, {"a.weight": (64, 512)}, lr=lr)
    writer.publish(trainer.state())
    target = StateDictTarget({})
    DeltaReader(store, target).sync()
    writer.publish(trainer.step())
    assert value_codings(store, 1)["a.weight"] == coding
    feature = features.CODING_FEATURES[coding]
    monkeypatch.setattr(schema, "KNOWN_FEATURES", schema.KNOWN_FEATURES - {feature})
    with pytest.raises(UnsupportedFeatureError, match=feature):
        DeltaReader(store, target).sync()
    assert target.resident().version == 0


@pytest.mark.parametrize("width", [2, 4, 8])
def test_the_fused_ulp_apply_equals_xor_bits_applied(width: int) -> None:
    """On the CPU a ulp change is applied in one pass (old bits read, stepped, new bits
    written, lanes summed): the same bits, before/after and lane deltas as turning the
    differences into XOR bits first and applying those; staging gives the same too."""
    from dcr_format.delta import dispatch

    torch_kind = {2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    kind = {2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    rng = np.random.default_rng(30 + width)
    old = rng.integers(0, 2**63, 50_000, dtype=np.uint64).astype(kind)
    positions = np.sort(rng.choice(old.size, 900, replace=False)).astype(np.int64)
    z = rng.integers(0, 2**63, positions.size, dtype=np.uint64).astype(kind)
    z[:300] = rng.integers(1, 5, 300).astype(kind)  # small steps, and any pattern
    flat = torch.from_numpy(old.copy()).view(torch_kind)
    where = torch.from_numpy(positions)
    values = torch.from_numpy(z.copy()).view(torch_kind)
    assert dispatch.fuses_ulp(flat, where)
    expected = flat.clone()
    at = old[positions]
    xor = torch.from_numpy(at ^ ulp.from_ulp(at, z)).view(torch_kind)
    before_x, lanes_x = dispatch.apply_with_lanes(expected, where, xor, op="xor")
    staged = dispatch.stage_change(flat, where, values, op="ulp")
    before, after, lanes = dispatch.apply_ulp_with_lanes(flat, where, values)
    assert torch.equal(flat, expected) and torch.equal(before, before_x)
    assert torch.equal(after, before_x ^ xor) and lanes == lanes_x
    assert torch.equal(staged[0], before) and torch.equal(staged[1], after)
    assert staged[2] == lanes
    for bad in (
        lambda: dispatch.scatter(flat, where, values, op="ulp"),
        lambda: dispatch.apply_with_lanes(flat, where, values, op="ulp"),
    ):
        with pytest.raises(ValueError):
            bad()
    # the old bits given (as resolve() keeps them): not read again. Given bits that differ
    # from the tensor's at one position show it: that position is stepped from the given
    # bits; bits of another shape or dtype are ignored (read from the tensor)
    given = torch.from_numpy(at.copy()).view(torch_kind)
    given[5] ^= 1
    for offered, moved in ((given, True), (given[1:], False), (given.view(torch.uint8), False)):
        again = torch.from_numpy(old.copy()).view(torch_kind)
        got = dispatch.apply_ulp_with_lanes(again, where, values, before=offered)
        wrong = ulp.from_ulp(at[5:6] ^ kind(1), z[5:6])[0]
        assert (again.numpy().view(kind)[int(where[5])] == wrong) == moved
        assert torch.equal(again[where[6:]], expected[where[6:]])
        assert (got[2] == lanes) != moved
    given[5] ^= 1
    again = torch.from_numpy(old.copy()).view(torch_kind)
    assert dispatch.apply_ulp_with_lanes(again, where, values, before=given)[2] == lanes
    assert torch.equal(again, expected)
    # a position past the end: refused, nothing applied
    past = torch.cat([where[:-1], torch.tensor([old.size], dtype=torch.int64)])
    kept = flat.clone()
    with pytest.raises(IndexError):
        dispatch.apply_ulp_with_lanes(flat, past, values)
    assert torch.equal(flat, kept)


@pytest.mark.parametrize("kernels", ["", "torch"])
def test_a_resolved_ulp_change_applies_stages_and_undoes(
    kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """resolve() leaves a ulp change as differences where the kernels fuse the step with the
    write (else it gives XOR bits); apply_change, stage_change and undo_delta take either,
    also a fused-ready change met where the kernels are off."""
    from dcr_format.delta import delta as d
    from dcr_format.format.dtypes import info_for

    monkeypatch.setenv("DCR_KERNELS", kernels)
    gen = torch.Generator().manual_seed(2)
    old = (torch.randn(40_000, generator=gen) * 0.02).bfloat16()
    new = (old.float() + 1e-4 * torch.randn(40_000, generator=gen)).bfloat16()
    new = torch.where(torch.rand(40_000, generator=gen) < 0.95, old, new)
    enc = d.encode_tensor(new, old, options=features.EncodeOptions.allowing(FEATURES))
    assert enc.values_coding == "ulp" and enc.positions and enc.values
    decoded = d.decode_delta(
        "xor",
        info_for(torch.bfloat16),
        new.numel(),
        enc.changed,
        positions=(str(enc.positions_coding), enc.positions),
        values=("ulp", enc.values),
    )
    resolved = d.resolve(decoded, old)
    assert resolved.ulp == (kernels == "")
    again = d.resolve(resolved, old)  # idempotent
    assert torch.equal(again.values, resolved.values) and again.ulp == resolved.ulp
    for mode in ("", "torch"):  # then with the kernels as resolve() found them, or not
        monkeypatch.setenv("DCR_KERNELS", mode)
        target = old.clone()
        staged = d.stage_change(target, resolved)
        assert torch.equal(target.view(torch.int16), old.view(torch.int16))
        done = d.apply_change(target, resolved)
        assert torch.equal(target.view(torch.int16), new.view(torch.int16))
        assert done.before is not None
        assert torch.equal(d.after_bits(resolved, done.before), staged.after)
        assert done.lane_deltas == staged.lane_deltas
        d.undo_delta(target, resolved, done.saved)
        assert torch.equal(target.view(torch.int16), old.view(torch.int16))
