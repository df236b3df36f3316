"""The small files of a checkpoint a version carries besides its tensors (FORMAT.md §3.5.6).

A writer is given them as a mapping of file name to bytes, or as a Hugging Face checkpoint
directory, whose small files are taken by :func:`directory_files`'s rule. Each file is
stored once under the sha256 of its bytes (``files/<sha256>``), so a file that did not
change since the previous version is not sent again.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path

from dcr_format.chain.chain import sha256_hex
from dcr_format.errors import ArgumentError
from dcr_format.format.schema import (
    CHECKPOINT_FILE_NAME,
    MAX_CHECKPOINT_FILE_BYTES,
    MAX_CHECKPOINT_FILES,
    MAX_CHECKPOINT_FILES_BYTES,
    CheckpointFile,
    is_dcr_file_name,
)

Files = Mapping[str, bytes] | str | os.PathLike[str]
"""What a writer may be given as a version's checkpoint files: names to bytes, or a
checkpoint directory (:func:`directory_files`)."""

WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
"""Files of a checkpoint directory that hold weights in other formats: never sent as files
(the tensors are published from the safetensors files)."""
_NAME = re.compile(CHECKPOINT_FILE_NAME)
_log = logging.getLogger(__name__)


def directory_files(path: str | os.PathLike[str]) -> tuple[dict[str, bytes], list[str]]:
    """The checkpoint files of a Hugging Face directory, and a line for each file left out.

    Taken: every regular file directly in ``path`` (links followed) whose name is a plain
    file name (:data:`~dcr_format.format.schema.CHECKPOINT_FILE_NAME`: not hidden, no path) and of
    at most 64 MiB, except the tensors and what a directory target writes itself
    (``*.safetensors``, ``model.safetensors.index.json``, ``dcr-state.json``) and weights
    in other formats (``*.bin``, ``*.pt``, ... and their ``*.index.json``): config,
    generation config, tokenizer files, chat template, README. Subdirectories, larger
    files and other names are left out, each with a line saying why.
    """
    root = Path(path)
    if not root.is_dir():
        raise ArgumentError(f"{root} is not a directory; pass a checkpoint directory")
    taken: dict[str, bytes] = {}
    left_out: list[str] = []
    total = 0
    for item in sorted(root.iterdir(), key=lambda p: p.name):
        name = item.name
        if name.startswith(".") or _is_weights(name):
            continue  # hidden (.git, .cache) or weights: never part of the files
        if item.is_dir():
            left_out.append(f"{name}/: a directory (only files directly in {root} are sent)")
            continue
        if not item.is_file():
            continue
        if not _NAME.match(name):
            left_out.append(f"{name}: not a plain file name ({CHECKPOINT_FILE_NAME})")
            continue
        size = item.stat().st_size
        if size > MAX_CHECKPOINT_FILE_BYTES:
            left_out.append(f"{name}: {size} bytes, over the {MAX_CHECKPOINT_FILE_BYTES} cap")
            continue
        if len(taken) == MAX_CHECKPOINT_FILES or total + size > MAX_CHECKPOINT_FILES_BYTES:
            left_out.append(f"{name}: the version's files would pass their caps")
            continue
        taken[name] = item.read_bytes()
        total += size
    return taken, left_out


def _is_weights(name: str) -> bool:
    if is_dcr_file_name(name):
        return True
    stem = name.removesuffix(".index.json")
    return stem.endswith(WEIGHT_SUFFIXES) or stem.endswith(".safetensors")


def files_to_publish(files: Files) -> dict[str, bytes]:
    """``files`` as names to bytes, checked (names, sizes, caps); a directory is read by
    :func:`directory_files`. Raises :class:`ArgumentError` naming the first problem."""
    if isinstance(files, (str, os.PathLike)):
        taken, left_out = directory_files(files)
        for line in left_out:
            _log.warning("checkpoint file not sent: %s", line)
        return taken
    if not isinstance(files, Mapping):
        raise ArgumentError(
            f"files= takes a mapping of file name to bytes or a directory, not "
            f"{type(files).__name__}"
        )
    checked: dict[str, bytes] = {}
    for name, data in files.items():
        if not isinstance(name, str) or not _NAME.match(name) or is_dcr_file_name(name):
            raise ArgumentError(
                f"checkpoint file name {name!r} is not allowed: a plain file name "
                f"({CHECKPOINT_FILE_NAME}), not a tensor file, index or dcr-state.json"
            )
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ArgumentError(
                f"checkpoint file {name!r} is {type(data).__name__}, not bytes; pass the "
                "file's bytes (text.encode(), path.read_bytes())"
            )
        if len(data) > MAX_CHECKPOINT_FILE_BYTES:
            raise ArgumentError(
                f"checkpoint file {name!r} is {len(data)} bytes, over the "
                f"{MAX_CHECKPOINT_FILE_BYTES}-byte cap readers enforce; leave it out"
            )
        checked[name] = bytes(data)
    if len(checked) > MAX_CHECKPOINT_FILES:
        raise ArgumentError(
            f"{len(checked)} checkpoint files, more than the {MAX_CHECKPOINT_FILES} of a version"
        )
    total = sum(len(data) for data in checked.values())
    if total > MAX_CHECKPOINT_FILES_BYTES:
        raise ArgumentError(
            f"the checkpoint files hold {total} bytes, over the {MAX_CHECKPOINT_FILES_BYTES} "
            "bytes of a version; leave the largest out"
        )
    return checked


def file_refs(files: Mapping[str, bytes]) -> tuple[CheckpointFile, ...]:
    """The manifest's listing of ``files``: name, size and sha256, in name order."""
    return tuple(
        CheckpointFile(name=name, size=len(files[name]), sha256=sha256_hex(files[name]))
        for name in sorted(files)
    )
