"""Applying versions to a live model through its own loader (FORMAT.md §8.4).

A rollout runtime keeps weights in its own layout (fused ``qkv_proj``, ``gate_up``,
tensor-parallel shards, fp32 norms) and knows the placement in its loader:
``load_weights(iterable of (canonical_name, tensor))`` in vLLM-style runtimes, or
``load_state_dict`` in plain torch. :class:`ModuleTarget` hands that loader a scratch
tensor of canonical shape, one name at a time, and intercepts with a storage-scoped
torch dispatch mode every write it makes into the module's parameter and buffer
storage. Meanwhile it follows where each scratch element goes: through views
(``narrow``, slicing, ``t()``, ``chunk``) and bit-preserving copies (``clone``,
``contiguous``) a copy is a *placement*; through pointwise arithmetic or a dtype cast
it is a *transform*; through anything else (a reduction, a matmul) it is *opaque*.

- ``xor``: the scratch holds the XOR bits at the delta's positions; each intercepted
  placement becomes ``dst_bits[e] ^= xor_bits`` at the destination elements ``e`` that
  the changed positions reach (found by inverting the copy's views: O(changed)).
- ``overwrite``: the scratch holds the new bits at the delta's positions; each
  intercepted copy, placement or transform, writes only the destination elements
  derived from those positions, with the values the loader computed for them.
- ``full``: the loader runs for real (a dense load of that tensor), old bits saved.

A prewarm pass (:meth:`ModuleTarget.prewarm`, run lazily for every name a sync meets)
runs the loader with the interception recording, not writing, and classifies each
canonical name: ``xor`` (every copy is a placement and no destination element is
written twice, within the name or by another name, e.g. tied embeddings),
``overwrite`` (a transform or an overlap), ``opaque`` (only ``full`` works) or
``absent`` (the loader places nothing: another rank's shard or expert). A reader
records the ``overwrite`` names in ``readers/<id>.json`` so writers send them that way;
an ``xor`` change for such a name fails closed with :class:`OverwriteRequiredError`
before anything is mutated.

Placements learned once: the loader's placement of an ``xor`` name is fixed, so after the
prewarm a change to it (``xor`` or ``overwrite``) is applied without calling the loader:
where the loader copies the whole tensor unchanged into one contiguous run of a parameter (a
whole weight, a row block of a fused ``qkv_proj``) through a canonical view of that run,
with the fused apply a plain tensor gets; else straight into the learned destinations with
the same kernels. A tensor-parallel shard's block of rows is a run of consecutive canonical
positions (the sorted changed positions sliced, one kernel pass that also sums the lane
deltas); a block of columns locates its positions by arithmetic on them; any other
placement inverts the copy's views (O(changed)) or looks them up in a sorted index table
where they do not invert. The names placed whole into one contiguous run are also offered
for staging (:meth:`ModuleTarget.staging`), and the changes to names placed otherwise in one
parameter (a shard, a transposed weight) are staged against its storage
(:meth:`ModuleTarget.stage_placed`), so that :meth:`DeltaReader.prepare` reads their changes
against the live bits while the module still serves, and the pause of
:meth:`DeltaReader.apply` is the write of the changed elements alone. The loader still
runs for the names it transforms and for ``full`` writes. Each sync first checks that every
parameter and buffer still has the storage it had when the placements were learned, and
learns again the names placed in one that moved (nothing is staged meanwhile).

Verification: for ``xor`` names the canonical bits the module holds are read back
through the inverse of the placements, giving the fingerprint lanes of the canonical
elements this rank holds. A module holding whole tensors is verified exactly like a
dict of tensors. For a tensor-parallel shard the lanes are partial; with
``reduce_lanes`` (e.g. :func:`all_reduce_lanes` over the tensor-parallel group) the
ranks' disjoint parts are summed into the full lanes and checked; without it those
names are reported in ``SyncResult.unverified``, as are names the loader transforms
(their canonical bits cannot be read back).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Collection, Hashable, Iterable, Mapping
from typing import Any

import torch

from dcr_format.delta.delta import OVERWRITE, XOR
from dcr_format.errors import ArgumentError
from dcr_format.format.schema import MAX_BASELINE_NAMES
from dcr_format.targets.change import Change, Resident
from dcr_format.targets.module_apply import _ModuleTransaction, _stage_placed, held_elementwise
from dcr_format.targets.placements import LoaderPlan, LoadWeights, Placements, ReduceLanes
from dcr_format.targets.protocol import Target, Transaction
from dcr_format.targets.reader_side import PlacedStage

__all__ = ["LoaderPlan", "ModuleTarget", "all_reduce_lanes"]


def all_reduce_lanes(
    group: Any = None,
) -> ReduceLanes:
    """A ``reduce_lanes`` for :class:`ModuleTarget` over a ``torch.distributed`` group (the
    tensor-parallel ranks of one model replica, a backend that carries objects).

    Where every rank passes the same names with as many lanes each (a tensor-parallel
    group: each rank holds a part of every tensor), the lanes are summed in one all-reduce
    of integers, after one small all-reduce that checks the names agree; otherwise each
    rank's lanes are gathered and summed by name."""

    def reduce(lanes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        import torch.distributed as dist

        names = sorted(lanes)
        widths = [len(lanes[name]) for name in names]
        digest = hashlib.sha256("\n".join(names).encode())
        digest.update(bytes(widths))  # 2 or 3 lanes a name
        key = int.from_bytes(digest.digest()[:7], "big")
        # the largest and (negated) smallest name count and digest over the ranks
        head = torch.tensor([len(names), -len(names), key, -key], dtype=torch.int64)
        dist.all_reduce(head, op=dist.ReduceOp.MAX, group=group)
        if int(head[0]) == -int(head[1]) and int(head[2]) == -int(head[3]):
            if not names:  # none on any rank
                return {}
            flat = list(itertools.chain.from_iterable(lanes[name] for name in names))
            box = torch.tensor(flat, dtype=torch.int64)
            dist.all_reduce(box, op=dist.ReduceOp.SUM, group=group)  # each lane below 2**31
            if min(widths) == max(widths):
                rows = box.view(-1, widths[0]).tolist()
                return {name: tuple(row) for name, row in zip(names, rows, strict=True)}
            summed, out, at = box.tolist(), {}, 0
            for name, width in zip(names, widths, strict=True):
                out[name] = tuple(summed[at : at + width])
                at += width
            return out
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, lanes, group=group)
        total: dict[str, list[int]] = {}
        for part in gathered:
            for name, values in part.items():
                sums = total.setdefault(name, [])
                sums.extend([0] * (len(values) - len(sums)))  # (a rank of another width)
                for i, v in enumerate(values):
                    sums[i] += v
        return {name: tuple(v) for name, v in total.items()}

    return reduce


# --- the target --------------------------------------------------------------------------


class ModuleTarget(Placements, Target):
    """A ``torch.nn.Module`` updated in place through its own loader.

    ``load_weights``: a vLLM-style ``load_weights(iterable of (name, tensor))``; it is
    called with one name at a time and may skip names it does not load on this rank.
    Without it the module's ``load_state_dict(..., strict=False)`` is used, and a name
    it reports as unexpected is an error. ``reduce_lanes`` sums partial fingerprint lanes
    over the ranks that share tensors (see :func:`all_reduce_lanes`); every rank must then
    sync together. ``version``/``chain_id`` declare a module already holding a version
    (loaded from that version's checkpoint). ``rollback_full`` keeps the old bits of
    whatever a ``full`` write replaces (a copy of the replaced parameters), so a failed
    sync can be undone; without it a failure during a base leaves the module mixed (and
    not resident at any version).

    ``direct``: a name whose loader only places elements (an ``xor`` plan) takes its later
    changes straight into the parameter storage, through the placements learned from the
    loader once, without calling the loader again; the loader still runs for names it
    transforms and for ``full`` writes. The placements are learned again when a parameter's
    storage has moved since (checked at the start of every sync). Without ``direct`` every
    change goes through the loader.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        load_weights: LoadWeights | None = None,
        reduce_lanes: ReduceLanes | None = None,
        version: int | None = None,
        chain_id: str | None = None,
        rollback_full: bool = True,
        direct: bool = True,
    ) -> None:
        if not isinstance(module, torch.nn.Module):
            raise ArgumentError(
                f"ModuleTarget takes a torch.nn.Module, not a {type(module).__name__} (for a "
                "dict of tensors use StateDictTarget)"
            )
        if (version is None) != (chain_id is None):
            raise ArgumentError("give both version and chain_id for a module that holds a version")
        super().__init__(
            module,
            load_weights=load_weights,
            reduce_lanes=reduce_lanes,
            rollback_full=rollback_full,
            direct=direct,
            resident=Resident(chain_id, version) if chain_id and version is not None else None,
        )

    # --- Target -------------------------------------------------------------------------

    def resident(self) -> Resident | None:
        """The version the module holds (as last synced, or as declared)."""
        return self._resident

    def begin(self) -> Transaction:
        """A transaction applying through the loader (or the placements learned from it)."""
        self._check_layout()
        return _ModuleTransaction(self)

    def claim_key(self) -> Hashable:
        """The module: targets over one module take turns."""
        return ("module", id(self.module))

    def accepts(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
        """Whether the loader places ``name`` in this module (prewarms it on first sight)."""
        return self.plan(name, dtype, shape).kind != "absent"

    def reads_baseline(self) -> bool:
        """False: the module's tensors are reached through its loader, not as canonical bits
        (except those of :meth:`baseline_names`)."""
        return False

    def baseline_names(self) -> frozenset[str]:
        """The names learned so far (:meth:`prewarm`) that the loader places whole into one
        contiguous run of a parameter (their canonical bits are a view of it, which a sync
        reads and writes directly), then those it places nowhere (another rank's); the
        largest first where they are more than a reader record lists. Not: tensor-parallel
        shards, names the loader transforms, transposes or places twice."""
        return frozenset(self._readable()[:MAX_BASELINE_NAMES])

    def baseline_except(self, names: Collection[str]) -> frozenset[str]:
        """Of ``names``, those :meth:`baseline_names` would not list however many it listed:
        shards, names the loader transforms, and names not learned yet."""
        readable = set(self._readable())
        return frozenset(name for name in names if name not in readable)

    def _readable(self) -> list[str]:
        """Every name :meth:`baseline_names` may list, in its order of preference."""
        absent, whole = [], []
        for plan in self._plans.values():
            if plan.kind == "absent":
                absent.append(plan.name)
            elif plan.kind == "xor" and self._canonical_view(plan) is not None:
                whole.append((-plan.numel, plan.name))
        return [name for _, name in sorted(whole)] + sorted(set(absent))

    def staging(self, names: Iterable[str]) -> Mapping[str, torch.Tensor]:
        """The canonical views (:meth:`Transaction.tensor`) of the names among ``names`` the
        loader places whole into one contiguous run of a parameter, so that a prepared
        version has their changes read against the live bits ahead of the pause, which is
        then the write alone; nothing where a parameter's storage moved since the
        placements were learned (the apply learns them again first)."""
        if not self.direct or self._layout is None or self._current_layout() != self._layout:
            return {}
        views = {}
        for name in names:
            if name not in self._held and not self._declared:
                continue  # not held: the sync writes it through apply (a new name)
            view = self._view_of_name(name)
            if view is not None:
                views[name] = view
        return views

    def stage_placed(self, changes: Mapping[str, Change]) -> Mapping[str, PlacedStage]:
        """The changes to names held as shards (:meth:`staging` aside: a block of rows or
        columns of one parameter, each element placed once), read against that parameter's
        storage ahead of the pause, which is then the write alone; their lanes are this
        rank's part. Nothing where a parameter's storage moved since the placements were
        learned."""
        if not self.direct or self._layout is None or self._current_layout() != self._layout:
            return {}
        out: dict[str, PlacedStage] = {}
        for name, change in changes.items():
            delta = change.delta
            if delta.op not in (XOR, OVERWRITE) or (delta.ulp and not held_elementwise(delta)):
                continue
            if name not in self._held and not self._declared:
                continue  # not held: the sync writes it through apply (a new name)
            plan = self._plan_of(name)
            if plan is None or (plan.dtype, plan.shape) != (change.dtype, change.shape):
                continue
            if self._canonical_view(plan) is not None:
                continue  # whole: offered by staging()
            bits = self._placed_bits(plan)
            if bits is None or delta.positions is None:
                continue
            positions = delta.positions.to(torch.int64).cpu()
            values = delta.values.cpu()
            # ulp values (held_elementwise) are stepped from the bits read at each element
            staged = _stage_placed(self, plan, bits, delta.op, positions, values, ulp=delta.ulp)
            out[name] = (bits, staged)
        return out

    def reads_changed(self) -> bool:
        """Whether every name learned so far whose old bits this module does not hold whole
        (:meth:`baseline_names` aside: a shard) sits in one parameter's storage, so that it
        reads the old bits of each changed element it holds there (``ulp`` values,
        FORMAT.md §3.6 ``reads_changed``)."""
        return all(
            self._canonical_view(plan) is not None or self._placed_bits(plan) is not None
            for plan in self._plans.values()
            if plan.kind == "xor"
        )

    def overwrite_names(self) -> frozenset[str]:
        """Names whose load path is not bit-preserving (they need ``overwrite``)."""
        return frozenset(p.name for p in self._plans.values() if p.kind == "overwrite")
