"""The steady benchmark's order of stages: the dense round trip is left to settle before
the publish that follows it is timed."""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest
import steady_bench as steady

from dcr_format.publish.writer import DeltaWriter
from dcr_format.store.store import Store


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


def test_writer_configurations_run_side_by_side(tmp_path, monkeypatch):
    """compared_series: every step times each configuration in turn (its own copy_ first),
    fed the same weights, and makes the dense round trip once, last."""
    events: list[str] = []
    real_dense, real_publish = steady.dense_refit, DeltaWriter.publish
    real_copy = steady._copy_seconds

    def dense(*args: Any, **kwargs: Any) -> dict[str, float]:
        events.append("dense")
        return real_dense(*args, **kwargs)

    def publish(self: DeltaWriter, *args: Any, **kwargs: Any) -> Any:
        events.append("publish " + (",".join(sorted(self.features)) or "none"))
        return real_publish(self, *args, **kwargs)

    def copy(*args: Any) -> float:
        events.append("copy")
        return real_copy(*args)

    monkeypatch.setattr(steady, "dense_refit", dense)
    monkeypatch.setattr(steady, "_copy_seconds", copy)
    monkeypatch.setattr(DeltaWriter, "publish", publish)
    configs = [
        (Store(str(tmp_path / "a")), ()),
        (Store(str(tmp_path / "b")), ("values-rans", "values-ulp")),
    ]
    rows = steady.compared_series(configs, {"w": (128, 64)}, (0.01, 0.05), steps=1, label="t")
    assert len(rows) == 2 * 3 and all(r["bit_exact"] for r in rows)
    assert [r["features"] for r in rows] == ["none", "values-rans,values-ulp"] * 3
    step = ["copy", "publish none", "copy", "publish values-rans,values-ulp", "dense"]
    assert events == ["publish none", "publish values-rans,values-ulp"] + step * 3
    summary = steady.summarise(rows)
    assert {(r["features"], r["target_rate"]) for r in summary} == {
        (f, rate) for f in ("none", "values-rans,values-ulp") for rate in (0.01, 0.05)
    }
    table = steady.format_table(summary)
    assert "features" in table.splitlines()[0] and "values-rans,values-ulp" in table


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


def test_costs_come_from_the_steady_rows(tmp_path, monkeypatch):
    """--save-costs: the projection's per-byte publish and sync costs are the steady rows'
    (a long-lived writer and reader), requests measured on the local store when no
    gateway runs."""
    import bench_costs as costs
    import bench_gateway as _gateway

    rows = steady.steady_series(
        Store(str(tmp_path / "store")), {"w": (64, 64)}, (0.01,), steps=2, label="local"
    )
    measured = [r for r in rows if not r["warmup"]]
    monkeypatch.setattr(_gateway, "s3_available", lambda: "no gateway in this test")
    monkeypatch.setattr(
        costs, "relay_costs", lambda **kw: {"relay_hop_bytes_per_s": 1e9, "relay_round_s": 1e-3}
    )
    monkeypatch.setattr(costs, "sha256_rate", lambda nbytes: 1e9)
    got = steady.steady_costs(measured, tails={0.01: [3e-10, 1e-10, 2e-10]})
    assert got.request_store == "local" and got.source.startswith("benchmarks/steady_bench.py")
    (rate,) = got.rates
    assert rate.sync_tail_s_per_byte == pytest.approx(2e-10)  # the median of the steps'
    assert steady.steady_costs(measured).rates[0].sync_tail_s_per_byte is None
    want = statistics.median(r["publish_s"] / r["dense_bytes"] for r in measured)
    assert rate.publish_s_per_byte == pytest.approx(want)
    want = statistics.median(r["sync_s"] / r["dense_bytes"] for r in measured)
    assert rate.sync_s_per_byte == pytest.approx(want)
    rows = steady.steady_series(
        Store(str(tmp_path / "three")), {"w": (64, 64)}, (0.01,), steps=3, label="local"
    )
    measured = [r for r in rows if not r["warmup"]]
    slow = {**measured[0], "publish_s": 100 * measured[0]["publish_s"]}  # one slow step
    got = steady.steady_costs([slow, *measured[1:]]).rates[0].publish_s_per_byte
    assert got < slow["publish_s"] / slow["dense_bytes"] / 10


def test_save_costs_needs_the_local_store(tmp_path, capsys):
    with pytest.raises(SystemExit):
        steady.main(["--stores", "", "--links", "", "--save-costs", str(tmp_path / "c.json")])
    assert "--save-costs needs the local store" in capsys.readouterr().err


def test_features_flag_default_none_and_lists():
    """``--features``: absent or ``default`` runs the writer's default, ``none`` or ``''``
    the plain codings, else the list; rows name each so."""
    assert steady.feature_set("default") is None and steady.feature_label(None) == "default"
    assert steady.feature_set("none") == () == steady.feature_set("")
    assert steady.feature_label(()) == "none"
    assert steady.feature_set("values-rans,none") == ("values-rans",)
    assert steady.feature_label(("values-rans", "values-ulp")) == "values-rans,values-ulp"


def test_the_late_shard_is_the_first_shard_asked_for_after_arming(tmp_path):
    backend = steady._LateShard(str(tmp_path))
    store = Store(backend)
    store.put("objects/1/a/shard-00000-00000.dcrs", b"x")
    store.put("objects/1/a/manifest-00000.json", b"{}")
    backend.arm(0.05)
    started = time.perf_counter()
    assert store.get("objects/1/a/manifest-00000.json") == b"{}"
    assert time.perf_counter() - started < 0.05 and backend.arrived == 0.0  # not a shard
    assert store.get("objects/1/a/shard-00000-00000.dcrs") == b"x"
    assert backend.arrived - started >= 0.05
    arrived = backend.arrived
    store.get("objects/1/a/shard-00000-00000.dcrs")  # once per arming
    assert backend.arrived == arrived


def test_sync_tails_measure_the_sync_after_its_late_shard(tmp_path, monkeypatch):
    """Per rate and measured step, the seconds of the sync after its held-back shard
    arrived, per dense byte, on a version of several shards; every sync bit for bit (the
    function raises otherwise)."""
    monkeypatch.setattr(steady, "TAIL_SHARD_BYTES", 4096)
    held: list[float] = []
    real_arm = steady._LateShard.arm
    monkeypatch.setattr(
        steady._LateShard, "arm", lambda self, d: (held.append(d), real_arm(self, d))
    )
    shapes = {"a": (256, 256), "b": (256, 256), "n": (256,)}
    tails = steady.sync_tails(shapes, (0.01, 0.05), steps=2)
    assert sorted(tails) == [0.01, 0.05] and all(len(v) == 2 for v in tails.values())
    dense = sum(256 * 256 * 2 for _ in range(2)) + 256 * 2
    assert all(0 < t * dense < 5 for v in tails.values() for t in v)
    # each rate: one step unheld (it measures the delay), then held twice as long as the last
    assert held[0] == 0 and held[3] == 0 and all(d > 0 for d in held[1:3] + held[4:])
