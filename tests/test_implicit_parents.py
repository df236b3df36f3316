"""The ``implicit-parents`` feature (FORMAT.md §3.5.5): delta manifests leave the parent
fingerprints of their whole entries null, readers and tools take them from the parent
version's state table, and every check that used them still holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_layout import advance, canonical_state, layout_for, locals_for

from dcr_format import DeltaReader, DeltaWriter, ProjectionWriter, StateDictTarget, verify
from dcr_format.chain.chain import Chain, TensorState, resolve_parents, state_table
from dcr_format.errors import (
    BaselineMismatchError,
    ChainBrokenError,
    SchemaError,
    UnsupportedFeatureError,
)
from dcr_format.format import schema
from dcr_format.publish.coordinate import ThreadCoordinator
from dcr_format.store.store import open_store
from dcr_format.sync._plan import _check_continuity
from dcr_format.testing.processes import in_threads

FEATURE = "implicit-parents"


def states(count: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    state = {
        **{
            f"model.layers.{i}.mlp.{p}_proj.weight": torch.randn(32, 64, generator=gen).bfloat16()
            for i in range(4)
            for p in ("gate", "up", "down")
        },
        "model.norm.weight": torch.ones(64, dtype=torch.bfloat16),  # never changes
        "model.steps": torch.zeros(3, dtype=torch.int64),
    }
    out = [state]
    for k in range(1, count):
        state = {n: t.clone() for n, t in state.items()}
        for name, t in state.items():
            if name.endswith("proj.weight"):
                t.view(-1)[k::97] += 0.01
        state["model.steps"][0] = k
        out.append(state)
    return out


def publish(store: Path, features: list[str], versions: list[dict[str, torch.Tensor]]) -> None:
    writer = DeltaWriter(store, features=features)
    for state in versions:
        writer.publish(state)


def same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_delta_manifests_leave_parents_null_and_read_back(tmp_path: Path) -> None:
    store, plain = tmp_path / "lean", tmp_path / "plain"
    versions = states(4)
    publish(store, [FEATURE, "manifest-zstd"], versions)
    publish(plain, ["manifest-zstd"], versions)
    chain, other = Chain(open_store(store)), Chain(open_store(plain))
    for version in range(4):
        loaded = chain.record(version)
        [manifest] = chain.manifests(loaded)
        [explicit] = other.manifests(other.record(version))
        if version == 0:  # a base has no parents: it does not list the feature
            assert FEATURE not in loaded.record.required_features
            continue
        assert FEATURE in loaded.record.required_features
        assert FEATURE in manifest.required_features
        assert all(e.parent_fingerprint is None for e in manifest.entries)
        assert any(e.changed == 0 for e in manifest.entries)  # the norm: unchanged, still null
        # the same fingerprints, and the parents the explicit writer wrote are the table's
        assert [e.fingerprint for e in manifest.entries] == [
            e.fingerprint for e in explicit.entries
        ]
        parent = state_table(chain.manifests(chain.record(version - 1)))
        [resolved] = resolve_parents([manifest], parent, version)
        assert [e.parent_fingerprint for e in resolved.entries] == [
            e.parent_fingerprint for e in explicit.entries
        ]
        lean_bytes = open_store(store).get(loaded.record.manifests[0].path)
        plain_bytes = open_store(plain).get(other.record(version).record.manifests[0].path)
        assert len(lean_bytes) < len(plain_bytes) - 8 * len(manifest.entries)
    # every way of reading: one sync from the base, version by version, and a new reader
    # that continues from the version a target holds (its parent table from the store)
    whole = StateDictTarget({})
    DeltaReader(store, whole, verify="all").sync()
    same_bits(whole.tensors, versions[-1])
    stepwise = StateDictTarget({})
    reader = DeltaReader(store, stepwise)
    for version in range(4):
        reader.sync(to=version)
        same_bits(stepwise.tensors, versions[version])
    resumed = StateDictTarget({})
    DeltaReader(store, resumed).sync(to=1)
    DeltaReader(store, resumed).sync()
    same_bits(resumed.tensors, versions[-1])
    report = verify(store, deep=True)
    assert report.ok and report.replayed_versions == 4, report.problems


def test_an_edited_target_is_still_refused(tmp_path: Path) -> None:
    """The baseline check compares the target with the parent table's fingerprint."""
    store = tmp_path / "s"
    versions = states(3)
    publish(store, [FEATURE], versions[:2])
    target = StateDictTarget({})
    DeltaReader(store, target).sync()
    name = "model.layers.0.mlp.up_proj.weight"
    target.tensors[name].view(-1)[5] += 1.0  # an edit outside dcr, where no delta changes
    before = {n: t.clone() for n, t in target.tensors.items()}
    DeltaWriter(store, features=[FEATURE]).publish(versions[2])
    with pytest.raises(BaselineMismatchError):
        DeltaReader(store, target, verify="all").sync()
    same_bits(target.tensors, before)


def test_schema_requires_null_parents_exactly_where_the_feature_is_listed(
    tmp_path: Path,
) -> None:
    store = tmp_path / "s"
    publish(store, [FEATURE], states(2))
    chain = Chain(open_store(store))
    loaded = chain.record(1)
    [manifest] = chain.manifests(loaded)
    ref = loaded.record.manifests[0]
    where = ref.path

    def check(m: schema.Manifest) -> None:
        from dcr_format.chain.chain import check_manifest

        check_manifest(m, m.chain_id, 1, "delta", m.attempt, 0, 1, where)

    check(manifest)
    first = manifest.entries[0]
    with_parent = manifest.model_copy(
        update={
            "entries": (
                first.model_copy(update={"parent_fingerprint": first.fingerprint}),
                *manifest.entries[1:],
            )
        }
    )
    with pytest.raises(SchemaError, match="leaves null"):
        check(with_parent)
    without_feature = manifest.model_copy(update={"required_features": ()})
    with pytest.raises(SchemaError, match="needs a parent_fingerprint"):
        check(without_feature)


def test_resolution_refuses_what_the_parent_does_not_hold(tmp_path: Path) -> None:
    store = tmp_path / "s"
    publish(store, [FEATURE], states(2))
    chain = Chain(open_store(store))
    [manifest] = chain.manifests(chain.record(1))
    parent = state_table(chain.manifests(chain.record(0)))
    unchanged = next(e for e in manifest.entries if e.changed == 0)
    changed = next(e for e in manifest.entries if e.changed > 0)
    # an unchanged entry must keep its parent's fingerprint
    moved = dict(parent)
    row = parent[unchanged.name]
    moved[unchanged.name] = TensorState(row.name, row.dtype, row.shape, "0" * 32, row.rank)
    with pytest.raises(ChainBrokenError, match="changes no element"):
        resolve_parents([manifest], moved, 1)
    # a changed entry whose name the parent lacks, or holds with another shape, stays null
    # and the continuity check refuses it
    for broken in (
        {n: r for n, r in parent.items() if n != changed.name},
        {
            **parent,
            changed.name: TensorState(changed.name, "bfloat16", (1,), "0" * 32, 0),
        },
    ):
        resolved = resolve_parents([manifest], broken, 1)
        entry = next(e for e in resolved[0].entries if e.name == changed.name)
        assert entry.parent_fingerprint is None
        with pytest.raises(ChainBrokenError, match=r"does not hold|drops"):
            _check_continuity(broken, resolved, 1)
    # the parent is whatever the table says: the resolved entries carry its fingerprints
    # (the baseline check then compares the target with them, test above)
    resolved = resolve_parents([manifest], parent, 1)
    assert {e.op for e in resolved[0].entries} == {"xor", "full"}  # the int64 counter: full
    for entry in resolved[0].entries:
        want = None if entry.op == "full" else parent[entry.name].fingerprint
        assert entry.parent_fingerprint == want
    _check_continuity(parent, resolved, 1)
    with pytest.raises(ChainBrokenError, match="not at hand"):  # no table, nothing to take
        resolve_parents([manifest], None, 1)
    # no manifest with the feature: returned as it is, whatever the table
    plain = manifest.model_copy(update={"required_features": ()})
    assert resolve_parents([plain], None, 1)[0] is plain


def test_pieces_keep_their_parent_fingerprints(tmp_path: Path) -> None:
    """Entries of tensors split over ranks carry their lanes and parents as before; the
    committer still checks they add up to the parent."""
    tp = 2
    store = str(tmp_path / "s")
    coordinator = ThreadCoordinator(tp)
    layouts = [layout_for(r, tp) for r in range(tp)]
    writers = [
        ProjectionWriter(
            store,
            layouts[r],
            rank=r,
            world_size=tp,
            coordinator=coordinator,
            features=[FEATURE],
        )
        for r in range(tp)
    ]
    state, master = canonical_state(0)
    for k in range(3):
        if k:
            state, master = advance(state, master, k)
        in_threads(
            lambda r, s=state, m=master: writers[r].publish(locals_for(layouts[r], s, m)), tp
        )
    chain = Chain(open_store(store))
    manifests = chain.manifests(chain.record(2))
    pieces = [e for m in manifests for e in m.entries if e.piece is not None]
    whole = [e for m in manifests for e in m.entries if e.piece is None]
    assert pieces and all(e.parent_fingerprint is not None for e in pieces)
    assert whole and all(e.parent_fingerprint is None for e in whole)
    target = StateDictTarget({})
    DeltaReader(store, target, verify="all").sync()
    same_bits(target.tensors, state)


def test_a_reader_without_the_feature_refuses_the_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    versions = states(2)
    publish(store, [FEATURE], versions)
    monkeypatch.setattr(schema, "KNOWN_FEATURES", schema.KNOWN_FEATURES - {FEATURE})
    target = StateDictTarget({})
    with pytest.raises(UnsupportedFeatureError, match=FEATURE):
        DeltaReader(store, target).sync()
    assert dict(target.tensors) == {}


def test_the_committer_takes_the_manifest_its_stored_bytes_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The committing rank takes its own manifest as it made it rather than parsing its
    uploaded bytes back: with the manifest features on (its parents left null, the bytes
    compressed), that object is exactly what the stored bytes parse to."""
    from dcr_format.publish import writer as writer_module

    taken: list[schema.Manifest] = []
    gather = writer_module.gather_manifests

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        taken.append(kwargs["own_manifest"])
        return gather(*args, **kwargs)

    monkeypatch.setattr(writer_module, "gather_manifests", spy)
    store = tmp_path / "store"
    publish(store, [FEATURE, "manifest-zstd", "values-rans", "values-ulp"], states(3))
    chain = Chain(open_store(store))
    assert len(taken) == 3
    for version, made in enumerate(taken):
        [stored] = chain.manifests(chain.record(version))
        assert made == stored
    assert all(e.parent_fingerprint is None for e in taken[-1].entries)
