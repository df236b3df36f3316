"""``dcr publish`` and ``dcr pull``: a checkpoint directory into the chain, and back out.

Each command imports what it needs when it runs: listing the commands stays quick.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from dcr_format.cli.main import command_imports
from dcr_format.cli.output import count, emit, human_bytes, progress_bar
from dcr_format.cli.params import (
    FEATURES_OPTION,
    FORMAT_OPTION,
    STORE_OPTION,
    WRITER_STORE_OPTION,
    default_cache,
    directory_option,
    version_option,
)

if TYPE_CHECKING:
    from dcr_format.store.store import Store


@click.command()
@click.argument("ckpt_dir", type=click.Path(exists=True, file_okay=False))
@WRITER_STORE_OPTION
@click.option("--step", type=int, default=None, help="Trainer step recorded in the commit.")
@click.option(
    "--base-every",
    type=click.IntRange(min=1),
    default=None,
    help="Write a full base every K versions.",
)
@click.option(
    "--base",
    is_flag=True,
    help="Write this version as a full base (it may drop tensors of the previous one).",
)
@directory_option(
    "--cache-dir",
    help="Local cache of the baseline bits (default: $DCR_CACHE_DIR or ~/.cache/dcr).",
)
@click.option(
    "--allow-empty",
    is_flag=True,
    help="Commit a version even when the checkpoint equals the newest version bit for bit.",
)
@FEATURES_OPTION
@FORMAT_OPTION
def publish(
    ckpt_dir: str,
    store: Store,
    step: int | None,
    base_every: int | None,
    base: bool,
    cache_dir: str | None,
    allow_empty: bool,
    features: tuple[str, ...] | None,
    fmt: str,
) -> None:
    """Publish a Hugging Face checkpoint directory as the chain's next version.

    The tensors of its safetensors files, and its small files (config, generation config,
    tokenizer files, chat template: each file directly in the directory of at most 64 MiB,
    weights in other formats aside), sent only where they changed. A checkpoint equal to the
    newest version, bit for bit and file for file, commits nothing (exit status 0) unless
    --allow-empty is given.
    """
    with command_imports():
        from dcr_format.errors import ArgumentError, CommitConflictError, UnchangedVersionError
        from dcr_format.publish._files import directory_files
        from dcr_format.publish._part import check_step
        from dcr_format.publish.checkpoint import count_tensors, iter_checkpoint
        from dcr_format.publish.writer import DeltaWriter

    try:
        check_step(step)  # a usage error, before any work
    except ArgumentError as exc:
        raise click.BadParameter(str(exc), param_hint="'--step'") from None
    _outside(store, ckpt_dir)
    # a file safetensors cannot read is a TargetError (checkpoint.py), here at its header
    total = count_tensors(ckpt_dir)
    files, left_out = directory_files(ckpt_dir)
    for line in left_out:
        click.echo(f"not sent: {line}", err=True)
    writer = DeltaWriter(
        store, base_every=base_every, cache_dir=cache_dir or default_cache(), features=features
    )
    try:
        info = writer.publish(
            progress_bar(iter_checkpoint(ckpt_dir), total=total, desc="publish"),
            step=step,
            files=files,
            allow_empty=allow_empty,
            base=base,
        )
    except CommitConflictError:
        raise CommitConflictError(
            "another writer committed this version while this publish ran, so nothing of "
            f"{ckpt_dir} was committed; run the command again to publish it on top"
        ) from None
    except UnchangedVersionError:
        from dcr_format.chain.chain import Chain

        latest = Chain(store).latest()
        emit(
            fmt,
            {"committed": False, "reason": "unchanged", "version": latest},
            lambda: click.echo(
                f"unchanged: {ckpt_dir} equals version {latest} bit for bit; nothing committed "
                "(--allow-empty commits it anyway)"
            ),
        )
        return

    def human() -> None:
        click.echo(
            f"committed version {info.version} ({info.kind}): {info.changed_elements} of "
            f"{info.total_elements} elements changed ({info.change_rate:.3%}), "
            f"{human_bytes(info.payload_bytes)} of {human_bytes(info.dense_bytes)} dense "
            f"({info.ratio:.2%})"
        )

    emit(fmt, info, human)


def _outside(store: Store, ckpt_dir: str) -> None:
    """A local store is not the checkpoint directory, nor inside it (its objects would be
    published as the checkpoint's files)."""
    import os

    if store.local_root is None:
        return
    root, ckpt = os.path.realpath(store.local_root), os.path.realpath(ckpt_dir)
    if root == ckpt or root.startswith(ckpt.rstrip(os.sep) + os.sep):
        raise click.BadParameter(
            f"the store {store.url} is inside the checkpoint directory {ckpt_dir}; publish "
            "into a store outside it (e.g. --store ./refit-store)",
            param_hint="'--store'",
        )


@click.command()
@STORE_OPTION
@directory_option("--into", required=True, help="Checkpoint directory to keep.")
@version_option("--version", "version", help="Target version (default newest).")
@click.option(
    "--wait",
    "wait",
    type=click.FloatRange(min=0),
    default=300.0,
    help="Seconds to wait while another sync holds the directory (0: refuse at once).",
)
@click.option(
    "--start-from",
    "start",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="A local checkpoint directory holding a version of the chain (the model the run "
    "started from): a new --into starts from it, checked by fingerprint, and fetches only "
    "the changes since. Ignored once --into holds a version.",
)
@FORMAT_OPTION
def pull(
    store: Store, into: str, version: int | None, wait: float, start: str | None, fmt: str
) -> None:
    """Bring a Hugging Face checkpoint directory to a version of the chain."""
    with command_imports():
        from dcr_format.targets.directory import SafetensorsDirTarget
        from dcr_format.tools._replay import sync_with_progress

    target = SafetensorsDirTarget(into, timeout=wait)
    if start is not None and target.resident() is None:
        from dcr_format.tools._start import start_from

        started = start_from(store, start, into, timeout=wait, progress=True)
        click.echo(f"{into} starts from {start}: version {started}, every tensor checked", err=True)
        target = SafetensorsDirTarget(into, timeout=wait)
    result = sync_with_progress(store, target, version, what="pull")

    def human() -> None:
        if not result.applied_versions:
            click.echo(f"{into} is already at version {result.version}")
        else:
            click.echo(
                f"{into} is at version {result.version} (applied "
                f"{count(len(result.applied_versions), 'version')}, "
                f"{human_bytes(result.payload_bytes)} fetched)"
            )

    emit(fmt, result, human)


COMMANDS = (publish, pull)
"""The commands this module adds to ``dcr``."""
