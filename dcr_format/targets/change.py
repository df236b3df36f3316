"""What a reader and a target hand each other: the version a target holds (:class:`Resident`),
one tensor's change (:class:`Change`), and what applying it did (:class:`Applied`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dcr_format.delta.delta import Delta

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")  # the form of Resident.record_sha256


@dataclass(frozen=True)
class Resident:
    """The chain and version a target holds, and the sha256 of the commit record it applied
    (None where unknown: declared by hand, or recorded before dcr kept it)."""

    chain_id: str
    version: int
    record_sha256: str | None = None


@dataclass(frozen=True)
class Change:
    """One tensor's change as a transaction applies it (canonical name, dtype and shape)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    delta: Delta


@dataclass(frozen=True)
class Applied:
    """What :meth:`Transaction.apply` did: how to undo it, and what the reader needs to
    follow the tensor's fingerprint lanes (FORMAT.md §9.1) without a full pass.

    For ``xor``/``overwrite``: the canonical flat ``positions`` the target could read back
    (all of the delta's positions, or those this target holds) with their bits ``before``
    and ``after``; None when the target cannot read canonical bits back (the tensor is then
    left unverified). For ``full``: the ``lanes`` of what the target holds afterwards.
    A target that keeps the default :meth:`Transaction.apply` never builds one.
    """

    undo: Callable[[], None]
    positions: torch.Tensor | None = None
    before: torch.Tensor | None = None
    after: torch.Tensor | None = None
    lanes: tuple[int, ...] | None = None
    # optional, xor/overwrite: the lane deltas of the change, summed while applying it (the
    # built-in apply does); None: the reader sums them from ``before`` and ``after``
    lane_deltas: tuple[int, ...] | None = None
    # optional, ``classed`` xor: the exponent rows of the bits the change was resolved
    # against (:attr:`DecodedDelta.rows`; the built-in apply passes them on), which the
    # reader moves to the new bits for the next change; None: counted again then
    rows: np.ndarray | None = None
