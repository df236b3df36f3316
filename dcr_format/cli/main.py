"""The ``dcr`` command."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from dcr_format.cli.params import (
    FORMAT_OPTION,
    SHOW_DEFAULTS,
    F,
    directory_option,
    endpoint_url,
    finite,
    one_line,
    output_option,
)
from dcr_format.errors import DcrError, VersionNotFoundError

if TYPE_CHECKING:
    from pydantic import BaseModel

    from dcr_format.store.store import Store
    from dcr_format.tools._inspect import ShowSort

VERSION = click.IntRange(min=0)
"""The type of every argument and option that names a version of the chain."""


def _remember(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    if param.name == "endpoint_url" and value:
        source = ctx.get_parameter_source("endpoint_url")
        ctx.meta["dcr.endpoint_from_env"] = source == click.core.ParameterSource.ENVIRONMENT
    ctx.meta[f"dcr.{param.name}"] = value


def _open_store(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """The --store URL as a Store, with the (eagerly parsed) S3 endpoint and writer mode."""
    if value is None:
        return None
    from dcr_format.store.store import Store

    endpoint = ctx.meta.get("dcr.endpoint_url")
    options = None
    is_s3 = value.startswith(("s3://", "s3a://"))
    if endpoint and not is_s3 and ctx.meta.get("dcr.endpoint_from_env"):
        endpoint = None  # AWS_ENDPOINT_URL set for S3 work says nothing about other stores
    if endpoint:
        endpoint = endpoint_url(endpoint)
        if not is_s3:
            raise click.BadParameter(
                "--endpoint-url applies to s3:// stores; drop it or pass an s3://bucket/prefix "
                "store",
                param=param,
            )
        options = {"endpoint_url": endpoint}
    store = Store(
        value, storage_options=options, single_writer=bool(ctx.meta.get("dcr.single_writer"))
    )
    if store.url.startswith("file://"):
        root = Path(store.url[len("file://") :])
        if root.exists() and not root.is_dir():
            raise click.BadParameter(
                f"{root} is a file, not a store directory; pass a directory (or a new path)",
                param=param,
            )
    return store


def _versions_in_chain(store: Store, **named: int | None) -> None:
    """Every named version (None: not given) is committed in the chain's range."""
    from dcr_format.chain.chain import Chain

    versions = Chain(store).versions()
    for option, version in named.items():
        if version is None:
            continue
        if not versions:
            raise VersionNotFoundError(f"{store.url} has no committed version; publish first")
        if not versions[0] <= version <= versions[-1]:
            raise VersionNotFoundError(
                f"{option} {version}: the chain of {store.url} holds versions "
                f"{versions[0]}..{versions[-1]}; pick one of those (`dcr log` lists them)"
            )


def STORE_OPTION(command: F) -> F:
    """``--store`` (env DCR_STORE) plus ``--endpoint-url``: a store the command reads."""
    command = click.option(
        "--store",
        envvar="DCR_STORE",
        required=True,
        callback=_open_store,
        help="Store URL or path (env DCR_STORE): ./refit-store, file:///..., memory://..., "
        "s3://bucket/prefix",
    )(command)
    return click.option(
        "--endpoint-url",
        envvar="AWS_ENDPOINT_URL",
        is_eager=True,
        expose_value=False,
        callback=_remember,
        help="S3 endpoint (default: the AWS environment and config, AWS_ENDPOINT_URL, which "
        "other stores ignore).",
    )(command)


def WRITER_STORE_OPTION(command: F) -> F:
    """:func:`STORE_OPTION` plus ``--single-writer``: a store the command writes."""
    return click.option(
        "--single-writer",
        is_flag=True,
        is_eager=True,
        expose_value=False,
        callback=_remember,
        help="Write to a server that ignores conditional writes: only one writer may run.",
    )(STORE_OPTION(command))


def _version_option(*names: str, help: str, required: bool = False) -> Callable[[F], F]:
    """An option naming a version of the chain (None: not given)."""
    return click.option(*names, type=VERSION, default=None, required=required, help=help)


def _default_cache() -> Path:
    base = os.environ.get("DCR_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dcr"
    )
    return Path(base)


def _progress(iterable: Iterable[Any], *, total: int | None, desc: str) -> Iterable[Any]:
    """A progress bar on a terminal, nothing otherwise."""
    from tqdm import tqdm

    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit="tensor",
        disable=not sys.stderr.isatty(),
        leave=False,
    )


def _emit(
    fmt: str, data: BaseModel | list[BaseModel] | dict[str, Any], human: Callable[[], None]
) -> None:
    from pydantic import BaseModel

    if fmt == "json":
        if isinstance(data, list):
            click.echo(json.dumps([d.model_dump(mode="json") for d in data], indent=2))
        elif isinstance(data, BaseModel):
            click.echo(data.model_dump_json(indent=2))
        else:
            click.echo(json.dumps(data, indent=2))
    else:
        human()


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        click.echo(
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _debug() -> bool:
    return os.environ.get("DCR_DEBUG", "") not in ("", "0")


_LAZY_COMMANDS = {"bench": "bench", "project": "project"}
"""Commands defined in :mod:`dcr_format.cli.bench`, imported only when named (or listed)."""


class _Group(click.Group):
    """Every failure caused by the input is one line on stderr.

    Usage errors (a bad option or argument, caught by click before any work) exit
    with status 2 and name the ``--help`` to read; a ``DcrError`` exits with 1,
    and so does a ``ValueError``, ``TypeError`` or ``OSError`` that no check caught.
    Any other exception is a bug and keeps its traceback; ``DCR_DEBUG=1`` shows
    the traceback of every error.
    """

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        call = dict(args=args, prog_name=prog_name, complete_var=complete_var, **extra)
        if not standalone_mode:
            return super().main(standalone_mode=False, **call)
        try:
            code = super().main(standalone_mode=False, **call)
        except click.exceptions.NoArgsIsHelpError as exc:
            exc.show()  # `dcr` alone: the help text, as click prints it
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "dcr"
            click.echo(
                f"dcr: error: {one_line(exc.format_message())} (see '{where} --help')", err=True
            )
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            click.echo(f"dcr: error: {one_line(exc.format_message())}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("dcr: interrupted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *_LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        name = _LAZY_COMMANDS.get(cmd_name)
        if name is not None and cmd_name not in self.commands:
            from dcr_format.cli import bench as cli_bench

            self.add_command(getattr(cli_bench, name), cmd_name)
        return super().get_command(ctx, cmd_name)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort, BrokenPipeError):
            raise
        except DcrError as exc:
            if _debug():
                raise
            click.echo(f"dcr: error: {one_line(exc)}", err=True)
            sys.exit(1)
        except (ValueError, TypeError, OSError) as exc:
            if _debug():
                raise
            text = one_line(exc) or type(exc).__name__
            click.echo(
                f"dcr: error: {text}; check the arguments (DCR_DEBUG=1 shows where it failed)",
                err=True,
            )
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("dcr: interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Group, name="dcr", context_settings=SHOW_DEFAULTS)
@click.version_option(package_name="dcr-format")
def cli() -> None:
    """Bit-exact delta refit of model weights through object storage."""


@cli.command()
@click.argument("ckpt_dir", type=click.Path(exists=True, file_okay=False))
@WRITER_STORE_OPTION
@click.option("--step", type=int, default=None, help="Trainer step recorded in the commit.")
@click.option(
    "--base-every",
    type=click.IntRange(min=1),
    default=None,
    help="Write a full base every K versions.",
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
@FORMAT_OPTION
def publish(
    ckpt_dir: str,
    store: Store,
    step: int | None,
    base_every: int | None,
    cache_dir: str | None,
    allow_empty: bool,
    fmt: str,
) -> None:
    """Publish a Hugging Face checkpoint directory as the chain's next version.

    The tensors of its safetensors files, and its small files (config, generation config,
    tokenizer files, chat template: each file directly in the directory of at most 64 MiB,
    weights in other formats aside), sent only where they changed. A checkpoint equal to the
    newest version, bit for bit and file for file, commits nothing (exit status 0) unless
    --allow-empty is given.
    """
    from dcr_format.errors import UnchangedVersionError
    from dcr_format.publish._files import directory_files
    from dcr_format.publish.checkpoint import count_tensors, iter_checkpoint
    from dcr_format.publish.writer import DeltaWriter

    # a file safetensors cannot read is a TargetError (checkpoint.py), here at its header
    total = count_tensors(ckpt_dir)
    files, left_out = directory_files(ckpt_dir)
    for line in left_out:
        click.echo(f"not sent: {line}", err=True)
    writer = DeltaWriter(store, base_every=base_every, cache_dir=cache_dir or _default_cache())
    try:
        info = writer.publish(
            _progress(iter_checkpoint(ckpt_dir), total=total, desc="publish"),
            step=step,
            files=files,
            allow_empty=allow_empty,
        )
    except UnchangedVersionError:
        from dcr_format.chain.chain import Chain

        latest = Chain(store).latest()
        _emit(
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
            f"{_bytes(info.payload_bytes)} of {_bytes(info.dense_bytes)} dense "
            f"({info.ratio:.2%})"
        )

    _emit(fmt, info, human)


@cli.command()
@STORE_OPTION
@directory_option("--into", required=True, help="Checkpoint directory to keep.")
@_version_option("--version", "version", help="Target version (default newest).")
@click.option(
    "--wait",
    "wait",
    type=click.FloatRange(min=0),
    default=300.0,
    help="Seconds to wait while another sync holds the directory (0: refuse at once).",
)
@FORMAT_OPTION
def pull(store: Store, into: str, version: int | None, wait: float, fmt: str) -> None:
    """Bring a Hugging Face checkpoint directory to a version of the chain."""
    from dcr_format.sync.reader import DeltaReader
    from dcr_format.targets.directory import SafetensorsDirTarget

    result = DeltaReader(store, SafetensorsDirTarget(into, timeout=wait)).sync(to=version)

    def human() -> None:
        if not result.applied_versions:
            click.echo(f"{into} is already at version {result.version}")
        else:
            click.echo(
                f"{into} is at version {result.version} (applied "
                f"{len(result.applied_versions)} versions, {_bytes(result.payload_bytes)} fetched)"
            )

    _emit(fmt, result, human)


def _duration(ctx: click.Context, param: click.Parameter, value: str) -> timedelta:
    from dcr_format.tools._common import parse_duration

    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _version_range(first: int | None, last: int | None) -> str:
    return "-" if first is None else f"{first}..{last}"


def _gc_item(item: Any) -> str:
    return {
        "version": f"the commit record of version {item.version}",
        "attempt": f"attempt {item.attempt} of version {item.version}",
        "base": f"the alternative base record of version {item.version}",
        "base-attempt": f"compaction {item.attempt} of version {item.version}",
    }[item.kind]


_GC_SHOWN = 50
_GC_WHAT = {
    "version": "commit record",
    "attempt": "attempt",
    "base": "base record",
    "base-attempt": "compaction",
}


def _gc_age(item: Any) -> str:
    return "unknown" if item.age_seconds is None else f"{item.age_seconds:.0f} s"


def _gc_plan_table(report: Any) -> None:
    """The plan of a dry run: one row per deletion (the first 50) and per kept attempt."""
    marked = [("delete", i) for i in report.deleted[:_GC_SHOWN]]
    marked += [("keep", i) for i in report.kept]
    if not marked:
        click.echo("nothing to delete")
        return
    rows: list[tuple[str, ...]] = [
        ("action", "what", "version", "attempt", "reason", "objects", "bytes", "age")
    ]
    rows += [
        (action, _GC_WHAT[i.kind], str(i.version), i.attempt or "-", i.reason, str(i.objects),
         _bytes(i.bytes), _gc_age(i))
        for action, i in marked
    ]  # fmt: skip
    for column in (1, 3, 4):  # text columns read left-aligned (_table right-aligns the rest)
        width = max(len(row[column]) for row in rows)
        rows = [(*r[:column], r[column].ljust(width), *r[column + 1 :]) for r in rows]
    _table(rows[0], rows[1:])


def _gc_lines(report: Any) -> None:
    """What a gc run deleted (the first 50) and the attempts it kept, one line each."""
    for item in report.deleted[:_GC_SHOWN]:
        click.echo(
            f"deleted {_gc_item(item)}: {item.objects} objects, {_bytes(item.bytes)} "
            f"({item.reason})"
        )
    for item in report.kept:
        age = "unknown age" if item.age_seconds is None else f"{_gc_age(item)} old"
        click.echo(f"kept {_gc_item(item)}: {age} ({item.reason})")


def _gc_notes(report: Any) -> None:
    """Lines below the listing: what was left out, temporary files, the clock, the totals."""
    verb = "would delete" if report.dry_run else "deleted"
    if len(report.deleted) > _GC_SHOWN:
        click.echo(f"... and {len(report.deleted) - _GC_SHOWN} more (--format json lists all)")
    if report.temp_files:
        click.echo(f"{verb} {len(report.temp_files)} temporary files of crashed writes")
    skew = report.clock_skew_seconds
    if skew is not None and abs(skew) >= 60:
        side = "ahead of" if skew > 0 else "behind"
        click.echo(
            f"note: this machine's clock is {abs(skew):.0f} s {side} the store's; "
            "ages were measured on the store's clock"
        )
    elif report.clock == "newest-object":
        click.echo(
            "note: could not write the clock probe: ages were measured against the newest "
            "object in the store, so younger orphans wait for a later gc"
        )
    click.echo(
        f"{verb} {report.deleted_objects} objects, {_bytes(report.deleted_bytes)}; the chain "
        f"keeps versions {_version_range(report.oldest_kept, report.latest)}"
    )


@cli.command(name="log")
@STORE_OPTION
@click.option(
    "--limit", type=click.IntRange(min=1), default=None, help="Show only the newest N versions."
)
@_version_option("--since", help="Show versions from N on.")
@FORMAT_OPTION
def log_cmd(store: Store, limit: int | None, since: int | None, fmt: str) -> None:
    """One row per committed version (kind "delta+base": compacted, it has an alternative base)."""
    from dcr_format.tools import log

    rows = log(store, limit=limit, since=since)

    def human() -> None:
        _table(
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
                    _bytes(r.payload_bytes),
                    _bytes(r.dense_bytes),
                    f"{r.ratio:.2%}",
                    r.writer_ranks,
                ]
                for r in rows
            ],
        )

    _emit(fmt, list(rows), human)


@cli.command()
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
    from dcr_format.tools import show as show_version

    detail = show_version(store, version, sort=sort_key, top=top)

    def human() -> None:
        v = detail.version
        click.echo(
            f"version {v.version} ({v.kind}{'+base' if v.compacted else ''}), parent {v.parent}, "
            f"step {v.step}, created {v.created}"
        )
        click.echo(
            f"state {detail.state_fingerprint}  attempt {detail.attempt}  ranks {v.writer_ranks}"
        )
        click.echo(
            f"changed {v.changed_elements} of {v.total_elements} ({v.change_rate:.3%}); "
            f"payload {_bytes(v.payload_bytes)} of {_bytes(v.dense_bytes)} ({v.ratio:.2%})"
        )
        click.echo(f"features {', '.join(detail.required_features) or 'none'}")
        _table(
            ["tensor", "dtype", "shape", "op", "changed", "bytes", "share", "coding"],
            [
                [
                    r.name,
                    r.dtype,
                    "x".join(map(str, r.shape)) or "()",
                    r.op,
                    r.changed,
                    _bytes(r.encoded_bytes),
                    f"{r.share:.1%}",
                    f"{r.positions_coding or '-'}/{r.values_coding or '-'}",
                ]
                for r in detail.tensors
            ],
        )

    _emit(fmt, detail, human)


@cli.command()
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
        _table(
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

    _emit(fmt, report, human)


@cli.command()
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
    from dcr_format.tools import replay as replay_version

    cache = None if no_cache else (cache_dir or _default_cache())
    result = replay_version(store, version, out, cache_dir=cache, progress=True)

    def human() -> None:
        if not result.applied_versions:
            how = f"already there (from the {result.source})"
        else:
            how = (
                f"{len(result.applied_versions)} versions applied from the {result.source} at "
                f"version {result.start_version}, {_bytes(result.payload_bytes)} fetched"
            )
        click.echo(f"{out} holds version {result.version}, verified: {how}")

    _emit(fmt, result, human)


@cli.command()
@STORE_OPTION
@_version_option("--from", "start", help="First version to check.")
@_version_option("--to", "end", help="Last version to check.")
@click.option(
    "--deep",
    is_flag=True,
    help="Also replay every version from the newest base at or before --from and check "
    "every tensor's fingerprint.",
)
@FORMAT_OPTION
def verify(store: Store, start: int | None, end: int | None, deep: bool, fmt: str) -> None:
    """Check every object of the chain (exit status 1 if anything is broken)."""
    from dcr_format.tools import verify as verify_chain

    if start is not None and end is not None and start > end:
        raise click.BadParameter(
            f"--from {start} is after --to {end}; pass the older version to --from",
            param_hint="'--from'",
        )
    _versions_in_chain(store, **{"--from": start, "--to": end})
    report = verify_chain(store, start=start, end=end, deep=deep, progress=True)

    def human() -> None:
        for p in report.problems:
            click.echo(f"version {p.version}: {p.key}: {p.error}: {p.message}")
        span = _version_range(report.first_version, report.last_version)
        checked = (
            f"{report.versions_checked} versions ({span}), "
            f"{report.objects_checked} objects, {report.bases_checked} alternative bases"
        )
        if deep:
            checked += f", {report.replayed_versions} versions replayed"
        if report.ok:
            click.echo(f"ok: {checked}")
        else:
            click.echo(
                f"broken: {len(report.problems)} problems, first at version "
                f"{report.first_broken_version}; checked {checked}"
            )

    _emit(fmt, report, human)
    if not report.ok:
        sys.exit(1)


@cli.command()
@WRITER_STORE_OPTION
@_version_option("--at", "at", required=True, help="The version to write a base of.")
@click.option(
    "--shard-mb",
    type=click.IntRange(min=1),
    default=32,
    help="Shard size limit before compression.",
)
@FORMAT_OPTION
def compact(store: Store, at: int, shard_mb: int, fmt: str) -> None:
    """Write an alternative base of a version: late joiners start there (spec §14)."""
    from dcr_format.tools import compact as compact_version

    result = compact_version(store, at, shard_bytes=shard_mb << 20, progress=True)

    def human() -> None:
        if result.created:
            click.echo(
                f"wrote {result.key}: {result.tensors} tensors, {_bytes(result.payload_bytes)} "
                f"({_bytes(result.dense_bytes)} dense), from {len(result.replayed_versions)} "
                "versions replayed"
            )
        else:
            click.echo(f"nothing to do: {result.reason} ({result.key})")

    _emit(fmt, result, human)


@cli.command()
@WRITER_STORE_OPTION
@click.option(
    "--keep-last",
    type=click.IntRange(min=1),
    required=True,
    help="Keep the newest K versions (and the base they start from).",
)
@click.option(
    "--keep-bases",
    type=click.IntRange(min=0),
    default=0,
    help="Also keep B older bases (and the versions after them) for late replays.",
)
@click.option(
    "--grace",
    default="1h",
    callback=_duration,
    help="Delete uncommitted attempts only when their newest object is older (30s, 15m, 2h, "
    "7d); at least the writers' commit timeout, better well above it.",
)
@click.option(
    "--commit-timeout",
    default="10m",
    callback=_duration,
    help="The longest commit timeout of the chain's writers (DeltaWriter's commit_timeout); "
    "a shorter --grace is refused. 0 when no writer is running.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the plan (what would be deleted and kept, and why) and delete nothing.",
)
@FORMAT_OPTION
def gc(
    store: Store,
    keep_last: int,
    keep_bases: int,
    grace: timedelta,
    commit_timeout: timedelta,
    dry_run: bool,
    fmt: str,
) -> None:
    """Delete uncommitted attempts and the versions before the kept range."""
    from dcr_format.tools import gc as collect

    report = collect(
        store,
        keep_last=keep_last,
        keep_bases=keep_bases,
        grace=grace,
        dry_run=dry_run,
        commit_timeout=commit_timeout,
    )

    def human() -> None:
        (_gc_plan_table if dry_run else _gc_lines)(report)
        _gc_notes(report)

    _emit(fmt, report, human)


@cli.command()
@WRITER_STORE_OPTION
@click.option(
    "--large-mb",
    type=click.IntRange(min=0),
    default=None,
    help="Size of the large-put probe (default: 129 MiB on S3, past multipart; 8 MiB "
    "elsewhere; 0 skips it).",
)
@FORMAT_OPTION
def doctor(store: Store, large_mb: int | None, fmt: str) -> None:
    """Probe the store's capabilities and say which uses are safe (exit 1 if a probe failed)."""
    from dcr_format.tools import doctor as probe

    report = probe(store, large_bytes=None if large_mb is None else large_mb << 20)

    def human() -> None:
        click.echo(
            f"store {report.store}" + (f", chain {report.chain_id}" if report.chain_id else "")
        )
        marks = {True: "ok", False: "NO", None: "--"}
        for check in report.checks:
            click.echo(f"  {marks[check.ok]:>2}  {check.name}: {check.detail}")
        for verdict in report.verdicts:
            click.echo(f"{verdict.use}: {'safe' if verdict.safe else 'unsafe'} ({verdict.reason})")

    _emit(fmt, report, human)
    if not report.ok:
        sys.exit(1)


@cli.command()
@STORE_OPTION
@output_option("--out", required=True, help="PNG file to write.")
@_version_option("--since", help="Plot versions from N on.")
@click.option(
    "--limit", type=click.IntRange(min=1), default=None, help="Plot only the newest N versions."
)
@click.option("--dpi", type=click.IntRange(min=10), default=100)
@FORMAT_OPTION
def plot(store: Store, out: str, since: int | None, limit: int | None, dpi: int, fmt: str) -> None:
    """Bytes and change rate per version, and change rate by layer (needs matplotlib)."""
    from dcr_format.tools import plot as draw

    _versions_in_chain(store, **{"--since": since})
    data = draw(store, out, since=since, limit=limit, dpi=dpi)
    _emit(
        fmt,
        data,
        lambda: click.echo(
            f"wrote {out}: {len(data.versions)} versions, {len(data.rows)} heat map rows"
        ),
    )


@cli.command()
@click.option(
    "--store",
    envvar="DCR_STORE",
    default=None,
    help="Store to publish into (default: a new temporary directory).",
)
@click.option("--steps", type=click.IntRange(min=1), default=10, help="Training steps.")
@click.option(
    "--size",
    type=click.Choice(["tiny", "small", "medium"]),
    default="small",
    help="Model size.",
)
@click.option(
    "--lr",
    type=click.FloatRange(min=0, min_open=True),
    callback=finite,
    default=None,
    help="AdamW learning rate (default: RL-like).",
)
@FORMAT_OPTION
def demo(store: str | None, steps: int, size: str, lr: float | None, fmt: str) -> None:
    """Train a small transformer, publish every step, pull each into a reader copy, check bits.

    Without --store the demo publishes into a temporary directory and removes it at the end.
    """
    from dcr_format.cli.demo import run_demo
    from dcr_format.tools._progress import Progress

    headers = ["version", "change", "delta", "dense", "ratio", "publish", "pull", "apply"]
    widths = [7, 8, 9, 9, 7, 7, 7, 7, 8]

    def line(cells: Sequence[str]) -> None:
        click.echo(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            )
        )

    bar = Progress("demo", total=steps + 1, unit="versions published and pulled")

    def on_row(r: Any) -> None:
        bar.add()
        if fmt != "human":
            return
        line(
            [
                str(r.version),
                f"{r.change_rate:.3%}",
                _bytes(r.delta_bytes),
                _bytes(r.dense_bytes),
                f"{r.ratio:.2%}",
                f"{r.publish_s:.2f}s",
                f"{r.pull_s:.2f}s",
                f"{r.apply_s:.2f}s",
                "yes" if r.verified else "NO",
            ]
        )

    temporary = None if store is not None else tempfile.mkdtemp(prefix="dcr-demo-")
    if fmt == "human":
        where = store if temporary is None else "a temporary directory (removed at the end)"
        click.echo(f"store: {where}")
        line([*headers, "verified"])
    if not sys.stderr.isatty():
        click.echo(f"dcr demo: training a {size} model for {steps} steps", err=True)
    try:
        with bar:
            rows = run_demo(
                store or os.path.join(str(temporary), "store"),
                steps=steps,
                size=size,
                lr=lr,
                on_row=on_row,
            )
    finally:
        if temporary is not None:
            import shutil

            shutil.rmtree(temporary, ignore_errors=True)
    if fmt != "human":
        _emit(fmt, list(rows), lambda: None)
    if not all(r.verified for r in rows):
        sys.exit(1)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="dcr")
