"""``dcr bench`` and ``dcr project``: the refit benchmark suite and the projection to scale.

Both are plain click commands; ``dcr_format.cli.main`` adds them to the ``dcr`` group.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from dcr_format.bench.projection import (
    Scenario,
    format_projection,
    parse_count,
    parse_rate,
    projection_report,
)
from dcr_format.cli.params import (
    FORMAT_OPTION,
    SHOW_DEFAULTS,
    F,
    directory_option,
    finite,
    output_option,
)


def _progress() -> Callable[[str], None]:
    started = time.perf_counter()

    def say(message: str) -> None:
        click.echo(f"[{time.perf_counter() - started:6.1f} s] {message}", err=True)

    return say


def _sizes(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> tuple[float, ...] | None:
    if value is None:
        return None
    sizes = []
    for item in value.split(","):
        text = item.strip().upper().removesuffix("B")
        scale = 1000.0 if text.endswith("G") else 1.0
        try:
            size = float(text.rstrip("MG")) * scale
        except ValueError:
            raise click.BadParameter(f"{item!r} is not a size like 100, 300MB or 1GB") from None
        if not math.isfinite(size) or size <= 0:
            raise click.BadParameter(f"{item!r}: sizes must be positive numbers like 100 or 1GB")
        sizes.append(size)
    return tuple(sizes)


def _rates(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> tuple[float, ...] | None:
    if value is None:
        return None
    try:
        return tuple(parse_rate(item) for item in value.split(","))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


_COUNT = click.IntRange(min=1)  # of nodes, processes, members
_POSITIVE = click.FloatRange(min=0, min_open=True)
_CLUSTER: tuple[tuple[str, click.ParamType[Any, Any], str | None], ...] = (
    ("rollout_nodes", _COUNT, None),
    ("link_gbps", _POSITIVE, "Network limit of every node into its cluster, each direction."),
    (
        "fabric_gbps",
        click.FloatRange(min=0),
        "Link of a rollout node inside the cluster: relay hops (0: the measured hop).",
    ),
    ("trainer_nodes", _COUNT, "Nodes that publish, each its share."),
    ("workers", _COUNT, "Processes per node encoding or applying a share each (one per GPU)."),
    ("store_gbps", click.FloatRange(min=0), "Aggregate object store bandwidth (0: no limit)."),
    ("group_size", _COUNT, None),
    ("fanout", _COUNT, None),
    ("bytes_per_param", _POSITIVE, None),
)
"""``dcr project``'s options for the cluster, in ``--help`` order: (:class:`Scenario` field,
type, help)."""


def _cluster_options(command: F) -> F:
    """An option per :data:`_CLUSTER` entry, named and defaulted as its Scenario field (a
    float is also refused when not finite)."""
    defaults = {f.name: f.default for f in dataclasses.fields(Scenario)}
    for field, kind, text in reversed(_CLUSTER):  # the last decorator applied is listed first
        command = click.option(
            "--" + field.replace("_", "-"),
            field,
            type=kind,
            callback=finite if isinstance(kind, click.FloatRange) else None,
            default=defaults[field],
            help=text,
        )(command)
    return command


PLOT_NAME = "dcr-bench.png"


def plot_path(out: str | None, png: str | None) -> str:
    """Where ``dcr bench`` writes its plot: ``png`` if given, else ``out/dcr-bench.png``
    (``out`` created if missing), else a file in a new temporary directory, never the
    working directory unless asked."""
    if png is not None:
        return png
    if out is None:
        return str(Path(tempfile.mkdtemp(prefix="dcr-bench-")) / PLOT_NAME)
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.BadParameter(
            f"cannot create directory {out} ({exc.strerror}); choose another --out",
            param_hint="'--out'",
        ) from None
    return str(Path(out) / PLOT_NAME)


@click.command(context_settings=SHOW_DEFAULTS)
@click.option(
    "--sizes",
    callback=_sizes,
    default=None,
    help="Model sizes in MB of bf16, comma-separated (default 100,300,1000; 1GB works too). "
    "Sizes that do not fit in free memory are skipped.",
)
@click.option(
    "--rates", callback=_rates, default=None, help="Change rates (default 0.5%,1%,3%,5%)."
)
@click.option("--members", type=click.IntRange(min=2), default=None, help="Relay members (8).")
@click.option(
    "--fanout-mb",
    type=click.FloatRange(min=0.1),
    callback=finite,
    default=None,
    help="Fan-out model MB (100).",
)
@click.option("--reps", type=click.IntRange(min=1), default=None, help="Timing repetitions (3).")
@click.option("--quick", is_flag=True, help="CI smoke run: an 8 MB model, about a minute.")
@click.option("--no-s3", is_flag=True, help="Skip the JuiceFS S3 gateway (local store only).")
@directory_option(
    "--out",
    help="Directory for the plot (dcr-bench.png); created if missing. "
    "Default: a new temporary directory, printed with the table.",
)
@output_option("--png", help="Write the plot to this file instead of OUT/dcr-bench.png.")
@output_option("--json-out", help="Also write the full result as JSON to this file.")
@output_option("--save-costs", help="Write the measured costs for `dcr project --costs`.")
@FORMAT_OPTION
def bench(
    sizes: tuple[float, ...] | None,
    rates: tuple[float, ...] | None,
    members: int | None,
    fanout_mb: float | None,
    reps: int | None,
    quick: bool,
    no_s3: bool,
    out: str | None,
    png: str | None,
    json_out: str | None,
    save_costs: str | None,
    fmt: str,
) -> None:
    """Refit benchmark: dense vs dcr over a local store and the JuiceFS S3 gateway, delta bytes
    vs the entropy bound, encode/apply vs torch.clone, relay fan-out vs independent readers.

    Prints one table and writes one PNG (under --out, or a new temporary directory); every
    ratio is measured in this run.
    """
    from dataclasses import replace

    from dcr_format.bench.suite import QUICK, SuiteOptions, format_table, plot, run_suite

    options = QUICK if quick else SuiteOptions()
    overrides = {
        "sizes_mb": sizes,
        "rates": rates,
        "members": members,
        "fanout_mb": fanout_mb,
        "reps": reps,
    }
    changes: dict[str, Any] = {k: v for k, v in overrides.items() if v}
    options = replace(options, s3=not no_s3, **changes)
    png = plot_path(out, png)
    result = run_suite(options, progress=_progress())
    plot(result, png)
    if save_costs is not None and result.costs is not None:
        Path(save_costs).write_text(result.costs.to_json())
    data = json.dumps({**result.to_dict(), "png": png}, indent=2)
    if json_out is not None:
        Path(json_out).write_text(data)
    if fmt == "json":
        click.echo(data)
    else:
        click.echo(format_table(result, png=png))
        if save_costs is not None:
            click.echo(f"costs: {save_costs}")
    if not all(r["bit_exact"] for r in result.refit) or not result.fanout.get("bit_exact", True):
        sys.exit(1)


@click.command(context_settings=SHOW_DEFAULTS)
@click.option("--params", required=True, help="Model parameters: 1T, 120B, 7e9, ...")
@click.option("--change", default="3%", help="Change rate per step.")
@_cluster_options
@click.option(
    "--costs",
    "costs_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Costs from `dcr bench --save-costs` (default: a short measurement now).",
)
@FORMAT_OPTION
def project(
    params: str,
    change: str,
    costs_file: str | None,
    fmt: str,
    **cluster: Any,
) -> None:
    """Project refit time (dense, dcr over S3, dcr relay tree) to a model and cluster size from
    measured costs, next to published reference points."""
    from dcr_format.bench.costs import Costs, quick_costs

    try:
        count = parse_count(params)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--params'") from None
    if not count > 0:
        raise click.BadParameter(
            f"{params!r} is no parameters; pass a model size like 1T, 120B or 7e9",
            param_hint="'--params'",
        )
    try:
        rate = parse_rate(change)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--change'") from None
    try:
        scenario = Scenario(params=count, change=rate, **cluster)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if costs_file is None:
        say = _progress()
        say("no --costs file: measuring costs on this machine (about half a minute)")
        costs = quick_costs(progress=say)
    else:
        try:
            costs = Costs.load(costs_file)
        except ValueError as exc:
            raise click.BadParameter(
                f"{costs_file} is not a costs file ({exc}); write one with "
                "`dcr bench --save-costs FILE`",
                param_hint="'--costs'",
            ) from None
    report = projection_report(scenario, costs)
    if fmt == "json":
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(format_projection(report))
