"""The format's names that stored objects carry (dtypes, change ops, stream codings) and the
exponent fields of the float dtypes: what the schema validates and the chain checks,
importable without torch or numpy (the ``dcr`` commands that only read records start
faster)."""

from __future__ import annotations

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

RICE = "rice"
RANGES = "ranges"
CLASSED = "classed"
POSITION_CODINGS = (RICE, RANGES)
"""The position codings every reader has (FORMAT.md §6); ``classed`` needs its feature."""

PLANES = "planes"
RANS = "rans"
VALUE_CODINGS = (PLANES, RANS)
"""The value codings of a stream coded alone (FORMAT.md §7); ``rans`` needs its feature."""
ULP = "ulp"
ULP_SHIFT = "ulp-shift"
"""The value codings decoded against the old bits (FORMAT.md §7)."""

EXPONENT_FIELDS: dict[str, tuple[int, int]] = {
    "bfloat16": (7, 0xFF),
    "float16": (10, 0x1F),
    "float32": (23, 0xFF),
    "float64": (52, 0x7FF),
}
"""(mantissa bits, exponent mask) of the dtypes whose elements have ``classed`` position
classes (FORMAT.md §6.5), by format dtype name."""
