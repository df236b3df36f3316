"""What a reader applies into: a dict of tensors, or a Hugging Face safetensors directory.

A target reports the version it holds (:meth:`Target.resident`) and opens a
:class:`Transaction`: the reader mutates tensors through it and then either
commits (recording the new version) or aborts (the reader has already undone its
in-place changes; the transaction forgets tensors it created or replaced).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dcr_format.codec.delta import FULL, DecodedDelta, apply_delta, undo_delta
from dcr_format.codec.dtypes import bits_view
from dcr_format.errors import TargetError
from dcr_format.fingerprint import tensor_lanes

DIR_STATE_FILE = "dcr-state.json"
DIR_STATE_FORMAT = "dcr-dir-1"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_FILE_BYTES = 5 << 30  # Hugging Face's customary shard size


@dataclass(frozen=True)
class Resident:
    """The chain and version a target holds."""

    chain_id: str
    version: int


@dataclass(frozen=True)
class Change:
    """One tensor's change as a transaction applies it (canonical name, dtype and shape)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    delta: DecodedDelta


@dataclass(frozen=True)
class Applied:
    """What :meth:`Transaction.apply` did: how to undo it, and what the reader needs to
    follow the tensor's fingerprint lanes (FORMAT.md §9.1) without a full pass.

    For ``xor``/``overwrite``: the canonical flat ``positions`` the target could read back
    (all of the delta's positions, or those this target holds) with their bits ``before``
    and ``after``; None when the target cannot read canonical bits back (the tensor is then
    left unverified). For ``full``: the ``lanes`` of what the target holds afterwards.
    """

    undo: Callable[[], None]
    positions: torch.Tensor | None = None
    before: torch.Tensor | None = None
    after: torch.Tensor | None = None
    lanes: tuple[int, ...] | None = None


class Transaction(ABC):
    """Mutable access to a target's tensors for one sync.

    The reader goes through :meth:`spec`, :meth:`prepare`, :meth:`lanes`,
    :meth:`complete_lanes` and :meth:`apply`; their defaults work on the live canonical
    tensors of :meth:`tensor` and :meth:`full_tensor`. A target without canonical tensors
    (a module behind its own loader) overrides them instead.
    """

    @abstractmethod
    def names(self) -> set[str]:
        """Names of the tensors the target holds now."""

    @abstractmethod
    def tensor(self, name: str) -> torch.Tensor | None:
        """The live tensor for ``name`` (mutated in place by the reader), or None."""

    @abstractmethod
    def full_tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor to receive a full write: the live one if it fits, else a new one."""

    @abstractmethod
    def drop(self, name: str) -> None:
        """Remove a tensor the new version no longer has (bases only)."""

    @abstractmethod
    def commit(self, resident: Resident) -> None:
        """Make the changes durable and record the new resident version."""

    @abstractmethod
    def abort(self) -> None:
        """Forget created, replaced and dropped tensors (in-place changes were undone)."""

    # --- what the reader calls (defaults: live canonical tensors) ------------------------

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]] | None:
        """Dtype and shape of the canonical tensor ``name`` the target holds, or None."""
        tensor = self.tensor(name)
        return None if tensor is None else (tensor.dtype, tuple(tensor.shape))

    def prepare(self, changes: Sequence[Change]) -> None:
        """Refuse, before anything is mutated, changes the target cannot apply."""
        for change in changes:
            if change.delta.op == FULL:
                continue
            tensor = self.tensor(change.name)
            if tensor is not None and not tensor.is_contiguous():
                raise TargetError(
                    f"target tensor {change.name!r} is not contiguous; pass contiguous tensors"
                )

    def lanes(self, name: str) -> tuple[int, ...] | None:
        """Fingerprint lanes of the bits the target holds for ``name`` (one full pass), or
        None when it cannot read them back in canonical coordinates."""
        tensor = self.tensor(name)
        return None if tensor is None else tensor_lanes(tensor)

    def complete_lanes(
        self, lanes: dict[str, tuple[int, ...]]
    ) -> dict[str, tuple[int, ...] | None]:
        """Whole-tensor lanes from what :meth:`lanes` and :meth:`apply` gave (a target that
        holds part of a tensor sums its part with its peers', or answers None)."""
        return dict(lanes)

    def apply(self, change: Change) -> Applied:
        """Apply one change in place (FORMAT.md §8.1)."""
        delta = change.delta
        if delta.op == FULL:
            tensor = self.full_tensor(change.name, change.dtype, change.shape)
            saved = apply_delta(tensor, delta)
            return Applied(lambda: undo_delta(tensor, delta, saved), lanes=tensor_lanes(tensor))
        tensor = self.tensor(change.name)
        if tensor is None:
            raise TargetError(f"the target lacks tensor {change.name!r}")
        flat = bits_view(tensor).reshape(-1)
        assert delta.positions is not None
        delta = replace(
            delta, positions=delta.positions.to(flat.device), values=delta.values.to(flat.device)
        )
        assert delta.positions is not None
        before = flat[delta.positions]
        saved = apply_delta(tensor, delta)
        return Applied(
            lambda: undo_delta(tensor, delta, saved),
            delta.positions,
            before,
            flat[delta.positions],
        )


class Target(ABC):
    """Something a :class:`~dcr_format.DeltaReader` keeps at a version of the chain."""

    @abstractmethod
    def resident(self) -> Resident | None:
        """The version held now, or None for an empty target."""

    @abstractmethod
    def begin(self) -> Transaction:
        """Open a transaction for one sync."""

    def accepts(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
        """Whether this canonical tensor lands in the target at all (False: it belongs to
        another rank's shard or expert). The reader neither fetches nor checks the rest."""
        return True

    def overwrite_names(self) -> frozenset[str]:
        """Canonical names this target can take only as ``overwrite`` or ``full`` (its load
        path transforms them); the reader records them for writers (FORMAT.md §3.6)."""
        return frozenset()


class _DictTransaction(Transaction):
    def __init__(
        self, tensors: MutableMapping[str, torch.Tensor], device: torch.device | None, on_commit
    ) -> None:  # type: ignore[no-untyped-def]
        self._tensors = tensors
        self._device = device
        self._on_commit = on_commit
        self._previous: dict[str, torch.Tensor | None] = {}  # name -> tensor before (None: absent)

    def names(self) -> set[str]:
        return set(self._tensors)

    def tensor(self, name: str) -> torch.Tensor | None:
        return self._tensors.get(name)

    def _remember(self, name: str) -> None:
        if name not in self._previous:
            self._previous[name] = self._tensors.get(name)

    def full_tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        live = self._tensors.get(name)
        if (
            live is not None
            and live.dtype == dtype
            and tuple(live.shape) == shape
            and live.is_contiguous()
        ):
            return live
        device = live.device if live is not None else self._device or _default_device(self._tensors)
        self._remember(name)
        fresh = torch.empty(shape, dtype=dtype, device=device)
        self._tensors[name] = fresh
        return fresh

    def drop(self, name: str) -> None:
        self._remember(name)
        self._tensors.pop(name, None)

    def commit(self, resident: Resident) -> None:
        self._on_commit(resident)
        self._previous.clear()

    def abort(self) -> None:
        for name, before in self._previous.items():
            if before is None:
                self._tensors.pop(name, None)
            else:
                self._tensors[name] = before
        self._previous.clear()


def _default_device(tensors: MutableMapping[str, torch.Tensor]) -> torch.device:
    for tensor in tensors.values():
        return tensor.device
    return torch.device("cpu")


class StateDictTarget(Target):
    """A dict of canonical tensors on any device, updated in place.

    Tensors keep their storage, so a model holding them sees each update. New
    tensors (a base into an empty dict) are created on ``device`` (default: the
    device of the dict's first tensor, else CPU).
    """

    def __init__(
        self,
        tensors: MutableMapping[str, torch.Tensor],
        *,
        version: int | None = None,
        chain_id: str | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        if (version is None) != (chain_id is None):
            raise ValueError("give both version and chain_id for a target that holds a version")
        self.tensors = tensors
        self.device = torch.device(device) if device is not None else None
        self._resident = (
            Resident(chain_id, version) if chain_id is not None and version is not None else None
        )

    def resident(self) -> Resident | None:
        """The version the dict holds (as last synced, or as declared at construction)."""
        return self._resident

    def begin(self) -> Transaction:
        """In-place transaction over the dict."""
        return _DictTransaction(self.tensors, self.device, self._set_resident)

    def _set_resident(self, resident: Resident) -> None:
        self._resident = resident


class SafetensorsDirTarget(Target):
    """A Hugging Face checkpoint directory, replaced atomically on every sync.

    ``path`` becomes a symbolic link to a versioned directory beside it
    (``.<name>.dcr/v<version>-<id>/``) holding ``model.safetensors`` (or shards
    plus ``model.safetensors.index.json``) and ``dcr-state.json``. A sync writes
    the new directory completely, fsyncs it, then swaps the link with one
    rename, so a crash at any moment leaves the old or the new version, never a
    mix. Other files in the directory (config, tokenizer) are carried forward.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, max_file_bytes: int = MAX_FILE_BYTES
    ) -> None:
        self.path = Path(path)
        self.max_file_bytes = max_file_bytes

    @property
    def _store_dir(self) -> Path:
        return self.path.parent / f".{self.path.name}.dcr"

    def _check_managed(self) -> None:
        if self.path.is_symlink():
            # only a link into our own versioned dirs is ours: a sync deletes what it pointed at
            if os.path.realpath(self.path).startswith(os.path.realpath(self._store_dir) + os.sep):
                return
            raise TargetError(
                f"{self.path} is a link to {os.readlink(self.path)}, not to a directory "
                f"dcr manages under {self._store_dir}; pull into a new or empty path"
            )
        if not self.path.exists():
            return
        if self.path.is_dir() and not any(self.path.iterdir()):
            return
        raise TargetError(
            f"{self.path} is an existing directory not managed by dcr; pull into a new or "
            "empty path (dcr keeps it as a link to versioned directories)"
        )

    def resident(self) -> Resident | None:
        """The version recorded in the directory's ``dcr-state.json``."""
        self._check_managed()
        state_path = self.path / DIR_STATE_FILE
        if not state_path.exists():
            return None
        try:
            state = json.loads(state_path.read_text())
            if state.get("format") != DIR_STATE_FORMAT:
                raise ValueError("unknown format")
            return Resident(str(state["chain_id"]), int(state["version"]))
        except (ValueError, KeyError, TypeError, OSError) as exc:
            raise TargetError(
                f"{state_path} is unreadable ({exc}); remove {self.path} and pull again"
            ) from None

    def begin(self) -> Transaction:
        """Load the current tensors into memory; commit writes and swaps a new directory."""
        from safetensors.torch import load_file

        self._check_managed()
        self._clean_orphans()
        tensors: dict[str, torch.Tensor] = {}
        layout: dict[str, str] = {}
        if (self.path / DIR_STATE_FILE).exists():
            for file in sorted(self.path.glob("*.safetensors")):
                for name, tensor in load_file(str(file)).items():
                    tensors[name] = tensor
                    layout[name] = file.name
        target = self

        class _DirTransaction(_DictTransaction):
            def commit(self, resident: Resident) -> None:
                target._write(tensors, layout, resident)
                self._previous.clear()

        return _DirTransaction(tensors, torch.device("cpu"), lambda resident: None)

    def _clean_orphans(self) -> None:
        """Remove versioned directories the link does not point at (crashed syncs)."""
        if not self._store_dir.exists():
            return
        live = self.path.resolve() if self.path.is_symlink() else None
        for child in self._store_dir.iterdir():
            if child.resolve() != live:
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)

    def _plan_files(
        self, tensors: dict[str, torch.Tensor], layout: dict[str, str]
    ) -> dict[str, list[str]]:
        files: dict[str, list[str]] = {}
        if layout and all(name in layout for name in tensors):
            for name in tensors:
                files.setdefault(layout[name], []).append(name)
            return files
        groups: list[list[str]] = [[]]
        size = 0
        for name, tensor in tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            if groups[-1] and size + nbytes > self.max_file_bytes:
                groups.append([])
                size = 0
            groups[-1].append(name)
            size += nbytes
        if len(groups) == 1:
            return {SINGLE_FILE: groups[0]}
        n = len(groups)
        return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}

    def _write(
        self, tensors: dict[str, torch.Tensor], layout: dict[str, str], resident: Resident
    ) -> None:
        from safetensors.torch import save_file

        self._store_dir.mkdir(parents=True, exist_ok=True)
        fresh = self._store_dir / f"v{resident.version:020d}-{uuid.uuid4().hex[:8]}"
        fresh.mkdir()
        files = self._plan_files(tensors, layout)
        for file, names in files.items():
            path = fresh / file
            save_file(
                {n: tensors[n].contiguous() for n in names}, str(path), metadata={"format": "pt"}
            )
            _fsync(path)
        if len(files) > 1:
            index = {
                "metadata": {
                    "total_size": sum(t.numel() * t.element_size() for t in tensors.values())
                },
                "weight_map": {n: f for f, names in files.items() for n in sorted(names)},
            }
            _write_synced(fresh / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True).encode())
        if self.path.is_symlink():  # carry forward config, tokenizer and other files
            for item in self.path.iterdir():
                if (
                    item.is_file()
                    and not item.name.endswith(".safetensors")
                    and item.name not in (INDEX_FILE, DIR_STATE_FILE)
                ):
                    shutil.copy2(item, fresh / item.name)
                    _fsync(fresh / item.name)
        state = {
            "format": DIR_STATE_FORMAT,
            "chain_id": resident.chain_id,
            "version": resident.version,
        }
        _write_synced(fresh / DIR_STATE_FILE, json.dumps(state).encode())
        _fsync_dir(fresh)
        old = self.path.resolve() if self.path.is_symlink() else None
        if self.path.is_dir() and not self.path.is_symlink():
            self.path.rmdir()  # empty (checked); the previous version was nothing
        link = self._store_dir / f"link-{uuid.uuid4().hex[:8]}"
        os.symlink(os.path.relpath(fresh, self.path.parent), link)
        os.replace(link, self.path)
        _fsync_dir(self.path.parent)
        if old is not None and old != fresh.resolve():
            shutil.rmtree(old, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync(path)
    except OSError:
        pass  # some filesystems refuse fsync on directories


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
