"""A cheap, bounded pre-scan of untrusted JSON bytes, run before any JSON parser sees them.

Parsing hostile JSON amplifies memory: ``[[],[],...]`` turns every 3 bytes into a
Python list (or a parser node) of 50 bytes or more, and a validator that reports
every bad element keeps a record of each. The scan counts what a parser would
build (containers and values, strings skipped) and the nesting depth, in a few
C-speed passes over the bytes, so an object whose shape no writer produces is
refused before it is parsed (spec/FORMAT.md Appendix C).

Characters inside strings do not count. The string pattern is possessive and also
matches an unterminated string (up to the end), so the scan is linear in the input
whatever it holds.
"""

from __future__ import annotations

import re

MAX_DEPTH = 16
"""Deepest nesting of arrays and objects accepted: the schema needs 5 (a manifest's
piece lanes); the rest is room for optional members of later versions."""
MIN_BYTES_PER_CONTAINER = 16
"""A writer's objects hold at least 35 bytes per array or object; ``[],`` holds 3."""
MIN_BYTES_PER_VALUE = 3
"""A writer's objects hold at least 3.8 bytes per value or member (a manifest entry with a
64-dimension shape of ones); ``1,`` holds 2."""
SLACK = 64  # small objects may be dense: a few containers and values are always allowed

_STRING = re.compile(rb'(?s)"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)')
_QUOTE = ord('"')
_PAIR = re.compile(rb"\[\]|\{\}")  # one pass removes one level (no rescan of the output)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{},:')


def _skeleton(data: bytes) -> bytes:
    """The structural characters of ``data`` outside strings (``[]{},:``), in order."""
    if b"\\" in data:  # escapes: a pattern finds where each string ends (rare in writers' JSON)
        return _STRING.sub(b"", data).translate(None, _NOT_STRUCTURE)
    # no escapes: every quote opens or closes a string, so a character is outside strings
    # iff an even number of quotes precede it
    chars = data.translate(None, _NOT_STRUCTURE)
    if len(chars) <= _SPLIT_UP_TO:
        return _outside_by_split(chars)
    return _outside_by_parity(chars)


_SPLIT_UP_TO = 1 << 16
"""Up to this many structural characters, :func:`_outside_by_split` (no numpy, so a command
that reads only small records never imports it; a list of at most this many pieces); above,
:func:`_outside_by_parity`, several times faster on large objects, in one more copy."""


def _outside_by_split(chars: bytes) -> bytes:
    """The characters outside strings of escape-free ``chars``: between the quotes, every
    other piece from the first."""
    return b"".join(chars.split(b'"')[::2])


def _outside_by_parity(chars: bytes) -> bytes:
    """The same as :func:`_outside_by_split`, by the parity of a byte-wide running sum of the
    quotes."""
    import numpy as np

    array = np.frombuffer(chars, dtype=np.uint8)
    quotes = array == _QUOTE
    outside = (np.cumsum(quotes, dtype=np.uint8) & 1) == 0
    outside &= ~quotes
    kept: np.ndarray = array[outside]
    return kept.tobytes()


def scan(data: bytes, *, max_depth: int = MAX_DEPTH) -> str | None:
    """Why ``data`` is refused before parsing (a short phrase), or None to go on and parse it.

    Refuses nesting deeper than ``max_depth``, unbalanced brackets, more than one array or
    object per :data:`MIN_BYTES_PER_CONTAINER` bytes and more than one value or member per
    :data:`MIN_BYTES_PER_VALUE` bytes (each beyond :data:`SLACK`). Costs at most one copy
    of ``data`` and a few linear passes; never parses it.
    """
    skeleton = _skeleton(data)
    brackets = skeleton.translate(None, _NOT_BRACKETS)
    containers = len(brackets) // 2
    if containers > len(data) // MIN_BYTES_PER_CONTAINER + SLACK:
        return f"{containers} arrays and objects in {len(data)} bytes, more than any writer makes"
    values = skeleton.count(b",") + skeleton.count(b":") + 1
    if values > len(data) // MIN_BYTES_PER_VALUE + SLACK:
        return f"{values} values in {len(data)} bytes, more than any writer makes"
    del skeleton
    for _ in range(max_depth):  # each pass removes the innermost level of pairs
        if not brackets:
            return None
        shorter = _PAIR.sub(b"", brackets)
        if len(shorter) == len(brackets):
            return "brackets that do not pair up"
        brackets = shorter
    if brackets:
        return f"nesting deeper than {max_depth} levels or brackets that do not pair up"
    return None
