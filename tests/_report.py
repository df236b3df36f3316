"""Reliability report: what the fault, crash and hostile-input tests tried, and how it ended.

As a pytest plugin (imported by conftest.py) it gives tests the ``reliability``
fixture::

    def test_something(reliability):
        ...
        reliability.record("S3 faults", "GET object: 503 SlowDown", "recovered by retry")

Each call counts one case of a class (``cases=`` for more). Records of a test
that fails are counted under the outcome ``"TEST FAILED"``. At the end of the
session the counts, with each group's test time, are written as JSON to
``$DCR_RELIABILITY_JSON`` (default ``.pytest_cache/dcr-reliability.json``).

As a script it renders that JSON as the Markdown table of docs/reliability.md::

    .venv/bin/python tests/_report.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

DEFAULT_PATH = Path(".pytest_cache") / "dcr-reliability.json"
_STASH = pytest.StashKey[dict]()


class Recorder:
    """Counts cases of one test by (group, class, outcome)."""

    def __init__(self, group_of_test: str) -> None:
        self.default_group = group_of_test
        self.counts: dict[tuple[str, str, str], int] = defaultdict(int)

    def record(self, group: str, cls: str, outcome: str, *, cases: int = 1) -> None:
        """Count ``cases`` cases of ``cls`` (in ``group``) that ended in ``outcome``."""
        self.counts[(group, cls, outcome)] += cases


def _path(root: Path) -> Path:
    return Path(os.environ.get("DCR_RELIABILITY_JSON") or root / DEFAULT_PATH)


@pytest.fixture
def reliability(request: pytest.FixtureRequest) -> Recorder:
    """Record the cases a test tries and their outcomes for docs/reliability.md."""
    recorder = Recorder(request.node.module.__name__)
    request.node.stash[_STASH] = {"recorder": recorder}
    return recorder


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    report = yield
    entry = item.stash.get(_STASH, None)
    if entry is not None:
        entry.setdefault("seconds", 0.0)
        entry["seconds"] += report.duration
        if report.failed:
            entry["failed"] = True
        if report.when == "teardown":
            _collect(item, entry)
    return report


def _collect(item: pytest.Item, entry: dict) -> None:
    session = item.session
    results = session.stash.setdefault(_STASH, {"rows": defaultdict(int), "tests": {}})
    recorder: Recorder = entry["recorder"]
    failed = entry.get("failed", False)
    if not recorder.counts and not failed:
        return  # skipped, or recorded nothing
    for (group, cls, outcome), n in recorder.counts.items():
        results["rows"][(group, cls, "TEST FAILED" if failed else outcome)] += n
    groups = {group for group, _, _ in recorder.counts} or {recorder.default_group + " (failed)"}
    for group in groups:
        seconds, tests = results["tests"].get(group, (0.0, 0))
        results["tests"][group] = (seconds + entry["seconds"] / len(groups), tests + 1)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    results = session.stash.get(_STASH, None)
    if not results or not results["rows"]:
        return
    rows = [
        {"group": g, "class": c, "outcome": o, "cases": n}
        for (g, c, o), n in sorted(results["rows"].items())
    ]
    data = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
        "groups": {
            g: {"seconds": round(s, 1), "tests": t}
            for g, (s, t) in sorted(results["tests"].items())
        },
    }
    path = _path(session.config.rootpath)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def render(data: dict) -> str:
    """The Markdown table: one row per (group, class), outcomes with their counts."""
    by_class: dict[tuple[str, str], dict[str, int]] = defaultdict(dict)
    for row in data["rows"]:
        by_class[(row["group"], row["class"])][row["outcome"]] = row["cases"]
    lines = ["| group | fault or input class | cases | outcome |", "|---|---|---:|---|"]
    for (group, cls), outcomes in sorted(by_class.items()):
        total = sum(outcomes.values())
        text = "; ".join(
            f"{o}" if len(outcomes) == 1 else f"{o} ({n})" for o, n in sorted(outcomes.items())
        )
        lines.append(f"| {group} | {cls} | {total} | {text} |")
    lines.append("")
    lines.append("| group | tests | seconds |")
    lines.append("|---|---:|---:|")
    for group, info in sorted(data.get("groups", {}).items()):
        lines.append(f"| {group} | {info['tests']} | {info['seconds']} |")
    total = sum(r["cases"] for r in data["rows"])
    failed = sum(r["cases"] for r in data["rows"] if r["outcome"] == "TEST FAILED")
    lines.append("")
    lines.append(f"{total} cases in all, {failed} in failed tests (report of {data['created']}).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="the JSON a test run wrote")
    args = parser.parse_args(argv)
    path = args.json or _path(Path(__file__).resolve().parents[1])
    if not path.exists():
        print(f"no report at {path}; run the tests first (pytest tests/)", file=sys.stderr)
        return 1
    print(render(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
