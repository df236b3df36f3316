"""The refit benchmark suite: one run, one table, one PNG.

    .venv/bin/python benchmarks/bench_suite.py [--quick] [--sizes 100,300,1000] [--png FILE]
        [--save-costs FILE]

Everything a ratio compares is measured in the same run on the same machine:

- end-to-end refit, dense against dcr (``refit_bench.py``), over a
  local store and over the JuiceFS S3 gateway on 127.0.0.1 (started here, disk
  backed, ``single_writer=True``), at each change rate and model size;
- stored delta bytes against the entropy bound of the same step
  (``codec_bounds.entropy_bound``);
- encode and decode+apply throughput against ``torch.clone`` of the same bytes
  (``codec_bench.measure_speed``);
- relay fan-out of N member processes against N independent readers
  (``bench_fanout.py``): store bytes and wall time;
- the per-byte and per-object costs the projection (``dcr project``) uses
  (``--save-costs FILE``; the package ships such a file as ``dcr_format/cli/costs.json``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click
from bench_costs import (
    derive_costs,
    machine,
    relay_costs,
    sha256_rate,
    store_costs,
)
from bench_gateway import juicefs_gateway, s3_available, worker_env
from refit_bench import RATES, SyntheticTrainer, lr_for, model_shapes, refit_series
from steady_bench import steady_series, summarise, sync_tails

from dcr_format.cli.costs import Costs
from dcr_format.cli.params import (
    FORMAT_OPTION,
    SHOW_DEFAULTS,
    directory_option,
    finite,
    output_option,
)
from dcr_format.cli.projection import parse_rate
from dcr_format.store.store import Store

RESULT_FORMAT = "dcr-bench-1"
DEFAULT_SIZES_MB = (100.0, 300.0, 1000.0)
FANOUT_RATE = 0.03
_BYTES_PER_MODEL_BYTE = 11  # peak resident bytes of a refit series per dense byte (measured)


@dataclass(frozen=True)
class SuiteOptions:
    """What the suite measures."""

    sizes_mb: tuple[float, ...] = DEFAULT_SIZES_MB
    rates: tuple[float, ...] = RATES
    members: int = 8
    fanout_mb: float = 100.0
    reps: int = 3
    s3: bool = True
    seed: int = 0
    chunk_bytes: int = 4 << 20
    quick: bool = False
    steady_steps: int = 5  # steady-state section: measured steps per rate (long-lived ends)


QUICK = SuiteOptions(sizes_mb=(8.0,), members=8, fanout_mb=4.0, reps=2, quick=True, steady_steps=2)


@dataclass
class SuiteResult:
    """Everything one run measured (``to_dict`` is the JSON ``--format json`` prints)."""

    options: SuiteOptions
    machine_start: dict[str, Any]
    machine_end: dict[str, Any] = field(default_factory=dict)
    refit: list[dict[str, Any]] = field(default_factory=list)
    steady: list[dict[str, Any]] = field(default_factory=list)  # medians per rate
    codec: list[dict[str, Any]] = field(default_factory=list)
    fanout: dict[str, Any] = field(default_factory=dict)
    costs: Costs | None = None
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": RESULT_FORMAT,
            "options": asdict(self.options),
            "machine_start": self.machine_start,
            "machine_end": self.machine_end,
            "refit": self.refit,
            "steady": self.steady,
            "codec": self.codec,
            "fanout": self.fanout,
            "costs": None if self.costs is None else self.costs.model_dump(mode="json"),
            "skipped": self.skipped,
            "seconds": self.seconds,
            "table": table_rows(self),
        }


# --- the run -----------------------------------------------------------------------------------


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _fits(size_mb: float) -> bool:
    available = _available_bytes()
    return available is None or size_mb * 1e6 * _BYTES_PER_MODEL_BYTE < 0.8 * available


def _labelled(progress: Callable[[str], None], size_mb: float) -> Callable[[str], None]:
    """``progress`` with the model size appended to every message."""

    def say(message: str) -> None:
        progress(f"{message} ({size_mb:g} MB)")

    return say


def _codec_rows(
    size_mb: float, rates: Sequence[float], *, reps: int, seed: int, progress: Callable[[str], None]
) -> list[dict[str, Any]]:
    from codec_bench import measure_speed

    trainer = SyntheticTrainer(model_shapes(size_mb), seed=seed)
    old = trainer.export()
    rows = []
    for rate in rates:
        trainer.step(lr_for(rate))
        new = trainer.export()
        progress(f"codec throughput: {rate:.1%} change")
        changed = sum(int((old[n].view(-1) != new[n].view(-1)).sum()) for n in new)
        total = sum(t.numel() for t in new.values())
        row: dict[str, Any] = {
            "target_rate": rate,
            "change_rate": changed / total,
            "dense_bytes": 2 * total,
        }
        row.update(measure_speed(old, new, reps=reps))
        rows.append(row)
        old = new
    return rows


def _fanout(
    store: Store,
    root: str,
    env: dict[str, str],
    options: SuiteOptions,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    from bench_fanout import relay_fanout

    from dcr_format.publish.writer import DeltaWriter

    trainer = SyntheticTrainer(model_shapes(options.fanout_mb), seed=options.seed + 1)
    writer = DeltaWriter(store)
    writer.publish(trainer.export(), step=0)
    trainer.step(lr_for(FANOUT_RATE))
    info = writer.publish(trainer.export(), step=1)
    del trainer, writer
    progress(f"relay fan-out: {options.members} processes")
    result = relay_fanout(root, env, members=options.members, chunk_bytes=options.chunk_bytes)
    result["dense_bytes"] = info.dense_bytes
    result["delta_bytes"] = info.payload_bytes
    result["change_rate"] = info.change_rate
    return result


def run_suite(
    options: SuiteOptions = SuiteOptions(),  # frozen
    *,
    progress: Callable[[str], None] = lambda message: None,
) -> SuiteResult:
    """Measure everything (see the module documentation); takes minutes at default sizes."""
    from dcr_format.publish.writer import DEFAULT_SHARD_BYTES
    from dcr_format.store.relay import DEFAULT_CHUNK_BYTES

    started = time.perf_counter()
    large = (8 if options.quick else 32) << 20  # the large object of the store and relay costs
    result = SuiteResult(options=options, machine_start=machine())
    sizes = []
    for size in options.sizes_mb:
        if _fits(size):
            sizes.append(size)
        else:
            result.skipped.append(f"{size:g} MB: more than this machine's free memory takes")
    if not sizes:
        raise ValueError("no model size fits in this machine's memory; pass smaller --sizes")
    no_s3 = s3_available() if options.s3 else "--no-s3"
    if no_s3 is not None:
        result.skipped.append(f"s3 (JuiceFS gateway): {no_s3}")
    with tempfile.TemporaryDirectory(prefix="dcr-bench-") as tmp:
        work = Path(tmp)
        for size in sizes:
            store = Store(work / f"local-{size:g}")
            result.refit += refit_series(
                store,
                model_shapes(size),
                options.rates,
                label="local",
                bound=True,
                seed=options.seed,
                progress=_labelled(progress, size),
            )
        steady_rows = steady_series(
            Store(work / "steady"),
            model_shapes(sizes[-1]),
            options.rates,
            steps=options.steady_steps,
            label="local",
            seed=options.seed,
            progress=lambda m: progress(f"{m} ({sizes[-1]:g} MB)"),
        )
        result.steady = summarise(steady_rows)
        tails = sync_tails(  # the part of a sync that cannot overlap its download
            model_shapes(sizes[-1]),
            options.rates,
            steps=options.steady_steps,
            progress=lambda m: progress(f"{m} ({sizes[-1]:g} MB)"),
        )
        result.codec = _codec_rows(
            sizes[0], options.rates, reps=options.reps, seed=options.seed, progress=progress
        )
        gateway_cm = juicefs_gateway(work) if no_s3 is None else contextlib.nullcontext()
        with gateway_cm as gateway:
            if gateway is not None:
                options_s3 = gateway.storage_options()
                for size in sizes:
                    with gateway.fresh_root() as root:
                        store = Store(root, storage_options=options_s3, single_writer=True)
                        result.refit += refit_series(
                            store,
                            model_shapes(size),
                            options.rates,
                            label="s3",
                            seed=options.seed,
                            progress=_labelled(progress, size),
                        )
                progress("store requests on the S3 gateway")
                with gateway.fresh_root() as root:
                    store = Store(root, storage_options=options_s3, single_writer=True)
                    measured = store_costs(store, large_bytes=large)
                with gateway.fresh_root() as root:
                    store = Store(root, storage_options=options_s3, single_writer=True)
                    result.fanout = _fanout(store, root, worker_env(gateway), options, progress)
                    result.fanout["store"] = "s3"
            else:
                store = Store(work / "fanout")
                measured = store_costs(store, large_bytes=large)
                result.fanout = _fanout(store, str(work / "fanout"), {}, options, progress)
                result.fanout["store"] = "local"
        progress("relay hop, sha256")
        # per-step costs from the long-lived writer and readers (medians), as RL runs them
        result.costs = derive_costs(
            [r for r in steady_rows if not r["warmup"]],
            source="dcr bench" + (" --quick" if options.quick else ""),
            store=measured,
            request_store="s3" if no_s3 is None else "local",
            relay=relay_costs(nbytes=large * 2, chunk_bytes=DEFAULT_CHUNK_BYTES),
            sha256_bytes_per_s=sha256_rate(large * 2),
            shard_bytes=DEFAULT_SHARD_BYTES,
            chunk_bytes=DEFAULT_CHUNK_BYTES,
            tails=tails,
        )
    result.machine_end = machine()
    result.seconds = time.perf_counter() - started
    return result


# --- the table ---------------------------------------------------------------------------------

TABLE_HEADERS = ("measure", "store", "model", "change", "baseline", "dcr", "ratio", "note")


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB" if n >= 10e6 else f"{n / 1e6:.2f} MB"


def _s(x: float) -> str:
    return f"{x:.2f} s" if x < 100 else f"{x:.0f} s"


def table_rows(result: SuiteResult) -> list[list[str]]:
    """The cells of the one table (header excluded), every ratio from this run."""
    rows: list[list[str]] = []
    for r in result.refit:
        rows.append(
            [
                "refit time",
                r["store"],
                _mb(r["dense_bytes"]),
                f"{r['change_rate']:.2%}",
                f"dense {_s(r['dense_s'])}",
                _s(r["dcr_s"]),
                f"{r['speedup']:.1f}x",
                "bit-exact" if r["bit_exact"] else "NOT EXACT",
            ]
        )
    for r in result.steady:
        for stage in ("publish", "prepare", "apply", "sync"):
            rows.append(
                [
                    f"steady {stage}",
                    r["store"],
                    _mb(r["dense_bytes"]),
                    f"{r['change_rate']:.2%}",
                    f"copy_ {_s(r['copy_s'])}",
                    _s(r[f"{stage}_s"]),
                    f"{r[f'{stage}_vs_copy']:.1f}x copy_",
                    f"median of {r['steps']} steps" + ("" if r["bit_exact"] else ", NOT EXACT"),
                ]
            )
    for r in result.refit:
        if r.get("bound_bytes"):
            rows.append(
                [
                    "delta bytes",
                    "-",
                    _mb(r["dense_bytes"]),
                    f"{r['change_rate']:.2%}",
                    f"bound {_mb(r['bound_bytes'])}",
                    _mb(r["delta_bytes"]),
                    f"{r['delta_vs_bound']:.3f}",
                    f"{r['delta_bytes'] / r['dense_bytes']:.2%} of dense",
                ]
            )
    for r in result.codec:
        for what, key, ratio in (
            ("encode", "encode_gbps", "encode_vs_clone"),
            ("apply", "decode_apply_gbps", "decode_apply_vs_clone"),
        ):
            rows.append(
                [
                    f"{what} speed",
                    "-",
                    _mb(r["dense_bytes"]),
                    f"{r['change_rate']:.2%}",
                    f"clone {r['clone_gbps']:.2f} GB/s",
                    f"{r[key]:.3f} GB/s",
                    f"{r[ratio]:.3f}",
                    "dense bytes per second",
                ]
            )
    fan = result.fanout
    if fan:
        members = fan["members"]
        for phase, label in (("base", "base"), ("delta", f"{fan['change_rate']:.1%} delta")):
            alone, relay = fan["phases"][f"independent_{phase}"], fan["phases"][f"relay_{phase}"]
            rows.append(
                [
                    "fan-out store bytes",
                    fan["store"],
                    _mb(fan["dense_bytes"]),
                    label,
                    f"{members} readers {_mb(alone['bytes'])}",
                    f"relay {_mb(relay['bytes'])}",
                    f"{alone['bytes'] / max(relay['bytes'], 1):.1f}x less",
                    f"{alone['requests']} vs {relay['requests']} GETs",
                ]
            )
            rows.append(
                [
                    "fan-out wall time",
                    fan["store"],
                    _mb(fan["dense_bytes"]),
                    label,
                    f"{members} readers {_s(alone['seconds'])}",
                    f"relay {_s(relay['seconds'])}",
                    f"{alone['seconds'] / relay['seconds']:.2f}x",
                    f"{members} processes" + ("" if fan["bit_exact"] else ", NOT EXACT"),
                ]
            )
    return rows


def format_table(result: SuiteResult, *, png: str | None = None) -> str:
    """The one table, with a line on the machine and a legend."""
    cells = [list(TABLE_HEADERS), *table_rows(result)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(TABLE_HEADERS))]
    start, end = result.machine_start, result.machine_end or result.machine_start
    lines = [
        f"dcr bench: {start['cpus']} CPUs, {start['torch_threads']} torch threads, load average "
        f"{start['load_average'][0]:.1f} at start and {end['load_average'][0]:.1f} at the end "
        f"(other work shares the machine when it is above the CPU count); {result.seconds:.0f} s",
        "",
    ]
    for index, row in enumerate(cells):
        lines.append(
            "  ".join(
                c.ljust(w) if i in (0, 1, 7) else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
        )
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += [
        "",
        "ratio: refit dense/dcr (higher: dcr faster); delta bytes stored/entropy bound "
        "(1.0 = the bound); encode/apply speed relative to torch.clone of the same dense bytes; "
        "fan-out independent/relay.",
        "refit: dense = serialise + put + get + deserialise + copy into the replica; dcr = "
        "publish (diff, encode, upload, commit) + sync (fetch, verify, apply), same store.",
        "steady: a long-lived writer and readers, medians of several steps, each stage over a "
        "copy_ of the dense bytes into preallocated tensors (apply = the pause of generation).",
    ]
    if result.skipped:
        lines.append("skipped: " + "; ".join(result.skipped))
    if png:
        lines.append(f"plot: {png}")
    return "\n".join(lines)


# --- the plot ----------------------------------------------------------------------------------


def plot(result: SuiteResult, path: str | os.PathLike[str], *, dpi: int = 110) -> None:
    """The suite's figure: refit time, delta/bound, throughput ratios, fan-out (one PNG)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        from dcr_format.errors import CapabilityError

        raise CapabilityError(
            f"plotting needs matplotlib ({exc}); pip install 'dcr-format[plot]'"
        ) from exc
    figure = Figure(figsize=(13, 9), layout="constrained")
    FigureCanvasAgg(figure)
    (ax_time, ax_bound), (ax_speed, ax_fan) = figure.subplots(2, 2)

    series: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in result.refit:
        series.setdefault((r["store"], r["dense_bytes"]), []).append(r)
    sizes = sorted({dense for _, dense in series})
    for (store, dense), rows in sorted(series.items()):
        ax_time.plot(
            [100 * r["change_rate"] for r in rows],
            [r["speedup"] for r in rows],
            "o-" if store == "s3" else "s--",
            color=f"C{sizes.index(dense)}",
            label=f"{store} {_mb(dense)}",
        )
    ax_time.axhline(1.0, color="k", lw=0.8)
    ax_time.set_yscale("log")
    ax_time.set_xlabel("change rate (%)")
    ax_time.set_ylabel("dense seconds / dcr seconds (log)")
    ax_time.set_title("end-to-end refit: dense time over dcr time (above 1: dcr faster)")
    ax_time.legend(fontsize=7, ncol=2)

    for dense, rows in sorted(
        {r["dense_bytes"]: [] for r in result.refit if r.get("bound_bytes")}.items()
    ):
        rows = [r for r in result.refit if r.get("bound_bytes") and r["dense_bytes"] == dense]
        ax_bound.plot(
            [100 * r["change_rate"] for r in rows],
            [r["delta_vs_bound"] for r in rows],
            "o-",
            label=f"{_mb(dense)}: stored / bound",
        )
        ax_bound.plot(
            [100 * r["change_rate"] for r in rows],
            [100 * r["delta_bytes"] / r["dense_bytes"] for r in rows],
            "s:",
            label=f"{_mb(dense)}: delta % of dense",
        )
    ax_bound.axhline(1.0, color="k", lw=0.8)
    ax_bound.set_xlabel("change rate (%)")
    ax_bound.set_ylabel("stored / bound (circles); % of dense (squares)")
    ax_bound.set_title("delta bytes against the entropy bound")
    ax_bound.legend(fontsize=7)

    if result.codec:
        rates = [100 * r["change_rate"] for r in result.codec]
        ax_speed.plot(rates, [r["encode_vs_clone"] for r in result.codec], "o-", label="encode")
        ax_speed.plot(
            rates, [r["decode_apply_vs_clone"] for r in result.codec], "s-", label="decode+apply"
        )
        ax_speed.axhline(1.0, color="k", lw=0.8)
        ax_speed.set_yscale("log")
        ax_speed.set_title(
            f"throughput relative to torch.clone ({_mb(result.codec[0]['dense_bytes'])})"
        )
        ax_speed.set_xlabel("change rate (%)")
        ax_speed.set_ylabel("speed / clone speed (log)")
        ax_speed.legend(fontsize=8)

    fan = result.fanout
    if fan:
        phases = ["base", "delta"]
        x = list(range(len(phases)))
        width = 0.38
        alone_mb = [fan["phases"][f"independent_{p}"]["bytes"] / 1e6 for p in phases]
        relay_mb = [fan["phases"][f"relay_{p}"]["bytes"] / 1e6 for p in phases]
        ax_fan.bar([i - width / 2 for i in x], alone_mb, width, label="independent: store MB")
        ax_fan.bar([i + width / 2 for i in x], relay_mb, width, label="relay: store MB")
        ax_fan.set_xticks(x, [f"{p} ({fan['members']} members)" for p in phases])
        ax_fan.set_ylabel("MB read from the store")
        twin = ax_fan.twinx()
        twin.plot(
            [i - width / 2 for i in x],
            [fan["phases"][f"independent_{p}"]["seconds"] for p in phases],
            "kv",
            label="independent: s",
        )
        twin.plot(
            [i + width / 2 for i in x],
            [fan["phases"][f"relay_{p}"]["seconds"] for p in phases],
            "k^",
            label="relay: s",
        )
        twin.set_ylabel("wall seconds (markers)")
        twin.set_ylim(bottom=0)
        handles = ax_fan.get_legend_handles_labels()
        extra = twin.get_legend_handles_labels()
        ax_fan.legend(handles[0] + extra[0], handles[1] + extra[1], fontsize=7)
        ax_fan.set_title(f"relay fan-out vs independent readers ({fan['store']})")
    end = result.machine_end or result.machine_start
    figure.suptitle(
        f"dcr bench: {result.machine_start['cpus']} CPUs, load average "
        f"{result.machine_start['load_average'][0]:.1f} to {end['load_average'][0]:.1f}; "
        "every ratio from one run"
    )
    figure.savefig(os.fspath(path), dpi=dpi)


# --- the command ---------------------------------------------------------------------------


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


PLOT_NAME = "dcr-bench.png"


def plot_path(out: str | None, png: str | None) -> str:
    """Where the suite writes its plot: ``png`` if given, else ``out/dcr-bench.png``
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


if __name__ == "__main__":
    bench(prog_name="bench_suite.py")
