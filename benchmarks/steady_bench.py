"""Steady-state refit: one long-lived writer and readers, step after step, against copy_.

RL runs publish and sync every optimizer step with the same writer and readers, so
this benchmark keeps them alive across steps and reports medians. Per step, in this
order (interleaved, so every figure of a row shares the machine's state):

- ``copy_``: the dense bytes copied into preallocated tensors (memory bandwidth):
  the reference every other figure is divided by;
- publish (by stage: diff + coding + shard uploads, manifest + commit, baseline advance);
- prepare then apply on one reader (apply is the pause of generation);
- sync on a second reader (the one-call form);
- dense: safetensors save, ``put``, ``get``, load and copy into a resident replica, last
  (the trainer's next step then stands between its 2 GB of writes and the next publish,
  as an optimizer step does in a run), then, on a server, an untimed pause so that the
  server's own work after the round trip is not billed to the next step (measured on the
  JuiceFS gateway: a publish right after the dense round trip took up to 3x its time
  after a 3 s pause; ``os.sync`` made it worse, on the local store too, so it is not
  called).

``--features`` given more than once runs a writer (and its two readers, each on its own
store) per feature set: on the local store side by side, each timed in turn within the
same step after its own ``copy_``, so that the sets compare at one moment of a noisy
machine; the dense round trip runs once a step, after all of them.

``--device cuda`` keeps the weights, the writer's baseline and the readers' tensors on a
GPU (coding stays on the host; each stage is timed until the device's work is done).

Stores: a local directory, the JuiceFS S3 gateway on 127.0.0.1, and that gateway
behind a shaped link: the benchmark creates a network namespace (``ip netns``), puts a
``tbf`` qdisc on that namespace's own loopback, runs itself (servers and clients)
inside it, and deletes it afterwards. The machine's own interfaces are never touched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from refit_bench import RATES, SyntheticTrainer, dense_refit, lr_for, model_shapes

from dcr_format.store._local import LocalBackend
from dcr_format.store.store import Store

if TYPE_CHECKING:
    from bench_costs import Costs

STEPS = 5
SETTLE_S = {"local": 0.0, "memory": 0.0}  # seconds to wait after the dense trip, by kind
SETTLE_DEFAULT_S = 3.0  # servers (the JuiceFS gateway keeps writing after a put returns)
LINKS_GBIT = (1.0, 5.0)


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in b
    )


def _finished(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a GPU's kernels run after their call returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_seconds(weights: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> float:
    device = next(iter(weights.values())).device
    _finished(device)
    started = time.perf_counter()
    for name, tensor in weights.items():
        buffers[name].copy_(tensor)
    _finished(device)
    return time.perf_counter() - started


def _settle(store: Store) -> None:
    """Let a server finish the dense round trip's work before the next timed stage."""
    pause = SETTLE_S.get(store.kind, SETTLE_DEFAULT_S)
    if pause:
        time.sleep(pause)


def steady_series(
    store: Store,
    shapes: dict[str, tuple[int, ...]],
    rates: Sequence[float] = RATES,
    *,
    steps: int = STEPS,
    label: str,
    seed: int = 0,
    features: Sequence[str] | None = (),
    device: str = "cpu",
    progress: Callable[[str], None] = lambda message: None,
) -> list[dict[str, Any]]:
    """One row per step: every stage's seconds, bytes moved, and whether all ends are exact
    (``features``: the writer's, FORMAT.md §12; None: its default; ``device``: where the
    weights, the writer's baseline and the readers' tensors live)."""
    return compared_series(
        [(store, features)],
        shapes,
        rates,
        steps=steps,
        label=label,
        seed=seed,
        device=device,
        progress=progress,
    )


class _Ends:
    """One configuration's long-lived writer and two readers (prepare/apply, sync), its
    baseline and tensors on ``device``."""

    def __init__(self, store: Store, features: Sequence[str] | None, device: str) -> None:
        from dcr_format.publish.writer import DeltaWriter
        from dcr_format.sync.reader import DeltaReader
        from dcr_format.targets.dict import StateDictTarget

        self.store, self.features = store, feature_label(features)
        self.device = torch.device(device)
        self.writer = DeltaWriter(store, features=features, baseline_device=self.device)
        self.staged: dict[str, torch.Tensor] = {}
        self.synced: dict[str, torch.Tensor] = {}
        self.preparer = DeltaReader(store, StateDictTarget(self.staged))
        self.syncer = DeltaReader(store, StateDictTarget(self.synced))

    def start(self, weights: dict[str, torch.Tensor]) -> None:
        """The base: published, and synced into each reader's tensors, made on the device
        first (a dict target writes into the tensors it holds)."""
        self.writer.publish(weights, step=0)
        for held in (self.staged, self.synced):
            held.update({n: torch.empty_like(t) for n, t in weights.items()})
        self.preparer.sync()
        self.syncer.sync()

    def step(self, weights: dict[str, torch.Tensor], step: int) -> dict[str, Any]:
        """Publish ``weights``, prepare and apply on one reader, sync the other: timed, each
        stage until its device work is done."""
        started = time.perf_counter()
        info = self.writer.publish(weights, step=step)
        _finished(self.device)
        published = time.perf_counter()
        prepared = self.preparer.prepare()
        _finished(self.device)
        ready = time.perf_counter()
        applied = self.preparer.apply(prepared)
        _finished(self.device)
        done = time.perf_counter()
        result = self.syncer.sync()
        _finished(self.device)
        finished = time.perf_counter()
        return {
            "features": self.features,
            "change_rate": info.change_rate,
            "dense_bytes": info.dense_bytes,
            "delta_bytes": info.payload_bytes,
            "publish_s": published - started,
            **{f"publish_{k}": v for k, v in self.writer.timings.items()},
            "prepare_s": ready - published,
            "apply_s": done - ready,
            "pause_s": applied.apply_seconds,
            "sync_s": finished - done,
            "sync_audited": result.audited,
            "changed": info.changed_elements,
            "dcr_bytes_moved": info.payload_bytes + result.payload_bytes,
        }


def compared_series(
    configs: Sequence[tuple[Store, Sequence[str] | None]],
    shapes: dict[str, tuple[int, ...]],
    rates: Sequence[float] = RATES,
    *,
    steps: int = STEPS,
    label: str,
    seed: int = 0,
    device: str = "cpu",
    progress: Callable[[str], None] = lambda message: None,
) -> list[dict[str, Any]]:
    """:func:`steady_series` for several writer configurations (a store and the writer's
    features each) fed the same weights: every step times each in turn, each after its own
    ``copy_``, so that their rows compare at the same moment of a shared machine; the dense
    round trip, the same for all, runs once at the end of the step (from ``device``
    through the host and the store, into a replica on ``device``)."""
    trainer = SyntheticTrainer(shapes, seed=seed, device=device)
    ends = [_Ends(store, features, device) for store, features in configs]
    weights = trainer.export()
    for end in ends:
        end.start(weights)
    replica = {n: t.clone() for n, t in weights.items()}
    buffers = {n: torch.empty_like(t) for n, t in weights.items()}
    rows: list[dict[str, Any]] = []
    step = 0
    for rate in rates:
        lr = lr_for(rate)
        for index in range(steps + (1 if rate == rates[0] else 0)):  # one warm-up step
            step += 1
            trainer.step(lr)
            weights = trainer.export()
            progress(f"steady {label}: {rate:.1%} step {index + 1}")
            timed = []
            for end in ends:
                copy_s = _copy_seconds(weights, buffers)
                timed.append({"copy_s": copy_s, **end.step(weights, step)})
            dense = dense_refit(ends[0].store, weights, replica)
            _settle(ends[0].store)
            for end, row in zip(ends, timed, strict=True):
                rows.append(
                    {
                        "store": label,
                        "target_rate": rate,
                        "warmup": rate == rates[0] and index == 0,
                        **row,
                        "dense_s": dense["dense_s"],
                        "dense_serialise_s": dense["dense_serialise_s"],
                        "dense_load_s": dense["dense_load_s"],
                        "dense_bytes_moved": dense["dense_bytes_moved"],
                        "bit_exact": _same_bits(end.staged, weights)
                        and _same_bits(end.synced, weights)
                        and _same_bits(replica, weights),
                    }
                )
    return rows


_STAGES = ("publish_s", "prepare_s", "apply_s", "sync_s", "dense_s")


def summarise(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians per (store, writer features, rate) over the measured steps, each stage also
    over copy_."""
    out = []
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for row in rows:
        if not row["warmup"]:
            key = (row["store"], row.get("features", "none"), row["target_rate"])
            groups.setdefault(key, []).append(row)
    for (store, features, rate), group in groups.items():
        med = {
            key: statistics.median(r[key] for r in group)
            for key in group[0]
            if isinstance(group[0][key], (int, float))
            and not isinstance(group[0][key], bool)
            and key != "target_rate"
        }
        summary: dict[str, Any] = {
            "store": store,
            "features": features,
            "target_rate": rate,
            "steps": len(group),
            **med,
            "bit_exact": all(r["bit_exact"] for r in group),
        }
        for stage in _STAGES:
            summary[stage.replace("_s", "_vs_copy")] = med[stage] / med["copy_s"]
        # dense/dcr: a trainer-to-reader refit each way (dcr: publish then sync)
        summary["dense_vs_dcr"] = med["dense_s"] / (med["publish_s"] + med["sync_s"])
        out.append(summary)
    return out


def format_table(summary: Sequence[dict[str, Any]]) -> str:
    """The medians as a text table (seconds and ratios to copy_)."""
    header = (
        "store", "rate", "copy_ s", "publish", "prepare", "apply", "sync", "dense",
        "dense/dcr", "delta %", "exact",
    )  # fmt: skip
    several = len({r.get("features", "none") for r in summary}) > 1
    lines = ["  ".join(f"{h:>11}" for h in header) + ("  features" if several else "")]
    for r in summary:
        cells: tuple[str, ...] = (
            r["store"],
            f"{r['change_rate']:.2%}",
            f"{r['copy_s']:.3f}",
            *(f"{r[s]:.2f}s {r[s.replace('_s', '_vs_copy')]:.1f}x" for s in _STAGES),
            f"{r['dense_vs_dcr']:.1f}x",
            f"{100 * r['delta_bytes'] / r['dense_bytes']:.2f}",
            "yes" if r["bit_exact"] else "NO",
        )
        lines.append(
            "  ".join(f"{c:>11}" for c in cells) + (f"  {r['features']}" if several else "")
        )
    return "\n".join(lines)


@contextlib.contextmanager
def _store(kind: str, work: Path) -> Iterator[Store]:
    if kind == "local":
        yield Store(str(work / "store"))
        return
    from bench_gateway import juicefs_store

    with juicefs_store(work) as (store, _):
        yield store


def _netns_available() -> str | None:
    """None when a shaped namespace can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode:
            return f"no {tool} command (apt-get install iproute2)"
    return None


@contextlib.contextmanager
def shaped_namespace(gbit: float) -> Iterator[str]:
    """A fresh network namespace whose loopback is limited to ``gbit`` by a tbf qdisc."""
    name = f"dcr-bench-{os.getpid()}-{int(gbit * 1000)}"
    rate_bytes = gbit * 1e9 / 8
    burst = max(256 << 10, int(rate_bytes / 100))  # 10 ms of the rate
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        run = ["ip", "netns", "exec", name]
        subprocess.run([*run, "ip", "link", "set", "lo", "up"], check=True, capture_output=True)
        subprocess.run(
            [*run, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
             f"{int(gbit * 1000)}mbit", "burst", str(burst), "latency", "100ms"],
            check=True,
            capture_output=True,
        )  # fmt: skip
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def run(
    *,
    mb: float,
    rates: Sequence[float],
    steps: int,
    stores: Sequence[str],
    links: Sequence[float],
    features: Sequence[Sequence[str] | None] = ((),),
    experts: int = 0,
    device: str = "cpu",
    progress: Callable[[str], None] = lambda message: None,
) -> dict[str, Any]:
    """Every store configuration in turn; the shaped ones in their own namespace.
    ``features``: the writer feature sets to run (None: the writer's default, with no reader
    records all six); on the local store they run side by
    side (:func:`compared_series`, one store each), elsewhere one after the other.
    ``experts``: the model's MLPs as that many experts each (:func:`model_shapes`).
    ``device``: where the weights, baselines and readers' tensors live."""
    torch.manual_seed(0)
    shapes = model_shapes(mb, experts)
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for kind in stores:
        if kind == "local":
            with tempfile.TemporaryDirectory(prefix="dcr-steady-") as work:
                configs = [
                    (Store(str(Path(work) / f"store-{i}")), wanted)
                    for i, wanted in enumerate(features)
                ]
                rows += compared_series(
                    configs,
                    shapes,
                    rates,
                    steps=steps,
                    label=kind,
                    device=device,
                    progress=progress,
                )
            continue
        for wanted in features:
            with tempfile.TemporaryDirectory(prefix="dcr-steady-") as work:
                with _store(kind, Path(work)) as store:
                    rows += steady_series(
                        store,
                        shapes,
                        rates,
                        steps=steps,
                        label=kind,
                        features=wanted,
                        device=device,
                        progress=progress,
                    )
    if links:
        why = _netns_available()
        if why is not None:
            skipped.append(f"shaped links skipped: {why}")
        for gbit in links if why is None else ():
            for wanted in features:
                with shaped_namespace(gbit) as name, tempfile.TemporaryDirectory() as out:
                    target = Path(out) / "rows.json"
                    command = [
                        "ip", "netns", "exec", name, sys.executable,
                        str(Path(__file__).resolve()), "--inside", str(target), "--label",
                        f"s3 {gbit:g} Gbps", "--mb", str(mb), "--steps", str(steps),
                        "--rates", ",".join(str(r) for r in rates),
                        "--features", feature_label(wanted), "--experts", str(experts),
                        "--device", device,
                    ]  # fmt: skip
                    progress(f"steady: the gateway behind a {gbit:g} Gbit/s link")
                    subprocess.run(command, check=True)
                    rows += json.loads(target.read_text())
    return {
        "rows": rows,
        "summary": summarise(rows),
        "skipped": skipped,
        "model_mb": mb,
        "tensors": len(shapes),
        "features": [feature_label(wanted) for wanted in features],
        "device": device,
    }


TAIL_SHARD_BYTES = 1 << 20
"""Shard size of the writer :func:`sync_tails` measures with: a version of several shards,
as a large model's is (the writer's default is 32 MiB)."""


class _LateShard(LocalBackend):
    """A local store whose first shard a sync asks for after :meth:`arm` arrives ``delay``
    seconds late (the other objects at once): the version's last object, arriving after
    the reader did everything it could without it."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self._lock = threading.Lock()
        self._delay: float | None = None
        self.arrived = 0.0  # when the late shard was handed to the reader

    def arm(self, delay: float) -> None:
        self._delay, self.arrived = delay, 0.0

    def get(self, key: str, max_size: int | None) -> bytes:
        with self._lock:
            delay = self._delay if key.endswith(".dcrs") else None
            if delay is not None:
                self._delay = None
        data = super().get(key, max_size)
        if delay is not None:
            time.sleep(delay)
            self.arrived = time.perf_counter()
        return data


def sync_tails(
    shapes: dict[str, tuple[int, ...]],
    rates: Sequence[float],
    *,
    steps: int,
    features: Sequence[str] | None = None,
    device: str = "cpu",
    progress: Callable[[str], None] = lambda message: None,
) -> dict[float, list[float]]:
    """By rate, per step, the seconds of a sync after its version's last object arrived, per
    dense byte: what of a sync cannot overlap its download (decoding and completing that
    object's changes, the apply, which waits until every object is verified, the small
    tensors, the commit). A long-lived writer (shards of :data:`TAIL_SHARD_BYTES`) and
    reader; each step's first shard is held back twice as long as the step before took to
    sync (the first step of each rate, unheld, measures that), so that everything else is
    done when it arrives. ``features``: the writer's (None: its default)."""
    from dcr_format.publish.writer import DeltaWriter
    from dcr_format.sync.reader import DeltaReader
    from dcr_format.targets.dict import StateDictTarget

    tails: dict[float, list[float]] = {}
    trainer = SyntheticTrainer(shapes, seed=1, device=device)
    with tempfile.TemporaryDirectory(prefix="dcr-tail-") as work:
        backend = _LateShard(str(Path(work) / "store"))
        writer = DeltaWriter(
            Store(backend),
            features=features,
            shard_bytes=TAIL_SHARD_BYTES,
            baseline_device=device,
        )
        weights = trainer.export()
        writer.publish(weights)
        held = {n: torch.empty_like(t) for n, t in weights.items()}
        reader = DeltaReader(Store(backend), StateDictTarget(held))
        reader.sync()
        for rate in rates:
            lr, took = lr_for(rate), 0.0
            for index in range(steps + 1):
                progress(f"sync after the last shard: {rate:.1%} step {index + 1}")
                trainer.step(lr)
                weights = trainer.export()
                info = writer.publish(weights)
                backend.arm(2 * took if index else 0.0)
                started = time.perf_counter()
                reader.sync()
                _finished(torch.device(device))
                ended = time.perf_counter()
                if not _same_bits(held, weights):
                    raise AssertionError("the reader is not bit-exact after a late shard")
                if index:
                    tails.setdefault(rate, []).append((ended - backend.arrived) / info.dense_bytes)
                took = ended - started
    return tails


def format_tails(tails: dict[float, list[float]], rows: Sequence[dict[str, Any]]) -> str:
    """The median part of a sync after its last object, by rate, in seconds for the rows'
    model and as a share of the same rate's median sync in ``rows``."""
    lines = ["sync after its version's last object arrived (medians):"]
    for rate, per_byte in sorted(tails.items()):
        same = [r for r in rows if r["target_rate"] == rate]
        if not same:
            continue
        dense = same[0]["dense_bytes"]
        tail = statistics.median(per_byte) * dense
        sync = statistics.median(r["sync_s"] for r in same)
        lines.append(f"  {rate:.1%}: {tail:.3f} s, {tail / sync:.0%} of a sync ({sync:.3f} s)")
    return "\n".join(lines)


def steady_costs(
    rows: Sequence[dict[str, Any]],
    *,
    tails: dict[float, list[float]] | None = None,
    progress: Callable[[str], None] = lambda message: None,
) -> Costs:
    """``dcr project`` costs from a long-lived writer's and reader's steady rows (the per-byte
    publish and sync costs of RL's steady state, ``tails`` the part of a sync after its last
    object, :func:`sync_tails`), the JuiceFS gateway's request latency and throughput where
    the gateway runs here (else the local store's), one relay hop and sha256."""
    from bench_costs import derive_costs, relay_costs, sha256_rate, store_costs
    from bench_gateway import juicefs_store, s3_available

    from dcr_format.publish.writer import DEFAULT_SHARD_BYTES
    from dcr_format.store.relay import DEFAULT_CHUNK_BYTES

    large = 32 << 20
    progress("store requests, relay hop, sha256")
    with tempfile.TemporaryDirectory(prefix="dcr-steady-costs-") as work:
        if s3_available() is None:
            with juicefs_store(Path(work)) as (store, _):
                measured, request_store = store_costs(store, large_bytes=large), "s3"
        else:
            measured, request_store = (
                store_costs(Store(Path(work) / "s"), large_bytes=large),
                "local",
            )
    return derive_costs(
        rows,
        source="benchmarks/steady_bench.py --save-costs",
        store=measured,
        request_store=request_store,
        relay=relay_costs(nbytes=large * 2, chunk_bytes=DEFAULT_CHUNK_BYTES),
        sha256_bytes_per_s=sha256_rate(large * 2),
        shard_bytes=DEFAULT_SHARD_BYTES,
        chunk_bytes=DEFAULT_CHUNK_BYTES,
        tails=tails,
    )


def feature_set(given: str) -> tuple[str, ...] | None:
    """A ``--features`` value: ``default`` is the writer's default (None), ``''`` or
    ``none`` no feature, else the comma-separated features."""
    if given == "default":
        return None
    return tuple(f for f in given.split(",") if f and f != "none")


def feature_label(features: Sequence[str] | None) -> str:
    """How rows name a writer's features (``default``, ``none`` or the list)."""
    return "default" if features is None else ",".join(features) or "none"


def main(argv: Sequence[str] | None = None) -> int:
    """``benchmarks/steady_bench.py``: long-lived writer and readers, medians over steps."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--mb", type=float, default=1000.0, help="model size in MB of bf16")
    parser.add_argument("--steps", type=int, default=STEPS, help="measured steps per rate")
    parser.add_argument("--rates", default=",".join(str(r) for r in RATES))
    parser.add_argument("--stores", default="local,s3", help="local, s3 (JuiceFS gateway)")
    parser.add_argument(
        "--links", default=",".join(f"{g:g}" for g in LINKS_GBIT), help="Gbit/s; '' for none"
    )
    parser.add_argument(
        "--features",
        action="append",
        help="the writer's features, comma-separated (FORMAT.md §12; '' or 'none' for none, "
        "'default' (when not given) for the writer's default: all six here); give it again "
        "for more writers, run side by side on the local store",
    )
    parser.add_argument(
        "--experts",
        type=int,
        default=0,
        help="split each layer's MLP into this many experts (a mixture-of-experts layout of "
        "the same bytes: many small tensors, where a tensor's fixed cost shows)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the weights, the writer's baseline and the readers' tensors live (cpu, "
        "cuda, cuda:1)",
    )
    parser.add_argument("--quick", action="store_true", help="20 MB, 2 steps, local (CI smoke)")
    parser.add_argument("--json", type=Path, help="also write every row and the summary here")
    parser.add_argument(
        "--save-costs",
        type=Path,
        help="write `dcr project --costs` costs from the local-store rows (requests measured "
        "on the JuiceFS gateway where it runs, else on the local store)",
    )
    parser.add_argument("--inside", type=Path, help=argparse.SUPPRESS)  # shaped-namespace child
    parser.add_argument("--label", default="s3", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.mb <= 0:
        parser.error("--steps and --mb must be positive")
    if args.experts < 0:
        parser.error("--experts must be 0 or more")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r} is not a device torch knows (cpu, cuda)")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device here", file=sys.stderr)
        return 2
    rates = [float(r) for r in args.rates.split(",") if r]
    feature_sets = [feature_set(given) for given in args.features or ["default"]]
    features = feature_sets[0]
    if args.inside is not None:  # already inside a shaped namespace: the gateway only
        with tempfile.TemporaryDirectory(prefix="dcr-steady-") as work:
            with _store("s3", Path(work)) as store:
                rows = steady_series(
                    store,
                    model_shapes(args.mb, args.experts),
                    rates,
                    steps=args.steps,
                    label=args.label,
                    features=features,
                    device=args.device,
                )
        args.inside.write_text(json.dumps(rows))
        return 0
    if args.quick:
        args.mb, args.steps, args.stores, args.links = 20.0, 2, "local", ""
        rates = rates[:2]
    result = run(
        mb=args.mb,
        rates=rates,
        steps=args.steps,
        stores=[s for s in args.stores.split(",") if s],
        links=[float(g) for g in args.links.split(",") if g],
        features=feature_sets,
        experts=args.experts,
        device=args.device,
        progress=lambda message: print(message, file=sys.stderr, flush=True),
    )
    print(
        f"steady-state refit, {result['model_mb']:.0f} MB bf16 model of {result['tensors']} "
        f"tensors on {args.device}, medians of each rate"
        + f", writer features {' | '.join(result['features'])}"
    )
    print(format_table(result["summary"]))
    for line in result["skipped"]:
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    if args.save_costs is not None:
        first = result["features"][0]  # the first writer's rows (one per step)
        local = [
            r
            for r in result["rows"]
            if r["store"] == "local" and not r["warmup"] and r["features"] == first
        ]
        if not local:
            parser.error("--save-costs needs the local store's rows (--stores local)")

        def say(message: str) -> None:
            print(message, file=sys.stderr, flush=True)

        tails = sync_tails(
            model_shapes(args.mb, args.experts),
            rates,
            steps=args.steps,
            features=feature_sets[0],
            device=args.device,
            progress=say,
        )
        print(format_tails(tails, local))
        costs = steady_costs(local, tails=tails, progress=say)
        args.save_costs.write_text(costs.model_dump_json(indent=2))
    return 0 if all(r["bit_exact"] for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
