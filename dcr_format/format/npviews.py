"""The unsigned numpy view of each element width, which the host-side stream codecs and the
exact-bits views use (apart from :mod:`dcr_format.format.names`, which the commands that
only read records import without numpy)."""

from __future__ import annotations

from typing import Any

import numpy as np

UNSIGNED_NP: dict[int, np.dtype[Any]] = {
    1: np.dtype("<u1"),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}
"""numpy unsigned views of each width, used by the host-side stream codecs."""
