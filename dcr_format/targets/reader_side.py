"""The side of a target only the reader uses: no target author implements or calls it.

Every :class:`~dcr_format.Transaction` inherits :class:`ReaderTransaction`, the undo journal
of a sync (:meth:`~ReaderTransaction.change` applies one change and keeps its undo,
:meth:`~ReaderTransaction.undo` and :meth:`~ReaderTransaction.rollback` revert them,
:meth:`~ReaderTransaction.keep_whole_undo` bounds it by the model for a plan of many
versions), and every :class:`~dcr_format.Target` inherits :class:`StagingSource`, whose
default offers nothing. The built-in targets add the fast path: tensors offered for
staging (:meth:`StagingSource.staging`) have their changes read against the live bits
while the version is still fetched (:class:`Staged`), so that applying one is the write
alone (:meth:`ReaderTransaction.put`), on the reader's threads.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from dcr_format.delta.delta import FULL, resolve
from dcr_format.delta.fingerprint import tensor_lanes
from dcr_format.delta.staged import (
    StagedBatch,
    StagedChange,
    put_batch,
    put_staged,
    unput_batch,
    unput_staged,
)
from dcr_format.errors import (
    BaselineCodingError,
    BaselineMismatchError,
    PositionsError,
    TargetError,
    ValuesError,
)
from dcr_format.format.dtypes import bits_view, info_for
from dcr_format.targets.change import Applied, Change


@dataclass(frozen=True)
class Staged:
    """A change read, not written, against a live tensor while a version was prepared
    (:meth:`Target.staging`): its bits before and after and its lane deltas. Applying it is
    then the write alone (:meth:`Transaction.put`)."""

    tensor: torch.Tensor  # the live tensor it was read from
    bits: StagedChange
    # the exponent rows of the bits it was resolved against (``classed``), or None
    rows: np.ndarray | None = None
    # the changes staged with it, end to end (``bits`` is a view of it), and their names
    batch: StagedBatch | None = None
    names: tuple[str, ...] = ()
    # the lanes the reader trusted for the tensor when it staged the change, and its lanes
    # after the change (from those and the lane deltas), or None
    lanes: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    # the exponent rows of the bits the change leaves (from ``rows`` and its bits), or None
    rows_after: np.ndarray | None = None
    # read against storage the target places the name in (:meth:`StagingSource.stage_placed`),
    # not a canonical tensor: ``bits.positions`` index that storage, so the change is written
    # only with its batch (:meth:`ReaderTransaction.put_batch`)
    placed: bool = False


PlacedStage = tuple[torch.Tensor, StagedChange]
"""A change :meth:`StagingSource.stage_placed` read: the flat storage it writes (the tensor
:meth:`ReaderTransaction.staged_into` gives for the name while the storage stays where it
was) and the change in that storage's positions."""


class StagingSource:
    """What a reader may read of a target ahead of its apply; a target offers nothing unless
    it overrides :meth:`staging` (the built-in dict and module targets do)."""

    def staging(self, names: Iterable[str]) -> Mapping[str, torch.Tensor]:
        """The live canonical tensors among ``names`` that :meth:`DeltaReader.prepare` may
        read (never write) while the target stays in use, so that the apply is only the
        write; the default stages nothing. A reader on its own syncing a one-version plan
        reads them too while the version's objects still arrive (completing the changes
        decoded so far), and applies the changes of these tensors (of more than
        :data:`~dcr_format.system.pools.ONE_THREAD_ELEMENTS` elements) while the fetch still
        decodes others, each through :meth:`Transaction.change` on a thread of its pool,
        several tensors at once (offer only tensors whose transaction takes that: distinct,
        untied, contiguous)."""
        return {}

    def stage_placed(self, changes: Mapping[str, Change]) -> Mapping[str, PlacedStage]:
        """Changes to names the target holds in parts of its own storage rather than as
        canonical tensors (a tensor-parallel shard), read (never written) against that
        storage while the target stays in use, so that applying them is the write alone:
        for each name it stages, the flat storage the change writes and the change in that
        storage's positions (its lane deltas summed at the canonical positions, over the
        elements the target holds). A change coded against the old bits is staged only
        where the target completes it at the elements it holds. The default stages
        nothing."""
        return {}

    def held_storage(self) -> Sequence[torch.Tensor] | None:
        """Every tensor holding bits a sync may change, for a target whose transaction
        cannot give them as canonical tensors (:meth:`Transaction.tensor`), or None (the
        default): a sync of many versions then keeps these once as its undo
        (:meth:`ReaderTransaction.keep_whole_undo`) instead of the undo of each change."""
        return None


class ReaderTransaction(ABC):
    """The undo journal of a sync, which the reader runs on every transaction.

    :meth:`change` applies one change (through :meth:`apply`, or :meth:`put` of what was
    staged for it) and keeps its undo, :meth:`undo` reverts every change so far (newest
    first), :meth:`rollback` undoes and aborts.
    """

    @abstractmethod
    def tensor(self, name: str) -> torch.Tensor | None:
        """The live canonical tensor for ``name``, or None (:meth:`Transaction.tensor`)."""

    @abstractmethod
    def apply(self, change: Change) -> Applied:
        """Apply one change in place (:meth:`Transaction.apply`)."""

    @abstractmethod
    def abort(self) -> None:
        """Forget created, replaced and dropped tensors (:meth:`Transaction.abort`)."""

    def _journal(self) -> list[Callable[[], None]]:
        """The undo of every change made through :meth:`change`, oldest first (kept on the
        instance, so subclasses need not call an ``__init__``)."""
        journal: list[Callable[[], None]] = self.__dict__.setdefault("_undo_journal", [])
        return journal

    def keep_whole_undo(self, storage: Sequence[torch.Tensor] | None = None) -> None:
        """From now on keep the undo of each tensor :meth:`tensor` gives as the bits it held
        before this transaction first changed it (one copy, in host memory), not as the
        undo of each change: a transaction of many versions then holds at most one copy
        of the model, not every change. A tensor a ``full`` write replaced or made needs
        none after that write.

        ``storage``: every tensor holding the bits the changes reach, for a target that
        cannot give them as canonical tensors (:meth:`StagingSource.held_storage`): their
        bits are kept now, once, and no change keeps an undo of its own."""
        if storage is not None:
            journal = self._journal()
            seen: set[tuple[str, int]] = set()
            for tensor in storage:
                memory = tensor.untyped_storage()
                key = (str(tensor.device), memory.data_ptr())
                if key not in seen:  # each storage once, whole: its bytes as they are
                    seen.add(key)
                    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(memory)
                    journal.append(restore_whole(raw, raw.to("cpu", copy=True)))
            self.__dict__["_whole_undo"] = _ALL
            return
        self.__dict__["_whole_undo"] = {}

    def adopt(self, name: str, tensor: torch.Tensor) -> bool:
        """Take ``tensor`` itself as the new tensor ``name`` where the target holds none by
        that name (True), instead of a copy into a tensor it makes; the default declines."""
        return False

    def change(
        self, change: Change, staged: Staged | None = None, *, owned: bool = False
    ) -> Applied:
        """Apply one change (:meth:`put` of what was staged for it where that still holds,
        else :meth:`apply`) and keep its undo for :meth:`undo`.

        ``owned``: nothing else holds the change's values, so a ``full`` write of a tensor
        the target does not hold may take them as the tensor itself (:meth:`adopt`): a base
        is then held once, not once decoded and once more copied."""
        if owned and change.delta.op == FULL and self.tensor(change.name) is None:
            applied = self._adopted(change)
            if applied is not None:
                return applied
        whole: dict[str, torch.Tensor] | None = self.__dict__.get("_whole_undo")
        if whole is _ALL:  # every bit it may change was kept at the start
            return replace(self.apply(self.resolved(change)), undo=_nothing)
        if whole is not None:
            return self._change_whole(change, whole)
        applied = None if staged is None else self.put(change, staged)
        if applied is None:
            applied = self.apply(self.resolved(change))
        self._journal().append(applied.undo)
        return applied

    def _adopted(self, change: Change) -> Applied | None:
        """A ``full`` write of a new tensor as its decoded values themselves, where they fit
        it (its dtype's bits, its size, one contiguous run of their own) and the target
        takes them (:meth:`adopt`); else None."""
        values = change.delta.values
        info = info_for(change.dtype)
        fits = (
            values.dtype == info.bits_dtype
            and values.is_contiguous()
            and values.numel() == math.prod(change.shape)
            and values.storage_offset() == 0
            and values.untyped_storage().nbytes() == values.numel() * values.element_size()
        )
        if not fits:
            return None
        tensor = values.view(change.dtype).reshape(change.shape)
        if not self.adopt(change.name, tensor):
            return None
        return Applied(restore_whole(tensor, None), lanes=tensor_lanes(tensor))

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
            self._journal().append(restore_whole(tensor, saved))
            whole[change.name] = tensor
        return replace(self.apply(self.resolved(change)), undo=_nothing)

    def put(self, change: Change, staged: Staged) -> Applied | None:
        """Write a change staged while preparing: its ``after`` bits, where the tensor it
        lands in is still the one it was read from (else None: :meth:`apply` it instead).

        The bits and lane deltas are those read at staging. Positions of the change edited
        since then get the version's bits anyway; an edit made before staging is caught by
        the lanes as with :meth:`apply`, any other by an audit (FORMAT.md §11.3).
        """
        tensor = self._puts(change, staged)
        if tensor is None:
            return None
        bits = staged.bits
        replaced = put_staged(tensor, bits)
        return _staged_applied(lambda: unput_staged(tensor, bits, replaced), staged)

    def _puts(self, change: Change, staged: Staged) -> torch.Tensor | None:
        """The live tensor :meth:`put` writes ``staged`` into (the one it was read from),
        or None where the change must be applied instead (also a change staged against
        placed storage, whose positions are not canonical: only its batch writes it)."""
        if staged.placed or change.delta.op == FULL:
            return None
        tensor = self.tensor(change.name)
        if tensor is None or tensor is not staged.tensor:
            return None
        return tensor

    def staged_into(self, name: str) -> torch.Tensor | None:
        """The tensor a change of ``name`` staged while preparing is written into now: the
        live canonical tensor (:meth:`tensor`), or for a target that stages changes against
        its own storage (:meth:`StagingSource.stage_placed`) that storage, the same object
        as when it was staged while it has not moved; None where there is none."""
        return self.tensor(name)

    def put_batch(self, names: Sequence[str], staged: Sequence[Staged]) -> bool:
        """:meth:`change` of every change of one batch staged together (``names``, each
        with what was staged for it in ``staged``, in the batch's order; none of them a
        ``full`` write), written in one pass and undone as one. False (nothing written)
        where any of them would not take :meth:`put`, or where the changes are not exactly
        the batch's: :meth:`change` each instead. What each change did is what was staged
        for it (:class:`Staged`: its positions, bits before and after, lane deltas)."""
        if not staged or self.__dict__.get("_whole_undo") is not None:
            return False
        batch = staged[0].batch
        if batch is None or staged[0].names != tuple(names):
            return False
        tensors = []
        tensor_of = self.staged_into
        for name, one in zip(names, staged, strict=True):
            tensor = tensor_of(name)
            if tensor is None or tensor is not one.tensor or one.batch is not batch:
                return False
            tensors.append(tensor)
        # the write is whole or nothing (put_batch); its undo is journalled before it
        replaced: list[torch.Tensor] = []

        def undo() -> None:
            if replaced:
                unput_batch(tensors, batch, replaced[0])

        self._journal().append(undo)
        replaced.append(put_batch(tensors, batch))
        return True

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
        return resolved_against(change, tensor, keep_before=True)  # applied to it next

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


def _staged_applied(undo: Callable[[], None], staged: Staged) -> Applied:
    """What :meth:`ReaderTransaction.put` reports of a staged change written."""
    bits = staged.bits
    return Applied(
        undo, bits.positions, bits.before, bits.after, lane_deltas=bits.lane_deltas,
        rows=staged.rows,
    )  # fmt: skip


def _nothing() -> None:
    """The undo of a change another undo covers."""


_ALL: dict[str, torch.Tensor] = {}  # keep_whole_undo(storage): every bit kept at the start


def restore_whole(tensor: torch.Tensor, saved: torch.Tensor | None) -> Callable[[], None]:
    """The undo of a ``full`` write: the bits it replaced put back (None: nothing to)."""
    if saved is None:
        return lambda: None

    def restore() -> None:
        bits_view(tensor).reshape(-1).copy_(saved, non_blocking=False)

    return restore


def resolved_against(change: Change, old: torch.Tensor, *, keep_before: bool = False) -> Change:
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
