"""Python's cyclic garbage collector held off for a block of work."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_off(*, freeze: bool = False) -> Iterator[None]:
    """The cyclic collector off within the block, where it was on (else nothing changes),
    and on again after it, however the block ends; with ``freeze``, the objects alive at
    the end are frozen first (:func:`gc.freeze`), so later full passes skip them."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        gc.enable()
