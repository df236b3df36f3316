"""The soak's short form (dcr_format/testing/soak.py): a writer and four readers in their own
processes, for about half a minute (on a busy machine longer, up to two minutes, until the
readers have synced 20 times), through random S3 faults and SIGKILLs of any of them; at the
end every reader holds exactly the writer's last version.

The full soak is one command (docs/reliability.md):
``.venv/bin/python -m dcr_format.testing.soak --minutes 5``.
``$DCR_SOAK_SECONDS`` lengthens this one.
"""

from __future__ import annotations

import os

import pytest

from dcr_format.testing.soak import run

pytestmark = [pytest.mark.s3, pytest.mark.multiprocess, pytest.mark.slow]

SECONDS = float(os.environ.get("DCR_SOAK_SECONDS", "30"))


def test_soak_short_form(moto_server, moto_root, tmp_path, reliability):
    report = run(
        SECONDS,
        root=moto_root,
        storage_options=moto_server.storage_options(),
        upstream=moto_server.endpoint,
        workdir=tmp_path / "soak",
        readers=4,
        fault_rate=0.1,
        kill_every=6.0,
        seed=11,
        deep=False,
        min_syncs=20,
        max_seconds=4 * SECONDS,
    )
    assert report.ok, report.problems
    assert report.versions >= 5, report
    assert report.syncs >= 20, report
    assert sum(report.faults.values()) >= 10, report
    assert sum(report.kills.values()) >= 3, report
    reliability.record(
        "soak (short form in CI)",
        f"{report.seconds:.0f} s: writer + 4 readers, {report.versions} versions, "
        f"{report.syncs} syncs, {sum(report.kills.values())} SIGKILLs",
        "every reader bit-equal to the writer; no wrong bits after any sync or kill",
        cases=sum(report.faults.values()),
    )
