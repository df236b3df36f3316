"""The steady benchmark's order of stages: the dense round trip is left to settle before
the publish that follows it is timed."""

from __future__ import annotations

from typing import Any

import pytest

from dcr_format.bench import steady
from dcr_format.store import Store
from dcr_format.writers.writer import DeltaWriter


def test_the_dense_round_trip_comes_last_in_a_step_and_settles(tmp_path, monkeypatch):
    events: list[str] = []
    real_dense, real_publish = steady.dense_refit, DeltaWriter.publish

    def dense(*args: Any, **kwargs: Any) -> dict[str, float]:
        events.append("dense")
        return real_dense(*args, **kwargs)

    def publish(self: DeltaWriter, *args: Any, **kwargs: Any) -> Any:
        events.append("publish")
        return real_publish(self, *args, **kwargs)

    monkeypatch.setattr(steady, "dense_refit", dense)
    monkeypatch.setattr(steady, "_settle", lambda store: events.append(f"settle {store.kind}"))
    monkeypatch.setattr(DeltaWriter, "publish", publish)
    rows = steady.steady_series(
        Store(str(tmp_path / "store")), {"w": (64, 64)}, (0.01,), steps=2, label="t"
    )
    assert len(rows) == 3 and all(r["bit_exact"] for r in rows)
    assert events == ["publish"] + ["publish", "dense", "settle local"] * 3


@pytest.mark.parametrize(("kind", "waits"), [("local", []), ("memory", []), ("s3", [3.0])])
def test_settle_waits_only_for_servers(kind, waits, monkeypatch):
    calls: list[object] = []
    monkeypatch.setattr(steady.os, "sync", lambda: calls.append("sync"))  # never called
    monkeypatch.setattr(steady.time, "sleep", calls.append)

    class Kinded:
        pass

    store = Kinded()
    store.kind = kind  # type: ignore[attr-defined]
    steady._settle(store)  # type: ignore[arg-type]
    assert calls == waits
