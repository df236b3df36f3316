"""``dcr diff A B``: which tensors, and how many elements, differ between two versions.

Computed from the chain without materialising either version:

- a tensor whose fingerprint is the same at A and B is unchanged (exact, up to a
  fingerprint collision, FORMAT.md §9.2);
- a tensor present at only one of them was added or removed, one whose dtype or
  shape differs was replaced (every element counts);
- otherwise the entries of the versions in (A, B] are combined: ``xor`` entries
  compose by XOR, so an element differs iff the XOR of all values written at its
  position is non-zero (exact: elements that changed back are not counted);
  positions an ``overwrite`` wrote are counted as differing (an upper bound: the
  value at A is not in the chain there); a ``full`` entry in between makes every
  element count (an upper bound); a tensor some entry codes against its old bits
  (``classed`` positions, ``ulp`` values) counts the changes its entries declare (an
  upper bound).

``exact=True`` resolves the upper bounds by replaying only the affected tensors
(through a reader restricted to them) to A and to B and comparing their bits.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch

from dcr_format.chain.chain import Chain, LoadedRecord, TensorState, get_verified, state_table
from dcr_format.delta.delta import FULL, XOR, Delta
from dcr_format.format.dtypes import bits_view, info_for
from dcr_format.format.names import CLASSED, ULP, ULP_SHIFT
from dcr_format.format.schema import Entry, Manifest
from dcr_format.format.shard import decode_shard
from dcr_format.store.store import Store, open_store
from dcr_format.sync._fetch import _decode_entry
from dcr_format.sync.reader import DeltaReader
from dcr_format.system.options import whole
from dcr_format.targets.dict import StateDictTarget
from dcr_format.tools._common import Row, numel
from dcr_format.tools._progress import Progress

Status = Literal["changed", "added", "removed", "replaced", "unchanged"]
_EXACT_GROUP_BYTES = 1 << 30  # tensors materialised together by exact=True


class DiffRow(Row):
    """One tensor compared between two versions."""

    name: str
    status: Status
    dtype: str
    shape: tuple[int, ...]
    elements: int
    """Elements whose bits differ (an upper bound when ``exact`` is False)."""
    total: int
    """Elements of the tensor (at B, or at A when it was removed)."""
    exact: bool
    versions: int
    """Versions between A and B that changed the tensor."""


class DiffReport(Row):
    """Result of :func:`diff`: the tensors that differ between versions ``a`` and ``b``."""

    a: int
    b: int
    tensors_compared: int
    tensors_differing: int
    elements_differing: int
    """Sum of ``elements`` over the rows (an upper bound unless ``exact``)."""
    exact: bool
    tensors: list[DiffRow]


class _Touched:
    """Where one tensor's xor/overwrite entries wrote, and the XOR of the xor values there.

    Sparse (sorted positions) while few positions are touched, dense past a quarter
    of the tensor.
    """

    def __init__(self, count: int, bits_dtype: torch.dtype) -> None:
        self.count = count
        self.bits_dtype = bits_dtype
        self.pos = torch.empty(0, dtype=torch.int64)
        self.net = torch.empty(0, dtype=bits_dtype)
        self.unknown = torch.empty(0, dtype=torch.int64)
        self.dense: tuple[torch.Tensor, torch.Tensor] | None = None  # (net, unknown mask)

    def add(self, op: str, positions: torch.Tensor, values: torch.Tensor) -> None:
        if self.dense is not None:
            net, mask = self.dense
            if op == XOR:
                net[positions] ^= values
            else:
                mask[positions] = True
            return
        if op == XOR:
            self._merge_xor(positions, values)
        else:
            self.unknown = torch.unique(torch.cat([self.unknown, positions]))
        if self.pos.numel() + self.unknown.numel() > self.count // 4:
            net = torch.zeros(self.count, dtype=self.bits_dtype)
            net[self.pos] = self.net
            mask = torch.zeros(self.count, dtype=torch.bool)
            mask[self.unknown] = True
            self.dense = (net, mask)

    def _merge_xor(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        # each side lists a position at most once, so duplicates come in pairs
        allp, order = torch.sort(torch.cat([self.pos, positions]), stable=True)
        allv = torch.cat([self.net, values])[order]
        if allp.numel() > 1:
            first = torch.nonzero(allp[1:] == allp[:-1]).reshape(-1)
            if first.numel():
                allv[first] ^= allv[first + 1]
                keep = torch.ones(allp.numel(), dtype=torch.bool)
                keep[first + 1] = False
                allp, allv = allp[keep], allv[keep]
        self.pos, self.net = allp, allv

    def result(self) -> tuple[int, bool]:
        """(elements that differ or may differ, whether that count is exact)."""
        if self.dense is not None:
            net, mask = self.dense
            unknown = int(mask.sum())
            return int(((net != 0) & ~mask).sum()) + unknown, unknown == 0
        known = self.net != 0
        if self.unknown.numel():
            known &= ~torch.isin(self.pos, self.unknown)
        return int(known.sum()) + self.unknown.numel(), self.unknown.numel() == 0


@dataclass
class _Version:
    loaded: LoadedRecord
    manifests: list[Manifest]


def diff(
    store: Store | str | os.PathLike[str],
    a: int,
    b: int,
    *,
    exact: bool = False,
    include_unchanged: bool = False,
    max_workers: int = 8,
    progress: bool = False,
) -> DiffReport:
    """Compare versions ``a`` and ``b`` tensor by tensor (see the module docstring).

    Every version from ``min(a, b)`` to ``max(a, b)`` must be committed; their
    records, links and manifests are checked on the way. Rows are sorted by
    differing elements, largest first; unchanged tensors are left out unless
    ``include_unchanged``. ``progress`` shows how far the reading and decoding are on
    stderr (a bar on a terminal, lines off one).
    """
    a, b = whole(a, "a", low=0), whole(b, "b", low=0)
    chain = Chain(open_store(store))
    chain.header  # noqa: B018  # refuse a store without a chain
    lo, hi = min(a, b), max(a, b)
    _check_range(chain, lo, hi)
    versions = _load_versions(chain, lo, hi, max_workers, progress)
    table_lo = state_table(versions[0].manifests)
    table_hi = state_table(versions[-1].manifests)
    changed_in = Counter(  # pieces of one tensor count once per version
        name
        for v in versions[1:]
        for name in {e.name for m in v.manifests for e in m.entries if e.changed > 0}
    )
    rows: dict[str, DiffRow] = {}
    pending: dict[str, TensorState] = {}  # same dtype and shape, fingerprints differ
    for name in sorted(set(table_lo) | set(table_hi)):
        old, new = table_lo.get(name), table_hi.get(name)
        changes = changed_in[name]
        if old is None or new is None:
            row = old or new
            assert row is not None
            status: Status = "added" if old is None else "removed"
            if a > b:
                status = "removed" if status == "added" else "added"
            rows[name] = _row(row, status, numel(row.shape), True, changes)
        elif (old.dtype, old.shape) != (new.dtype, new.shape):
            count = max(numel(old.shape), numel(new.shape))
            rows[name] = _row(new, "replaced", count, True, changes)
        elif old.fingerprint == new.fingerprint:
            rows[name] = _row(new, "unchanged", 0, True, changes)
        else:
            pending[name] = new
    touched = _combine(chain, versions[1:], pending, max_workers, progress)
    bounds: Counter[str] = Counter()  # changes in all, of tensors whose positions are not read
    for version in versions[1:]:
        for manifest in version.manifests:
            for entry in manifest.entries:
                if entry.name in pending and entry.name not in touched:
                    bounds[entry.name] += entry.changed
    for name, state in pending.items():
        found = touched.get(name)
        if found is None:
            count, is_exact = min(numel(state.shape), bounds[name]), False
        else:
            count, is_exact = found.result()
        rows[name] = _row(state, "changed", count, is_exact, changed_in[name])
    if exact:
        inexact = [n for n in pending if not rows[n].exact]
        for name, count in _exact_counts(chain, lo, hi, inexact, table_hi).items():
            rows[name] = rows[name].model_copy(update={"elements": count, "exact": True})
    listed = [r for r in rows.values() if include_unchanged or r.status != "unchanged"]
    listed.sort(key=lambda r: (-r.elements, r.name))
    differing = [r for r in rows.values() if r.status != "unchanged"]
    return DiffReport(
        a=a,
        b=b,
        tensors_compared=len(rows),
        tensors_differing=len(differing),
        elements_differing=sum(r.elements for r in differing),
        exact=all(r.exact for r in rows.values()),
        tensors=listed,
    )


def _row(state: TensorState, status: Status, elements: int, exact: bool, versions: int) -> DiffRow:
    return DiffRow(
        name=state.name,
        status=status,
        dtype=state.dtype,
        shape=state.shape,
        elements=elements,
        total=numel(state.shape),
        exact=exact,
        versions=versions,
    )


def _check_range(chain: Chain, lo: int, hi: int) -> None:
    """Both ends are in the chain's committed range (a gap in between is named on loading)."""
    committed = chain.versions()
    for version in (lo, hi):
        if not committed or not committed[0] <= version <= committed[-1]:
            raise chain.not_committed(version, committed)


def _load_versions(
    chain: Chain, lo: int, hi: int, max_workers: int, progress: bool
) -> list[_Version]:
    total = 2 * (hi - lo + 1)  # each version's record, then its manifests
    with (
        ThreadPoolExecutor(max_workers) as pool,
        Progress("diff: read", total=total, unit="records and manifests", enabled=progress) as bar,
    ):
        records = []
        for record in pool.map(chain.record, range(lo, hi + 1)):
            records.append(record)
            bar.add()
        for parent, child in itertools.pairwise(records):
            chain.check_link(parent, child)
        manifests = []
        for found in pool.map(chain.manifests, records):
            manifests.append(found)
            bar.add()
    return [_Version(r, m) for r, m in zip(records, manifests, strict=True)]


def _combine(
    chain: Chain,
    versions: list[_Version],
    pending: dict[str, TensorState],
    max_workers: int,
    progress: bool = False,
) -> dict[str, _Touched]:
    """Accumulate the positions of every xor/overwrite entry of the pending tensors.

    Tensors that a whole ``full`` entry rewrote in between are left out (every element
    counts); a ``full`` piece (FORMAT.md §4.8) writes its region like an ``overwrite``.
    So are tensors with ``classed`` positions or ``ulp``/``ulp-shift`` values (FORMAT.md §6.5,
    §7.5-7.6): they
    decode only against the tensor's bits, which this report does not materialise
    (``exact`` does).
    """
    rewritten = {
        e.name
        for v in versions
        for m in v.manifests
        for e in m.entries
        if (e.op == FULL and e.piece is None)
        or (e.positions is not None and e.positions.coding == CLASSED)
        or (e.values is not None and e.values.coding in (ULP, ULP_SHIFT))
    } & set(pending)
    wanted = set(pending) - rewritten
    touched = {
        name: _Touched(numel(pending[name].shape), info_for(pending[name].dtype).bits_dtype)
        for name in wanted
    }
    with (
        ThreadPoolExecutor(max_workers) as pool,
        Progress(
            "diff: decode", total=len(versions), unit="versions", enabled=progress and bool(wanted)
        ) as bar,
    ):
        for version in versions:
            for _, entry, delta in _decoded(chain, version, wanted, pool):
                assert delta.positions is not None
                touched[entry.name].add(delta.op, delta.positions, delta.values)
            bar.add()
    return touched


def _decoded(
    chain: Chain, version: _Version, wanted: set[str], pool: ThreadPoolExecutor
) -> Iterator[tuple[Manifest, Entry, Delta]]:
    """Decode the changed entries of ``wanted`` tensors in one version (each shard fetched once)."""
    jobs: list[tuple[Manifest, int]] = []
    for manifest in version.manifests:
        entries = [e for e in manifest.entries if e.name in wanted and e.changed > 0]
        shards = sorted({r.shard for e in entries for r in e.streams})
        jobs.extend((manifest, index) for index in shards)

    def load(job: tuple[Manifest, int]) -> tuple[tuple[int, int], dict[str, memoryview]]:
        manifest, index = job
        ref = manifest.shards[index]
        stored = get_verified(chain.store, ref.path, size=ref.size, sha256=ref.sha256)
        return (manifest.rank, index), decode_shard(stored, decoded_size=ref.decoded_size)

    streams = dict(pool.map(load, jobs))
    for manifest in version.manifests:
        for entry in manifest.entries:
            if entry.name in wanted and entry.changed > 0:
                yield manifest, entry, _decode_entry(entry, manifest, streams)


def _exact_counts(
    chain: Chain, lo: int, hi: int, names: list[str], table_hi: dict[str, TensorState]
) -> dict[str, int]:
    """Materialise only ``names`` at ``lo`` and at ``hi`` (in groups) and count differing bits."""
    counts: dict[str, int] = {}
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = numel(table_hi[name].shape) * info_for(table_hi[name].dtype).width
        if groups[-1] and size + nbytes > _EXACT_GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    for group in groups:
        if not group:
            continue
        chosen = set(group)
        tensors: dict[str, torch.Tensor] = {}
        reader = DeltaReader(chain.store, StateDictTarget(tensors), select=chosen.__contains__)
        reader.sync(to=lo)
        before = {n: bits_view(t).reshape(-1).clone() for n, t in tensors.items()}
        reader.sync(to=hi)
        for name in group:
            after = bits_view(tensors[name]).reshape(-1)
            counts[name] = int((before[name] != after).sum())
    return counts
