"""The codings registry: every coding the format names, with its feature, kind of stream,
bound and entry points; nothing else."""

from __future__ import annotations

import numpy as np
import pytest

from dcr_format.codings.registry import CODINGS, coding, positions_bound
from dcr_format.errors import SchemaError
from dcr_format.format import names
from dcr_format.format.features import BASELINE_CODINGS, CODING_FEATURES

POSITIONS = (*names.POSITION_CODINGS, names.CLASSED)
VALUES = (*names.VALUE_CODINGS, names.ULP, names.ULP_SHIFT)


def test_every_coding_of_the_format_and_no_other() -> None:
    assert set(CODINGS) == {*POSITIONS, *VALUES}
    for name, found in CODINGS.items():
        assert found.name == name and coding(name) is found
        assert found.stream == ("positions" if name in POSITIONS else "values")
        assert found.feature == CODING_FEATURES.get(name)
        assert found.baseline == (name in BASELINE_CODINGS)


def test_unknown_coding_is_refused() -> None:
    with pytest.raises(SchemaError, match="unknown stream coding"):
        coding("zip")


def test_positions_bound_is_the_codings_bound() -> None:
    changed, numel = 7, 1000
    bounds = {name: CODINGS[name].bound(changed, numel, 0) for name in POSITIONS}
    for name in POSITIONS:
        assert positions_bound(name, changed, numel) == bounds[name]
    assert positions_bound("zip", changed, numel) == max(bounds.values())
    assert positions_bound(names.PLANES, changed, numel) == max(bounds.values())
    assert CODINGS[names.RANS].bound(changed, numel, 4) == changed * 4


def test_entry_points_round_trip() -> None:
    positions = np.array([3, 4, 5, 90, 400, 999], dtype=np.int64)
    for name in names.POSITION_CODINGS:
        stream = CODINGS[name].encode(positions)
        assert len(stream) <= positions_bound(name, positions.size, 1000)
        back = CODINGS[name].decode(stream, count=positions.size, numel=1000)
        assert np.array_equal(back, positions)
    values = np.arange(50, dtype=np.uint16) * 1031
    stream = CODINGS[names.PLANES].encode(values)
    assert len(stream) <= CODINGS[names.PLANES].bound(values.size, 1000, 2)
    assert np.array_equal(CODINGS[names.PLANES].decode(stream, values.size, 2), values)
