"""Agreement among the reader ranks that share one target (a tensor-parallel group).

Every rank of the group runs the same stages of a sync; at the end of each stage
the ranks exchange whether it succeeded (a gloo all-reduce), and if any rank
failed every rank stops: before the apply nothing has been touched, after it
every rank rolls its part back. So either all ranks apply a version or none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from dcr_format.errors import GroupAbortError, StalePreparedError

_DONE, _FAILED, _STALE = 0, 1, 2  # how a rank ended a stage


class Agreement:
    """Whether the ranks of a stage passed the same values (set when the stage ends)."""

    same: bool = True


class ReaderGroup:
    """The ranks of a ``torch.distributed`` process group (``None``: a reader on its own).

    The group must carry CPU tensors (gloo); pass a gloo group when the default
    group is NCCL (``torch.distributed.new_group(backend="gloo")``).
    """

    def __init__(
        self,
        group: Any = None,
        *,
        solo: bool = False,
        before_agreeing: Callable[[], None] | None = None,
    ) -> None:
        self._group = group
        self._solo = solo
        # called before every agreement (a relay store closes its epoch there)
        self._before_agreeing = before_agreeing

    @classmethod
    def solo(cls, *, before_agreeing: Callable[[], None] | None = None) -> ReaderGroup:
        """A reader that agrees with nobody."""
        return cls(None, solo=True, before_agreeing=before_agreeing)

    @property
    def alone(self) -> bool:
        """Whether this reader agrees with nobody (no process group)."""
        return self._solo

    @property
    def rank(self) -> int:
        """This reader's rank in the group (0 on its own)."""
        if self._solo:
            return 0
        return int(self._group.rank())

    def _dist(self) -> Any:
        import torch.distributed as dist

        return dist

    def min(self, value: int) -> int:
        """The smallest ``value`` over the ranks."""
        if self._before_agreeing is not None:
            self._before_agreeing()
        if self._solo:
            return value
        dist = self._dist()
        box = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self._group)
        return int(box.item())

    def rows(self, *values: int) -> list[tuple[int, ...]]:
        """Every rank's ``values``, by rank (every rank calls this with as many values;
        one all-reduce)."""
        if self._before_agreeing is not None:
            self._before_agreeing()
        if self._solo:
            return [tuple(values)]
        dist = self._dist()
        # the group's own numbers: a group need not be registered with torch.distributed
        size, me = self._group.size(), self._group.rank()
        box = torch.zeros((size, len(values)), dtype=torch.int64)
        box[me] = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.SUM, group=self._group)
        return [tuple(row) for row in box.tolist()]

    def failed_ranks(self, ok: bool) -> list[int]:
        """Group ranks that reported failure (every rank calls this once per stage)."""
        return [rank for rank, (flag,) in enumerate(self.rows(0 if ok else 1)) if flag]

    @contextmanager
    def stage(self, what: str, *, agree: tuple[int, ...] = ()) -> Iterator[Agreement]:
        """Run a stage; raise :class:`GroupAbortError` if another rank's stage failed.

        A local failure is reported to the group and re-raised unchanged. Where every rank
        that failed found its target moved since the version was prepared
        (:class:`StalePreparedError`), every rank raises that error, so that all prepare
        again; where one of them failed otherwise, none does (a rank that found its target
        moved raises :class:`GroupAbortError` too). ``agree``: values the ranks compare in
        the same exchange; the :class:`Agreement` yielded says, once the stage has ended on
        every rank, whether all passed the same.
        """
        agreement = Agreement()
        try:
            yield agreement
        except Exception as exc:
            stale = isinstance(exc, StalePreparedError)
            rows = self.rows(_STALE if stale else _FAILED, *agree)
            others = [rank for rank, row in enumerate(rows) if row[0] == _FAILED]
            if stale and others:
                raise self.aborted(others, what) from exc
            raise
        rows = self.rows(_DONE, *agree)
        agreement.same = all(row[1:] == rows[0][1:] for row in rows)
        failed = [rank for rank, row in enumerate(rows) if row[0] != _DONE]
        if failed and all(rows[rank][0] == _STALE for rank in failed):
            raise StalePreparedError(
                f"reader rank(s) {failed} no longer hold the version this one was prepared "
                "against; prepare again, every rank"
            )
        if failed:
            raise self.aborted(failed, what)

    @staticmethod
    def aborted(failed: list[int], what: str) -> GroupAbortError:
        """The error of a rank whose group's ranks ``failed`` while ``what``."""
        return GroupAbortError(
            f"reader rank(s) {failed} failed while {what}; no rank applies this version: "
            "see their errors, then sync again"
        )
