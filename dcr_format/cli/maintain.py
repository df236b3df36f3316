"""Operator tools: ``dcr verify``, ``compact``, ``gc``, ``doctor`` and ``readers``.

Each command imports what it needs when it runs: listing the commands stays quick.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import click

from dcr_format.cli.main import command_imports
from dcr_format.cli.output import count, emit, human_bytes, table
from dcr_format.cli.params import (
    FORMAT_OPTION,
    STORE_OPTION,
    WRITER_STORE_OPTION,
    version_option,
    versions_in_chain,
)

if TYPE_CHECKING:
    from dcr_format.store.store import Store


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
         human_bytes(i.bytes), _gc_age(i))
        for action, i in marked
    ]  # fmt: skip
    for column in (1, 3, 4):  # text columns read left-aligned (table right-aligns the rest)
        width = max(len(row[column]) for row in rows)
        rows = [(*r[:column], r[column].ljust(width), *r[column + 1 :]) for r in rows]
    table(rows[0], rows[1:])


def _gc_lines(report: Any) -> None:
    """What a gc run deleted (the first 50) and the attempts it kept, one line each."""
    for item in report.deleted[:_GC_SHOWN]:
        click.echo(
            f"deleted {_gc_item(item)}: {count(item.objects, 'object')}, {human_bytes(item.bytes)} "
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
        f"{verb} {count(report.deleted_objects, 'object')}, {human_bytes(report.deleted_bytes)}; "
        f"the chain keeps versions {_version_range(report.oldest_kept, report.latest)}"
    )


@click.command()
@STORE_OPTION
@version_option("--from", "start", help="First version to check.")
@version_option("--to", "end", help="Last version to check.")
@click.option(
    "--deep",
    is_flag=True,
    help="Also replay every version from the newest base at or before --from and check "
    "every tensor's fingerprint.",
)
@FORMAT_OPTION
def verify(store: Store, start: int | None, end: int | None, deep: bool, fmt: str) -> None:
    """Check every object of the chain (exit status 1 if anything is broken)."""
    with command_imports():
        from dcr_format.tools import verify as verify_chain

    if start is not None and end is not None and start > end:
        raise click.BadParameter(
            f"--from {start} is after --to {end}; pass the older version to --from",
            param_hint="'--from'",
        )
    versions_in_chain(store, **{"--from": start, "--to": end})
    report = verify_chain(store, start=start, end=end, deep=deep, progress=True)

    def human() -> None:
        for p in report.problems:
            click.echo(f"version {p.version}: {p.key}: {p.error}: {p.message}")
        span = _version_range(report.first_version, report.last_version)
        checked = (
            f"{count(report.versions_checked, 'version')} ({span}), "
            f"{count(report.objects_checked, 'object')}, "
            f"{count(report.bases_checked, 'alternative base')}"
        )
        if deep:
            checked += f", {count(report.replayed_versions, 'version')} replayed"
        if report.ok:
            click.echo(f"ok: {checked}")
        else:
            click.echo(
                f"broken: {count(len(report.problems), 'problem')}, first at version "
                f"{report.first_broken_version}; checked {checked}"
            )

    emit(fmt, report, human)
    if not report.ok:
        sys.exit(1)


@click.command()
@WRITER_STORE_OPTION
@version_option("--at", "at", required=True, help="The version to write a base of.")
@click.option(
    "--shard-mb",
    type=click.IntRange(min=1),
    default=32,
    help="Shard size limit before compression.",
)
@FORMAT_OPTION
def compact(store: Store, at: int, shard_mb: int, fmt: str) -> None:
    """Write an alternative base of a version: late joiners start there (spec §14)."""
    with command_imports():
        from dcr_format.tools import compact as compact_version

    result = compact_version(store, at, shard_bytes=shard_mb << 20, progress=True)

    def human() -> None:
        if result.created:
            click.echo(
                f"wrote {result.key}: {result.tensors} tensors, "
                f"{human_bytes(result.payload_bytes)} "
                f"({human_bytes(result.dense_bytes)} dense), from {len(result.replayed_versions)} "
                "versions replayed"
            )
        else:
            click.echo(f"nothing to do: {result.reason} ({result.key})")

    emit(fmt, result, human)


@click.command()
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
    with command_imports():
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

    emit(fmt, report, human)


@click.command()
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
    with command_imports():
        from dcr_format.tools import doctor as probe

    report = probe(store, large_bytes=None if large_mb is None else large_mb << 20)

    def human() -> None:
        click.echo(
            f"store {report.store}" + (f", chain {report.chain_id}" if report.chain_id else "")
        )
        marks = {True: "ok", False: "NO", None: "--"}
        for check in report.checks:
            click.echo(f"  {marks[check.ok]:>2}  {check.name}: {check.detail}")
        said = {True: "safe", False: "unsafe", None: "not known"}
        for verdict in report.verdicts:
            click.echo(f"{verdict.use}: {said[verdict.safe]} ({verdict.reason})")

    emit(fmt, report, human)
    if not report.ok:
        sys.exit(1)


def _optional_duration(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> timedelta | None:
    return None if value is None else _duration(ctx, param, value)


def _age(seconds: float | None) -> str:
    """``90`` -> ``1m``, ``7200`` -> ``2h``, ``259200`` -> ``3d``; ``-`` where unknown."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if abs(seconds) >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _readers_table(report: Any) -> None:
    """One row per reader: what its record asks of writers, and when it was written."""
    if not report.readers:
        click.echo(f"no reader records in {report.store}")
        return
    rows: list[tuple[str, ...]] = [
        ("reader", "records", "written", "age", "overwrite", "old bits", "features", "writers")
    ]
    for r in report.readers:
        written = "-" if r.written is None else r.written.strftime("%Y-%m-%d %H:%M:%S")
        old = {
            "listed": f"{r.baseline_names} listed",
            "all-but": f"all but {r.baseline_names}",
        }.get(r.reads_old_bits, r.reads_old_bits)
        if r.reads_changed:  # the others' at their changed elements
            old += ", changed of the rest"
        features = "lacks " + ",".join(r.lacks) if r.lacks else "every"
        rows.append(
            (r.reader_id, str(len(r.keys)), written, _age(r.age_seconds), str(r.overwrite), old,
             features, "skip" if r.problem else "honour")
        )  # fmt: skip
    for column in (5, 6):  # text columns read left-aligned (table right-aligns the rest)
        width = max(len(row[column]) for row in rows)
        rows = [(*r[:column], r[column].ljust(width), *r[column + 1 :]) for r in rows]
    table(rows[0], rows[1:])
    live = sum(r.live for r in report.readers)
    click.echo(
        f"{count(len(report.readers), 'reader')}, {live} written within the hour (live); "
        "times in UTC"
    )
    for r in report.readers:
        if r.problem:
            click.echo(f"writers skip {r.reader_id}: {r.problem}")


def _removed_lines(result: Any) -> None:
    """What was removed, and which of those readers are probably still running."""
    verb = "would remove" if result.dry_run else "removed"
    if not result.removed:
        click.echo("no reader record to remove")
    for r in result.removed:
        click.echo(
            f"{verb} reader {r.reader_id}: {', '.join(r.keys)} (written {_age(r.age_seconds)} ago)"
        )
    for reader_id in result.live:
        click.echo(
            f"note: {reader_id} wrote its record within the hour: that reader is live and "
            "writes its record again within the hour (at once if a version arrives in a coding "
            "it cannot take)"
        )


@click.command()
@STORE_OPTION
@click.option(
    "--remove",
    "remove",
    multiple=True,
    metavar="ID",
    help="Delete the record of this reader, with its parts (repeat for more).",
)
@click.option(
    "--remove-older-than",
    "older_than",
    default=None,
    callback=_optional_duration,
    metavar="DURATION",
    help="Delete the records not written for longer (12h, 7d): a syncing reader writes its "
    "record every hour.",
)
@click.option("--dry-run", is_flag=True, help="Print what would be removed and delete nothing.")
@FORMAT_OPTION
def readers(
    store: Store, remove: tuple[str, ...], older_than: timedelta | None, dry_run: bool, fmt: str
) -> None:
    """List the reader records writers honour; remove those of readers that are gone."""
    with command_imports():
        from dcr_format.tools import readers as list_readers
        from dcr_format.tools import remove_readers

    if not remove and older_than is None:
        if dry_run:
            raise click.UsageError("--dry-run applies to --remove and --remove-older-than")
        report = list_readers(store)
        emit(fmt, report, lambda: _readers_table(report))
        return
    result = remove_readers(store, remove, older_than=older_than, dry_run=dry_run)
    emit(fmt, result, lambda: _removed_lines(result))


COMMANDS = (verify, compact, gc, doctor, readers)
"""The commands this module adds to ``dcr``."""
