"""``dcr verify``: is every object of the chain intact, and (deep) does every version replay?"""

from __future__ import annotations

import os

from pydantic import computed_field

from dcr_format.chain.bases import alternative_bases, base_record_key, load_base
from dcr_format.chain.chain import (
    Chain,
    LoadedRecord,
    ManifestAllowance,
    TensorState,
    commit_key,
    get_verified,
    resolve_parents,
    state_table,
    table_fingerprint,
)
from dcr_format.errors import ChainBrokenError, DcrError, VersionNotFoundError
from dcr_format.format.schema import Manifest
from dcr_format.store.store import Store, open_store
from dcr_format.sync._plan import _check_continuity
from dcr_format.sync.reader import DeltaReader
from dcr_format.system.options import whole
from dcr_format.targets.dict import StateDictTarget
from dcr_format.tools._common import Problem, Row
from dcr_format.tools._progress import Progress


class VerifyReport(Row):
    """Result of :func:`verify`: ``ok`` is True iff no problem was found."""

    ok: bool
    deep: bool
    first_version: int | None
    """The first version checked (None: nothing committed in the range)."""
    last_version: int | None
    versions_checked: int
    objects_checked: int
    bases_checked: int
    """Alternative bases (``dcr compact``) checked."""
    replayed_versions: int
    """Deep: versions whose full state was replayed and checked tensor by tensor."""
    problems: list[Problem]

    @computed_field  # type: ignore[prop-decorator]  # pydantic's form; mypy wants a bare @property
    @property
    def first_broken_version(self) -> int | None:
        """The lowest version with a problem."""
        return min((p.version for p in self.problems), default=None)


def verify(
    store: Store | str | os.PathLike[str],
    *,
    start: int | None = None,
    end: int | None = None,
    deep: bool = False,
    progress: bool = False,
) -> VerifyReport:
    """Check the chain's versions ``start..end`` (default: all) and report every problem.

    Shallow (always): every commit record (schema, numbering, the hash link to its
    parent), every manifest, shard and checkpoint file (size, sha256, schema,
    membership), that the
    manifests add up to each version's state fingerprint, that each delta keeps
    its parent's tensors and starts each change from the parent's fingerprint,
    and every alternative base in the range (record, manifests, shards, its
    binding to the commit record). A chain truncated by ``dcr gc`` starts at its
    oldest remaining version, whose parent link is not checked; that version must
    be a base or have an alternative base.

    Deep (``deep=True``) also replays: from the newest base at or before ``start``
    one version at a time through ``end``, applying each version to the state of
    the previous one and checking every tensor's fingerprint against that
    version's state table (a reader's ``verify="all"``); and every alternative
    base in the range is materialised and checked the same way. After a version
    fails to replay, replay resumes at the next base. ``progress`` shows how far
    the run is on stderr (a bar on a terminal, lines off one).
    """
    start = None if start is None else whole(start, "start", low=0)
    end = None if end is None else whole(end, "end", low=0)
    chain = Chain(open_store(store))
    chain.header  # noqa: B018  # a store without a chain is an error, not an empty report
    committed = chain.versions()
    have = set(committed)
    versions = [v for v in committed if (start is None or v >= start) and (end is None or v <= end)]
    alternatives = set(alternative_bases(chain.store))
    problems: list[Problem] = []
    counts = {"objects": 0, "bases": 0}
    seen: set[str] = set()  # checkpoint files checked already (versions share them)
    if committed:  # versions missing inside the chain
        low = max(committed[0], start if start is not None else committed[0])
        high = min(committed[-1], end if end is not None else committed[-1])
        for v in range(low, high + 1):
            if v not in have:
                missing = VersionNotFoundError(
                    f"version {v} is missing from the chain (versions after it cannot be "
                    "replayed from an older base); restore it"
                )
                problems.append(Problem.of(v, commit_key(v), missing, "link"))
    previous: LoadedRecord | None = None
    previous_table: dict[str, TensorState] | None = None
    if versions and versions[0] - 1 in have:  # the first version's link into the range
        try:
            previous = chain.record(versions[0] - 1)
        except DcrError:
            previous = None  # reported when its own range is checked
    with Progress(
        "verify", total=len(versions), unit="versions checked", enabled=progress
    ) as checking:
        for version in versions:
            checking.add()
            loaded, table = _check_version(
                chain, version, previous, previous_table, problems, counts, seen
            )
            if loaded is not None and version == committed[0] and version > 0:
                # the oldest remaining version of a truncated chain: readers start there
                if loaded.record.kind != "base" and version not in alternatives:
                    unreachable = ChainBrokenError(
                        f"version {version} is the oldest left in the chain but is neither a base "
                        "nor has an alternative base: no reader can start there; restore the older "
                        "versions or compact it"
                    )
                    problems.append(Problem.of(version, commit_key(version), unreachable, "link"))
            if loaded is not None and version in alternatives:
                _check_alternative(chain, loaded, problems, counts, seen)
            previous, previous_table = loaded, table
    replayed = 0
    if deep and versions:
        replayed = _replay_check(chain, versions, alternatives, problems, progress=progress)
    problems.sort(key=lambda p: (p.version, p.key))
    return VerifyReport(
        ok=not problems,
        deep=deep,
        first_version=versions[0] if versions else None,
        last_version=versions[-1] if versions else None,
        versions_checked=len(versions),
        objects_checked=counts["objects"],
        bases_checked=counts["bases"],
        replayed_versions=replayed,
        problems=problems,
    )


def _check_version(
    chain: Chain,
    version: int,
    previous: LoadedRecord | None,
    previous_table: dict[str, TensorState] | None,
    problems: list[Problem],
    counts: dict[str, int],
    seen: set[str],
) -> tuple[LoadedRecord | None, dict[str, TensorState] | None]:
    """Shallow checks of one version; returns its record and table when they are sound."""
    key = commit_key(version)
    try:
        loaded = chain.record(version)
        counts["objects"] += 1
    except DcrError as exc:
        problems.append(Problem.of(version, key, exc))
        return None, None
    if previous is not None and previous.record.version == version - 1:
        try:
            chain.check_link(previous, loaded)
        except DcrError as exc:
            problems.append(Problem.of(version, key, exc, "link"))
    manifests = _manifests(chain, loaded, problems, counts, seen)
    if manifests is None:
        return loaded, None
    try:
        table = state_table(manifests)
        if table_fingerprint(table) != loaded.record.state_fingerprint:
            raise ChainBrokenError(
                f"the manifests of version {version} do not add up to its state fingerprint"
            )
        if loaded.record.kind == "delta" and previous_table is not None:
            if previous is not None and previous.record.version == version - 1:
                resolved = resolve_parents(manifests, previous_table, version)
                _check_continuity(previous_table, resolved, version)
    except DcrError as exc:
        problems.append(Problem.of(version, key, exc))
        return loaded, None
    return loaded, table


def _manifests(
    chain: Chain,
    loaded: LoadedRecord,
    problems: list[Problem],
    counts: dict[str, int],
    seen: set[str],
) -> list[Manifest] | None:
    """Every manifest, shard and checkpoint file of a version; None when any is broken."""
    version = loaded.record.version
    manifests = []
    refs = sorted(loaded.record.manifests, key=lambda r: r.rank)
    try:
        allowance = ManifestAllowance(f"version {version}", refs)
    except DcrError as exc:
        problems.append(Problem.of(version, commit_key(version), exc))
        return None
    for ref in refs:
        try:
            manifests.append(chain.manifest(loaded, ref, allowance=allowance))
            counts["objects"] += 1
        except DcrError as exc:
            problems.append(Problem.of(version, ref.path, exc))
    broken = len(manifests) != len(loaded.record.manifests)
    for manifest in manifests:
        broken |= not _shards(chain, version, manifest, problems, counts, seen)
    return None if broken else manifests


def _shards(
    chain: Chain,
    version: int,
    manifest: Manifest,
    problems: list[Problem],
    counts: dict[str, int],
    seen: set[str],
    check: str = "object",
) -> bool:
    """Every shard of a manifest, and each checkpoint file it lists that no version
    checked before (FORMAT.md §3.5.6), is there with its size and sha256."""
    ok = True
    objects = [(shard.path, shard.size, shard.sha256) for shard in manifest.shards]
    objects += [(f.key, f.size, f.sha256) for f in manifest.files if f.key not in seen]
    for key, size, sha256 in objects:
        try:
            get_verified(chain.store, key, size=size, sha256=sha256)
            counts["objects"] += 1
            seen.add(key)
        except DcrError as exc:
            problems.append(Problem.of(version, key, exc, check))
            ok = False
    return ok


def _check_alternative(
    chain: Chain,
    loaded: LoadedRecord,
    problems: list[Problem],
    counts: dict[str, int],
    seen: set[str],
) -> None:
    version = loaded.record.version
    try:
        snapshot = load_base(chain, loaded)
    except DcrError as exc:
        problems.append(Problem.of(version, base_record_key(version), exc, "base"))
        return
    counts["bases"] += 1
    counts["objects"] += 1 + len(snapshot.manifests)
    for manifest in snapshot.manifests:
        _shards(chain, version, manifest, problems, counts, seen, "base")


def _replay_check(
    chain: Chain,
    versions: list[int],
    alternatives: set[int],
    problems: list[Problem],
    *,
    progress: bool,
) -> int:
    """Replay ``versions`` one after another, checking every tensor of every version."""
    replayed = 0
    reader: DeltaReader | None = None  # None: start (again) from a base
    bar = Progress("verify --deep", total=len(versions), unit="versions replayed", enabled=progress)
    with bar:
        for version in versions:
            bar.add()
            if reader is None:
                if version != versions[0] and not _is_base(chain, version, alternatives):
                    continue  # after a failure, versions up to the next base cannot be replayed
                reader = DeltaReader(chain.store, StateDictTarget({}), verify="all")
            try:
                result = reader.sync(to=version)
            except DcrError as exc:
                problems.append(Problem.of(version, commit_key(version), exc, "state"))
                reader = None
                continue
            replayed += 1
            started_here = result.previous is None and result.applied_versions[:1] == (version,)
            if version in alternatives and not started_here:
                _check_alternative_bits(chain, version, problems)
    return replayed


def _check_alternative_bits(chain: Chain, version: int, problems: list[Problem]) -> None:
    """Materialise an alternative base on its own and check every tensor (readers start there)."""
    try:
        DeltaReader(chain.store, StateDictTarget({}), verify="all").sync(to=version)
    except DcrError as exc:
        problems.append(Problem.of(version, base_record_key(version), exc, "base"))


def _is_base(chain: Chain, version: int, alternatives: set[int]) -> bool:
    if version in alternatives:
        return True
    try:
        return chain.record(version).record.kind == "base"
    except DcrError:
        return False
