"""Reading Hugging Face safetensors checkpoint directories as canonical tensors."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from dcr_format.errors import TargetError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"  # what transformers loads first


def checkpoint_files(path: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a checkpoint: from its index, else every ``*.safetensors``."""
    root = Path(path)
    if not root.is_dir():
        raise TargetError(f"{root} is not a directory; pass a Hugging Face checkpoint directory")
    index = root / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError) as exc:
            raise TargetError(f"{index} is not a valid index ({exc}); fix or remove it") from None
        files = []
        for name in names:
            if not isinstance(name, str) or "/" in name or "\\" in name or name.startswith("."):
                raise TargetError(f"{index} names file {name!r} outside the checkpoint")
            files.append(root / name)
        single = root / SINGLE_FILE
        if single.exists() and SINGLE_FILE not in names:
            raise TargetError(
                f"{root} holds both {SINGLE_FILE} and {INDEX_FILE}, which names other files "
                f"(transformers loads {SINGLE_FILE}, the index is ignored): remove the stale one"
            )
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        from dcr_format.publish._files import WEIGHT_SUFFIXES

        other = sorted(p.name for p in root.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
        if other:
            raise TargetError(
                f"{root} holds weights only in other formats ({', '.join(other[:3])}); save "
                "the checkpoint as safetensors (save_pretrained(..., safe_serialization=True))"
            )
        raise TargetError(f"{root} holds no .safetensors files; pass a checkpoint directory")
    for file in files:
        if not file.is_file():
            raise TargetError(f"{file} is missing from the checkpoint")
    return files


@contextmanager
def _readable(file: Path) -> Iterator[None]:
    """A file safetensors cannot read is a :class:`TargetError` naming it."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, OSError) as exc:
        raise TargetError(
            f"{file} is not a readable safetensors file ({exc}); save the checkpoint again"
        ) from None


def iter_checkpoint(path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` one tensor at a time (only one is in memory at once)."""
    from safetensors import safe_open

    seen: set[str] = set()
    for file in checkpoint_files(path):
        with _readable(file), safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if name in seen:
                    raise TargetError(f"tensor {name!r} appears in two files of {path}")
                seen.add(name)
                yield name, handle.get_tensor(name)


def count_tensors(path: str | os.PathLike[str]) -> int:
    """Number of tensors in a checkpoint (for progress bars)."""
    from safetensors import safe_open

    total = 0
    for file in checkpoint_files(path):
        with _readable(file), safe_open(str(file), framework="pt") as handle:
            total += len(list(handle.keys()))
    return total
