"""The options and checks of ``dcr`` command-line values the commands share: each bad value
is a click usage error (exit status 2, one line), found before any work starts. ``--store``
opens the store as the command's argument; the version options name versions of its chain."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import click

from dcr_format.errors import VersionNotFoundError

if TYPE_CHECKING:
    from dcr_format.store.store import Store

F = TypeVar("F", bound=Callable[..., Any])

SHOW_DEFAULTS: dict[str, Any] = {"show_default": True}
"""The context settings of every ``dcr`` command: ``--help`` shows each option's default."""

FORMAT_OPTION = click.option(
    "--format",
    "fmt",
    type=click.Choice(["human", "json"]),
    default="human",
    help="Output for people or for programs.",
)


def feature_list(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> tuple[str, ...] | None:
    """``--features``: None (not given: the writer's default), ``none`` (no feature) or a
    comma-separated list of writer features (a usage error unless each is one)."""
    if value is None:
        return None
    from dcr_format.errors import ArgumentError
    from dcr_format.format.features import writer_features

    chosen = tuple(f.strip() for f in value.split(",") if f.strip() and f.strip() != "none")
    try:
        writer_features(chosen)
    except ArgumentError as exc:
        raise click.BadParameter(str(exc)) from None
    return chosen


FEATURES_OPTION = click.option(
    "--features",
    callback=feature_list,
    default=None,
    metavar="LIST",
    help="Writer features (spec FORMAT.md §12), comma-separated, or 'none' for the plain "
    "codings every reader reads. Default: every feature all the chain's reader records list "
    "(all six: values-rans, positions-classed, values-ulp, values-ulp-shift, manifest-zstd, "
    "implicit-parents, when there are no records); the codings against the old bits only "
    "where every reader reads its old bits.",
)


def finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """Callback: refuse NaN and infinities (click's FloatRange lets them through)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number; pass a number like 1.5")
    return value


def output_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Callback: a file to write must be in a directory that exists."""
    if value is None:
        return None
    parent = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(parent):
        raise click.BadParameter(
            f"directory {parent} does not exist; create it or write the file elsewhere"
        )
    return value


def directory_option(name: str, *, help: str, required: bool = False) -> Callable[[F], F]:
    """An option naming a directory (one that need not exist yet; None: not given)."""
    return click.option(
        name, type=click.Path(file_okay=False), required=required, default=None, help=help
    )


def output_option(name: str, *, help: str, required: bool = False) -> Callable[[F], F]:
    """An option naming a file to write, checked by :func:`output_file` (None: not given)."""
    return click.option(
        name,
        type=click.Path(dir_okay=False),
        callback=output_file,
        required=required,
        default=None,
        help=help,
    )


def endpoint_url(value: str) -> str:
    """``value`` if it is an http(s) endpoint URL with a host (and a valid port), else
    ``click.BadParameter``."""
    problem = None
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018  # raises ValueError for a port that is not a number
    except ValueError as exc:
        problem = str(exc)
    else:
        if parts.scheme not in ("http", "https"):
            problem = "it does not start with http:// or https://"
        elif not parts.hostname:
            problem = "it names no host"
        elif parts.query or parts.fragment:
            problem = "it has a query or fragment"
    if problem is not None:
        raise click.BadParameter(
            f"{value!r} is not an endpoint URL ({problem}); pass one like "
            "http://127.0.0.1:9000 or https://s3.us-east-1.amazonaws.com",
            param_hint="'--endpoint-url'",
        )
    return value


def one_line(text: Any) -> str:
    """``text`` with every run of whitespace (newlines included) as one space."""
    return " ".join(str(text).split())


class _Version(click.ParamType[int, Any]):
    """A version of the chain: a whole number from 0."""

    name = "version"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        text = str(value).strip()
        if text.isascii() and text.isdigit():
            return int(text)
        self.fail(
            f"{value!r} is not a version number: versions are 0, 1, 2, ... "
            "(`dcr log --store URL` lists them)",
            param,
            ctx,
        )


VERSION = _Version()
"""The type of every argument and option that names a version of the chain."""


def _remember(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    if param.name == "endpoint_url" and value:
        source = ctx.get_parameter_source("endpoint_url")
        ctx.meta["dcr.endpoint_from_env"] = source == click.core.ParameterSource.ENVIRONMENT
    ctx.meta[f"dcr.{param.name}"] = value


def _open_store(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """The --store URL as a Store, with the (eagerly parsed) S3 endpoint and writer mode."""
    if value is None:
        return None
    from dcr_format.store.store import Store

    endpoint = ctx.meta.get("dcr.endpoint_url")
    options = None
    is_s3 = value.startswith(("s3://", "s3a://"))
    if endpoint and not is_s3 and ctx.meta.get("dcr.endpoint_from_env"):
        endpoint = None  # AWS_ENDPOINT_URL set for S3 work says nothing about other stores
    if endpoint:
        endpoint = endpoint_url(endpoint)
        if not is_s3:
            raise click.BadParameter(
                "--endpoint-url applies to s3:// stores; drop it or pass an s3://bucket/prefix "
                "store",
                param=param,
            )
        options = {"endpoint_url": endpoint}
    store = Store(
        value, storage_options=options, single_writer=bool(ctx.meta.get("dcr.single_writer"))
    )
    if store.url.startswith("file://"):
        root = Path(store.url[len("file://") :])
        if root.exists() and not root.is_dir():
            raise click.BadParameter(
                f"{root} is a file, not a store directory; pass a directory (or a new path)",
                param=param,
            )
    return store


def versions_in_chain(store: Store, **named: int | None) -> None:
    """Every named version (None: not given) is committed in the chain's range."""
    from dcr_format.chain.chain import Chain

    versions = Chain(store).versions()
    for option, version in named.items():
        if version is None:
            continue
        if not versions:
            raise VersionNotFoundError(f"{store.url} has no committed version; publish first")
        if not versions[0] <= version <= versions[-1]:
            raise VersionNotFoundError(
                f"{option} {version}: the chain of {store.url} holds versions "
                f"{versions[0]}..{versions[-1]}; pick one of those (`dcr log` lists them)"
            )


def STORE_OPTION(command: F) -> F:
    """``--store`` (env DCR_STORE) plus ``--endpoint-url``: a store the command reads."""
    command = click.option(
        "--store",
        envvar="DCR_STORE",
        required=True,
        callback=_open_store,
        help="Store URL or path (env DCR_STORE): ./refit-store, file:///..., memory://..., "
        "s3://bucket/prefix",
    )(command)
    return click.option(
        "--endpoint-url",
        envvar="AWS_ENDPOINT_URL",
        is_eager=True,
        expose_value=False,
        callback=_remember,
        help="S3 endpoint (default: the AWS environment and config, AWS_ENDPOINT_URL, which "
        "other stores ignore).",
    )(command)


def WRITER_STORE_OPTION(command: F) -> F:
    """:func:`STORE_OPTION` plus ``--single-writer``: a store the command writes."""
    return click.option(
        "--single-writer",
        is_flag=True,
        is_eager=True,
        expose_value=False,
        callback=_remember,
        help="Write to a server that ignores conditional writes: only one writer may run.",
    )(STORE_OPTION(command))


def version_option(*names: str, help: str, required: bool = False) -> Callable[[F], F]:
    """An option naming a version of the chain (None: not given)."""
    return click.option(*names, type=VERSION, default=None, required=required, help=help)


def default_cache() -> Path:
    """Where publish and replay keep the baseline bits: $DCR_CACHE_DIR, else the user cache."""
    base = os.environ.get("DCR_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dcr"
    )
    return Path(base).expanduser()
