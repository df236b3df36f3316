"""The `dcr` command as a user meets it: the environment of S3 work does not break local
stores, commands start without loading what they do not need, out-of-range values are one
named line, nothing is created or committed by a command that has nothing to do."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from conftest import make_state, step_state

from dcr_format import DeltaWriter
from dcr_format.cli import cli
from dcr_format.errors import GraceTooShortError
from dcr_format.tools import gc
from dcr_format.tools._common import parse_duration


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local store whose chain ends at version 1."""
    root = tmp_path_factory.mktemp("cli-workflow")
    gen = torch.Generator().manual_seed(0)
    state = make_state(0)
    writer = DeltaWriter(root / "store", cache_dir=root / "cache")
    for version in range(2):
        if version:
            step_state(state, gen)
        writer.publish(state, step=version)
    return str(root / "store")


def _invoke(*args: str, env: dict[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env={"DCR_DEBUG": None, **(env or {})})


def test_aws_endpoint_from_the_environment_applies_to_s3_stores_only(store: str) -> None:
    env: dict[str, str | None] = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    result = _invoke("log", "--store", store, env=env)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1].startswith("1 ")
    # even one that is no URL at all: it is for S3 tools, not for this store
    assert _invoke("log", "--store", store, env={"AWS_ENDPOINT_URL": "x"}).exit_code == 0
    # an explicit --endpoint-url with a local store is still a usage error
    refused = _invoke("log", "--store", store, "--endpoint-url", "http://127.0.0.1:9")
    assert refused.exit_code == 2 and "applies to s3:// stores" in refused.stderr


def test_version_imports_neither_torch_nor_numba() -> None:
    code = (
        "import sys\n"
        "from dcr_format.cli import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
        "heavy = {m.split('.')[0] for m in sys.modules} & {'torch', 'numba', 'pydantic'}\n"
        "print(sorted(heavy))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["dcr, version 0.1.0", "[]"]


def test_a_huge_grace_is_one_line_not_an_overflow(store: str) -> None:
    result = _invoke("gc", "--store", store, "--keep-last", "1", "--grace", "99999999999d")
    assert result.exit_code == 2, result.output
    assert "longer than" in result.stderr and "Traceback" not in result.output
    result = _invoke("gc", "--store", store, "--keep-last", "1", "--grace", "9" * 400 + "d")
    assert result.exit_code == 2 and "longer than" in result.stderr
    assert parse_duration("1000w") == timedelta(weeks=1000)


def test_a_grace_below_the_commit_timeout_is_refused(store: str) -> None:
    with pytest.raises(GraceTooShortError, match="commit timeout"):
        gc(store, keep_last=1, grace=timedelta(minutes=5))
    with pytest.raises(GraceTooShortError):
        gc(store, keep_last=1, grace=timedelta(seconds=30), commit_timeout=timedelta(minutes=1))
    result = _invoke("gc", "--store", store, "--keep-last", "5", "--grace", "1m")
    assert result.exit_code == 1 and "commit timeout" in result.stderr
    # where the writers use a shorter timeout (or none runs), a shorter grace is fine
    ok = ("--grace", "1m", "--commit-timeout", "30s", "--dry-run")
    assert _invoke("gc", "--store", store, "--keep-last", "5", *ok).exit_code == 0
    assert gc(store, keep_last=5, grace=timedelta(0), commit_timeout=timedelta(0)).deleted == []


def test_diff_past_the_end_of_the_chain_names_the_version_asked_for(store: str) -> None:
    result = _invoke("diff", "0", "7", "--store", store)
    assert result.exit_code == 1
    assert "version 7 is not committed" in result.stderr and "0..1" in result.stderr
    assert "version 2" not in result.stderr


def test_doctor_refuses_a_directory_that_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "store"
    result = _invoke("doctor", "--store", str(missing))
    assert result.exit_code == 1 and "does not exist" in result.stderr, result.output
    assert "safe" not in result.stdout
    assert not (tmp_path / "no").exists()
    os.makedirs(missing)  # an empty directory is a new store to probe
    assert _invoke("doctor", "--store", str(missing), "--large-mb", "0").exit_code == 0
