"""``dcr plot``: bytes and change rate per version, and change rate by layer over versions."""

from __future__ import annotations

import math
import os
import re
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from dcr_format.chain.bases import alternative_bases
from dcr_format.chain.chain import Chain
from dcr_format.errors import CapabilityError, VersionNotFoundError
from dcr_format.publish._info import CommitInfo
from dcr_format.store.store import Store, open_store
from dcr_format.tools._common import Row, numel
from dcr_format.tools._inspect import records, row_from

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|blocks|h)\.(\d+)\.")


class PlotVersion(Row):
    """One version's sizes and change rate."""

    version: int
    kind: str
    payload_bytes: int
    dense_bytes: int
    change_rate: float
    compacted: bool = False
    """A delta with an alternative base (``dcr compact``): readers may start there."""


class PlotData(Row):
    """What :func:`plot` draws."""

    versions: list[PlotVersion]
    rows: list[str]
    """Heat map rows: ``layer <i>`` for tensors named ``…layers.<i>.…``, then every other
    tensor under its own name."""
    change_rate: list[list[float | None]]
    """``change_rate[row][column]``: changed over total elements of the row's tensors in
    the column's version; None for base versions (everything is rewritten)."""


def row_of(name: str) -> str:
    """The heat map row of a tensor: its layer, or its own name."""
    match = _LAYER.search(name)
    return f"layer {int(match.group(1))}" if match else name


def plot_data(
    store: Store | str | os.PathLike[str], *, since: int | None = None, limit: int | None = None
) -> PlotData:
    """Per version sizes and change rates, and change rate by layer (reads every manifest)."""
    chain = Chain(open_store(store))
    chain.header  # noqa: B018  # refuse a store without a chain
    loaded_records = records(chain, since=since, limit=limit)
    compacted = set(alternative_bases(chain.store)) if loaded_records else set()
    with ThreadPoolExecutor(8) as pool:
        manifests = list(pool.map(chain.manifests, loaded_records))
    columns = []
    per_row: list[dict[str, tuple[int, int]]] = []
    for loaded, version_manifests in zip(loaded_records, manifests, strict=True):
        info = CommitInfo.from_record(loaded.record)
        columns.append(row_from(PlotVersion, info, compacted=loaded.record.version in compacted))
        changed: dict[str, int] = defaultdict(int)
        shapes: dict[str, tuple[int, ...]] = {}
        for manifest in version_manifests:
            for entry in manifest.entries:  # the pieces of a tensor (FORMAT.md §4.8) add up
                changed[entry.name] += entry.changed
                shapes[entry.name] = tuple(entry.shape)
        sums: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for name, count in changed.items():
            row = sums[row_of(name)]
            row[0] += count
            row[1] += numel(shapes[name])
        per_row.append({k: (v[0], v[1]) for k, v in sums.items()})
    names = {n for column in per_row for n in column}
    layers = sorted((n for n in names if n.startswith("layer ")), key=lambda n: int(n[6:]))
    rows = layers + sorted(names - set(layers))
    rates: list[list[float | None]] = []
    for name in rows:
        line: list[float | None] = []
        for column, sums_of in zip(columns, per_row, strict=True):
            elements, total = sums_of.get(name, (0, 0))
            line.append(None if column.kind == "base" or not total else elements / total)
        rates.append(line)
    return PlotData(versions=columns, rows=rows, change_rate=rates)


def plot(
    store: Store | str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    since: int | None = None,
    limit: int | None = None,
    dpi: int = 100,
) -> PlotData:
    """Draw :func:`plot_data` into a PNG at ``out`` (needs the ``plot`` extra: matplotlib)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise CapabilityError(
            f"plotting needs matplotlib ({exc}); pip install 'dcr-format[plot]'"
        ) from None
    store = open_store(store)
    data = plot_data(store, since=since, limit=limit)
    if not data.versions:
        after = "" if since is None else f" from version {since} on"
        raise VersionNotFoundError(
            f"{store.url} holds no committed version{after} to plot; publish one first, or "
            "run `dcr log` to see the committed versions"
        )
    figure = _figure(data, dpi)
    figure.savefig(os.fspath(out), format="png")
    return data


_BASE, _DELTA, _COMPACTED = "tab:orange", "tab:blue", "tab:green"


def _figure(data: PlotData, dpi: int) -> Figure:
    """The three panels of :func:`plot`."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    versions = [c.version for c in data.versions]
    height = 5.0 + min(0.22 * len(data.rows), 12.0)
    figure = Figure(figsize=(10, height), dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)
    top, middle, bottom = figure.subplots(
        3, 1, height_ratios=[2, 2, max(2, min(len(data.rows), 40) * 0.3)]
    )
    colors = [
        _BASE if c.kind == "base" else _COMPACTED if c.compacted else _DELTA for c in data.versions
    ]
    top.bar(versions, [max(c.payload_bytes, 1) for c in data.versions], color=colors)
    (dense,) = top.plot(versions, [c.dense_bytes for c in data.versions], "k--", lw=1)
    top.set_yscale("log")
    top.set_ylabel("bytes per version")
    top.set_title("payload per version against the dense checkpoint")
    # beside the panel, not over the bars and the dense line
    top.legend(
        [Patch(color=_BASE), Patch(color=_DELTA), Patch(color=_COMPACTED), dense],
        ["base", "delta", "delta with an alternative base", "dense checkpoint"],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
    )
    deltas = [c for c in data.versions if c.kind != "base"]
    middle.plot(
        [c.version for c in deltas], [100 * c.change_rate for c in deltas], "o-", ms=3, lw=1
    )
    middle.set_ylabel("changed elements (%)")
    middle.set_title("change rate per delta version")
    grid = np.array(
        [[math.nan if v is None else v for v in line] for line in data.change_rate], dtype=float
    ).reshape(len(data.rows), len(versions))
    positive = grid[np.isfinite(grid) & (grid > 0)]
    if positive.size:
        norm = LogNorm(vmin=float(positive.min()), vmax=float(max(positive.max(), positive.min())))
        shown = np.where(grid > 0, grid, math.nan) if positive.size else grid
    else:
        norm, shown = None, grid
    image = bottom.imshow(
        np.ma.masked_invalid(shown),
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        norm=norm,
        extent=(
            versions[0] - 0.5 if versions else -0.5,
            versions[-1] + 0.5 if versions else 0.5,
            len(data.rows) - 0.5,
            -0.5,
        ),
    )
    bottom.set_facecolor("0.85")
    if len(data.rows) <= 40:
        bottom.set_yticks(range(len(data.rows)), data.rows, fontsize=7)
    bottom.set_xlabel("version")
    bottom.set_title("change rate by layer (gray: base or unchanged)")
    for axes in (top, middle, bottom):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.colorbar(image, ax=bottom, label="changed / elements")
    return figure
