"""The writer's default features (FORMAT.md §12.1): every writer feature its chain's recorded
readers read, the codings against the old bits only where every reader reads them;
``features=`` restricts or forces; ``dcr publish --features``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget
from dcr_format.cli.main import cli
from dcr_format.format.features import BASELINE_FEATURES, WRITER_FEATURES
from dcr_format.format.schema import KNOWN_FEATURES, ReaderRecord, parse
from dcr_format.publish import _commit
from dcr_format.store.store import open_store

ALL_SIX = tuple(sorted(WRITER_FEATURES))


def _steps() -> list[dict[str, torch.Tensor]]:
    """A base and two steps where every writer feature pays: small bfloat16 weights stepped
    (classed positions, update-sized values), float32 one-ulp steps (ulp values), low bits of
    an int16 tensor flipped (rans), and every manifest (compressed, implicit parents)."""
    gen = torch.Generator().manual_seed(7)
    master = torch.randn(128, 128, generator=gen) * 0.02
    ulps = (torch.rand(4096, generator=gen) + 1.0).view(torch.int32)
    counts = torch.randint(0, 1 << 14, (4096,), generator=gen, dtype=torch.int16)
    states = []
    for _ in range(3):
        states.append(
            {"w": master.bfloat16(), "u": ulps.clone().view(torch.float32), "k": counts.clone()}
        )
        master = master - 2e-3 * torch.sign(torch.randn(128, 128, generator=gen)) * (
            master.abs() < 0.01
        )
        moved = torch.randint(0, 4096, (120,), generator=gen)
        ulps[moved] += 1
        flipped = torch.randint(0, 4096, (120,), generator=gen)
        counts[flipped] ^= torch.randint(1, 4, (120,), generator=gen, dtype=torch.int16)
    return states


def _record(store: str, reader_id: str, **fields: object) -> None:
    record = ReaderRecord(reader_id=reader_id, updated="2026-01-01T00:00:00Z", **fields)  # type: ignore[arg-type]
    open_store(store).put(f"readers/{reader_id}.json", record.to_json())


def _used(writer: DeltaWriter, store: str) -> list[tuple[str, ...]]:
    infos = [writer.publish(state) for state in _steps()]
    held: dict[str, torch.Tensor] = {}
    DeltaReader(store, StateDictTarget(held)).sync()  # every version reads back
    assert torch.equal(held["w"].view(torch.int16), _steps()[-1]["w"].view(torch.int16))
    return [info.required_features for info in infos]


def test_the_default_uses_every_feature_without_records_and_none_given_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = str(tmp_path / "default")
    caplog.set_level(logging.INFO, logger="dcr_format.publish.writer")
    used = _used(DeltaWriter(store), store)
    assert used[1] == ALL_SIX  # a delta of small-weight steps takes all six
    assert "manifest-zstd" in used[0]  # a base too, for its manifest
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f"version 0 on uses writer features {', '.join(ALL_SIX)} (the default: "
        "every feature its readers read)"
    ]  # logged once: the choice held
    plain = str(tmp_path / "plain")
    writer = DeltaWriter(plain, features=())
    assert _used(writer, plain) == [(), (), ()]
    assert writer.last_features == frozenset()


def test_records_limit_the_default_and_an_explicit_set_forces(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A record without a feature leaves it out of the default from the next publish on (a
    base too); a record that cannot read its old bits leaves out the codings against them,
    whatever the writer was given; an explicit set is used as given otherwise."""
    store = str(tmp_path / "store")
    lacking = tuple(sorted(KNOWN_FEATURES - {"values-rans", "manifest-zstd"}))
    _record(store, "old-engine", features=lacking)
    caplog.set_level(logging.INFO, logger="dcr_format.publish.writer")
    used = _used(DeltaWriter(store), store)
    assert all(not {"values-rans", "manifest-zstd"} & set(u) for u in used)
    assert {"positions-classed", "values-ulp", "implicit-parents"} <= set(used[1])
    assert "reader records limiting them: old-engine" in caplog.records[0].getMessage()

    forced = str(tmp_path / "forced")
    _record(forced, "old-engine", features=lacking)
    assert "values-rans" in _used(DeltaWriter(forced, features=["values-rans"]), forced)[1]

    for given in (None, ALL_SIX):
        blind_store = str(tmp_path / f"blind-{given is None}")
        _record(blind_store, "module", reads_baseline=False)
        _record(blind_store, "silent")  # no features listed: every one
        used = _used(DeltaWriter(blind_store, features=given), blind_store)
        assert not set(used[1]) & BASELINE_FEATURES and "manifest-zstd" in used[1]


def test_a_record_a_reader_writes_lists_the_features_it_implements(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    DeltaWriter(store).publish(_steps()[0])
    DeltaReader(store, StateDictTarget({}), reader_id="rollout-3").sync()
    record = parse(ReaderRecord, open_store(store).get("readers/rollout-3.json"), what="record")
    assert record.features == tuple(sorted(KNOWN_FEATURES))
    assert _commit.read_reader_records(open_store(store)).features == WRITER_FEATURES


def test_dcr_publish_features_default_none_and_a_list(tmp_path: Path) -> None:
    help_text = CliRunner().invoke(cli, ["publish", "--help"]).output
    assert "Default: every feature" in help_text and "'none'" in help_text
    used = {}
    for flag in (None, "none", "values-rans,manifest-zstd"):
        store = str(tmp_path / f"store-{flag}")
        for number, state in enumerate(_steps()[:2]):
            ckpt = tmp_path / f"ckpt-{flag}-{number}"
            ckpt.mkdir()
            save_file(state, str(ckpt / "model.safetensors"))
            args = ["publish", str(ckpt), "--store", store, "--format", "json"]
            args += ["--cache-dir", str(tmp_path / f"cache-{flag}")]
            args += [] if flag is None else ["--features", flag]
            result = CliRunner().invoke(cli, args, catch_exceptions=False)
            assert result.exit_code == 0, result.output
        used[flag] = tuple(json.loads(result.stdout)["required_features"])
    assert used[None] == ALL_SIX and used["none"] == ()
    assert used["values-rans,manifest-zstd"] in {
        ("manifest-zstd",),
        ("manifest-zstd", "values-rans"),
    }
    bad = CliRunner().invoke(
        cli,
        [
            "publish",
            str(tmp_path / "ckpt-none-0"),
            "--store",
            str(tmp_path / "x"),
            "--features",
            "values-zip",
        ],
    )
    assert bad.exit_code != 0 and "values-zip" in bad.output
