"""A dict of canonical tensors as a target (:class:`StateDictTarget`), updated in place.

Tied weights (one storage under several names) take each change once; a tensor the
caller gave is only ever changed in place.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, replace

import torch

from dcr_format.delta.delta import FULL, DecodedDelta, after_bits, ready
from dcr_format.errors import AliasedTensorError, ArgumentError, NotInPlaceError, TargetError
from dcr_format.format.dtypes import bits_view
from dcr_format.targets.change import SHA256_HEX, Applied, Change, Resident
from dcr_format.targets.protocol import Target, Transaction, not_contiguous
from dcr_format.targets.reader_side import Staged, resolved_against

_ViewKey = tuple[torch.device, int, int, torch.dtype, tuple[int, ...], tuple[int, ...]]


def _view_key(tensor: torch.Tensor) -> _ViewKey | None:
    """Where a tensor's elements live (device, storage address, offset, dtype, shape,
    strides); None for a tensor without addressable storage (empty, meta, subclasses).

    Read at every sync for every tensor of the dict (twice: :meth:`StateDictTarget.staging`
    and :meth:`StateDictTarget.begin`), so it takes torch's own hashable values as they
    come (a ``torch.device``, a ``torch.Size``, the stride tuple), not strings or copies."""
    if tensor.numel() == 0 or tensor.is_meta:
        return None
    try:
        address = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return (
        tensor.device,
        address,
        int(tensor.storage_offset()),
        tensor.dtype,
        tensor.shape,
        tensor.stride(),
    )


def _alias_groups(tensors: MutableMapping[str, torch.Tensor]) -> dict[str, frozenset[str]]:
    """Names whose tensors are the same view of one storage (tied weights), each mapped to
    its group. Refuses, with :class:`AliasedTensorError`, tensors whose bytes overlap
    without being the same view: an in-place change through one would corrupt the other."""
    by_view: dict[_ViewKey, list[str]] = {}
    # each storage's distinct views (their first name and tensor); most storages hold one,
    # and only those that hold several have extents to compare
    views_of: dict[tuple[torch.device, int], list[tuple[_ViewKey, str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        key = _view_key(tensor)
        if key is None:
            continue
        names = by_view.get(key)
        if names is None:
            by_view[key] = [name]
            storage = (key[0], key[1])
            views = views_of.get(storage)
            if views is None:
                views_of[storage] = [(key, name, tensor)]
            else:
                views.append((key, name, tensor))
        else:
            names.append(name)
    for views in views_of.values():
        if len(views) > 1:
            _check_disjoint(views)
    groups: dict[str, frozenset[str]] = {}
    for names in by_view.values():
        if len(names) > 1:
            group = frozenset(names)
            groups.update(dict.fromkeys(names, group))
    return groups


def _check_disjoint(views: list[tuple[_ViewKey, str, torch.Tensor]]) -> None:
    """Refuse (:class:`AliasedTensorError`) distinct views of one storage whose bytes
    overlap."""
    spans = []
    for key, name, tensor in views:
        _, _, offset, _, shape, strides = key
        size = tensor.element_size()
        span = 1 + sum((d - 1) * s for d, s in zip(shape, strides, strict=True))
        start = offset * size
        spans.append((start, start + span * size, name))
    spans.sort()
    reach, holder = -1, ""
    for start, end, name in spans:
        if start < reach:
            raise AliasedTensorError(
                f"tensors {holder!r} and {name!r} share storage but are not the same view "
                "(their bytes overlap in part), so a change to one would corrupt the "
                "other; give each its own storage (clone one), or use ModuleTarget"
            )
        if end > reach:
            reach, holder = end, name


@dataclass
class _Shared:
    """A change applied through one name of a tied group, awaiting its peers' changes."""

    delta: DecodedDelta
    waiting: set[str]
    applied: Applied


class _DictTransaction(Transaction):
    def __init__(
        self,
        tensors: MutableMapping[str, torch.Tensor],
        device: torch.device | None,
        on_commit: Callable[[Resident], None],
        aliases: dict[str, frozenset[str]] | None = None,
        created: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self._tensors = tensors
        self._device = device
        self._on_commit = on_commit
        self._previous: dict[str, torch.Tensor | None] = {}  # name -> tensor before (None: absent)
        self._aliases = aliases or {}
        self._shared: dict[_ViewKey, _Shared] = {}
        # the tensors the target made itself (None: every tensor is the target's own); any
        # other was given by the caller, who may hold it elsewhere, so it changes in place only
        self._created = created
        self._fresh: dict[str, torch.Tensor] = {}  # made by this transaction

    def _given(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (held under ``name``) came from the caller, not from dcr."""
        if self._created is None:
            return False
        return self._fresh.get(name) is not tensor and self._created.get(name) is not tensor

    def prepare(self, changes: Sequence[Change]) -> None:
        """As :meth:`Transaction.prepare`; also refuses a ``full`` write that would have to
        replace a tensor the caller gave (another dtype or shape, or not contiguous)."""
        super().prepare(changes)
        for change in changes:
            live = self._tensors.get(change.name)
            if change.delta.op == FULL and live is not None:
                self._check_fits(change.name, live, change.dtype, change.shape)

    def _check_fits(
        self, name: str, live: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> None:
        if _fits(live, dtype, shape) or not self._given(name, live):
            return
        held = f"{str(live.dtype).removeprefix('torch.')} {list(live.shape)}"
        wanted = f"{str(dtype).removeprefix('torch.')} {list(shape)}"
        if (live.dtype, tuple(live.shape)) == (dtype, shape):
            raise NotInPlaceError(not_contiguous(name))
        raise NotInPlaceError(
            f"tensor {name!r} is {held} in the dict, and this version holds it as {wanted}: a "
            "dict target changes the tensors it was given in place, so the model holding them "
            "would never see a new one; publish the dtype and shape the model holds (e.g. "
            "cast the trainer's tensors before publish), or sync into an empty dict"
        )

    def names(self) -> set[str]:
        return set(self._tensors)

    def tensor(self, name: str) -> torch.Tensor | None:
        return self._tensors.get(name)

    def _puts(self, change: Change, staged: Staged) -> torch.Tensor | None:
        """As :meth:`Transaction.put`, except for tied tensors (they take a change once,
        through :meth:`apply`)."""
        if change.name in self._aliases:
            return None
        return super()._puts(change, staged)

    def resolved(self, change: Change) -> Change:
        """As :meth:`Transaction.resolved`; a tied name whose storage the tie's first name
        already changed is completed against the bits from before that change (a copy with
        them put back), so that :meth:`apply` can compare it with the first's."""
        tensor = self._tensors.get(change.name)
        if change.delta.needs_target and tensor is not None and change.name in self._aliases:
            key = _view_key(tensor)
            shared = None if key is None else self._shared.get(key)
            if shared is not None and change.name in shared.waiting:
                done = shared.applied
                assert done.positions is not None and done.before is not None
                old = tensor.clone()
                flat = bits_view(old).reshape(-1)
                flat[done.positions.to(flat.device)] = done.before.to(flat.device)
                return resolved_against(change, old)
        return super().resolved(change)

    def apply(self, change: Change) -> Applied:
        """As :meth:`Transaction.apply`, but a change arriving through every name of a group
        of tied tensors (one storage, the same view) is applied once: the first name applies
        it, each peer's identical change is checked against it and reports the same bits
        (an XOR applied twice would cancel). ``full`` writes are idempotent and go through."""
        group = self._aliases.get(change.name)
        tensor = self._tensors.get(change.name)
        if group is None or tensor is None or change.delta.op == FULL:
            return super().apply(change)
        key = _view_key(tensor)
        peers = {
            n
            for n in group
            if n != change.name and n in self._tensors and _view_key(self._tensors[n]) == key
        }
        if key is None or not peers:  # the tie was broken (a full write made a new tensor)
            return super().apply(change)
        shared = self._shared.get(key)
        if shared is None or change.name not in shared.waiting:
            applied = super().apply(change)
            self._shared[key] = _Shared(ready(change.delta), peers, applied)
            return applied
        done = shared.applied
        assert done.positions is not None and done.before is not None and done.after is not None
        positions = change.delta.positions
        assert positions is not None
        wanted = after_bits(change.delta, done.before.to(done.after.device))
        if not (
            torch.equal(positions.to(done.positions.device), done.positions)
            and torch.equal(wanted, done.after)
        ):
            raise TargetError(
                f"tensor {change.name!r} shares storage with {sorted(group - {change.name})} "
                "(tied weights) but this version gives them different bits; untie them in the "
                "target (clone one) or publish them tied"
            )
        shared.waiting.discard(change.name)
        if not shared.waiting:
            del self._shared[key]
        return replace(done, undo=lambda: None)  # the same bits, lanes and lane deltas

    def _remember(self, name: str) -> None:
        if name not in self._previous:
            self._previous[name] = self._tensors.get(name)

    def adopt(self, name: str, tensor: torch.Tensor) -> bool:
        """Take ``tensor`` itself as the new tensor ``name`` (none is held by that name, and
        it lies where a new one would be made)."""
        if name in self._tensors:
            return False
        if tensor.device != (self._device or _default_device(self._tensors)):
            return False
        self._remember(name)
        self._tensors[name] = tensor
        self._fresh[name] = tensor
        return True

    def full_tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        live = self._tensors.get(name)
        if live is not None and _fits(live, dtype, shape):
            return live
        if live is not None:
            self._check_fits(name, live, dtype, shape)
        device = live.device if live is not None else self._device or _default_device(self._tensors)
        self._remember(name)
        fresh = torch.empty(shape, dtype=dtype, device=device)
        self._tensors[name] = fresh
        self._fresh[name] = fresh
        return fresh

    def drop(self, name: str) -> None:
        live = self._tensors.get(name)
        if live is not None and self._given(name, live):
            raise NotInPlaceError(
                f"this version drops tensor {name!r}, which the caller gave the dict target: "
                "whatever holds it would keep stale bits; remove it from the dict first (or "
                "leave it out with select=), or sync into an empty dict"
            )
        self._remember(name)
        self._tensors.pop(name, None)

    def commit(self, resident: Resident) -> None:
        self._on_commit(resident)
        if self._created is not None:  # the target's own tensors: those it made, still held
            made = {**self._created, **self._fresh}
            self._created.clear()
            self._created.update((n, t) for n, t in made.items() if self._tensors.get(n) is t)
        self._fresh.clear()
        self._previous.clear()
        self._shared.clear()

    def abort(self) -> None:
        for name, before in self._previous.items():
            if before is None:
                self._tensors.pop(name, None)
            else:
                self._tensors[name] = before
        self._previous.clear()
        self._shared.clear()
        self._fresh.clear()


def _fits(tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """Whether a ``full`` write of ``dtype`` and ``shape`` can land in ``tensor`` in place."""
    return tensor.dtype == dtype and tuple(tensor.shape) == shape and tensor.is_contiguous()


def _default_device(tensors: MutableMapping[str, torch.Tensor]) -> torch.device:
    for tensor in tensors.values():
        return tensor.device
    return torch.device("cpu")


class StateDictTarget(Target):
    """A dict of canonical tensors on any device, updated in place.

    Tensors keep their storage, so a model holding them sees each update. New
    tensors (a base into an empty dict) are created on ``device`` (default: the
    device of the dict's first tensor, else CPU). A tensor the caller gave is only ever
    changed in place: a version that holds it with another dtype or shape, or a base
    that drops it, is refused with the dict left as it was (:class:`NotInPlaceError`),
    since a model holding it would never see a replacement; publish the dtype the model
    holds.

    Tied weights (``policy.state_dict()`` with ``lm_head.weight`` the same tensor as
    ``model.embed_tokens.weight``) are found when the target is built and at every sync:
    names that are the same view of one storage take each change once. Tensors whose bytes
    overlap without being the same view are refused (:class:`AliasedTensorError`).
    """

    def __init__(
        self,
        tensors: MutableMapping[str, torch.Tensor],
        *,
        version: int | None = None,
        chain_id: str | None = None,
        device: str | torch.device | None = None,
        record_sha256: str | None = None,
    ) -> None:
        if not isinstance(tensors, MutableMapping):
            raise ArgumentError(
                f"StateDictTarget takes a dict of names to tensors (a state_dict), not a "
                f"{type(tensors).__name__}"
            )
        bad = next((n for n, t in tensors.items() if not isinstance(t, torch.Tensor)), None)
        if bad is not None:
            raise ArgumentError(
                f"{bad!r} is not a torch.Tensor ({type(tensors[bad]).__name__}); "
                "give the target tensors only"
            )
        if (version is None) != (chain_id is None):
            raise ArgumentError("give both version and chain_id for a target that holds a version")
        if record_sha256 is not None and (chain_id is None or not SHA256_HEX.match(record_sha256)):
            raise ArgumentError("record_sha256 is 64 lowercase hex digits, given with a version")
        _alias_groups(tensors)  # refuse partly overlapping tensors up front
        self.tensors = tensors
        self.device = torch.device(device) if device is not None else None
        self._created: dict[str, torch.Tensor] = {}  # the tensors syncs made (not the caller's)
        self._resident = (
            Resident(chain_id, version, record_sha256)
            if chain_id is not None and version is not None
            else None
        )

    def resident(self) -> Resident | None:
        """The version the dict holds (as last synced, or as declared at construction)."""
        return self._resident

    def begin(self) -> Transaction:
        """In-place transaction over the dict (tied tensors found again: the dict may have
        changed since the target was built)."""
        return _DictTransaction(
            self.tensors,
            self.device,
            self._set_resident,
            _alias_groups(self.tensors),
            created=self._created,
        )

    def claim_key(self) -> Hashable:
        """The dict: targets over one dict take turns."""
        return ("tensors", id(self.tensors))

    def staging(self, names: Iterable[str]) -> Mapping[str, torch.Tensor]:
        """The dict's contiguous tensors among ``names`` that no other name ties to."""
        tied = {n for group in _alias_groups(self.tensors).values() for n in group}
        found = {}
        for name in names:
            tensor = self.tensors.get(name)
            if tensor is not None and tensor.is_contiguous() and name not in tied:
                found[name] = tensor
        return found

    def _set_resident(self, resident: Resident) -> None:
        self._resident = resident
