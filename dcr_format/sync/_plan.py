"""Planning a sync from metadata only: which versions, which objects, which checks.

The plan itself is plain data computed from commit records and manifests that have been
read and validated (FORMAT.md §11.4 step 1): nothing in it touches a shard or a target,
so a plan can be built and inspected from hand-made records. :func:`read_plan` reads
and checks those records and manifests from the chain (the resident version's record,
each version's link to its parent, an alternative base where it fetches less) and builds
the plan from them. The reader then fetches the plan's objects
(:mod:`dcr_format.sync._fetch`) and applies the decoded changes through the target's
transaction (:mod:`dcr_format.sync._apply`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from dcr_format.chain.bases import alternative_bases, load_base, read_base_record
from dcr_format.chain.chain import (
    Chain,
    LoadedRecord,
    TensorChange,
    TensorState,
    resolve_parents,
    state_table,
    table_fingerprint,
    tensor_changes,
)
from dcr_format.codings.registry import positions_bound
from dcr_format.errors import (
    ChainBrokenError,
    DcrError,
    DecodeLimitError,
    SchemaError,
    ShardError,
    TargetError,
    VersionNotFoundError,
)
from dcr_format.format.budget import decoded_bytes
from dcr_format.format.dtypes import info_for
from dcr_format.format.features import CODING_FEATURES
from dcr_format.format.schema import Entry, Manifest
from dcr_format.format.shard import shard_decoded_bound

if TYPE_CHECKING:
    from dcr_format.targets.change import Resident

# what a plan needs to know about the target: does it take this tensor at all?
Wants = Callable[[str, str, tuple[int, ...]], bool]


@dataclass(frozen=True)
class ShardObject:
    """One shard a step fetches: its key, stored size and sha256, declared decoded size,
    and the most each of its streams may inflate to (from the entries that use it)."""

    rank: int
    index: int
    path: str
    size: int
    sha256: str
    decoded_size: int
    limits: dict[str, int]


@dataclass(frozen=True)
class DecodeJob:
    """Shards that the wanted entries link (an entry's two streams in two shards join
    them), fetched and decoded together; ``entries`` index the step's ``wanted``."""

    rank: int
    shards: tuple[ShardObject, ...]
    entries: tuple[int, ...]
    output_bytes: int = 0  # what its entries decode to (:func:`entry_output_bytes`)

    @property
    def decoded_bytes(self) -> int:
        """Bytes the job holds at once, its inflated shards and what its entries decode to
        (counted against the decode budget before anything is fetched)."""
        return sum(shard.decoded_size for shard in self.shards) + self.output_bytes

    @property
    def stored_bytes(self) -> int:
        """Bytes the job fetches."""
        return sum(shard.size for shard in self.shards)


@dataclass(frozen=True)
class FetchPlan:
    """What one version fetches for a target: the entries it takes (manifest order) and
    the decode jobs of their shards."""

    manifests: tuple[Manifest, ...]
    wanted: tuple[tuple[Manifest, Entry], ...]
    jobs: tuple[DecodeJob, ...]

    @property
    def stored_bytes(self) -> int:
        """Bytes of the shards it fetches."""
        return sum(job.stored_bytes for job in self.jobs)

    @property
    def output_bytes(self) -> int:
        """Bytes its entries decode to, all held until the version is applied."""
        return sum(job.output_bytes for job in self.jobs)


@dataclass(frozen=True)
class StepPlan:
    """One version of a plan: its record, state table, what to fetch and what changes."""

    loaded: LoadedRecord
    table: dict[str, TensorState]
    base: bool  # a full snapshot: a base version, or the alternative base of a delta version
    fetch: FetchPlan
    tensors: tuple[TensorChange, ...]  # each wanted tensor's change, pieces combined
    metadata_bytes: int  # the manifests' stored bytes

    @property
    def version(self) -> int:
        """The version this step reaches."""
        return self.loaded.record.version

    @property
    def payload_bytes(self) -> int:
        """Bytes this step fetches: its manifests and the shards its entries need."""
        return self.metadata_bytes + self.fetch.stored_bytes


@dataclass(frozen=True)
class Checks:
    """What the reader checks on the target before mutating it (FORMAT.md §11.4 step 2).

    ``baseline``: each tensor a non-full change reaches, as its first listing in the plan
    describes it (dtype, shape and the fingerprint it is changed from). ``changing``: names
    a delta changes before any full write of them (those deltas land on the resident bits).
    """

    baseline: dict[str, TensorChange]
    changing: frozenset[str]


@dataclass(frozen=True)
class SyncPlan:
    """Everything a sync does, decided before anything is fetched or touched."""

    goal: int
    previous: int | None
    steps: tuple[StepPlan, ...]
    incremental: bool  # the steps continue from the resident version (else from a base)
    parent_table: dict[str, TensorState] | None  # the resident version's (incremental plans)
    checks: Checks

    @property
    def versions(self) -> tuple[int, ...]:
        """The versions applied, in order."""
        return tuple(step.version for step in self.steps)

    @property
    def payload_bytes(self) -> int:
        """Bytes the plan fetches."""
        return sum(step.payload_bytes for step in self.steps)


def choose_versions(
    resident: int | None,
    goal: int,
    committed: Collection[int],
    *,
    kind: Callable[[int], Literal["base", "delta"]],
    alternatives: Callable[[], Collection[int]],
    where: str,
    cost: Callable[[int, bool], int] | None = None,
) -> tuple[list[int], int | None]:
    """The versions to apply to go from ``resident`` to ``goal``; the second item is the
    first version when it starts from that version's alternative base (None otherwise).

    ``kind(version)`` is a committed version's record kind, ``alternatives()`` the versions
    with an alternative base (FORMAT.md §14), ``where`` the store named in errors.
    ``cost(version, alternative)``, where given, is the bytes a version (or its alternative
    base) fetches: a plan of two versions or more from ``resident`` then starts at the
    newest base after it instead, where that fetches fewer bytes in all. Without
    ``cost``, a plan that can continue from ``resident`` does, without asking for the
    alternative bases.
    """
    have = set(committed)
    if resident is not None and all(v in have for v in range(resident, goal + 1)):
        chain = list(range(resident + 1, goal + 1))
        if cost is None or len(chain) < 2:
            return chain, None
        found = _newest_base(goal, have, kind, set(alternatives()), after=resident + 1)
        if found is not None:
            start, alternative = found
            later = range(start + 1, goal + 1)
            from_base = cost(start, alternative) + sum(cost(v, False) for v in later)
            if from_base < sum(cost(v, False) for v in chain):
                return list(range(start, goal + 1)), start if alternative else None
        return chain, None
    found = _newest_base(goal, have, kind, set(alternatives()))
    if found is None:
        raise VersionNotFoundError(
            f"no base at or before version {goal} is left in {where}; "
            "compact the chain or pick a newer version"
        )
    start, alternative = found
    return list(range(start, goal + 1)), start if alternative else None


def _newest_base(
    goal: int,
    have: set[int],
    kind: Callable[[int], Literal["base", "delta"]],
    bases: set[int],
    *,
    after: int = -1,
) -> tuple[int, bool] | None:
    """The newest version above ``after``, at or before ``goal`` with every version after
    it committed, that is a base or has an alternative base (True: the alternative)."""
    version = goal
    while version in have and version > after:
        if version in bases:
            return version, True
        if kind(version) == "base":
            return version, False
        version -= 1
    return None


def check_version(
    loaded: LoadedRecord,
    manifests: list[Manifest],
    table: dict[str, TensorState],
    parent_table: dict[str, TensorState] | None,
) -> list[Manifest]:
    """A version's manifests add up to its state fingerprint, and a delta continues from
    its parent's table (when known). Returns the manifests with the parent fingerprints they
    leave implicit filled in from that table (FORMAT.md §3.5.5)."""
    version = loaded.record.version
    if table_fingerprint(table) != loaded.record.state_fingerprint:
        raise ChainBrokenError(
            f"the manifests of version {version} do not add up to its state fingerprint; "
            "the store is corrupt: run `dcr verify`"
        )
    if loaded.record.kind != "delta":
        return manifests
    manifests = resolve_parents(manifests, parent_table, version)
    if parent_table is not None:
        _check_continuity(parent_table, manifests, version)
    return manifests


def plan_step(
    loaded: LoadedRecord,
    manifests: list[Manifest],
    table: dict[str, TensorState],
    *,
    base: bool,
    wants: Wants,
    max_shard_bytes: int,
    metadata_bytes: int,
) -> StepPlan:
    """One validated version as a step for a target that ``wants`` some of its tensors."""
    fetch = plan_fetch(manifests, wants=wants, max_shard_bytes=max_shard_bytes)
    tensors = _tensors(fetch.wanted, manifests)
    return StepPlan(loaded, table, base, fetch, tensors, metadata_bytes)


def plan_fetch(manifests: list[Manifest], *, wants: Wants, max_shard_bytes: int) -> FetchPlan:
    """The entries of a version's manifests that a target ``wants`` and the jobs that fetch
    their shards; refuses shards whose declared sizes are over ``max_shard_bytes`` or over
    what their entries can need (before anything is fetched)."""
    wanted = tuple((m, e) for m in manifests for e in m.entries if wants(e.name, e.dtype, e.shape))
    return FetchPlan(tuple(manifests), wanted, tuple(_jobs(wanted, manifests, max_shard_bytes)))


def plan_checks(steps: Collection[StepPlan]) -> Checks:
    """The baseline checks of a plan (see :class:`Checks`)."""
    baseline: dict[str, TensorChange] = {}
    changing: set[str] = set()
    rewritten: set[str] = set()
    for step in steps:
        for tensor in step.tensors:
            baseline.setdefault(tensor.name, tensor)
            if tensor.full:
                rewritten.add(tensor.name)
            elif tensor.changed > 0 and tensor.name not in rewritten:
                changing.add(tensor.name)
    return Checks({n: t for n, t in baseline.items() if not t.full}, frozenset(changing))


def _tensors(
    wanted: tuple[tuple[Manifest, Entry], ...], manifests: list[Manifest]
) -> tuple[TensorChange, ...]:
    """Each wanted tensor's change once, in order of first listing, pieces combined."""
    changes = tensor_changes(manifests)
    return tuple(changes[name] for name in dict.fromkeys(entry.name for _, entry in wanted))


def entry_output_bytes(entry: Entry) -> int:
    """The bytes an entry's streams decode to, known from the manifest alone (a stream may
    decode to far more bytes than it holds: a ``rans`` or ``ranges`` stream of any count
    can be a few bytes)."""
    if entry.changed == 0:
        return 0
    width = info_for(entry.dtype).width
    return decoded_bytes(entry.changed, width, positions=entry.positions is not None)


def _jobs(
    wanted: tuple[tuple[Manifest, Entry], ...],
    manifests: list[Manifest],
    max_shard_bytes: int,
) -> list[DecodeJob]:
    """The decode jobs of a step, ordered by (rank, first shard), each shard checked with
    what the entries whose values it holds decode to."""
    ranks = {m.rank: m for m in manifests}
    limits = {m.rank: stream_limits(m) for m in manifests}
    output: dict[tuple[int, int], int] = {}  # (rank, shard index): bytes its entries decode to
    for manifest, entry in wanted:
        if entry.values is not None and entry.changed > 0:
            key = (manifest.rank, entry.values.shard)
            output[key] = output.get(key, 0) + entry_output_bytes(entry)
    jobs: list[DecodeJob] = []
    for rank, groups in _linked_shards(wanted).items():
        manifest = ranks[rank]
        for indices, members in groups:
            shards = []
            for index in sorted(members):
                ref = manifest.shards[index]
                shard_limits = limits[rank].get(index, {})
                _check_shard_size(
                    ref.path,
                    ref.decoded_size,
                    shard_limits,
                    max_shard_bytes,
                    output.get((rank, index), 0),
                )
                shards.append(
                    ShardObject(
                        rank, index, ref.path, ref.size, ref.sha256, ref.decoded_size, shard_limits
                    )
                )
            out = sum(output.get((rank, index), 0) for index in members)
            jobs.append(DecodeJob(rank, tuple(shards), tuple(indices), out))
    return sorted(jobs, key=lambda job: (job.rank, job.shards[0].index))


def _check_shard_size(
    path: str, decoded_size: int, limits: dict[str, int], max_shard_bytes: int, output: int = 0
) -> None:
    if decoded_size > max_shard_bytes:
        raise ShardError(
            f"{path} declares {decoded_size} decoded bytes, over the "
            f"{max_shard_bytes} limit; the manifest is hostile or raise the limit"
        )
    bound = shard_decoded_bound(limits)
    if decoded_size > bound:
        raise ShardError(
            f"{path} declares {decoded_size} decoded bytes but its entries "
            f"need at most {bound}; the manifest is corrupt or hostile"
        )
    if decoded_size + output > max_shard_bytes:
        raise DecodeLimitError(
            f"the entries of {path} would decode to {output} bytes, which with its "
            f"{decoded_size} inflated bytes is over the {max_shard_bytes}-byte shard limit; "
            "the manifest is hostile or raise the limit (max_shard_bytes)"
        )


def _linked_shards(
    wanted: tuple[tuple[Manifest, Entry], ...] | list[tuple[Manifest, Entry]],
) -> dict[int, list[tuple[list[int], set[int]]]]:
    """Per writer rank: groups of shards that the changed entries link (an entry's two
    streams in two shards join them), each with the indices (into ``wanted``) of its
    entries."""
    by_rank: dict[int, list[tuple[int, set[int]]]] = {}
    for index, (manifest, entry) in enumerate(wanted):
        if entry.changed == 0:
            continue
        shards = {ref.shard for ref in entry.streams}
        if shards:
            by_rank.setdefault(manifest.rank, []).append((index, shards))
    return {rank: _join(items) for rank, items in by_rank.items()}


def _join(items: list[tuple[int, set[int]]]) -> list[tuple[list[int], set[int]]]:
    """Union the shard sets that share a shard; each group keeps its entry indices.

    Each shard points at the group that holds it, and groups that an item links are merged
    into the largest of them, so a shard shared by many entries (thousands of small
    tensors' streams in one shard) costs each entry a constant step, not a copy of the
    group."""
    groups: dict[int, tuple[list[int], set[int]]] = {}  # by group id
    owner: dict[int, int] = {}  # shard -> id of the group that holds it
    for index, shards in items:
        linked = {owner[s] for s in shards if s in owner}
        if not linked:
            gid = index
            groups[gid] = ([index], set(shards))
        else:
            gid = max(linked, key=lambda g: len(groups[g][0]))
            indices, members = groups[gid]
            indices.append(index)
            for other in linked - {gid}:
                their_indices, their_members = groups.pop(other)
                indices.extend(their_indices)
                members |= their_members
                for shard in their_members:
                    owner[shard] = gid
            members |= shards
        for shard in shards:
            owner[shard] = gid
    return [(sorted(indices), members) for indices, members in groups.values()]


def _check_continuity(
    parent: dict[str, TensorState], manifests: list[Manifest], version: int
) -> None:
    """A delta keeps every tensor of its parent and starts each change from the parent's bits
    (pieces combined: their summed lanes give the parent fingerprint, FORMAT.md §4.8)."""
    listed = tensor_changes(manifests)
    missing = sorted(set(parent) - set(listed))
    if missing:
        raise ChainBrokenError(
            f"delta version {version} drops tensor {missing[0]!r} of its parent; "
            "the store is corrupt: run `dcr verify`"
        )
    for name, entry in listed.items():
        if entry.full:
            continue
        row = parent.get(name)
        if (
            row is None
            or row.dtype != entry.dtype
            or row.shape != tuple(entry.shape)
            or row.fingerprint != entry.parent_fingerprint
        ):
            raise ChainBrokenError(
                f"version {version} changes tensor {name!r} from bits its parent does not "
                "hold; the store is corrupt: run `dcr verify`"
            )


def stream_limits(manifest: Manifest) -> dict[int, dict[str, int]]:
    """For each shard index of ``manifest``: every stream key its entries name, and the most
    bytes that stream can hold (values exactly ``changed * width``; positions
    :func:`~dcr_format.codings.registry.positions_bound`). Feed ``limits=stream_limits(m)[index]``
    to :func:`~dcr_format.format.shard.decode_shard`.

    Every entry counts, wanted or not: the shard holds them all. A key named twice (a
    hostile manifest) gets the larger bound; the decoders check each use. (A ``rans``
    values stream is shorter than its ``planes`` would be, FORMAT.md §7.3, so the same
    bound holds.) An entry whose coding needs a feature the manifest does not list
    in ``required_features`` is refused (:class:`SchemaError`, FORMAT.md §6.5, §7.3).
    """
    limits: dict[int, dict[str, int]] = {}
    for entry in manifest.entries:
        for stream in entry.streams:
            feature = CODING_FEATURES.get(stream.coding)
            if feature is not None and feature not in manifest.required_features:
                raise SchemaError(
                    f"entry {entry.name[:256]!r} uses the {stream.coding!r} coding but "
                    f"its manifest does not require {feature!r}; the manifest is corrupt"
                )
        if entry.changed == 0:
            continue
        numel = 1
        for dim in entry.shape:
            numel *= dim
        width = info_for(entry.dtype).width
        for ref, bound in (
            (entry.positions, None),
            (entry.values, entry.changed * width),
        ):
            if ref is None:
                continue
            if bound is None:
                bound = positions_bound(ref.coding, entry.changed, numel)
            shard = limits.setdefault(ref.shard, {})
            shard[ref.key] = max(shard.get(ref.key, 0), bound)
    return limits


# --- reading the metadata a plan is made from ---------------------------------------------


def check_goal(
    chain: Chain, resident: Resident | None, goal: int, committed: list[int]
) -> int | None:
    """The resident version, once the target's chain and the goal are checked."""
    header = chain.header
    if resident is not None and resident.chain_id != header.chain_id:
        raise TargetError(
            f"the target holds chain {resident.chain_id}, the store {header.chain_id}; "
            "pull or replay into a new directory (or a new target) for this store"
        )
    if goal not in committed:
        raise chain.not_committed(goal, committed)
    previous = resident.version if resident is not None else None
    if previous is not None and previous > goal:
        raise TargetError(
            f"the target is at version {previous}, newer than {goal}; "
            "replay older versions into a new directory (or a new target)"
        )
    return previous


def plan_versions(
    chain: Chain, resident: Resident | None, goal: int, committed: list[int]
) -> tuple[list[int], int | None]:
    """The versions to apply; the second item is the first version when it starts from
    that version's alternative base (None otherwise)."""
    return choose_versions(
        None if resident is None else resident.version,
        goal,
        committed,
        kind=lambda version: chain.record(version).record.kind,
        alternatives=lambda: alternative_bases(chain.store),
        where=chain.store.url,
        cost=lambda version, alternative: _cost(chain, version, alternative),
    )


def _cost(chain: Chain, version: int, alternative: bool) -> int:
    """Bytes a version's objects (or its alternative base's) take to fetch, as its
    record states them (a planning estimate: what is fetched is checked as always);
    an alternative base that cannot be read counts as never cheaper."""
    if not alternative:
        return chain.record(version).record.stats.payload_bytes
    try:
        return read_base_record(chain, version)[0].stats.payload_bytes
    except DcrError:
        return sys.maxsize


def resident_record(chain: Chain, resident: Resident) -> LoadedRecord:
    """The resident version's commit record, checked against the one the target applied."""
    loaded = chain.record(resident.version)
    if resident.record_sha256 is not None and resident.record_sha256 != loaded.sha256:
        raise ChainBrokenError(
            f"the commit record of version {resident.version} is not the one the target "
            "applied (was it rewritten by a second writer?); run `dcr verify` on the "
            "store and pull into a fresh target"
        )
    return loaded


def read_plan(
    chain: Chain,
    resident: Resident | None,
    goal: int,
    committed: list[int],
    pool: ThreadPoolExecutor,
    *,
    wants: Wants,
    max_shard_bytes: int,
    table_of: Callable[[LoadedRecord], dict[str, TensorState]],
) -> SyncPlan:
    """Read and validate the metadata of every version to apply, and plan from it
    (``table_of``: a record's state table, where the reader keeps it)."""
    versions, alternative = plan_versions(chain, resident, goal, committed)
    # incremental: the plan continues from the resident version (else it starts at a base)
    incremental = (
        resident is not None
        and versions[0] == resident.version + 1
        and resident.version in set(committed)
    )
    parent: LoadedRecord | None = None
    parent_table: dict[str, TensorState] | None = None
    if incremental:
        assert resident is not None
        parent = resident_record(chain, resident)
        parent_table = table_of(parent)
    resident_table = parent_table
    steps: list[StepPlan] = []
    for version in versions:
        loaded = chain.record(version)
        if parent is not None:
            chain.check_link(parent, loaded)
        step = _plan_version(
            chain,
            loaded,
            version == alternative,
            parent_table,
            pool,
            wants=wants,
            max_shard_bytes=max_shard_bytes,
        )
        steps.append(step)
        parent, parent_table = loaded, step.table
    return SyncPlan(
        goal,
        None if resident is None else resident.version,
        tuple(steps),
        incremental,
        resident_table,
        plan_checks(steps),
    )


def _plan_version(
    chain: Chain,
    loaded: LoadedRecord,
    alternative: bool,
    parent_table: dict[str, TensorState] | None,
    pool: ThreadPoolExecutor,
    *,
    wants: Wants,
    max_shard_bytes: int,
) -> StepPlan:
    """Read one version's manifests (or its alternative base), check them, plan it."""
    if alternative:  # validated like a commit base (FORMAT.md §14)
        snapshot = load_base(chain, loaded, map_fn=pool.map)
        manifests, table = snapshot.manifests, snapshot.table
        metadata = sum(ref.size for ref in snapshot.record.manifests)
    else:
        manifests = chain.manifests(loaded, map_fn=pool.map)
        table = state_table(manifests)
        manifests = check_version(loaded, manifests, table, parent_table)
        metadata = sum(ref.size for ref in loaded.record.manifests)
    return plan_step(
        loaded,
        manifests,
        table,
        base=alternative or loaded.record.kind == "base",
        wants=wants,
        max_shard_bytes=max_shard_bytes,
        metadata_bytes=metadata,
    )
