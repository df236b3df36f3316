"""benchmarks/gpu_kit.sh: the wheels it carries to a CUDA image cover the package's needs."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KIT = ROOT / "benchmarks" / "gpu_kit.sh"


def _array(name: str) -> set[str]:
    found = re.search(rf"^{name}=\(([^)]*)\)", KIT.read_text(), re.MULTILINE)
    assert found is not None, f"{name}=(...) not in {KIT.name}"
    return set(found.group(1).split())


def test_the_image_and_the_wheels_hold_every_dependency():
    """Every runtime dependency of pyproject.toml is either in the CUDA image the kit
    expects or among the wheels it downloads (a new dependency needs one or the other)."""
    block = re.search(
        r"^dependencies = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.S | re.M
    )
    assert block is not None
    listed = re.findall(r'^\s*"([^"]+)"', block.group(1), re.M)
    needed = {re.split(r"[<>=!~; \[]", dep, maxsplit=1)[0].lower() for dep in listed}
    assert {"torch", "pydantic", "zstandard"} <= needed  # the block was read
    covered = _array("IMAGE") | _array("WHEELS")
    assert needed <= covered, f"not in the image or the wheels: {sorted(needed - covered)}"
    assert {"pydantic-core", "annotated-types", "typing-inspection"} <= _array("WHEELS")


def test_without_a_command_it_says_how_to_use_it():
    run = subprocess.run(["bash", str(KIT)], capture_output=True, text=True)
    assert run.returncode == 2
    assert "gpu_kit.sh wheels" in run.stdout and "gpu_kit.sh run OUTDIR" in run.stdout
