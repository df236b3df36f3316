"""Worker processes for tests/test_crash.py: a writer or a reader that SIGKILLs itself at a
named stage of a publish or a sync.

Workers run in processes forked from a forkserver that has torch and dcr_format
loaded (``dcr_format.testing.soak.worker_context``), so each starts in milliseconds.
The stage is named by the ``stage`` argument (or ``$DCR_CRASH_STAGE`` when run
as a script); the worker installs a hook at that point that kills its own
process with SIGKILL: no ``finally``, no ``atexit``, no ``ABORTED`` marker.
Stages that must die while a request is on the wire are killed by the test's
fault proxy instead (``proxy`` stages below).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

STAGE_ENV = "DCR_CRASH_STAGE"
WORLD = 2  # writer ranks, one thread each, in one process
SHARD_BYTES = 16  # a shard per changed tensor: several shards per rank
FILE_BYTES = 3000  # several safetensors files per checkpoint directory

WRITER_STAGES = {
    "mid-shard": "rank 0 uploading its second shard",
    "some-manifests": "rank 1's manifest uploaded, rank 0's not",
    "before-commit": "every manifest uploaded, commit record not sent",
    "during-commit": "commit request sent, its answer never read",
    "after-commit": "commit record created, baselines not advanced",
    "mid-cache-save": "baseline cache half written (tensors new, version old)",
}
READER_STAGES = {
    "fetch": "fetching shards",
    "staged": "everything fetched and verified, nothing applied",
    "mid-files": "writing the new directory's files",
    "before-swap": "new directory complete, link not swapped",
    "after-swap": "link swapped, old directory not removed",
}
# Stages whose kill the test's fault proxy delivers while the request is in flight (S3 only).
PROXY_STAGES = {
    "mid-shard": ("put", r"shard-00000-00001"),
    "during-commit": ("put_if_absent", r"/commits/"),
}


def model(version: int) -> dict[str, torch.Tensor]:
    """The canonical tensors of ``version`` that every process agrees on."""
    gen = torch.Generator().manual_seed(99)
    tensors = {
        f"model.layers.{i}.weight": torch.randn(24, 32, generator=gen).bfloat16() for i in range(6)
    }
    tensors["lm_head.weight"] = torch.randn(16, 32, generator=gen)
    for v in range(1, version + 1):
        for i, tensor in enumerate(tensors.values()):
            flat = tensor.view(-1)
            start = (v * 53 + i * 17) % (flat.numel() - 40)
            flat[start : start + 5 + (v + i) % 7] += 0.5
    return tensors


def die() -> None:
    """SIGKILL this process: nothing after this line runs, no handler, no cleanup."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # never reached: the signal is delivered at once


def _isolate() -> None:
    from dcr_format.testing.servers import AWS_ENV_NAMES, ISOLATED_AWS_ENV

    for name in AWS_ENV_NAMES:
        os.environ.pop(name, None)
    os.environ.update(ISOLATED_AWS_ENV)


def _store(url: str, storage_options: dict[str, Any] | None):
    from dcr_format import Store

    return Store(url, storage_options=storage_options) if storage_options else Store(url)


# --- writer -------------------------------------------------------------------------------------


def _writer_hooks(stage: str, s3: bool) -> None:
    import dcr_format.publish._cache as cache_module
    import dcr_format.publish.writer as writer_module
    from dcr_format import Store
    from dcr_format.store.store import TEMP_PREFIX

    put, put_if_absent = Store.put, Store.put_if_absent
    if stage == "mid-shard" and not s3:

        def partial_put(self, key, data):  # type: ignore[no-untyped-def]
            if key.endswith("shard-00000-00001.dcrs"):
                # a local put killed mid-write leaves a partial temporary file, never the object
                root = self.url[len("file://") :]
                directory = Path(root, key).parent
                directory.mkdir(parents=True, exist_ok=True)
                (directory / f"{TEMP_PREFIX}{uuid.uuid4().hex}").write_bytes(data[: len(data) // 2])
                die()
            return put(self, key, data)

        Store.put = partial_put  # type: ignore[method-assign]
    elif stage == "some-manifests":

        def manifest_put(self, key, data):  # type: ignore[no-untyped-def]
            if key.endswith("manifest-00000.json"):
                other = key.replace("manifest-00000", "manifest-00001")
                deadline = time.monotonic() + 20
                while not self.exists(other) and time.monotonic() < deadline:
                    time.sleep(0.01)
                die()
            return put(self, key, data)

        Store.put = manifest_put  # type: ignore[method-assign]
    elif stage == "before-commit":

        def no_commit(self, key, data):  # type: ignore[no-untyped-def]
            if key.startswith("commits/"):
                die()
            return put_if_absent(self, key, data)

        Store.put_if_absent = no_commit  # type: ignore[method-assign]
    elif stage == "during-commit" and not s3:

        def lost_answer(self, key, data):  # type: ignore[no-untyped-def]
            put_if_absent(self, key, data)
            if key.startswith("commits/"):
                die()  # the record landed; the writer never learns it

        Store.put_if_absent = lost_answer  # type: ignore[method-assign]
    elif stage == "after-commit":
        writer_module.DeltaWriter._advance = lambda *args, **kwargs: die()  # type: ignore[method-assign]
    elif stage == "mid-cache-save":
        replace = os.replace

        def half_saved(src, dst):  # type: ignore[no-untyped-def]
            if str(dst).endswith("baseline.json"):
                die()  # the tensors file is already the new version's
            return replace(src, dst)

        cache_module.os.replace = half_saved  # type: ignore[attr-defined]
    elif stage not in PROXY_STAGES:
        raise ValueError(f"unknown writer stage {stage!r}; use one of {', '.join(WRITER_STAGES)}")


def publish_ranks(store, version: int, tensors, *, cache_dir: str | None = None, **kwargs):  # type: ignore[no-untyped-def]
    """Open WORLD writer ranks (threads) on ``store`` and publish ``tensors`` as the next
    version; returns the ranks' CommitInfos (or raises the first rank's error)."""
    from dcr_format import DeltaWriter, ThreadCoordinator

    coordinator = ThreadCoordinator(WORLD, timeout=30)
    writers = [
        DeltaWriter(
            store,
            rank=rank,
            world_size=WORLD,
            coordinator=coordinator,
            shard_bytes=SHARD_BYTES,
            commit_timeout=20,
            cache_dir=cache_dir,
            **kwargs,
        )
        for rank in range(WORLD)
    ]
    results: list[Any] = [None] * WORLD
    errors: list[BaseException | None] = [None] * WORLD

    def go(rank: int) -> None:
        try:
            assert (
                writers[rank].version == version - 1 if version else writers[rank].version is None
            )
            results[rank] = writers[rank].publish(tensors, step=version)
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=go, args=(r,), daemon=True) for r in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for error in errors:
        if error is not None:
            raise error
    return results


def writer(url: str, storage_options: dict[str, Any] | None, cache_dir: str, stage: str) -> None:
    """Open the chain with WORLD ranks and publish its next version, dying at ``stage``."""
    _isolate()
    s3 = url.startswith("s3://")
    _writer_hooks(stage, s3)
    from dcr_format.chain.chain import Chain

    store = _store(url, storage_options)
    version = Chain(store).latest() + 1
    publish_ranks(store, version, model(version), cache_dir=cache_dir)
    # reaching this line means the stage's hook never fired: the test sees exit code 0


# --- reader -------------------------------------------------------------------------------------


def _reader_hooks(stage: str, path: Path) -> None:
    import safetensors.torch

    import dcr_format.sync.reader as reader_module
    import dcr_format.targets.directory as targets_module
    from dcr_format import Store

    if stage == "fetch":
        get = Store.get

        def dying_get(self, key, **kwargs):  # type: ignore[no-untyped-def]
            if "/shard-" in key:
                die()
            return get(self, key, **kwargs)

        Store.get = dying_get  # type: ignore[method-assign]
    elif stage == "staged":
        reader_module.DeltaReader._apply = lambda *args, **kwargs: die()  # type: ignore[method-assign]
    elif stage == "mid-files":
        save_file = safetensors.torch.save_file
        calls = [0]

        def dying_save(tensors, filename, metadata=None):  # type: ignore[no-untyped-def]
            calls[0] += 1
            if calls[0] == 2:  # the first file is whole, the second half written
                save_file(tensors, filename, metadata=metadata)
                data = Path(filename).read_bytes()
                Path(filename).write_bytes(data[: len(data) // 2])
                die()
            return save_file(tensors, filename, metadata=metadata)

        safetensors.torch.save_file = dying_save
    elif stage == "before-swap":
        replace = os.replace

        def dying_replace(src, dst):  # type: ignore[no-untyped-def]
            if Path(dst) == path:
                die()  # the new directory and a link to it exist; the target still points back
            return replace(src, dst)

        targets_module.os.replace = dying_replace  # type: ignore[attr-defined]
    elif stage == "after-swap":
        fsync_dir = targets_module._fsync_dir

        def dying_fsync_dir(directory):  # type: ignore[no-untyped-def]
            if Path(directory) == path.parent:
                die()  # called right after the swap, before the old directory is removed
            return fsync_dir(directory)

        targets_module._fsync_dir = dying_fsync_dir
    else:
        raise ValueError(f"unknown reader stage {stage!r}; use one of {', '.join(READER_STAGES)}")


def reader(url: str, storage_options: dict[str, Any] | None, path: str, stage: str) -> None:
    """Sync the safetensors directory ``path`` to the newest version, dying at ``stage``."""
    _isolate()
    from dcr_format import DeltaReader, SafetensorsDirTarget

    _reader_hooks(stage, Path(path))
    target = SafetensorsDirTarget(path, max_file_bytes=FILE_BYTES)
    DeltaReader(_store(url, storage_options), target).sync()


if __name__ == "__main__":
    # python tests/crash_workers.py writer|reader URL CACHE_OR_PATH  (stage: $DCR_CRASH_STAGE)
    role, url, where = sys.argv[1:4]
    (writer if role == "writer" else reader)(url, None, where, os.environ[STAGE_ENV])
