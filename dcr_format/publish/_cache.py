"""A writer rank's baseline on local disk, so that a restarted writer need not replay the
chain: the owned tensors in a safetensors file beside a JSON of their version.

The cache is written without reading it back; the writer that reopens it checks its bits
against the chain (:meth:`~dcr_format.publish._canonical.CanonicalPart.restore`: each
tensor's fingerprint lanes, computed once and kept for the next publish, against the
fingerprint the chain records), so a file that does not hold the version's bits is a miss.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from dcr_format.targets.dict import StateDictTarget

_log = logging.getLogger(__name__)


class BaselineCache:
    """A rank's baseline on local disk (safetensors plus a JSON of its version), so a
    restarted writer need not replay the chain."""

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
    ) -> None:
        """Replace the cache with the baseline of committed ``version`` (the tensors first,
        the JSON naming their version last); a failure drops the cache and warns (the
        version is committed: the cache is only an optimisation)."""
        try:
            from safetensors.torch import save_file

            tensor_path, meta_path = self._paths(chain_id)
            tensor_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = tensor_path.with_suffix(".tmp")
            save_file({n: t.detach().cpu().contiguous() for n, t in baseline.items()}, str(tmp))
            os.replace(tmp, tensor_path)
            meta = {"version": version}
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

    def load(self, chain_id: str) -> StateDictTarget | None:
        """The cached tensors at their version, or None when the cache is absent or
        unreadable (the caller checks the bits against the chain)."""
        tensor_path, meta_path = self._paths(chain_id)
        if not tensor_path.exists() or not meta_path.exists():
            return None
        try:
            from safetensors.torch import load_file

            version = int(json.loads(meta_path.read_text())["version"])
            tensors = load_file(str(tensor_path))
        except Exception:
            return None  # an unreadable cache is just a miss
        return StateDictTarget(tensors, version=version, chain_id=chain_id)
