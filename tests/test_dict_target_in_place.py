"""A dict target changes the tensors it was given in place, or refuses with nothing changed.

``StateDictTarget(policy.state_dict())`` holds the policy's own parameters: a sync that put
new tensors into the dict would report success while the policy kept its old weights.
"""

from __future__ import annotations

import pytest
import torch

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget
from dcr_format.errors import NotInPlaceError, TargetError


def _policy(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2)).to(dtype)


def _trainer_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    master = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))  # fp32 master
    return {n: t.detach().clone() for n, t in master.state_dict().items()}


def _storages(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, torch.dtype]]:
    return {n: (t.untyped_storage().data_ptr(), t.dtype) for n, t in state.items()}


def test_fp32_publish_into_a_bf16_policy_is_refused_and_changes_nothing(tmp_path):
    store = str(tmp_path / "store")
    DeltaWriter(store).publish(_trainer_state(1))
    policy = _policy(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in policy.state_dict().items()}
    tensors = policy.state_dict()
    given = dict(tensors)
    target = StateDictTarget(tensors)
    with pytest.raises(NotInPlaceError, match="publish the dtype"):
        DeltaReader(store, target).sync()
    assert isinstance(NotInPlaceError("x"), TargetError)
    assert target.resident() is None
    assert all(tensors[n] is given[n] for n in given) and set(tensors) == set(given)
    for name, param in policy.state_dict().items():
        assert param.dtype == torch.bfloat16
        assert torch.equal(param.view(torch.int16), before[name].view(torch.int16))


def test_a_publish_of_the_policy_dtype_lands_in_the_policy_itself(tmp_path):
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    policy = _policy(torch.bfloat16)
    tensors = policy.state_dict()
    where = _storages(tensors)
    reader = DeltaReader(store, StateDictTarget(tensors))
    for seed in (1, 2):
        published = {n: t.bfloat16() for n, t in _trainer_state(seed).items()}
        writer.publish(published)
        reader.sync()
        assert _storages(tensors) == where
        for name, param in policy.state_dict().items():
            assert torch.equal(param.view(torch.int16), published[name].view(torch.int16))


def test_a_base_that_drops_a_given_tensor_is_refused(tmp_path):
    store = str(tmp_path / "store")
    writer = DeltaWriter(store, base_every=1)
    state = _trainer_state(1)
    writer.publish(state)
    tensors = {n: t.clone() for n, t in state.items()}
    target = StateDictTarget(tensors)
    reader = DeltaReader(store, target)
    reader.sync()
    kept = dict(tensors)
    smaller = {n: t for n, t in state.items() if n != "1.bias"}
    smaller["0.weight"] = smaller["0.weight"] + 1
    writer.publish(smaller)
    with pytest.raises(NotInPlaceError, match=r"drops tensor '1\.bias'"):
        reader.sync()
    assert target.resident().version == 0
    assert set(tensors) == set(kept) and all(tensors[n] is kept[n] for n in kept)
    assert torch.equal(tensors["0.weight"], state["0.weight"])


def test_tensors_a_sync_made_may_be_replaced_by_later_versions(tmp_path):
    store = str(tmp_path / "store")
    writer = DeltaWriter(store, base_every=1)
    state = _trainer_state(1)
    writer.publish(state)
    target = StateDictTarget({})
    reader = DeltaReader(store, target)
    reader.sync()
    writer.publish({n: t.bfloat16() for n, t in state.items() if n != "1.bias"})
    reader.sync()
    assert sorted(target.tensors) == sorted(n for n in state if n != "1.bias")
    assert all(t.dtype == torch.bfloat16 for t in target.tensors.values())


def test_a_tensor_that_is_not_contiguous_is_refused_by_name_and_changes_nothing(tmp_path):
    """A given tensor of the right dtype and shape that is not contiguous cannot be changed
    in place: refused with the remedy, whether a base or a delta would land in it."""
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    state = _trainer_state(1)
    writer.publish(state)
    message = (
        "tensor '0.weight' of the target is not contiguous, and a sync changes tensors in "
        "place through their elements in order; make it contiguous where the model holds it "
        "(e.g. param.data = param.data.contiguous()) before syncing"
    )
    strided = torch.zeros(8, 4).t()  # [4, 8], not contiguous
    tensors = {n: torch.zeros_like(t) for n, t in state.items()} | {"0.weight": strided}
    with pytest.raises(NotInPlaceError) as refused:
        DeltaReader(store, StateDictTarget(tensors)).sync()
    assert str(refused.value) == message
    assert tensors["0.weight"] is strided and not strided.any()

    tensors = {n: t.clone() for n, t in state.items()}
    target = StateDictTarget(tensors)
    DeltaReader(store, target).sync()
    writer.publish({n: t + 1 for n, t in state.items()})
    kept = tensors["0.weight"].clone()
    tensors["0.weight"] = kept.t().contiguous().t()  # the same values, not contiguous
    with pytest.raises(TargetError) as refused:
        DeltaReader(store, target).sync()
    assert str(refused.value) == message
    assert torch.equal(tensors["0.weight"], kept) and target.resident().version == 0
