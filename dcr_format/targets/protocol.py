"""What a target author implements: a :class:`Target` and its :class:`Transaction`.

A target reports the version it holds (``Target.resident``) and opens a transaction for
each sync (``Target.begin``). A target holding canonical tensors (arrays in a dict, tensors
in files) implements six methods of the transaction: ``names``, ``tensor`` (the live tensor
the reader changes in place), ``full_tensor`` (where a whole tensor is written), ``drop``,
``commit`` (keep the changes and record the new version) and ``abort`` (forget what
``full_tensor`` and ``drop`` did). The reader changes the bits, checks their fingerprints
and undoes a failed sync through those; every other method has a default. A target without
canonical tensors (a module behind its own loader) overrides ``spec``, ``lanes`` and
``apply`` instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import replace

import torch

from dcr_format.delta.delta import FULL, after_bits, apply_change, ready, undo_delta
from dcr_format.delta.fingerprint import tensor_lanes
from dcr_format.errors import TargetError
from dcr_format.targets.change import Applied, Change, Resident
from dcr_format.targets.reader_side import ReaderTransaction, StagingSource, restore_whole

LOCK_TIMEOUT = 300.0  # seconds a sync waits for another sync of the same target


def not_contiguous(name: str) -> str:
    """The refusal of a target tensor that a sync cannot change in place."""
    return (
        f"tensor {name!r} of the target is not contiguous, and a sync changes tensors in place "
        "through their elements in order; make it contiguous where the model holds it (e.g. "
        "param.data = param.data.contiguous()) before syncing"
    )


class Transaction(ReaderTransaction):
    """Mutable access to a target's tensors for one sync.

    A target implements :meth:`names`, :meth:`tensor`, :meth:`full_tensor`, :meth:`drop`,
    :meth:`commit` and :meth:`abort`. The reader goes through :meth:`spec`,
    :meth:`prepare`, :meth:`lanes`, :meth:`complete_lanes` and :meth:`apply`, whose
    defaults work on the live canonical tensors of :meth:`tensor` and :meth:`full_tensor`;
    a target without canonical tensors (a module behind its own loader) overrides them
    instead. The reader keeps the undo of every change it applies and reverts them itself
    when a sync fails, before it calls :meth:`abort`.
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

    def put_files(self, files: Mapping[str, str], fetched: Mapping[str, bytes]) -> None:
        """Keep the version's checkpoint files with the commit (FORMAT.md §3.5.6): ``files``
        is every file's sha256 by name, ``fetched`` the verified bytes of those the target
        did not hold (:meth:`Target.checkpoint_files`). Called only for a target that
        keeps files; the default keeps none."""
        raise TargetError("this target keeps no checkpoint files")

    # --- optional: defaults over the live canonical tensors of tensor() -------------------

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
                raise TargetError(not_contiguous(change.name))

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
        delta = ready(change.delta)
        if delta.op == FULL:
            live = self.tensor(change.name)
            tensor = self.full_tensor(change.name, change.dtype, change.shape)
            # a new tensor holds none of the target's bits: the abort forgets it, and the
            # undo keeps nothing (neither a copy nor the decoded values)
            saved = apply_change(tensor, delta, keep_old=tensor is live).saved
            return Applied(restore_whole(tensor, saved), lanes=tensor_lanes(tensor))
        live = self.tensor(change.name)
        if live is None:
            raise TargetError(f"the target lacks tensor {change.name!r}")
        tensor = live
        assert delta.positions is not None
        positions = delta.positions.to(tensor.device)
        values = delta.values.to(tensor.device)
        if positions is not delta.positions or values is not delta.values:  # else as it is
            delta = replace(delta, positions=positions, values=values)
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
            rows=delta.rows,
        )


class Target(StagingSource, ABC):
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
        answering False tells writers through its reader record, with the names it does
        read the old bits of (:meth:`baseline_names`)."""
        return True

    def reads_changed(self) -> bool:
        """For a target that does not read the old bits of every tensor whole
        (:meth:`reads_baseline` False): whether it reads, of every tensor it holds, the old
        bits of each changed element it holds (a tensor-parallel shard), so it decodes
        ``ulp`` values (FORMAT.md §7.5) though not ``classed`` positions or ``ulp-shift``
        values, which need the whole tensor's. The default: False."""
        return False

    def baseline_names(self) -> frozenset[str] | None:
        """The canonical names whose streams coded against the old bits the reader can
        decode into this target: those whose exact canonical bits :meth:`Transaction.tensor`
        gives, and those it never takes (:meth:`accepts`). None: every name (the default
        where :meth:`reads_baseline`, else none). The reader records them for writers
        (FORMAT.md §3.6, at most :data:`~dcr_format.format.schema.MAX_BASELINE_NAMES`),
        and writers use such codings only for those names."""
        return None if self.reads_baseline() else frozenset()

    def baseline_except(self, names: Collection[str]) -> frozenset[str] | None:
        """Of ``names`` (every canonical name of the version the reader stages), those whose
        streams coded against the old bits the reader cannot decode into this target; None
        where the target cannot tell (the default unless :meth:`reads_baseline`). A target
        that reads the old bits of more tensors than :meth:`baseline_names` can list is
        recorded this way instead (FORMAT.md §3.6 ``baseline_except``), so writers code
        every tensor but these against the old bits."""
        return frozenset() if self.reads_baseline() else None

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
