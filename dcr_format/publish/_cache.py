"""A writer rank's baseline on local disk, so that a restarted writer need not replay the
chain: the owned tensors in a safetensors file beside a JSON of their version, their
fingerprint lanes and the file's sha256.

The sha256 lets a writer reopening at the cached version trust the recorded lanes (and skip
reading every tensor for its fingerprint, at the reopen and at the next publish) once the
file's bytes are shown to be the bytes it wrote; a file that does not match is a miss.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from dcr_format.targets.dict import StateDictTarget

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Cached:
    """A cache as loaded: its tensors at their version, and the fingerprint lanes recorded
    with them where the file's bytes matched the recorded sha256 (None for a cache that
    records none: its tensors must be fingerprinted to be checked)."""

    target: StateDictTarget
    lanes: dict[str, tuple[int, ...]] | None


class BaselineCache:
    """A rank's baseline on local disk (safetensors plus a JSON of version, fingerprint lanes
    and the file's sha256), so a restarted writer need not replay the chain."""

    def __init__(self, root: Path, rank: int, world_size: int) -> None:
        self.root, self.rank, self.world_size = root, rank, world_size

    def _paths(self, chain_id: str) -> tuple[Path, Path]:
        folder = self.root / chain_id / f"rank-{self.rank:05d}-of-{self.world_size:05d}"
        return folder / "baseline.safetensors", folder / "baseline.json"

    def save(
        self,
        chain_id: str,
        version: int,
        baseline: Mapping[str, torch.Tensor],
        lanes: Mapping[str, tuple[int, ...]],
    ) -> None:
        """Replace the cache with the baseline of committed ``version`` and its fingerprint
        lanes (the tensors first, the JSON naming their version last); a failure drops the
        cache and warns (the version is committed: the cache is only an optimisation)."""
        try:
            from safetensors.torch import save_file

            tensor_path, meta_path = self._paths(chain_id)
            tensor_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = tensor_path.with_suffix(".tmp")
            save_file({n: t.detach().cpu().contiguous() for n, t in baseline.items()}, str(tmp))
            sha256 = _sha256(tmp)
            os.replace(tmp, tensor_path)
            meta = {
                "version": version,
                "lanes": {n: list(values) for n, values in lanes.items()},
                "sha256": sha256,
            }
            tmp_meta = meta_path.with_suffix(".tmp")
            tmp_meta.write_text(json.dumps(meta))
            os.replace(tmp_meta, meta_path)
        except Exception as exc:
            self.drop(chain_id)
            _log.warning(
                "version %d is committed, but the baseline cache in %s could not be written "
                "(%s); a restarted writer will rebuild its baseline from the store",
                version,
                self.root,
                exc,
            )

    def drop(self, chain_id: str) -> None:
        """Remove a cache that may be half written (best effort: a miss costs a replay)."""
        for path in self._paths(chain_id):
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass

    def load(self, chain_id: str) -> Cached | None:
        """The cache at its version, or None when it is absent, unreadable or its file's bytes
        are not those the JSON records (the caller checks it against the chain)."""
        tensor_path, meta_path = self._paths(chain_id)
        if not tensor_path.exists() or not meta_path.exists():
            return None
        try:
            from safetensors.torch import load_file

            meta = json.loads(meta_path.read_text())
            version = int(meta["version"])
            lanes: dict[str, tuple[int, ...]] | None = None
            if "sha256" in meta:
                if _sha256(tensor_path) != meta["sha256"]:
                    return None  # damaged since it was written
                lanes = {
                    str(n): tuple(int(v) for v in values)
                    for n, values in dict(meta["lanes"]).items()
                }
            tensors = load_file(str(tensor_path))
        except Exception:
            return None  # an unreadable cache is just a miss
        target = StateDictTarget(tensors, version=version, chain_id=chain_id)
        return Cached(target, lanes)


def _sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()
