"""A prepared version into a module: its placed names read ahead, the pause only writes them.

:meth:`DeltaReader.prepare` reads the changes to the names the loader places whole into one
contiguous run of a parameter (:meth:`ModuleTarget.staging`) against the live bits, and
those placed otherwise in one parameter (:meth:`ModuleTarget.stage_placed`) against its
storage; the apply then writes each one (checking that the bits it replaces are still those
it read), calls the loader for the rest, and verifies and rolls back exactly as an
unprepared apply.
"""

from __future__ import annotations

import pytest
import torch
from test_module_target import (
    SPECS,
    XOR_NAMES,
    Runtime,
    assert_module,
    bits_of,
    checkpoint,
    counted,
    step,
)
from torch import nn

import dcr_format.sync._apply as apply_module
from dcr_format import DeltaReader, DeltaWriter, ModuleTarget
from dcr_format.delta.backend import Backend
from dcr_format.delta.backends import backend_for
from dcr_format.errors import ApplyError, BaselineMismatchError, StalePreparedError
from dcr_format.format.dtypes import bits_view

# placed whole, in order, into one contiguous run (the experts are placed transposed)
RUNS = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"}
RUNS |= {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}


def synced(tmp_path, **target_args):  # type: ignore[no-untyped-def]
    """A writer at a base and a module synced to it."""
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    state = checkpoint()
    writer.publish(state)
    module = Runtime()
    calls: list[str] = []
    target = ModuleTarget(module, load_weights=counted(module, calls), **target_args)
    reader = DeltaReader(store, target)
    reader.sync()
    return writer, state, module, target, reader, calls


def test_a_prepared_version_writes_the_placed_names_read_ahead(tmp_path):
    writer, state, module, target, reader, calls = synced(tmp_path)
    assert set(target.staging(SPECS)) == RUNS
    for k in range(3):
        state = step(state, k)
        writer.publish(state)
        prepared = reader.prepare()
        staged = prepared._staged
        assert {name for name, one in staged.items() if not one.placed} == RUNS
        # the experts, placed transposed, are read against their parameters' storage
        assert {name for name, one in staged.items() if one.placed} == XOR_NAMES - RUNS
        calls.clear()
        result = reader.apply(prepared)
        assert_module(module, state)
        assert not set(result.unverified) & XOR_NAMES
        assert not set(calls) & XOR_NAMES  # the transformed names still go through the loader
        assert set(calls) == set(SPECS) - XOR_NAMES


def test_nothing_is_read_ahead_without_direct_placements(tmp_path):
    writer, state, module, target, reader, _calls = synced(tmp_path, direct=False)
    assert target.staging(SPECS) == {}
    state = step(state, 0)
    writer.publish(state)
    reader.apply(reader.prepare())
    assert_module(module, state)


def test_an_edit_before_preparing_is_caught_and_every_write_undone(tmp_path):
    """An edit outside dcr at a changed position before the prepare fails the verification
    after every placed name was written; all of them are rolled back."""
    writer, state, module, target, reader, _ = synced(tmp_path)
    writer.publish(step(state, 0))
    with torch.no_grad():  # down_proj, written after q/k/v/o and gate/up
        module.down.view(-1)[0] += 1
    before = bits_of(module)
    prepared = reader.prepare()
    with pytest.raises(BaselineMismatchError, match="down_proj"):
        reader.apply(prepared)
    after = bits_of(module)
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert target.resident().version == 0


@pytest.mark.parametrize("audited_first", [False, True])
def test_an_edit_undone_after_preparing_makes_the_preparation_stale(tmp_path, audited_first):
    """An edit outside dcr at a changed position before the prepare, undone before the
    apply (after an audited apply refused it, as an engine's operator would find it): the
    changes were read against bits the target no longer holds, so the apply undoes every
    write and says to prepare again (not that the store is damaged); a new preparation
    applies exactly."""
    writer, state, module, target, reader, _ = synced(tmp_path)
    state = step(state, 0)
    writer.publish(state)
    saved = module.down.view(-1)[0].clone()
    with torch.no_grad():
        module.down.view(-1)[0] += 1
    if audited_first:
        with pytest.raises(BaselineMismatchError, match="down_proj"):
            reader.apply(reader.prepare(), audit=True)
    prepared = reader.prepare()
    with torch.no_grad():
        module.down.view(-1)[0] = saved
    before = bits_of(module)
    with pytest.raises(StalePreparedError, match=r"down_proj.*prepare it again"):
        reader.apply(prepared)
    after = bits_of(module)
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert target.resident().version == 0
    reader.apply(reader.prepare())
    assert_module(module, state)


def test_an_edit_between_prepare_and_apply_still_ends_exact(tmp_path):
    """As for a dict target: the pause writes the version's bits at every changed position,
    whatever is there; the lanes were read against the bits the prepare found."""
    writer, state, module, _, reader, _ = synced(tmp_path)
    state = step(state, 0)
    writer.publish(state)
    prepared = reader.prepare()
    with torch.no_grad():
        module.down.view(-1)[0] += 1
    reader.apply(prepared)
    assert_module(module, state)


def test_a_failure_in_the_middle_of_the_writes_undoes_them_all(tmp_path, monkeypatch):
    writer, state, module, _target, reader, _calls = synced(tmp_path)
    writer.publish(step(state, 0))
    prepared = reader.prepare()
    before = bits_of(module)
    written = fail_after_writing(monkeypatch, 3, "the engine went away")
    with pytest.raises(ApplyError, match="went away"):
        reader.apply(prepared)
    after = bits_of(module)
    assert len(written) == 3 and all(torch.equal(after[n], before[n]) for n in before)
    monkeypatch.undo()
    state = step(state, 0)
    reader.apply(reader.prepare())
    assert_module(module, state)


def fail_after_writing(monkeypatch, count: int, message: str) -> list[str]:  # type: ignore[no-untyped-def]
    """Make the apply of a prepared version fail with ``message`` once its staged batch is
    written and ``count`` of its changes are followed; returns the names followed."""
    followed: list[str] = []
    follow = apply_module._follow_staged

    def failing(sync, entry, *rest):  # type: ignore[no-untyped-def]
        if len(followed) == count:
            raise RuntimeError(message)
        followed.append(entry.name)
        return follow(sync, entry, *rest)

    monkeypatch.setattr(apply_module, "_follow_staged", failing)
    return followed


def test_a_storage_moved_after_preparing_is_learned_again_and_written(tmp_path):
    writer, state, module, target, reader, _calls = synced(tmp_path)
    state = step(state, 0)
    writer.publish(state)
    prepared = reader.prepare()
    old = module.qkv
    kept = old.detach().clone()
    module.qkv = nn.Parameter(old.detach().clone(), requires_grad=False)
    assert target.staging(SPECS) == {}  # the placements are stale until the next apply
    result = reader.apply(prepared)
    assert_module(module, state)
    assert torch.equal(old, kept)  # nothing written into the storage the module let go of
    assert not {"q_proj.weight", "k_proj.weight", "v_proj.weight"} & set(result.unverified)
    assert set(target.staging(SPECS)) == RUNS


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("fault", [None, "out of range"])
def test_put_matches_the_torch_reference(dtype, fault):
    """The compiled write (several parallel tasks) against the torch reference: the same
    bits written, the same error for a position out of range."""
    kernels = pytest.importorskip("dcr_format.kernels.numba_kernels")
    gen = torch.Generator().manual_seed(3)
    numel = 5 * kernels._PUT_CHUNK
    width = torch.empty(0, dtype=dtype).element_size()
    live = torch.randint(0, 250, (numel * width,), generator=gen, dtype=torch.uint8)
    flat = bits_view(live.view(dtype)).reshape(-1)
    positions = torch.randperm(numel, generator=gen)[: 3 * numel // 4].sort().values
    bits = flat[positions] ^ 1
    backend = backend_for(flat)
    assert type(backend) is not Backend  # the compiled loops
    results = []
    for each in (backend, Backend()):
        target = flat.clone()
        if fault == "out of range":
            with pytest.raises(IndexError):
                each.put(target, positions + target.numel(), bits)
            assert torch.equal(target, flat)
        else:
            each.put(target, positions, bits)
        results.append(target)
    assert torch.equal(results[0], results[1])
    if fault is None:
        want = flat.clone()
        want[positions] = bits
        assert torch.equal(results[0], want)


def test_the_view_looked_up_by_name_follows_a_storage_moved_in_place(tmp_path):
    """A sync looks each name's plan and canonical view up once and keeps them; a
    parameter whose storage moves (``param.data = ...``) gets views of its new storage."""
    writer, state, module, target, reader, _ = synced(tmp_path)
    kept = target._view_of_name("q_proj.weight")
    assert kept is not None and target._view_of_name("q_proj.weight") is kept
    assert kept.untyped_storage().data_ptr() == module.qkv.untyped_storage().data_ptr()
    old = module.qkv.data
    module.qkv.data = old.clone()  # the same parameter, another storage
    txn = target.begin()
    view = txn.tensor("q_proj.weight")
    txn.abort()
    assert view is not None and view is not kept
    assert view.untyped_storage().data_ptr() == module.qkv.untyped_storage().data_ptr()
    before = old.clone()
    for k in range(2):
        state = step(state, k)
        writer.publish(state)
        reader.apply(reader.prepare())
        assert_module(module, state)
    assert torch.equal(old, before)  # nothing written into the storage let go of


def test_the_plan_looked_up_by_name_follows_the_plans_learned_and_the_names_held():
    module = nn.Linear(4, 4, bias=False)  # one float32 weight, loaded by load_state_dict
    target = ModuleTarget(module)
    exact = target.plan("weight", torch.float32, (4, 4))
    assert exact.kind == "xor" and target._plan_of("weight") is exact
    assert target._view_of_name("weight") is not None
    cast = target.plan("weight", torch.bfloat16, (4, 4))  # the loader casts: another plan
    assert cast.kind == "overwrite"
    assert target._plan_of("weight") is None  # two plans and none held: no single one
    target._held = {"weight": (torch.bfloat16, (4, 4))}
    assert target._plan_of("weight") is cast and target._view_of_name("weight") is None
    target._held = {"weight": (torch.float32, (4, 4))}
    assert target._plan_of("weight") is exact and target._view_of_name("weight") is not None


def test_the_layout_checked_names_every_parameter_and_buffer_as_torch_does():
    """The layout a sync checks (one walk of the submodules) is ``named_parameters`` and
    ``named_buffers`` with duplicates kept: shared submodules and tied weights under each
    name, unset entries left out."""
    from dcr_format.targets.module_trace import _key

    module = nn.Module()
    module.a = nn.Linear(3, 3)
    module.b = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    module.again = module.b  # one submodule under two names
    module.tied = module.a.weight
    module.register_buffer("kept", torch.zeros(2))
    module.register_buffer("unset", None)
    module.register_parameter("missing", None)
    named = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    layout = ModuleTarget(module)._current_layout()
    assert layout == {name: _key(tensor) for name, tensor in named}
    assert "again.1.running_mean" in layout and "tied" in layout
