"""Commands that show what dcr does without a store of one's own: ``dcr project`` (refit
time at scale from measured costs) and ``dcr demo`` (a small model trained and refit).

Each command imports what it needs when it runs: listing the commands stays quick.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import click

from dcr_format.cli.main import command_imports
from dcr_format.cli.output import count, emit, human_bytes
from dcr_format.cli.params import FORMAT_OPTION, SHOW_DEFAULTS, F, finite
from dcr_format.cli.projection import (
    Scenario,
    format_projection,
    parse_count,
    parse_rate,
    projection_report,
)

_COUNT = click.IntRange(min=1)  # of nodes, processes, members
_POSITIVE = click.FloatRange(min=0, min_open=True)
_CLUSTER: tuple[tuple[str, click.ParamType[Any, Any], str], ...] = (
    ("rollout_nodes", _COUNT, "Rollout nodes that each receive every version."),
    ("link_gbps", _POSITIVE, "Network limit of every node into its cluster, each direction."),
    (
        "fabric_gbps",
        click.FloatRange(min=0),
        "Link of a rollout node inside the cluster: relay hops (0: the measured hop).",
    ),
    ("trainer_nodes", _COUNT, "Nodes that publish, each its share."),
    ("workers", _COUNT, "Processes per node encoding or applying a share each (one per GPU)."),
    ("store_gbps", click.FloatRange(min=0), "Aggregate object store bandwidth (0: no limit)."),
    ("group_size", _COUNT, "Rollout nodes per relay group (one of them reads the store)."),
    ("fanout", _COUNT, "Members each relay member forwards to (2: a binary tree)."),
    ("bytes_per_param", _POSITIVE, "Bytes of one parameter in the dense checkpoint (2: bf16)."),
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


@click.command(context_settings=SHOW_DEFAULTS)
@click.option("--params", required=True, help="Model parameters: 1T, 120B, 7e9, ...")
@click.option("--change", default="3%", help="Change rate per step.")
@_cluster_options
@click.option(
    "--costs",
    "costs_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Costs file measured by the benchmark suite of a source checkout "
    "(default: the costs shipped with dcr-format).",
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
    from dcr_format.cli.costs import WRITTEN_BY, Costs, shipped_costs

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
        costs = shipped_costs()
    else:
        try:
            costs = Costs.load(costs_file)
        except ValueError as exc:
            raise click.BadParameter(
                f"{costs_file} is not a costs file ({exc}); write one with `{WRITTEN_BY}` "
                "in a source checkout",
                param_hint="'--costs'",
            ) from None
    report = projection_report(scenario, costs)
    if fmt == "json":
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(format_projection(report))


@click.command()
@click.option(
    "--store",
    default=None,
    help="A new store to publish into (default: a new temporary directory; DCR_STORE, "
    "the store of real work, is not used).",
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
    with command_imports():
        from dcr_format.cli.demo import run_demo
        from dcr_format.tools._progress import Progress

    if store is not None:
        _refuse_a_chain(store)

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
                human_bytes(r.delta_bytes),
                human_bytes(r.dense_bytes),
                f"{r.ratio:.2%}",
                f"{r.publish_s:.2f}s",
                f"{r.pull_s:.2f}s",
                f"{r.apply_s * 1000:.1f}ms",
                "yes" if r.verified else "NO",
            ]
        )

    temporary = None if store is not None else tempfile.mkdtemp(prefix="dcr-demo-")
    if fmt == "human":
        where = store if temporary is None else "a temporary directory (removed at the end)"
        click.echo(f"store: {where}")
        line([*headers, "verified"])
    if not sys.stderr.isatty():
        click.echo(f"dcr demo: training a {size} model for {count(steps, 'step')}", err=True)
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
        emit(fmt, list(rows), lambda: None)
    if not all(r.verified for r in rows):
        sys.exit(1)


def _refuse_a_chain(store: str) -> None:
    """The demo publishes a model of its own: never into a chain that holds versions."""
    from dcr_format.chain.chain import Chain
    from dcr_format.errors import StoreNotInitializedError
    from dcr_format.store.store import open_store

    try:
        held = Chain(open_store(store)).versions()
    except StoreNotInitializedError:
        return
    if held:
        raise click.BadParameter(
            f"{store} already holds a chain (versions {held[0]}..{held[-1]}), which the demo's "
            "model would replace; pass a new or empty store, or leave out --store",
            param_hint="'--store'",
        )


COMMANDS = (project, demo)
"""The commands this module adds to ``dcr``."""
