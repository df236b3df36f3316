"""Damaged streams of every coding end alike on the compiled kernels and on the reference,
and the compiled decoders stay inside their arrays (tests/mutated_streams.py)."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import mutated_streams as streams
import pytest

GROUP = "fuzz: damaged streams, compiled kernels against the reference"


@pytest.fixture(scope="module")
def pool() -> list[streams.Case]:
    return streams.cases()


def test_every_pair_of_codings_is_there_and_decodes_to_the_new_bits(
    pool: list[streams.Case],
) -> None:
    floats = {(p, v) for p in streams.POSITIONS for v in streams.VALUES}
    ints = {(p, v) for p in ("rice", "ranges") for v in ("planes", "rans")}
    assert {c.codings for c in pool if c.dtype != "int32"} == floats
    assert {c.codings for c in pool if c.dtype == "int32"} == ints
    for case in pool:
        new = streams.flat_bits(case.new).tobytes()
        for which in ("native", "torch"):
            for rows in (False, True):
                with streams.kernels(which):
                    got = streams.outcome(
                        case, case.positions[1], case.values[1], case.changed, rows
                    )
                assert got == new, (case.dtype, case.codings, which, rows)


def test_damaged_streams_end_alike_on_both_paths(pool: list[streams.Case], reliability) -> None:
    runs = int(os.environ.get("DCR_DAMAGED_STREAMS", "3000"))
    tally = streams.run(runs, seed=1, pool=pool)
    assert tally.differ == []
    # every pair was refused some time, and damage that still decodes was met too (a flipped
    # value bit is a valid stream of other values): both outcomes were compared
    assert set(tally.refused) == {c.codings for c in pool}
    assert sum(tally.decoded.values()) > runs // 20
    reliability.record(
        GROUP,
        "damaged streams, every pair of codings",
        "refused alike",
        cases=sum(tally.refused.values()),
    )
    reliability.record(
        GROUP,
        "damaged streams, every pair of codings",
        "same bits on both",
        cases=sum(tally.decoded.values()),
    )


def _checked_build_cache(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """Where the bounds-checked kernels are cached: a directory of pytest's cache named by
    the source of every compiled kernel (and the numba and Python that compile it), so a
    build is reused only for the very code it was compiled from and never mixed with the
    unchecked builds numba caches next to the modules; ``tmp_path`` (compiled afresh)
    without pytest's cache."""
    import numba

    import dcr_format

    package = Path(dcr_format.__file__).parent
    sources = sorted(
        [*package.glob("kernels/*.py"), *package.glob("codings/_*_kernels.py")],
        key=lambda path: path.relative_to(package).as_posix(),
    )
    digest = hashlib.sha256(f"{numba.__version__} {sys.version} {platform.machine()}".encode())
    for source in sources:
        digest.update(source.relative_to(package).as_posix().encode() + b"\0")
        digest.update(source.read_bytes() + b"\0")
    cache = getattr(request.config, "cache", None)
    if cache is None:
        return tmp_path
    root = Path(cache.mkdir("numba-boundscheck"))
    for stale in root.iterdir():  # builds of other sources
        if stale.name != digest.hexdigest()[:20]:
            shutil.rmtree(stale, ignore_errors=True)
    return root / digest.hexdigest()[:20]


@pytest.mark.slow  # numba compiles every decoder with the checks (~35 s) unless cached
def test_compiled_decoders_stay_inside_their_arrays(
    request: pytest.FixtureRequest, tmp_path: Path, reliability
) -> None:
    pytest.importorskip("numba")
    env = {
        **os.environ,
        "NUMBA_BOUNDSCHECK": "1",
        # only builds with the checks, of this very source
        "NUMBA_CACHE_DIR": str(_checked_build_cache(request, tmp_path)),
    }
    env.pop("DCR_KERNELS", None)
    runs = int(os.environ.get("DCR_DAMAGED_STREAMS_CHECKED", "1500"))
    script = Path(__file__).with_name("mutated_streams.py")
    done = subprocess.run(
        [sys.executable, str(script), str(runs), "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "bounds checked: True" in done.stdout  # the checks were really on
    reliability.record(
        GROUP, "damaged streams, NUMBA_BOUNDSCHECK=1", "no index out of bounds", cases=runs
    )
