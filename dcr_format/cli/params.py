"""Checks of ``dcr`` command-line values shared by the commands: each bad value is a click
usage error (exit status 2, one line), found before any work starts; and the options that
``dcr_format.cli.main`` and ``dcr_format.cli.bench`` both declare."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import click

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
