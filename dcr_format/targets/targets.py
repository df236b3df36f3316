"""What a reader applies into: a dict of tensors, or a Hugging Face safetensors directory.

A target reports the version it holds (:meth:`Target.resident`) and opens a
:class:`Transaction`: the reader changes tensors through it (:meth:`Transaction.change`,
which keeps each change's undo) and then either commits (recording the new version) or
rolls back (:meth:`Transaction.rollback`: the in-place changes undone newest first, then
the tensors it created, replaced or dropped restored).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dcr_format.delta.delta import (
    FULL,
    DecodedDelta,
    StagedChange,
    after_bits,
    apply_change,
    put_staged,
    resolve,
    undo_delta,
    unput_staged,
)
from dcr_format.delta.fingerprint import tensor_lanes
from dcr_format.errors import (
    AliasedTensorError,
    BaselineCodingError,
    BaselineMismatchError,
    NotInPlaceError,
    PositionsError,
    TargetBusyError,
    TargetChangedError,
    TargetError,
    TargetLayoutError,
    TargetUnreadableError,
    ValuesError,
)
from dcr_format.format.dtypes import bits_view
from dcr_format.format.schema import CHECKPOINT_FILE_NAME, is_dcr_file_name
from dcr_format.system.fsync import fsync

DIR_STATE_FILE = "dcr-state.json"
DIR_STATE_FORMAT = "dcr-dir-1"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_FILE_BYTES = 5 << 30  # Hugging Face's customary shard size
LOCK_TIMEOUT = 300.0  # seconds a sync waits for another sync of the same directory
_VERSION_DIR = re.compile(r"^v[0-9]{20}-[0-9a-f]{8}$")  # the only directories dcr deletes
_TEMP_LINK = re.compile(r"^link-[0-9a-f]{8}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_FILE_NAME = re.compile(CHECKPOINT_FILE_NAME)


@dataclass(frozen=True)
class Resident:
    """The chain and version a target holds, and the sha256 of the commit record it applied
    (None where unknown: declared by hand, or recorded before dcr kept it)."""

    chain_id: str
    version: int
    record_sha256: str | None = None


@dataclass(frozen=True)
class Change:
    """One tensor's change as a transaction applies it (canonical name, dtype and shape)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    delta: DecodedDelta


@dataclass(frozen=True)
class Applied:
    """What :meth:`Transaction.apply` did: how to undo it, and what the reader needs to
    follow the tensor's fingerprint lanes (FORMAT.md §9.1) without a full pass.

    For ``xor``/``overwrite``: the canonical flat ``positions`` the target could read back
    (all of the delta's positions, or those this target holds) with their bits ``before``
    and ``after``; None when the target cannot read canonical bits back (the tensor is then
    left unverified). For ``full``: the ``lanes`` of what the target holds afterwards.
    """

    undo: Callable[[], None]
    positions: torch.Tensor | None = None
    before: torch.Tensor | None = None
    after: torch.Tensor | None = None
    lanes: tuple[int, ...] | None = None
    # xor/overwrite: the lane deltas of the change, summed while applying it (the reader then
    # need not sum them from ``before`` and ``after``)
    lane_deltas: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Staged:
    """A change read, not written, against a live tensor while a version was prepared
    (:meth:`Target.staging`): its bits before and after and its lane deltas. Applying it is
    then the write alone (:meth:`Transaction.put`)."""

    tensor: torch.Tensor  # the live tensor it was read from
    bits: StagedChange


class Transaction(ABC):
    """Mutable access to a target's tensors for one sync.

    The reader goes through :meth:`spec`, :meth:`prepare`, :meth:`lanes`,
    :meth:`complete_lanes` and :meth:`change`; the defaults work on the live canonical
    tensors of :meth:`tensor` and :meth:`full_tensor`. A target without canonical tensors
    (a module behind its own loader) overrides them (and :meth:`apply`) instead.

    The transaction owns the undo of a sync: :meth:`change` applies one change and keeps
    its undo, :meth:`undo` reverts every change so far (newest first), :meth:`rollback`
    undoes and aborts, :meth:`commit` makes the changes the new resident version.
    """

    @abstractmethod
    def names(self) -> set[str]:
        """Names of the tensors the target holds now."""

    @abstractmethod
    def tensor(self, name: str) -> torch.Tensor | None:
        """The live tensor for ``name`` (mutated in place by the reader), or None."""

    @abstractmethod
    def full_tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor to receive a full write: the live one if it fits, else a new one."""

    @abstractmethod
    def drop(self, name: str) -> None:
        """Remove a tensor the new version no longer has (bases only)."""

    @abstractmethod
    def commit(self, resident: Resident) -> None:
        """Make the changes durable and record the new resident version."""

    @abstractmethod
    def abort(self) -> None:
        """Forget created, replaced and dropped tensors (after :meth:`undo` reverted the
        in-place changes; :meth:`rollback` does both)."""

    # --- the undo journal ----------------------------------------------------------------

    def _journal(self) -> list[Callable[[], None]]:
        """The undo of every change made through :meth:`change`, oldest first (kept on the
        instance, so subclasses need not call an ``__init__``)."""
        journal: list[Callable[[], None]] = self.__dict__.setdefault("_undo_journal", [])
        return journal

    def keep_whole_undo(self) -> None:
        """From now on keep the undo of each tensor :meth:`tensor` gives as the bits it held
        before this transaction first changed it (one copy, in host memory), not as the
        undo of each change: a transaction of many versions then holds at most one copy
        of the model, not every change. A tensor a ``full`` write replaced or made needs
        none after that write."""
        self.__dict__["_whole_undo"] = {}

    def change(self, change: Change, staged: Staged | None = None) -> Applied:
        """Apply one change (:meth:`put` of what was staged for it where that still holds,
        else :meth:`apply`) and keep its undo for :meth:`undo`."""
        whole: dict[str, torch.Tensor] | None = self.__dict__.get("_whole_undo")
        if whole is not None:
            return self._change_whole(change, whole)
        applied = None if staged is None else self.put(change, staged)
        if applied is None:
            applied = self.apply(self.resolved(change))
        self._journal().append(applied.undo)
        return applied

    def _change_whole(self, change: Change, whole: dict[str, torch.Tensor]) -> Applied:
        """:meth:`change` under :meth:`keep_whole_undo`; ``whole``: by name, the tensor whose
        bits from before the transaction an undo already restores whole."""
        tensor = self.tensor(change.name)
        if change.delta.op == FULL or tensor is None:
            applied = self.apply(self.resolved(change))
            self._journal().append(applied.undo)
            written = self.tensor(change.name)
            if change.delta.op == FULL and written is not None:
                whole[change.name] = written  # its undo (or the abort) restores it whole
            return applied
        if whole.get(change.name) is not tensor:
            saved = bits_view(tensor).reshape(-1).to("cpu", copy=True)
            self._journal().append(_restore(tensor, saved))
            whole[change.name] = tensor
        return replace(self.apply(self.resolved(change)), undo=_nothing)

    def put(self, change: Change, staged: Staged) -> Applied | None:
        """Write a change staged while preparing: its ``after`` bits, where the tensor it
        lands in is still the one it was read from (else None: :meth:`apply` it instead).

        The bits and lane deltas are those read at staging. Positions of the change edited
        since then get the version's bits anyway; an edit made before staging is caught by
        the lanes as with :meth:`apply`, any other by an audit (FORMAT.md §11.3).
        """
        tensor = self.tensor(change.name)
        if tensor is None or tensor is not staged.tensor or change.delta.op == FULL:
            return None
        bits = staged.bits
        put_staged(tensor, bits)
        return Applied(
            lambda: unput_staged(tensor, bits),
            bits.positions,
            bits.before,
            bits.after,
            lane_deltas=bits.lane_deltas,
        )

    def resolved(self, change: Change) -> Change:
        """``change`` completed against the tensor it lands in where the writer coded it
        against the old bits (``classed`` positions, FORMAT.md §6.5; ``ulp`` and ``ulp-shift``
        values, §7.5-7.6);
        the tensor then holds exactly those bits (changes apply in version order)."""
        if not change.delta.needs_target:
            return change
        tensor = self.tensor(change.name)
        if tensor is None:
            raise TargetError(f"the target lacks tensor {change.name!r}")
        return _resolved(change, tensor, keep_before=True)  # applied to it next

    def undo(self) -> None:
        """Revert every change made through :meth:`change`, newest first; the bits the
        target held before the sync are back in place (tensors it created or dropped are
        restored by :meth:`abort`)."""
        journal = self._journal()
        while journal:
            journal.pop()()

    def rollback(self) -> None:
        """Undo every change and abort: the target is as it was before the sync."""
        self.undo()
        self.abort()

    def put_files(self, files: Mapping[str, str], fetched: Mapping[str, bytes]) -> None:
        """Keep the version's checkpoint files with the commit (FORMAT.md §3.5.6): ``files``
        is every file's sha256 by name, ``fetched`` the verified bytes of those the target
        did not hold (:meth:`Target.checkpoint_files`). Called only for a target that
        keeps files; the default keeps none."""
        raise TargetError("this target keeps no checkpoint files")

    # --- what the reader calls (defaults: live canonical tensors) ------------------------

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]] | None:
        """Dtype and shape of the canonical tensor ``name`` the target holds, or None."""
        tensor = self.tensor(name)
        return None if tensor is None else (tensor.dtype, tuple(tensor.shape))

    def prepare(self, changes: Sequence[Change]) -> None:
        """Refuse, before anything is mutated, changes the target cannot apply."""
        for change in changes:
            if change.delta.op == FULL:
                continue
            tensor = self.tensor(change.name)
            if tensor is not None and not tensor.is_contiguous():
                raise TargetError(
                    f"target tensor {change.name!r} is not contiguous; pass contiguous tensors"
                )

    def lanes(self, name: str) -> tuple[int, ...] | None:
        """Fingerprint lanes of the bits the target holds for ``name`` (one full pass), or
        None when it cannot read them back in canonical coordinates."""
        tensor = self.tensor(name)
        return None if tensor is None else tensor_lanes(tensor)

    def complete_lanes(
        self, lanes: dict[str, tuple[int, ...]]
    ) -> dict[str, tuple[int, ...] | None]:
        """Whole-tensor lanes from what :meth:`lanes` and :meth:`apply` gave (a target that
        holds part of a tensor sums its part with its peers', or answers None)."""
        return dict(lanes)

    def apply(self, change: Change) -> Applied:
        """Apply one change in place (FORMAT.md §8.1)."""
        delta = change.delta
        if delta.op == FULL:
            live = self.tensor(change.name)
            tensor = self.full_tensor(change.name, change.dtype, change.shape)
            # a new tensor holds none of the target's bits: the abort forgets it, and the
            # undo keeps nothing (neither a copy nor the decoded values)
            saved = apply_change(tensor, delta, keep_old=tensor is live).saved
            return Applied(_restore(tensor, saved), lanes=tensor_lanes(tensor))
        live = self.tensor(change.name)
        if live is None:
            raise TargetError(f"the target lacks tensor {change.name!r}")
        tensor = live
        flat = bits_view(tensor).reshape(-1)
        assert delta.positions is not None
        delta = replace(
            delta, positions=delta.positions.to(flat.device), values=delta.values.to(flat.device)
        )
        assert delta.positions is not None
        # one pass: old bits read, new bits written, and the change's lane deltas summed
        done = apply_change(tensor, delta)
        assert done.before is not None
        after = done.after if done.after is not None else after_bits(delta, done.before)
        return Applied(
            lambda: undo_delta(tensor, delta, done.saved),
            delta.positions,
            done.before,
            after,
            lane_deltas=done.lane_deltas,
        )


def _nothing() -> None:
    """The undo of a change another undo covers."""


def _restore(tensor: torch.Tensor, saved: torch.Tensor | None) -> Callable[[], None]:
    """The undo of a ``full`` write: the bits it replaced put back (None: nothing to)."""
    if saved is None:
        return lambda: None

    def restore() -> None:
        bits_view(tensor).reshape(-1).copy_(saved, non_blocking=False)

    return restore


class Target(ABC):
    """Something a :class:`~dcr_format.DeltaReader` keeps at a version of the chain."""

    @abstractmethod
    def resident(self) -> Resident | None:
        """The version held now, or None for an empty target."""

    @abstractmethod
    def begin(self) -> Transaction:
        """Open a transaction for one sync."""

    def accepts(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
        """Whether this canonical tensor lands in the target at all (False: it belongs to
        another rank's shard or expert). The reader neither fetches nor checks the rest."""
        return True

    def reads_baseline(self) -> bool:
        """Whether the reader can read the exact canonical bits of the tensors this target
        holds (:meth:`Transaction.tensor`) before applying, so it decodes streams coded
        against them (``classed`` positions, FORMAT.md §6.5; ``ulp`` values, §7.5). A target
        answering False tells writers through its reader record."""
        return True

    def checkpoint_files(self) -> Mapping[str, str] | None:
        """The checkpoint files (FORMAT.md §3.5.6) the target holds from the chain, their
        sha256 by name, or None for a target that keeps no files (the default: the reader
        then fetches none). The reader fetches the goal's files it lacks and hands them to
        :meth:`Transaction.put_files`."""
        return None

    def overwrite_names(self) -> frozenset[str]:
        """Canonical names this target can take only as ``overwrite`` or ``full`` (its load
        path transforms them); the reader records them for writers (FORMAT.md §3.6)."""
        return frozenset()

    def claim_key(self) -> Hashable:
        """What one sync at a time owns in this process (:func:`claim_target`): by default
        the target object; a target over shared state (a dict, a module, a path) names
        that state, so that two targets over it take turns too."""
        return ("target", id(self))

    def claim_timeout(self) -> float | None:
        """Seconds a sync waits for another sync of this target (None: for ever)."""
        return LOCK_TIMEOUT

    def staging(self, names: Iterable[str]) -> Mapping[str, torch.Tensor]:
        """The live canonical tensors among ``names`` that :meth:`DeltaReader.prepare` may
        read (never write) while the target stays in use, so that the apply is only the
        write; the default stages nothing. A reader on its own syncing a one-version plan
        applies the changes of these tensors while the fetch still decodes others, each
        through :meth:`Transaction.change` on a thread of its pool, several tensors at once
        (offer only tensors whose transaction takes that: distinct, untied, contiguous)."""
        return {}


class _Claim:
    """The turn of the syncs of one target in this process: ``users`` waiting or holding."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.owner: int | None = None  # the thread holding it


_CLAIMS: dict[Hashable, _Claim] = {}  # by Target.claim_key; an entry lives while used
_CLAIMS_LOCK = threading.Lock()


def claim_target(target: Target, timeout: float | None) -> Callable[[], None]:
    """Wait until no other sync in this process holds ``target`` (the state it names,
    :meth:`Target.claim_key`), and hold it: from a sync's check that the target is at the
    version it planned from until its commit or rollback. Returns the release (idempotent).

    Raises :class:`TargetBusyError` after ``timeout`` seconds (None: waits for ever).
    Across processes, a directory target also takes its lock file (:meth:`Target.begin`).
    """
    key = target.claim_key()
    with _CLAIMS_LOCK:
        claim = _CLAIMS.setdefault(key, _Claim())
        if claim.owner == threading.get_ident():
            raise TargetBusyError(
                "this thread is already syncing this target; a sync cannot start another "
                "sync of its own target (from a hook or a callback)"
            )
        claim.users += 1

    def leave() -> None:
        with _CLAIMS_LOCK:
            claim.users -= 1
            if claim.users == 0 and _CLAIMS.get(key) is claim:
                del _CLAIMS[key]

    if not claim.lock.acquire(timeout=-1 if timeout is None else timeout):
        leave()
        raise TargetBusyError(
            f"another sync in this process has been applying to this target for over "
            f"{timeout:g} s; wait for it to finish, or sync one target from one thread"
        )
    claim.owner = threading.get_ident()
    released = False

    def release() -> None:
        nonlocal released
        with _CLAIMS_LOCK:
            if released:
                return
            released = True
            claim.owner = None
        claim.lock.release()
        leave()

    return release


_ViewKey = tuple[str, int, int, torch.dtype, tuple[int, ...], tuple[int, ...]]


def _view_key(tensor: torch.Tensor) -> _ViewKey | None:
    """Where a tensor's elements live (device, storage address, offset, dtype, shape,
    strides); None for a tensor without addressable storage (empty, meta, subclasses)."""
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return None
    try:
        address = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return (
        str(tensor.device),
        address,
        int(tensor.storage_offset()),
        tensor.dtype,
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )


def _alias_groups(tensors: MutableMapping[str, torch.Tensor]) -> dict[str, frozenset[str]]:
    """Names whose tensors are the same view of one storage (tied weights), each mapped to
    its group. Refuses, with :class:`AliasedTensorError`, tensors whose bytes overlap
    without being the same view: an in-place change through one would corrupt the other."""
    by_view: dict[_ViewKey, list[str]] = {}
    extents: dict[tuple[str, int], list[tuple[int, int, str]]] = {}
    for name, tensor in tensors.items():
        key = _view_key(tensor)
        if key is None:
            continue
        if key not in by_view:
            size = tensor.element_size()
            span = 1 + sum((d - 1) * s for d, s in zip(tensor.shape, tensor.stride(), strict=True))
            start = int(tensor.storage_offset()) * size
            extents.setdefault(key[:2], []).append((start, start + span * size, name))
        by_view.setdefault(key, []).append(name)
    for spans in extents.values():
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
    groups: dict[str, frozenset[str]] = {}
    for names in by_view.values():
        if len(names) > 1:
            group = frozenset(names)
            groups.update(dict.fromkeys(names, group))
    return groups


@dataclass
class _Shared:
    """A change applied through one name of a tied group, awaiting its peers' changes."""

    delta: DecodedDelta
    waiting: set[str]
    applied: Applied


def _resolved(change: Change, old: torch.Tensor, *, keep_before: bool = False) -> Change:
    """``change`` completed against ``old`` (its tensor's bits before the change;
    ``keep_before``: see :func:`resolve`)."""
    try:
        return replace(change, delta=resolve(change.delta, old, keep_before=keep_before))
    except (PositionsError, ValuesError) as exc:  # the streams checked out: the bits are not
        # the parent's (classed positions that do not decode, ulp-shift low bits that do not fit)
        raise BaselineMismatchError(
            f"tensor {change.name!r} in the target is not the bits its change was coded "
            "against; it was changed outside dcr: pull into a fresh target"
        ) from exc


def baseline_coding_error(name: str) -> BaselineCodingError:
    """The error of a change coded against the old bits (``classed``, ``ulp``, ``ulp-shift``)
    reaching a target that cannot read ``name``'s canonical old bits."""
    return BaselineCodingError(
        f"this version codes {name!r} against its old bits (positions-classed, "
        "values-ulp or values-ulp-shift), which this target cannot read; its reader record "
        "asks writers not to from the next version: sync to that one, or from a base"
    )


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
            held += " (not contiguous)"
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

    def put(self, change: Change, staged: Staged) -> Applied | None:
        """As :meth:`Transaction.put`, except for tied tensors (they take a change once,
        through :meth:`apply`)."""
        if change.name in self._aliases:
            return None
        return super().put(change, staged)

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
                return _resolved(change, old)
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
            self._shared[key] = _Shared(change.delta, peers, applied)
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
        if (version is None) != (chain_id is None):
            raise ValueError("give both version and chain_id for a target that holds a version")
        if record_sha256 is not None and (chain_id is None or not _SHA256.match(record_sha256)):
            raise ValueError("record_sha256 is 64 lowercase hex digits, given with a version")
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


_UNSET = object()


class _Lock:
    """An open lock file holding an ``flock``; the kernel releases it when the fd closes
    (also when the holder is killed)."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        self.release()


class SafetensorsDirTarget(Target):
    """A Hugging Face checkpoint directory, replaced atomically on every sync.

    ``path`` becomes a symbolic link to a versioned directory beside it
    (``.<name>.dcr/v<version>-<id>/``) holding ``model.safetensors`` (or shards
    plus ``model.safetensors.index.json``) and ``dcr-state.json``. A sync writes
    the new directory completely, fsyncs it, then swaps the link with one
    rename, so a crash at any moment leaves the old or the new version, never a
    mix. Everything else in the directory (config, tokenizer, subdirectories,
    symbolic links) is carried forward as it is.

    One sync at a time owns the directory: :meth:`begin` takes an exclusive
    ``flock`` on ``.<name>.dcr.lock`` beside it until the transaction commits or
    aborts, and :meth:`resident` a shared one while it reads. A second sync waits up
    to ``timeout`` seconds (None: for ever; 0: refuses at once) and then raises
    :class:`TargetBusyError` naming the holder's pid and host. A holder that dies
    releases the lock with its last file descriptor.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_file_bytes: int = MAX_FILE_BYTES,
        timeout: float | None = LOCK_TIMEOUT,
    ) -> None:
        if timeout is not None and not timeout >= 0:
            raise ValueError("timeout is seconds >= 0, or None to wait for ever")
        self.path = Path(path)
        self.max_file_bytes = max_file_bytes
        self.timeout = timeout
        self._held: _Lock | None = None  # the exclusive lock of this target's open transaction
        self._planned: object = _UNSET  # what resident() last answered (checked by begin)

    def claim_key(self) -> Hashable:
        """The path (its parent resolved): targets over one directory take turns."""
        return ("directory", os.path.realpath(self.path.parent), self.path.name)

    def claim_timeout(self) -> float | None:
        """``timeout``, as for the lock file."""
        return self.timeout

    @property
    def _store_dir(self) -> Path:
        return self.path.parent / f".{self.path.name}.dcr"

    @property
    def _lock_path(self) -> Path:
        return self.path.parent / f".{self.path.name}.dcr.lock"

    # --- ownership -----------------------------------------------------------------------

    def _acquire(self, *, exclusive: bool) -> _Lock | None:
        """Take the directory's lock (None: a shared lock where the lock file cannot be
        opened, e.g. a read-only filesystem, where nobody can sync either)."""
        lock_path = self._lock_path
        flags = os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(lock_path, flags | os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if not exclusive:
                try:
                    fd = os.open(lock_path, flags | os.O_RDONLY)
                except OSError:
                    return None
            else:
                raise TargetUnreadableError(
                    f"cannot open the lock file {lock_path} ({exc}); make {self.path.parent} "
                    "writable by this user (and not a link)"
                ) from None
        lock = _Lock(fd)
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        delay = 0.01
        try:
            while True:
                try:
                    fcntl.flock(fd, mode | (fcntl.LOCK_NB if deadline is not None else 0))
                    break
                except BlockingIOError:
                    assert deadline is not None
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TargetBusyError(
                            f"{self.path} is being synced by {_holder(fd)} (lock {lock_path}); "
                            f"wait for that sync to finish, or give timeout= more than "
                            f"{self.timeout:g} s"
                        ) from None
                    time.sleep(min(delay, left))
                    delay = min(delay * 2, 0.25)
            if exclusive:
                holder = {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                }
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(holder).encode(), 0)
        except OSError as exc:
            lock.release()
            raise TargetUnreadableError(
                f"cannot lock {lock_path} ({exc}); use a local filesystem with flock support"
            ) from None
        except BaseException:
            lock.release()
            raise
        return lock

    def _check_managed(self) -> Path | None:
        """The versioned directory the link points at; None for a missing or empty path (or
        a link to a versioned directory that is gone: the next sync starts from a base)."""
        store = self._store_dir
        if store.is_symlink() or (os.path.lexists(store) and not store.is_dir()):
            raise TargetLayoutError(
                f"{store} is a symbolic link or not a directory; dcr keeps its versioned "
                f"directories in a real directory beside {self.path} and deletes old ones "
                f"there: to use another disk, move {self.path} and {store} there together "
                "(or mount the disk at that path)"
            )
        if self.path.is_symlink():
            link = os.readlink(self.path)
            real = Path(os.path.realpath(self.path.parent / link))
            if real.parent == Path(os.path.realpath(store)) and _VERSION_DIR.match(real.name):
                return real if real.is_dir() else None
            raise TargetLayoutError(
                f"{self.path} is a link to {link}, not to a directory "
                f"dcr manages under {store}; pull into a new or empty path"
            )
        if not self.path.exists():
            return None
        if self.path.is_dir() and not any(self.path.iterdir()):
            return None
        raise TargetLayoutError(
            f"{self.path} is an existing directory not managed by dcr; pull into a new or "
            "empty path (dcr keeps it as a link to versioned directories)"
        )

    def _read_state(self, live: Path) -> Resident | None:
        return self._state(live)[0]

    def _state(self, live: Path) -> tuple[Resident | None, dict[str, str]]:
        """The resident version ``dcr-state.json`` records, and the checkpoint files it
        records as the chain's (sha256 by name)."""
        state_path = live / DIR_STATE_FILE
        try:
            raw = state_path.read_bytes()
        except FileNotFoundError:
            return None, {}
        except OSError as exc:
            raise TargetUnreadableError(
                f"cannot read {state_path} ({exc}); make it readable by this user"
            ) from None
        try:
            state = json.loads(raw)
            if not isinstance(state, dict) or state.get("format") != DIR_STATE_FORMAT:
                raise ValueError(f"not a {DIR_STATE_FORMAT} state")
            chain_id, version = state["chain_id"], state["version"]
            sha = state.get("record_sha256")
            if not isinstance(chain_id, str) or type(version) is not int or version < 0:
                raise ValueError("chain_id or version malformed")
            if sha is not None and not (isinstance(sha, str) and _SHA256.match(sha)):
                raise ValueError("record_sha256 malformed")
            files = state.get("files", {})
            if not isinstance(files, dict) or not all(
                isinstance(n, str)
                and _FILE_NAME.match(n)
                and not is_dcr_file_name(n)
                and isinstance(h, str)
                and _SHA256.match(h)
                for n, h in files.items()
            ):
                raise ValueError("files malformed")
            return Resident(chain_id, version, sha), files
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise TargetUnreadableError(
                f"{state_path} is unreadable ({exc}); remove {self.path} and pull again"
            ) from None

    # --- the target ----------------------------------------------------------------------

    def resident(self) -> Resident | None:
        """The version recorded in the directory's ``dcr-state.json``, read under the
        shared lock (waits for a sync in progress, up to ``timeout``)."""
        if self._held is None and not os.path.lexists(self.path) and not self._lock_path.exists():
            # no sync has run here (a sync creates the lock file first): nothing is resident,
            # and a sync refused before it begins leaves no lock file behind
            self._planned = None
            return None
        lock = None if self._held is not None else self._acquire(exclusive=False)
        try:
            live = self._check_managed()
            found = None if live is None else self._read_state(live)
        finally:
            if lock is not None:
                lock.release()
        if self._held is None:  # a sync planning (not one checking its open transaction)
            self._planned = found
        return found

    def checkpoint_files(self) -> Mapping[str, str]:
        """The checkpoint files the directory holds from the chain (FORMAT.md §3.5.6), their
        sha256 by name: those ``dcr-state.json`` records whose bytes are still the recorded
        ones (a file edited or removed since is fetched again), read under the shared lock."""
        lock = None if self._held is not None else self._acquire(exclusive=False)
        try:
            live = self._check_managed()
            if live is None:
                return {}
            recorded = self._state(live)[1]
            return {n: sha for n, sha in recorded.items() if _file_sha256(live / n) == sha}
        finally:
            if lock is not None:
                lock.release()

    def begin(self) -> Transaction:
        """Take the directory's lock and load its tensors; commit writes and swaps in a new
        directory, commit or abort releases the lock.

        Raises :class:`TargetChangedError` if another sync moved the directory since this
        target's last :meth:`resident` (the reader planned from there: sync again).
        """
        if self._held is not None:
            raise TargetError(
                f"a transaction on {self.path} is already open; commit or abort it first"
            )
        planned, self._planned = self._planned, _UNSET
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TargetUnreadableError(
                f"cannot create {self.path.parent} ({exc}); create it or pick another path"
            ) from None
        lock = self._acquire(exclusive=True)
        assert lock is not None
        try:
            live = self._check_managed()
            current, held = (None, {}) if live is None else self._state(live)
            if planned is not _UNSET and current != planned:
                raise TargetChangedError(
                    f"another sync moved {self.path} from {_describe(planned)} to "
                    f"{_describe(current)} while this one was planning; sync again"
                )
            self._clean_orphans(live)
            tensors, layout = (
                self._load(live) if live is not None and current is not None else ({}, {})
            )
        except BaseException:
            lock.release()
            raise
        self._held = lock
        return _DirTransaction(self, tensors, layout, live, lock, held)

    def _release(self, lock: _Lock) -> None:
        if self._held is lock:
            self._held = None
        lock.release()

    def _load(self, live: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        layout: dict[str, str] = {}
        for file in sorted(live.glob("*.safetensors")):
            if not file.is_file():
                continue
            try:
                loaded = load_file(str(file))
            except Exception as exc:  # SafetensorError, OSError, a bad header: all unreadable
                raise TargetUnreadableError(
                    f"{self.path}/{file.name} cannot be loaded ({type(exc).__name__}: {exc}); "
                    f"remove {self.path} and pull again"
                ) from None
            for name, tensor in loaded.items():
                tensors[name] = tensor
                layout[name] = file.name
        return tensors, layout

    def _clean_orphans(self, live: Path | None) -> None:
        """Remove what crashed syncs left in the sidecar: versioned directories the link does
        not point at and temporary links. Called under the exclusive lock, so no live sync
        can still swap one in; nothing else in the sidecar is touched."""
        store = self._store_dir
        if not store.is_dir():
            return
        for child in store.iterdir():
            if _VERSION_DIR.match(child.name) and child.is_dir() and not child.is_symlink():
                if live is None or child.name != live.name:
                    shutil.rmtree(child, ignore_errors=True)
            elif _TEMP_LINK.match(child.name) and child.is_symlink():
                child.unlink(missing_ok=True)

    def _plan_files(
        self, tensors: dict[str, torch.Tensor], layout: dict[str, str]
    ) -> dict[str, list[str]]:
        files: dict[str, list[str]] = {}
        if layout and all(name in layout for name in tensors):
            for name in tensors:
                files.setdefault(layout[name], []).append(name)
            if len(files) > 1:
                return files  # the index names exactly these
            # one file left (a base dropped the others' tensors): a loader finds it only
            # as model.safetensors, since no index is written for one file
            return {SINGLE_FILE: next(iter(files.values()), [])}
        groups: list[list[str]] = [[]]
        size = 0
        # by name, numbers as numbers (layer 2 before layer 10): the same files whatever
        # order a sync's changes arrived in
        for name in sorted(tensors, key=_natural_key):
            tensor = tensors[name]
            nbytes = tensor.numel() * tensor.element_size()
            if groups[-1] and size + nbytes > self.max_file_bytes:
                groups.append([])
                size = 0
            groups[-1].append(name)
            size += nbytes
        if len(groups) == 1:
            return {SINGLE_FILE: groups[0]}
        n = len(groups)
        return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}

    def _write(
        self,
        tensors: dict[str, torch.Tensor],
        layout: dict[str, str],
        resident: Resident,
        live: Path | None,
        chain_files: _FileSet,
    ) -> None:
        from dcr_format.format.schema import RESERVED_TENSOR_NAMES

        reserved = sorted(RESERVED_TENSOR_NAMES & set(tensors))
        if reserved:
            raise TargetError(
                f"tensor name {reserved[0]!r} cannot be stored in a safetensors file; "
                "rename the tensor in the writer"
            )
        store = self._store_dir
        store.mkdir(exist_ok=True)
        fresh = store / f"v{resident.version:020d}-{uuid.uuid4().hex[:8]}"
        fresh.mkdir()
        link = store / f"link-{uuid.uuid4().hex[:8]}"
        swapped = False
        try:
            self._fill(fresh, tensors, layout, resident, live, chain_files)
            _fsync_dir(fresh)  # complete: what follows is the swap
            if self.path.is_dir() and not self.path.is_symlink():
                self.path.rmdir()  # empty (checked); the previous version was nothing
            os.symlink(os.path.relpath(fresh, self.path.parent), link)
            os.replace(link, self.path)
            swapped = True
        finally:
            if not swapped:
                link.unlink(missing_ok=True)
                shutil.rmtree(fresh, ignore_errors=True)
        _fsync_dir(self.path.parent)
        if live is not None and live.name != fresh.name:
            shutil.rmtree(live, ignore_errors=True)

    def _fill(
        self,
        fresh: Path,
        tensors: dict[str, torch.Tensor],
        layout: dict[str, str],
        resident: Resident,
        live: Path | None,
        chain_files: _FileSet,
    ) -> None:
        """Write a new version's directory: its safetensors files (and index), its
        checkpoint files, what the previous version held besides tensors (less the chain's
        files the version no longer has), and the state file; each file synced."""
        from safetensors.torch import save_file

        files = self._plan_files(tensors, layout)
        for file, names in files.items():
            path = fresh / file
            save_file(
                {n: tensors[n].contiguous() for n in names}, str(path), metadata={"format": "pt"}
            )
            fsync(path, strict=True)
        if len(files) > 1:
            index = {
                "metadata": {
                    "total_size": sum(t.numel() * t.element_size() for t in tensors.values())
                },
                "weight_map": {n: f for f, names in files.items() for n in sorted(names)},
            }
            _write_synced(fresh / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True).encode())
        if live is not None:
            _carry_forward(live, fresh, skip=chain_files.replaced)
        for name, data in chain_files.fetched.items():
            _write_synced(fresh / name, data)
        missing = sorted(n for n in chain_files.listed if not (fresh / n).is_file())
        if missing:
            raise TargetError(
                f"checkpoint file {missing[0]!r} vanished from {self.path} during the sync; "
                "sync again"
            )
        state: dict[str, object] = {
            "format": DIR_STATE_FORMAT,
            "chain_id": resident.chain_id,
            "version": resident.version,
        }
        if resident.record_sha256 is not None:
            state["record_sha256"] = resident.record_sha256
        if chain_files.listed:
            state["files"] = dict(sorted(chain_files.listed.items()))
        _write_synced(fresh / DIR_STATE_FILE, json.dumps(state).encode())


@dataclass(frozen=True)
class _FileSet:
    """The checkpoint files a directory's new version holds (``listed``: sha256 by name),
    the bytes of those written anew (``fetched``), and the names not carried forward from
    the previous version (``replaced``: fetched anew, or the chain's and gone)."""

    listed: Mapping[str, str]
    fetched: Mapping[str, bytes]
    replaced: frozenset[str]


def _file_sha256(path: Path) -> str | None:
    """The sha256 of a regular file's bytes (None: missing, a link, or not a file)."""
    import hashlib

    if path.is_symlink() or not path.is_file():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class _DirTransaction(_DictTransaction):
    """A dict transaction over a directory's tensors, holding its lock until the end."""

    def __init__(
        self,
        target: SafetensorsDirTarget,
        tensors: dict[str, torch.Tensor],
        layout: dict[str, str],
        live: Path | None,
        lock: _Lock,
        held: Mapping[str, str],
    ) -> None:
        super().__init__(tensors, torch.device("cpu"), lambda resident: None)
        self._target = target
        self._loaded = tensors
        self._layout = layout
        self._live = live
        self._lock: _Lock | None = lock
        # the chain's checkpoint files: those the directory holds, until put_files says
        self._files = _FileSet(held, {}, frozenset())

    def put_files(self, files: Mapping[str, str], fetched: Mapping[str, bytes]) -> None:
        """The version's checkpoint files replace the chain's files the directory held; a
        file the version lists and did not fetch is carried forward (it holds those bytes)."""
        gone = set(self._files.listed) - set(files)
        self._files = _FileSet(dict(files), dict(fetched), frozenset(gone | set(fetched)))

    def commit(self, resident: Resident) -> None:
        if self._lock is None:
            raise TargetError("this transaction is closed; begin a new one")
        try:
            self._target._write(self._loaded, self._layout, resident, self._live, self._files)
        finally:
            self._close()
        self._previous.clear()

    def abort(self) -> None:
        super().abort()
        self._close()

    def _close(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            self._target._release(lock)


def _describe(resident: object) -> str:
    if isinstance(resident, Resident):
        return f"version {resident.version}"
    return "nothing"


def _holder(fd: int) -> str:
    """Who holds a lock, as its holder recorded (pid, host, since)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0))
        return f"pid {int(info['pid'])} on {str(info['host'])!r} since {info['since']!s}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not recorded its pid yet)"


def _link_or_copy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Hard-link ``src`` at ``dst`` (the old version is deleted after the swap, so the new
    one keeps the only name); copy where links are impossible (another filesystem)."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)
        fsync(Path(dst), strict=True)


def _carry_forward(live: Path, fresh: Path, *, skip: frozenset[str] = frozenset()) -> None:
    """Everything of the previous version that is not dcr's own (config, tokenizer,
    ``original/``, links) and not named in ``skip``, into the new directory: links as links
    with the same target, files and directories hard-linked or copied."""
    for item in sorted(live.iterdir()):
        if item.name in skip:
            continue
        destination = fresh / item.name
        if item.is_symlink():
            if item.name in (INDEX_FILE, DIR_STATE_FILE) or item.name.endswith(".safetensors"):
                continue  # loaded as tensors and written anew
            os.symlink(os.readlink(item), destination)
        elif item.is_dir():
            shutil.copytree(item, destination, symlinks=True, copy_function=_link_or_copy)
            for root, dirs, _ in os.walk(destination):
                for name in dirs:
                    _fsync_dir(Path(root) / name)
        elif item.is_file():
            if item.name in (INDEX_FILE, DIR_STATE_FILE) or item.name.endswith(".safetensors"):
                continue
            _link_or_copy(item, destination)


def _fsync_dir(path: Path) -> None:
    """Flush a directory's entries, best effort (around the link swap: tests hook it)."""
    fsync(path)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """``name`` split into text and numbers, so that names sort as a reader expects them:
    ``layers.2`` before ``layers.10``."""
    return tuple(
        (1, int(part)) if part.isdigit() else (0, part) for part in re.split(r"(\d+)", name)
    )
