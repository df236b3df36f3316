"""Commands that read the chain: ``dcr log``, ``show``, ``diff``, ``replay`` and ``plot``.

Each command imports what it needs when it runs: listing the commands stays quick.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from dcr_format.cli.main import command_imports
from dcr_format.cli.output import count, emit, human_bytes, table
from dcr_format.cli.params import (
    FORMAT_OPTION,
    STORE_OPTION,
    VERSION,
    default_cache,
    directory_option,
    output_option,
    version_option,
    versions_in_chain,
)

if TYPE_CHECKING:
    from dcr_format.store.store import Store
    from dcr_format.tools._inspect import ShowSort


@click.command(name="log")
@STORE_OPTION
@click.option(
    "--limit", type=click.IntRange(min=1), default=None, help="Show only the newest N versions."
)
@version_option("--since", help="Show versions from N on.")
@FORMAT_OPTION
def log_cmd(store: Store, limit: int | None, since: int | None, fmt: str) -> None:
    """One row per committed version (kind "delta+base": compacted, it has an alternative base)."""
    with command_imports():
        from dcr_format.tools import log

    rows = log(store, limit=limit, since=since)

    def human() -> None:
        table(
            [
                "version",
                "kind",
                "parent",
                "step",
                "created",
                "change",
                "payload",
                "dense",
                "ratio",
                "ranks",
            ],
            [
                [
                    r.version,
                    r.kind + ("+base" if r.compacted else ""),
                    "-" if r.parent is None else r.parent,
                    "-" if r.step is None else r.step,
                    r.created[:19],
                    f"{r.change_rate:.3%}",
                    human_bytes(r.payload_bytes),
                    human_bytes(r.dense_bytes),
                    f"{r.ratio:.2%}",
                    r.writer_ranks,
                ]
                for r in rows
            ],
        )

    emit(fmt, list(rows), human)


@click.command()
@click.argument("version", type=VERSION)
@STORE_OPTION
@click.option("--top", type=click.IntRange(min=0), default=None, help="Only the N first rows.")
@click.option(
    "--sort",
    "sort_key",
    type=click.Choice(["bytes", "changed", "name"]),
    default="bytes",
    help="Order of the tensor rows.",
)
@FORMAT_OPTION
def show(version: int, store: Store, top: int | None, sort_key: ShowSort, fmt: str) -> None:
    """The commit record of VERSION and its tensors."""
    with command_imports():
        from dcr_format.tools import show as show_version

    detail = show_version(store, version, sort=sort_key, top=top)

    def human() -> None:
        v = detail.version
        click.echo(
            f"version {v.version} ({v.kind}{'+base' if v.compacted else ''}), "
            f"parent {'-' if v.parent is None else v.parent}, "
            f"step {'-' if v.step is None else v.step}, created {v.created}"
        )
        click.echo(
            f"state {detail.state_fingerprint}  attempt {detail.attempt}  ranks {v.writer_ranks}"
        )
        click.echo(
            f"changed {v.changed_elements} of {v.total_elements} ({v.change_rate:.3%}); "
            f"payload {human_bytes(v.payload_bytes)} of {human_bytes(v.dense_bytes)} "
            f"({v.ratio:.2%})"
        )
        click.echo(f"features {', '.join(detail.required_features) or 'none'}")
        if detail.files:
            listed = (f"{n} ({human_bytes(size)})" for n, size in sorted(detail.files.items()))
            click.echo(f"files {', '.join(listed)}")
        table(
            ["tensor", "dtype", "shape", "op", "changed", "bytes", "share", "coding"],
            [
                [
                    r.name,
                    r.dtype,
                    "x".join(map(str, r.shape)) or "()",
                    r.op,
                    r.changed,
                    human_bytes(r.encoded_bytes),
                    f"{r.share:.1%}",
                    f"{r.positions_coding or '-'}/{r.values_coding or '-'}",
                ]
                for r in detail.tensors
            ],
        )

    emit(fmt, detail, human)


@click.command()
@click.argument("a", type=VERSION)
@click.argument("b", type=VERSION)
@STORE_OPTION
@click.option(
    "--exact",
    is_flag=True,
    help="Resolve upper bounds (overwrite or full entries in between) by replaying those tensors.",
)
@click.option("--all", "include_unchanged", is_flag=True, help="List unchanged tensors too.")
@click.option("--top", type=click.IntRange(min=0), default=None, help="Only the N first rows.")
@FORMAT_OPTION
def diff(
    a: int, b: int, store: Store, exact: bool, include_unchanged: bool, top: int | None, fmt: str
) -> None:
    """Which tensors, and how many elements, differ between versions A and B."""
    with command_imports():
        from dcr_format.tools import diff as diff_versions

    report = diff_versions(
        store, a, b, exact=exact, include_unchanged=include_unchanged, progress=True
    )
    if top is not None:
        report = report.model_copy(update={"tensors": report.tensors[:top]})

    def human() -> None:
        bound = "" if report.exact else " (at most: rows marked <= are upper bounds)"
        click.echo(
            f"versions {a} -> {b}: {report.tensors_differing} of {report.tensors_compared} "
            f"tensors differ, {report.elements_differing} elements{bound}"
        )
        table(
            ["tensor", "status", "dtype", "shape", "elements", "of", "share", "versions"],
            [
                [
                    r.name,
                    r.status,
                    r.dtype,
                    "x".join(map(str, r.shape)) or "()",
                    ("" if r.exact else "<=") + str(r.elements),
                    r.total,
                    f"{r.elements / r.total:.3%}" if r.total else "-",
                    r.versions,
                ]
                for r in report.tensors
            ],
        )

    emit(fmt, report, human)


@click.command()
@click.argument("version", type=VERSION)
@STORE_OPTION
@directory_option("--out", required=True, help="Directory to write.")
@directory_option(
    "--cache-dir",
    help="Replay cache (default: $DCR_CACHE_DIR or ~/.cache/dcr); it keeps the newest version "
    "replayed, so a later version starts from it.",
)
@click.option("--no-cache", is_flag=True, help="Replay from a base; leave the cache alone.")
@FORMAT_OPTION
def replay(
    version: int, store: Store, out: str, cache_dir: str | None, no_cache: bool, fmt: str
) -> None:
    """Materialise VERSION as a Hugging Face checkpoint directory, every tensor verified."""
    with command_imports():
        from dcr_format.tools import replay as replay_version

    cache = None if no_cache else (cache_dir or default_cache())
    result = replay_version(store, version, out, cache_dir=cache, progress=True)

    def human() -> None:
        source = {"base": "the base", "cache": "the cache", "out": out}[result.source]
        if not result.applied_versions:
            how = f"copied from {source}" if result.source == "cache" else "already there"
        else:
            how = (
                f"{count(len(result.applied_versions), 'version')} applied from {source} at "
                f"version {result.start_version}, {human_bytes(result.payload_bytes)} fetched"
            )
        click.echo(f"{out} holds version {result.version}, verified: {how}")

    emit(fmt, result, human)


@click.command()
@STORE_OPTION
@output_option("--out", required=True, help="PNG file to write.")
@version_option("--since", help="Plot versions from N on.")
@click.option(
    "--limit", type=click.IntRange(min=1), default=None, help="Plot only the newest N versions."
)
@click.option(
    "--dpi", type=click.IntRange(min=10), default=100, help="Resolution of the PNG, dots per inch."
)
@FORMAT_OPTION
def plot(store: Store, out: str, since: int | None, limit: int | None, dpi: int, fmt: str) -> None:
    """Bytes and change rate per version, and change rate by layer (needs matplotlib)."""
    with command_imports():
        from dcr_format.tools import plot as draw

    versions_in_chain(store, **{"--since": since})
    data = draw(store, out, since=since, limit=limit, dpi=dpi)
    emit(
        fmt,
        data,
        lambda: click.echo(
            f"wrote {out}: {len(data.versions)} versions, {len(data.rows)} heat map rows"
        ),
    )


COMMANDS = (log_cmd, show, diff, replay, plot)
"""The commands this module adds to ``dcr``."""
