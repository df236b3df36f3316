"""The format's names that stored objects carry (dtypes, change ops) and the unsigned numpy
views of each element width: what the schema validates and the host-side stream codecs use,
importable without torch (the ``dcr`` commands that only read records start faster)."""

from __future__ import annotations

from typing import Any

import numpy as np

DTYPE_NAMES: tuple[str, ...] = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
)
"""Every dtype the format carries, by its format name (:mod:`dcr_format.format.dtypes` maps
each to torch and checks it lists the same)."""

XOR = "xor"
OVERWRITE = "overwrite"
FULL = "full"
OPS = (XOR, OVERWRITE, FULL)
"""How an entry changes its tensor (FORMAT.md §4)."""

UNSIGNED_NP: dict[int, np.dtype[Any]] = {
    1: np.dtype("<u1"),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}
"""numpy unsigned views of each width, used by the host-side stream codecs."""
