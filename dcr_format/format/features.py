"""Codec features (spec/FORMAT.md §12): codings beyond the ones every reader has, and
leaner manifests (``manifest-zstd``, ``implicit-parents``).

A writer is allowed a set of features (``DeltaWriter(features=...)``). ``manifest-zstd``
stores its manifests compressed, ``implicit-parents`` leaves the parent fingerprints of its
delta entries to the parent version's table; each other one names a coding (``values-rans``: the
``rans`` value coding, ``positions-classed``: the ``classed`` position coding,
``values-ulp``: the ``ulp`` value coding, ``values-ulp-shift``: the ``ulp-shift`` value
coding; the last three are decoded against the old bits, :data:`BASELINE_FEATURES`).
Encoders use an allowed coding only where it is smaller, and a manifest lists in
``required_features`` the feature of every coding its entries use, so a reader without it
refuses the version instead of misreading it.

What is allowed travels as an argument: a writer makes one :class:`EncodeOptions` of its
features for each tensor (:class:`PublishCodings`: the codings against the old bits only
for the tensors every recorded reader reads the old bits of) and passes it to the tensor
encoders (:mod:`dcr_format.delta.delta`,
:mod:`dcr_format.delta.pipeline`), which pass its codings down to the stream encoders
(:mod:`dcr_format.codings.values`: their ``codings`` argument).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dcr_format.errors import ArgumentError

VALUES_RANS_FEATURE = "values-rans"
POSITIONS_CLASSED_FEATURE = "positions-classed"
VALUES_ULP_FEATURE = "values-ulp"
VALUES_ULP_SHIFT_FEATURE = "values-ulp-shift"
MANIFEST_ZSTD_FEATURE = "manifest-zstd"
"""Manifests stored as one zstd frame of their JSON (FORMAT.md §3.5), not a coding."""
IMPLICIT_PARENTS_FEATURE = "implicit-parents"
"""Delta manifests whose whole entries leave ``parent_fingerprint`` null: readers take it from
the parent version's state table, which they check every delta against anyway (FORMAT.md
§3.5.5), not a coding."""
CHECKPOINT_FILES_FEATURE = "checkpoint-files"
"""A version that carries its checkpoint's small files (config, tokenizer) besides its
tensors (FORMAT.md §3.5.6), not a coding: a writer lists it whenever it is given files."""
CODING_FEATURES: dict[str, str] = {
    "rans": VALUES_RANS_FEATURE,
    "classed": POSITIONS_CLASSED_FEATURE,
    "ulp": VALUES_ULP_FEATURE,
    "ulp-shift": VALUES_ULP_SHIFT_FEATURE,
}
"""The ``required_features`` entry each coding beyond ``rice``/``ranges``/``planes`` needs."""
FEATURE_CODINGS: dict[str, str] = {feature: coding for coding, feature in CODING_FEATURES.items()}
WRITER_FEATURES: frozenset[str] = frozenset(
    {*FEATURE_CODINGS, MANIFEST_ZSTD_FEATURE, IMPLICIT_PARENTS_FEATURE}
)
"""Every feature a writer may be allowed; by default a writer uses each one its chain's
recorded readers read (:func:`publish_features`)."""
BASELINE_FEATURES: frozenset[str] = frozenset(
    {POSITIONS_CLASSED_FEATURE, VALUES_ULP_FEATURE, VALUES_ULP_SHIFT_FEATURE}
)
"""Features whose codings a reader decodes against the old bits it holds (FORMAT.md §3.6)."""
BASELINE_CODINGS: frozenset[str] = frozenset(FEATURE_CODINGS[f] for f in BASELINE_FEATURES)
"""Their codings (``classed``, ``ulp``, ``ulp-shift``): a writer codes them from the new bits
of a change."""
CHANGED_FEATURES: frozenset[str] = frozenset({VALUES_ULP_FEATURE})
"""Of those, the features a reader decodes from the old bits of each changed element alone
(not of the whole tensor): what a reader holding part of a tensor decodes (FORMAT.md §3.6
``reads_changed``)."""
CHANGED_CODINGS: frozenset[str] = frozenset(FEATURE_CODINGS[f] for f in CHANGED_FEATURES)
"""Their codings (``ulp``)."""


@dataclass(frozen=True)
class EncodeOptions:
    """What a tensor encoder may use: the codings beyond the ones every reader has that its
    writer is allowed (``rans``, ``classed``, ``ulp``, ``ulp-shift``). The default allows
    none of them."""

    codings: frozenset[str] = frozenset()

    @classmethod
    def allowing(cls, features: Iterable[str]) -> EncodeOptions:
        """The options of a writer allowed ``features`` (features that name no coding, such
        as ``manifest-zstd``, are ignored: a writer passes all its features)."""
        return cls(frozenset(FEATURE_CODINGS[f] for f in features if f in FEATURE_CODINGS))

    @property
    def features(self) -> tuple[str, ...]:
        """The features of the codings allowed, sorted."""
        return tuple(sorted(CODING_FEATURES[c] for c in self.codings))


NO_CODINGS = EncodeOptions()
"""The options that allow no coding beyond the ones every reader has (the default)."""


def writer_features(features: Iterable[str]) -> frozenset[str]:
    """Check the features a writer is allowed: each must be one of
    :data:`WRITER_FEATURES`; raises :class:`ArgumentError` otherwise."""
    if isinstance(features, (str, bytes)):
        raise ArgumentError(
            f"features takes a collection of feature names, not a string: features={{{features!r}}}"
        )
    chosen = frozenset(features)
    unknown = sorted(chosen - WRITER_FEATURES)
    if unknown:
        raise ArgumentError(
            f"writer features {unknown} are not features a writer can use; "
            f"use any of {sorted(WRITER_FEATURES)}"
        )
    return chosen


Readable = tuple[frozenset[str] | None, frozenset[str]]
"""Tensors a set of reader records reads something of: ``(names, except)``, the tensors of
``names`` (None: every tensor) but those of ``except``."""
EVERY: Readable = (None, frozenset())
"""Every tensor."""


def _reads(readable: Readable, name: str) -> bool:
    names, excluded = readable
    return (names is None or name in names) and name not in excluded


def publish_features(
    allowed: frozenset[str] | None,
    readers: frozenset[str],
    baseline_names: frozenset[str] | None,
    *,
    changed_names: frozenset[str] | None = None,
) -> frozenset[str]:
    """The features one publish uses (FORMAT.md §12): ``allowed``, the writer's explicit set,
    or by default (None) every writer feature the chain's recorded readers all read
    (``readers``); the codings decoded against the old bits (:data:`BASELINE_FEATURES`)
    unless no tensor's old bits are read by every recorded reader (``baseline_names``
    empty; None: every tensor's are), and ``values-ulp`` unless no tensor's changed
    elements are (``changed_names`` empty). Which tensors may use them:
    :class:`PublishCodings`."""
    chosen = WRITER_FEATURES & readers if allowed is None else allowed
    if baseline_names is not None and not baseline_names:
        chosen = chosen - (BASELINE_FEATURES - CHANGED_FEATURES)
    if changed_names is not None and not changed_names:
        chosen = chosen - BASELINE_FEATURES
    return chosen


class PublishCodings:
    """The codings each tensor of one publish may use: those of its ``features``, except that
    the codings decoded against the old bits of the whole tensor (``classed``, ``ulp-shift``)
    only for the tensors every recorded reader reads the old bits of (``baseline``), and
    ``ulp``, decoded against the old bits of each changed element, only for those every
    recorded reader reads the changed elements of (``changed``; by default ``baseline``).
    One lookup per tensor: the options are made once."""

    __slots__ = ("_all", "_baseline", "_changed", "_plain", "_ulp")

    def __init__(
        self,
        features: Iterable[str],
        baseline: Readable = EVERY,
        changed: Readable | None = None,
    ) -> None:
        self._all = EncodeOptions.allowing(features)
        self._plain = EncodeOptions(self._all.codings - BASELINE_CODINGS)
        self._ulp = EncodeOptions(self._all.codings - (BASELINE_CODINGS - CHANGED_CODINGS))
        self._baseline = baseline
        self._changed = baseline if changed is None else changed

    def for_tensor(self, name: str) -> EncodeOptions:
        """The options of tensor ``name``."""
        if _reads(self._baseline, name):
            return self._all
        return self._ulp if _reads(self._changed, name) else self._plain


def features_for(codings: Iterable[str | None]) -> tuple[str, ...]:
    """The sorted ``required_features`` that streams of ``codings`` need (for a manifest)."""
    return tuple(sorted({CODING_FEATURES[c] for c in codings if c in CODING_FEATURES}))


__all__ = [
    "BASELINE_CODINGS",
    "BASELINE_FEATURES",
    "CHANGED_CODINGS",
    "CHANGED_FEATURES",
    "CHECKPOINT_FILES_FEATURE",
    "CODING_FEATURES",
    "EVERY",
    "FEATURE_CODINGS",
    "IMPLICIT_PARENTS_FEATURE",
    "MANIFEST_ZSTD_FEATURE",
    "NO_CODINGS",
    "POSITIONS_CLASSED_FEATURE",
    "VALUES_RANS_FEATURE",
    "VALUES_ULP_FEATURE",
    "VALUES_ULP_SHIFT_FEATURE",
    "WRITER_FEATURES",
    "EncodeOptions",
    "PublishCodings",
    "Readable",
    "features_for",
    "publish_features",
    "writer_features",
]
