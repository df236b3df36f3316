"""How ``dcr`` commands print: JSON or a human view, tables, sizes, progress bars."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from pydantic import BaseModel


def progress_bar(iterable: Iterable[Any], *, total: int | None, desc: str) -> Iterator[Any]:
    """The items of ``iterable``, counted on stderr as tensors (a bar on a terminal, a line
    now and then off one: :class:`~dcr_format.tools._progress.Progress`)."""
    from dcr_format.tools._progress import Progress

    bar = Progress(desc, total=total, unit="tensors")
    try:
        for item in iterable:
            yield item
            bar.add()
    except GeneratorExit:  # the consumer stopped early (an error): no "done" line
        bar.enabled = False
        raise
    finally:
        bar.close()


def emit(
    fmt: str, data: BaseModel | list[BaseModel] | dict[str, Any], human: Callable[[], None]
) -> None:
    """Print ``data`` as JSON (``--format json``), else call ``human`` to print its view."""
    from pydantic import BaseModel

    if fmt == "json":
        if isinstance(data, list):
            click.echo(json.dumps([d.model_dump(mode="json") for d in data], indent=2))
        elif isinstance(data, BaseModel):
            click.echo(data.model_dump_json(indent=2))
        else:
            click.echo(json.dumps(data, indent=2))
    else:
        human()


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print aligned columns: the first left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        click.echo(
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )


def count(n: int, noun: str) -> str:
    """``count(1, "version")`` -> ``1 version``, ``count(3, "version")`` -> ``3 versions``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def human_bytes(n: float) -> str:
    """``1234567`` -> ``1.2 MB`` (decimal units)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)
