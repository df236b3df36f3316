"""Soak: one writer publishing and several readers syncing for minutes, through random S3
faults and SIGKILLs, then every reader must hold exactly the writer's bits.

    .venv/bin/python -m dcr_format.testing.soak --minutes 5

starts moto on 127.0.0.1 with the fault proxy (:mod:`dcr_format.testing.faultproxy`)
in front of it, a writer process and four reader processes (two keep a dict of
tensors, two a safetensors directory), and for the given time:

- the proxy answers a share of all requests (``--fault-rate``) with a random
  fault: 500, 503 SlowDown, connection reset (before or after the server acted),
  a truncated body, a body altered in transit, a delay, or a hang past the
  client's read timeout;
- every ``--kill-every`` seconds one process is killed with SIGKILL and started
  again (a reader keeps its safetensors directory; the writer reopens the chain);
- after every sync a reader checks its whole target against the expected bits
  of the version it reports, and the parent checks a killed reader's directory
  is exactly one committed version.

At the end faults stop, every reader syncs to the writer's last version and is
compared with it bit for bit, and the chain must pass ``verify(deep=True)``. The
summary is printed as JSON; the exit status is 0 only if nothing went wrong.
The tests run a short form (tests/test_soak.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SoakReport", "run", "worker_context"]

PRELOAD = ["dcr_format", "dcr_format.sync.reader", "dcr_format.tools", "dcr_format.store._s3"]
FAULT_MENU = (
    ("500", False),
    ("500", True),
    ("503", False),
    ("reset", False),
    ("reset", True),
    ("truncate", False),
    ("corrupt", False),
    ("delay", False),
    ("hang", False),
    ("hang", True),
)
READ_TIMEOUT_S = 2.0


def worker_context() -> Any:
    """A multiprocessing context whose processes fork from a server that already imported
    torch and dcr_format: a worker starts in milliseconds, and SIGKILL is as real as ever."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


# --- the bits everyone agrees on -----------------------------------------------------------------


class Model:
    """The canonical tensors of every version, computed forwards from version 0."""

    def __init__(self, tensors: int = 8, rows: int = 48, cols: int = 64) -> None:
        self.shape = (tensors, rows, cols)
        self._at: tuple[int, dict[str, Any]] | None = None

    def _base(self) -> dict[str, Any]:
        import torch

        gen = torch.Generator().manual_seed(7)
        count, rows, cols = self.shape
        state = {
            f"model.layers.{i}.mlp.weight": torch.randn(rows, cols, generator=gen).bfloat16()
            for i in range(count)
        }
        state["model.norm.weight"] = torch.randn(cols, generator=gen)
        return state

    @staticmethod
    def _step(state: dict[str, Any], version: int) -> None:
        import torch

        gen = torch.Generator().manual_seed(1000 + version)
        for tensor in state.values():
            flat = tensor.view(-1)
            count = max(1, flat.numel() // 100)
            positions = torch.randint(0, flat.numel(), (count,), generator=gen)
            flat[positions] += 0.01 * torch.randn(count, generator=gen).to(flat.dtype)

    def at(self, version: int) -> dict[str, Any]:
        """The state of ``version`` (cached; cheap when versions only go forwards)."""
        if self._at is None or self._at[0] > version:
            self._at = (0, self._base())
        current, state = self._at
        for v in range(current + 1, version + 1):
            self._step(state, v)
        self._at = (version, state)
        return {name: t.clone() for name, t in state.items()}


def same_bits(actual: dict[str, Any], expected: dict[str, Any]) -> bool:
    """Same names, dtypes, shapes and bits."""
    import torch

    if sorted(actual) != sorted(expected):
        return False
    for name, want in expected.items():
        got = actual[name]
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            return False
        if not torch.equal(
            got.contiguous().view(-1).view(torch.uint8),
            want.contiguous().view(-1).view(torch.uint8),
        ):
            return False
    return True


def dir_tensors(path: Path) -> dict[str, Any]:
    """Every tensor of a safetensors checkpoint directory."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


# --- workers (separate processes) ----------------------------------------------------------------


def _log(path: Path, **event: Any) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(event) + "\n")
        handle.flush()


def _store(root: str, storage_options: dict[str, Any] | None) -> Any:
    from dcr_format import Store

    return Store(root, storage_options=storage_options) if storage_options else Store(root)


def _isolate() -> None:
    from dcr_format.testing.servers import AWS_ENV_NAMES, ISOLATED_AWS_ENV

    for name in AWS_ENV_NAMES:
        os.environ.pop(name, None)
    os.environ.update(ISOLATED_AWS_ENV)


def writer_main(
    root: str, options: dict[str, Any] | None, log: str, stop: str, base_every: int, pause: float
) -> None:
    """Publish the model's versions one after another until ``stop`` exists."""
    _isolate()
    from dcr_format import DcrError, DeltaWriter
    from dcr_format.errors import CommitConflictError, CommitStateUnknownError

    model = Model()
    log_path = Path(log)
    writer = None
    while not os.path.exists(stop):
        try:
            if writer is None:
                writer = DeltaWriter(_store(root, options), base_every=base_every)
                _log(log_path, event="open", version=writer.version)
            version = 0 if writer.version is None else writer.version + 1
            info = writer.publish(model.at(version), step=version)
            _log(log_path, event="commit", version=info.version, kind=info.kind)
        except (CommitConflictError, CommitStateUnknownError) as exc:
            # the outcome of our own publish is unknown or taken: learn it from the chain
            _log(log_path, event="error", error=type(exc).__name__)
            writer = None
        except DcrError as exc:  # transient: the baseline is unchanged, publish again
            _log(log_path, event="error", error=type(exc).__name__)
        time.sleep(pause)
    _log(log_path, event="stopped", version=None if writer is None else writer.version)


def reader_main(
    root: str, options: dict[str, Any] | None, log: str, final: str, kind: str, path: str
) -> None:
    """Sync and check the whole target after every sync; once ``final`` exists (the writer
    has stopped and faults are off), make one last sync and stop."""
    _isolate()
    from dcr_format import DcrError, DeltaReader, SafetensorsDirTarget, StateDictTarget

    model = Model()
    log_path = Path(log)
    tensors: dict[str, Any] = {}
    target = SafetensorsDirTarget(path) if kind == "dir" else StateDictTarget(tensors)
    reader = DeltaReader(_store(root, options), target)
    while True:
        last = os.path.exists(final)
        try:
            result = reader.sync()
        except DcrError as exc:
            _log(log_path, event="error", error=type(exc).__name__, last=last)
            time.sleep(0.05)
            continue  # a last sync that fails is logged: faults are off by then
        held = dir_tensors(Path(path)) if kind == "dir" else tensors
        exact = same_bits(held, model.at(result.version))
        _log(log_path, event="sync", version=result.version, applied=len(result.applied_versions))
        if not exact:
            _log(log_path, event="WRONG_BITS", version=result.version)
        if last:
            _log(log_path, event="final", version=result.version, exact=exact)
            return
        time.sleep(0.02)


# --- the parent ---------------------------------------------------------------------------------


@dataclass
class SoakReport:
    """What a soak did and whether every promise held."""

    seconds: float
    versions: int
    final_version: int | None
    syncs: int
    faults: dict[str, int]
    requests: dict[str, int]
    kills: dict[str, int]
    errors: dict[str, int]
    problems: list[str] = field(default_factory=list)
    verified_versions: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line cut by SIGKILL
            events.append(json.loads(line))
    return events


def _check_dir(path: Path, model: Model, problems: list[str], who: str) -> None:
    """A killed reader's directory holds exactly one committed version, or nothing yet."""
    state = path / "dcr-state.json"
    if not state.exists():
        return
    version = json.loads(state.read_text())["version"]
    if not same_bits(dir_tensors(path), model.at(version)):
        problems.append(f"{who}: after SIGKILL the directory is not exactly version {version}")


def _syncs(workdir: Path, names: list[str]) -> int:
    """The syncs the readers' logs record so far."""
    return sum(
        event["event"] == "sync"
        for name in names
        if name.startswith("reader")
        for event in _events(workdir / f"{name}.log")
    )


def run(
    seconds: float,
    *,
    root: str,
    storage_options: dict[str, Any],
    upstream: str,
    workdir: Path,
    readers: int = 4,
    fault_rate: float = 0.06,
    kill_every: float | None = 10.0,
    seed: int = 0,
    base_every: int = 20,
    deep: bool = True,
    progress: bool = False,
    min_syncs: int = 0,
    max_seconds: float | None = None,
) -> SoakReport:
    """Run a soak against the S3 server at ``upstream`` (the store ``root`` on it), with the
    fault proxy between them; ``storage_options`` reach the server (the endpoint is replaced
    by the proxy's). ``deep``: the final check of the chain replays every version (else it
    checks every object and hash link). ``min_syncs``: past ``seconds``, the faults and
    kills go on until the readers have synced that many times, or ``max_seconds`` have
    passed (a busy machine syncs less in the same time)."""
    from dcr_format import DcrError, DeltaReader, StateDictTarget, Store
    from dcr_format.testing.faultproxy import FaultProxy, Rule
    from dcr_format.tools import verify

    rng = random.Random(seed)
    context = worker_context()
    workdir.mkdir(parents=True, exist_ok=True)
    stop, final = workdir / "stop", workdir / "final"
    stop.unlink(missing_ok=True)
    final.unlink(missing_ok=True)
    model = Model()
    problems: list[str] = []
    kills: Counter[str] = Counter()
    started = time.monotonic()
    with FaultProxy(upstream, seed=seed) as proxy:
        options = dict(storage_options)
        options["endpoint_url"] = proxy.endpoint
        config = dict(options.get("config_kwargs") or {})
        config.update(read_timeout=READ_TIMEOUT_S, connect_timeout=READ_TIMEOUT_S)
        options["config_kwargs"] = config
        for fault, after in FAULT_MENU:
            proxy.add(
                Rule(
                    fault=fault,
                    after=after,
                    probability=fault_rate / len(FAULT_MENU),
                    delay=0.3 if fault == "delay" else READ_TIMEOUT_S + 0.5,
                )
            )

        def start(name: str) -> Any:
            log = str(workdir / f"{name}.log")
            if name == "writer":
                args: tuple[Any, ...] = (root, options, log, str(stop), base_every, 0.05)
                process = context.Process(target=writer_main, args=args, name=name)
            else:
                index = int(name.split("-")[1])
                kind = "dir" if index % 2 else "dict"
                path = str(workdir / f"ckpt-{index}")
                args = (root, options, log, str(final), kind, path)
                process = context.Process(target=reader_main, args=args, name=name)
            process.start()
            return process

        names = ["writer", *(f"reader-{i}" for i in range(readers))]
        processes = {name: start(name) for name in names}
        deadline = started + seconds
        cap = started + max(seconds, max_seconds or seconds)
        next_kill = started + kill_every if kill_every else None

        def going() -> bool:
            now = time.monotonic()
            if now < deadline:
                return True
            return now < cap and _syncs(workdir, names) < min_syncs

        while going():
            time.sleep(0.2)
            for name, process in processes.items():
                if not process.is_alive():
                    problems.append(f"{name} exited early with code {process.exitcode}")
                    processes[name] = start(name)
            if kill_every and next_kill is not None and time.monotonic() >= next_kill:
                victim = rng.choice(names)
                processes[victim].kill()
                processes[victim].join(10)
                kills[victim.split("-")[0]] += 1
                if victim.startswith("reader") and int(victim.split("-")[1]) % 2:
                    _check_dir(workdir / f"ckpt-{victim.split('-')[1]}", model, problems, victim)
                processes[victim] = start(victim)
                next_kill += kill_every
            if progress:
                commits = sum(e["event"] == "commit" for e in _events(workdir / "writer.log"))
                print(
                    f"\r{time.monotonic() - started:6.0f} s  {commits} versions  "
                    f"{sum(proxy.faults.values())} faults",
                    end="",
                    file=sys.stderr,
                )
        # faults off, writer stops, readers make their last sync
        proxy.remove_rules()
        writer = processes.pop("writer")
        stop.write_text("stop")
        writer.join(120)
        if writer.exitcode != 0:
            problems.append(f"the writer did not stop cleanly (exit code {writer.exitcode})")
        final.write_text("final")
        for name, process in processes.items():
            process.join(120)
            if process.exitcode != 0:
                problems.append(f"{name} did not finish its last sync (exit {process.exitcode})")
                if process.is_alive():
                    process.kill()
        faults = {f"{kind} {fault}": n for (kind, fault), n in sorted(proxy.faults.items())}
        requests = dict(sorted(proxy.requests.items()))

    store = Store(root, storage_options=storage_options)
    latest: int | None = None
    verified = 0
    try:
        from dcr_format.chain.chain import Chain

        latest = Chain(store).latest()
        tensors: dict[str, Any] = {}
        DeltaReader(store, StateDictTarget(tensors)).sync()
        if latest is None or not same_bits(tensors, model.at(latest)):
            problems.append(f"the chain's newest version {latest} is not the writer's bits")
        report = verify(store, deep=deep)
        verified = report.replayed_versions if deep else report.versions_checked
        problems.extend(f"verify: {p.key}: {p.message}" for p in report.problems)
    except DcrError as exc:
        problems.append(f"checking the chain failed: {type(exc).__name__}: {exc}")
    errors: Counter[str] = Counter()
    syncs = 0
    for name in names:
        events = _events(workdir / f"{name}.log")
        for event in events:
            if event["event"] == "error":
                errors[event["error"]] += 1
                if event.get("last"):
                    problems.append(f"{name}: a sync failed after the faults stopped")
            elif event["event"] == "WRONG_BITS":
                problems.append(f"{name} held wrong bits after syncing to {event['version']}")
            elif event["event"] == "sync":
                syncs += 1
        if name.startswith("reader"):
            finals = [e for e in events if e["event"] == "final"]
            if not finals or not finals[-1]["exact"] or finals[-1]["version"] != latest:
                problems.append(f"{name} did not end bit-equal to the writer's version {latest}")
    commits = [e for e in _events(workdir / "writer.log") if e["event"] == "commit"]
    versions = len({e["version"] for e in commits})
    return SoakReport(
        seconds=round(time.monotonic() - started, 1),
        versions=versions,
        final_version=latest,
        syncs=syncs,
        faults=faults,
        requests=requests,
        kills=dict(kills),
        errors=dict(sorted(errors.items())),
        problems=problems,
        verified_versions=verified,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dcr_format.testing.soak", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to run (default 5)")
    parser.add_argument("--readers", type=int, default=4)
    parser.add_argument("--fault-rate", type=float, default=0.06, help="share of faulty requests")
    parser.add_argument(
        "--kill-every", type=float, default=10.0, help="seconds between SIGKILLs (0: none)"
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--keep", type=Path, default=None, help="keep logs and targets here")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)

    import logging

    from dcr_format.testing.servers import AWS_ENV_NAMES, ISOLATED_AWS_ENV, MotoServer

    for name in AWS_ENV_NAMES:
        os.environ.pop(name, None)
    os.environ.update(ISOLATED_AWS_ENV)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="dcr-soak-"))
    server = MotoServer()
    try:
        with server.fresh_root() as root:
            report = run(
                args.minutes * 60,
                root=root,
                storage_options=server.storage_options(),
                upstream=server.endpoint,
                workdir=workdir,
                readers=args.readers,
                fault_rate=args.fault_rate,
                kill_every=args.kill_every or None,
                seed=seed,
                progress=sys.stderr.isatty(),
            )
    finally:
        server.stop()
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps({"seed": seed, "ok": report.ok, **report.__dict__}, indent=1))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
