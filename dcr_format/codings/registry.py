"""Every stream coding of the format by its name: what kind of stream it codes, the feature a
manifest must require to use it, the most bytes its stream can hold, and its encode and
decode entry points.

A coding is a :class:`Coding`; :data:`CODINGS` maps each format name
(:mod:`dcr_format.format.names`) to one, and :func:`coding` looks a name up. The entry points
are the coding module's own functions (their arguments differ: ``classed``, ``ulp`` and
``ulp-shift`` are decoded against the old bits); the registry names them, it adds no code
path of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from dcr_format.codings import classed, planes, positions, rans, ulp, ulp_shift
from dcr_format.errors import SchemaError
from dcr_format.format.features import CODING_FEATURES
from dcr_format.format.names import (
    CLASSED,
    PLANES,
    RANGES,
    RANS,
    RICE,
    ULP,
    ULP_SHIFT,
)


@dataclass(frozen=True)
class Coding:
    """One stream coding: ``name`` (its format name), ``stream`` (``positions`` or
    ``values``), ``feature`` (the ``required_features`` entry it needs, None where every
    reader has it), ``bound(changed, numel, width)`` (the most bytes its stream of
    ``changed`` of ``numel`` elements of ``width`` bytes can hold and still decode), and
    ``encode`` / ``decode``, the functions that make and read its stream."""

    name: str
    stream: Literal["positions", "values"]
    feature: str | None
    bound: Callable[[int, int, int], int]
    encode: Callable[..., Any]
    decode: Callable[..., Any]

    @property
    def baseline(self) -> bool:
        """Whether its stream is decoded against the old bits a reader holds."""
        return self.name in (CLASSED, ULP, ULP_SHIFT)


def _positions(bound: Callable[[int, int], int]) -> Callable[[int, int, int], int]:
    return lambda changed, numel, width: bound(changed, numel)


def _values_bound(changed: int, numel: int, width: int) -> int:
    """A values stream holds at most its planes, ``changed * width`` bytes (FORMAT.md §7)."""
    del numel
    return changed * width


CODINGS: Mapping[str, Coding] = {
    c.name: c
    for c in (
        Coding(
            RICE,
            "positions",
            None,
            _positions(positions.rice_bound),
            positions.encode_rice,
            positions.decode_rice,
        ),
        Coding(
            RANGES,
            "positions",
            None,
            _positions(positions.ranges_bound),
            positions.encode_ranges,
            positions.decode_ranges,
        ),
        Coding(
            CLASSED,
            "positions",
            CODING_FEATURES[CLASSED],
            _positions(classed.classed_bound),
            classed.encode_classed,
            classed.decode_classed,
        ),
        Coding(PLANES, "values", None, _values_bound, planes.to_planes, planes.from_planes),
        Coding(
            RANS, "values", CODING_FEATURES[RANS], _values_bound, rans.encode_rans, rans.decode_rans
        ),
        Coding(ULP, "values", CODING_FEATURES[ULP], _values_bound, ulp.to_ulp, ulp.from_ulp),
        Coding(
            ULP_SHIFT,
            "values",
            CODING_FEATURES[ULP_SHIFT],
            _values_bound,
            ulp_shift.split,
            ulp_shift.join,
        ),
    )
}
"""Every coding of the format, by name."""


def coding(name: str) -> Coding:
    """The coding named ``name``; raises :class:`SchemaError` for a name the format lacks."""
    found = CODINGS.get(name)
    if found is None:
        raise SchemaError(f"unknown stream coding {name[:64]!r}; upgrade dcr-format")
    return found


def positions_bound(coding_name: str, changed: int, numel: int) -> int:
    """The most bytes a positions stream in ``coding_name`` of ``changed`` of ``numel``
    positions can hold and still decode (FORMAT.md §6); for a name that is no position
    coding, the largest of them (the schema refuses such a name later)."""
    found = CODINGS.get(coding_name)
    if found is not None and found.stream == "positions":
        return found.bound(changed, numel, 0)
    return max(c.bound(changed, numel, 0) for c in CODINGS.values() if c.stream == "positions")


__all__ = ["CODINGS", "Coding", "coding", "positions_bound"]
