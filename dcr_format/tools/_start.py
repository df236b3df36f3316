"""Start a pulled directory from a local checkpoint that already holds a version of the chain
(the model a run started from, downloaded once to every rollout node): its tensors are
checked against the chain's fingerprints and written as that version, so that a pull then
fetches only the changes since, not the whole model."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from dcr_format.chain.chain import Chain, TensorState, state_table
from dcr_format.delta.fingerprint import state_fingerprint, tensor_fingerprint
from dcr_format.errors import ArgumentError, VersionNotFoundError
from dcr_format.format.dtypes import info_for
from dcr_format.publish.checkpoint import checkpoint_files, iter_checkpoint
from dcr_format.store.store import Store, open_store
from dcr_format.sync._fetch import fetch_files
from dcr_format.targets.change import Resident
from dcr_format.targets.directory import SafetensorsDirTarget
from dcr_format.targets.protocol import LOCK_TIMEOUT
from dcr_format.tools._progress import Progress


def start_from(
    store: Store | str | os.PathLike[str],
    checkpoint: str | os.PathLike[str],
    into: str | os.PathLike[str],
    *,
    timeout: float | None = LOCK_TIMEOUT,
    progress: bool = False,
) -> int:
    """Make ``into``, a new or empty path, a pulled directory at the version of the chain
    whose tensors the checkpoint directory ``checkpoint`` holds bit for bit; returns that
    version. A pull (``dcr pull``, a ``DeltaReader`` over ``SafetensorsDirTarget(into)``)
    then fetches only the versions after it.

    Every tensor of ``checkpoint`` is fingerprinted (FORMAT.md §9) and the state compared
    with each committed version's, the oldest first (the model a run started from), then
    from the newest down; the version's checkpoint files (``config.json``, ...) come from
    the store, checked as a pull checks them. ``checkpoint`` is only read, and held in
    memory while the directory is written. ``progress`` shows the bytes checked so far on
    stderr (a bar on a terminal, lines off one).

    Raises :class:`ArgumentError` where ``into`` already holds a version, and
    :class:`VersionNotFoundError` where no committed version has exactly these tensors
    (another dtype, a tensor more or less, other bits).
    """
    store = open_store(store)
    chain = Chain(store)
    target = SafetensorsDirTarget(into, timeout=timeout)
    held = target.resident()
    if held is not None:
        raise ArgumentError(
            f"{into} already holds version {held.version}; start a directory from a "
            "checkpoint only when it is new or empty (a pull continues from what it holds)"
        )
    tensors: dict[str, torch.Tensor] = {}
    rows: dict[str, TensorState] = {}
    total = sum(f.stat().st_size for f in checkpoint_files(checkpoint))
    with Progress("start", total=total, unit="B", enabled=progress) as bar:
        for name, tensor in iter_checkpoint(checkpoint):
            tensor = tensor.contiguous()
            dtype = info_for(tensor.dtype).name
            fingerprint = tensor_fingerprint(tensor)
            rows[name] = TensorState(name, dtype, tuple(tensor.shape), fingerprint, 0)
            tensors[name] = tensor
            bar.add(tensor.numel() * tensor.element_size())
    found = state_fingerprint((t.name, t.dtype, t.shape, t.fingerprint) for t in rows.values())
    committed = chain.versions()
    # the oldest first (the model a run started from), then the newest down
    order = committed[:1] + committed[:0:-1]
    records = (chain.record(v) for v in order)
    loaded = next((r for r in records if r.record.state_fingerprint == found), None)
    if loaded is None:
        raise VersionNotFoundError(_no_version(chain, committed, checkpoint, rows))
    version = loaded.record.version
    manifests = tuple(chain.manifests(loaded))
    with ThreadPoolExecutor(4) as pool:
        files = fetch_files(store, {}, manifests, pool)
    assert files is not None
    txn = target.begin()  # refused if another sync filled it meanwhile
    try:
        for name, tensor in tensors.items():
            if not txn.adopt(name, tensor):
                txn.full_tensor(name, tensor.dtype, tuple(tensor.shape)).copy_(tensor)
        txn.put_files(files.listed, files.fetched)
        txn.commit(Resident(chain.header.chain_id, version, loaded.sha256))
    except BaseException:
        txn.abort()
        raise
    return version


def _no_version(
    chain: Chain, committed: list[int], checkpoint: object, rows: dict[str, TensorState]
) -> str:
    """Why no version holds the checkpoint's tensors, told against the newest version."""
    if not committed:
        return f"the chain has no committed version for {checkpoint} to match; pull without it"
    newest = committed[-1]
    table = state_table(chain.manifests(chain.record(newest)))
    extra = sorted(set(rows) - set(table))
    missing = sorted(set(table) - set(rows))
    if extra or missing:
        why = (
            f"it holds {len(extra)} tensor(s) version {newest} lacks (first: {extra[0]!r})"
            if extra
            else f"it lacks {len(missing)} tensor(s) of version {newest} (first: {missing[0]!r})"
        )
    else:
        other = next(
            (
                n
                for n in sorted(rows)
                if (rows[n].dtype, rows[n].shape) != (table[n].dtype, table[n].shape)
            ),
            None,
        )
        why = (
            f"tensor {other!r} is {rows[other].dtype} {list(rows[other].shape)} there and "
            f"{table[other].dtype} {list(table[other].shape)} in version {newest}"
            if other is not None
            else "its tensors' names, dtypes and shapes are the chain's, but their bits are "
            "no committed version's"
        )
    if committed[0] > 0:  # the version it holds may be one gc removed
        why += f"; the versions before {committed[0]} were removed (dcr gc)"
    return (
        f"{checkpoint} holds none of the chain's versions {committed[0]}..{newest} ({why}); "
        "pull without starting from it"
    )
