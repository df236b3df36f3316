"""The backends under :class:`~dcr_format.store.store.Store`, and the choice of one from a URL.

- :mod:`._base`: the :class:`~._base.Backend` protocol, key rules, capabilities,
  listing entries and the signals backends raise;
- :mod:`._local`: local paths (``./store``, ``/abs``, ``file://``, ``local://``);
- :mod:`._memory`: ``memory://name``;
- :mod:`._s3`: ``s3://bucket/prefix`` and ``s3a://`` (the ``s3`` extra; imported
  only when such a URL is opened, since s3fs may not be installed);
- :mod:`._fsspec`: any other fsspec URL.
"""

from __future__ import annotations

import os
import re
from typing import Any

from dcr_format.errors import CapabilityError, StoreError
from dcr_format.store._base import Backend
from dcr_format.store._local import LocalBackend, local_root

__all__ = ["describe", "open_backend"]

_S3_SCHEMES = ("s3://", "s3a://")
_ONE_SLASH = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/(?!/)(.*)$", re.S)  # s3:/b, not C:/


def describe(exc: BaseException) -> str:
    """An exception's reason on one line (its ``strerror`` where it has one)."""
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return " ".join(str(text).split())


def open_backend(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None, *, single_writer: bool
) -> Backend:
    """The backend for a store URL or path; refusals are named errors that say what to do."""
    if isinstance(url, str):
        url = _one_slash(url)
    root = local_root(url)
    if root is not None:
        return LocalBackend(root, single_writer=single_writer)
    assert isinstance(url, str)  # a PathLike is always local
    if url.startswith(_S3_SCHEMES):
        return _open_s3(url, storage_options, single_writer=single_writer)
    # imported here: a local store (the common case, and every quick command) needs no fsspec
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    from dcr_format.store._fsspec import FsspecBackend, fsspec_url
    from dcr_format.store._memory import MemoryBackend

    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise CapabilityError(
            f"cannot open store {url}: {describe(exc)}; "
            "install the fsspec backend for this protocol or fix the URL"
        ) from exc
    except OSError as exc:
        raise StoreError(
            f"cannot open store {url}: {describe(exc)}; "
            "check the URL, credentials and connectivity, then retry"
        ) from exc
    if type(fs) is MemoryFileSystem:  # only fsspec's own is known to be process-local
        return MemoryBackend(fs, path, single_writer=single_writer)
    return FsspecBackend(fs, path, fsspec_url(fs, url, path), single_writer=single_writer)


def _one_slash(url: str) -> str:
    """``url`` itself, or ``file:/abs`` as the local path ``/abs``; a URL of another scheme
    with one slash (``s3:/bucket``: a typo, not the local directory ``s3:``) is refused."""
    match = _ONE_SLASH.match(url)
    if match is None:
        return url
    scheme, rest = match.groups()
    if scheme.lower() == "file":
        return "/" + rest
    raise StoreError(
        f"store URL {url} has one slash after {scheme}:; write {scheme}://{rest}, or "
        f"./{url} for a local directory of that name"
    )


def _open_s3(url: str, storage_options: dict[str, Any] | None, *, single_writer: bool) -> Backend:
    # Imported here, not above: s3fs and botocore come with the optional s3 extra.
    try:
        from dcr_format.store._s3 import S3Backend
    except ImportError as exc:
        raise CapabilityError(
            f"cannot open store {url}: {describe(exc)}; install the S3 extra: "
            "pip install 'dcr-format[s3]'"
        ) from exc
    try:
        backend = S3Backend(url, storage_options, single_writer=single_writer)
    except (TypeError, ValueError) as exc:
        raise StoreError(
            f"cannot open store {url}: {describe(exc)}; use s3://bucket/prefix and valid "
            "storage_options"
        ) from exc
    return backend
