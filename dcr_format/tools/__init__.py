"""Chain tooling shared by Python callers and the ``dcr`` command.

Every function takes a store (a :class:`~dcr_format.Store`, a path or a URL) and
returns a frozen pydantic model; ``dcr ... --format json`` prints its
serialisation.

- :func:`log`, :func:`show`: what the chain holds;
- :func:`diff`: which tensors and elements differ between two versions;
- :func:`verify`: are all objects intact (``deep=True``: does every version replay);
- :func:`replay`: materialise a version as a checkpoint directory (with a cache);
- :func:`start_from`: start a pulled directory from a local checkpoint that holds a version;
- :func:`compact`: write an alternative base of a version (FORMAT.md §14);
- :func:`gc`: delete uncommitted attempts and versions older than the kept range;
- :func:`doctor`: probe a store's capabilities;
- :func:`plot`: bytes and change rate per version, by layer;
- :func:`readers`, :func:`remove_readers`: the reader records writers honour, and removing
  those of readers that are gone.
"""

import typing as _typing

from dcr_format.system.lazy import lazy_names as _lazy_names

if _typing.TYPE_CHECKING:
    from dcr_format.store.store import ObjectInfo
    from dcr_format.tools._common import Problem, object_infos, parse_duration
    from dcr_format.tools._compact import CompactResult, compact
    from dcr_format.tools._diff import DiffReport, DiffRow, diff
    from dcr_format.tools._doctor import Check, DoctorReport, Verdict, doctor
    from dcr_format.tools._gc import DEFAULT_GRACE, GcItem, GcReport, gc
    from dcr_format.tools._inspect import LogRow, TensorRow, VersionDetail, log, show
    from dcr_format.tools._plot import PlotData, PlotVersion, plot, plot_data
    from dcr_format.tools._readers import (
        ReaderInfo,
        ReadersReport,
        RemovedReaders,
        readers,
        remove_readers,
    )
    from dcr_format.tools._replay import ReplayResult, replay
    from dcr_format.tools._start import start_from
    from dcr_format.tools._verify import VerifyReport, verify

# Each name and its module, imported on first use: a command that needs one tool does not
# load the others (torch among them).
_WHERE: dict[str, str] = {
    "ObjectInfo": "dcr_format.store.store",
    **dict.fromkeys(("Problem", "object_infos", "parse_duration"), "dcr_format.tools._common"),
    **dict.fromkeys(("CompactResult", "compact"), "dcr_format.tools._compact"),
    **dict.fromkeys(("DiffReport", "DiffRow", "diff"), "dcr_format.tools._diff"),
    **dict.fromkeys(("Check", "DoctorReport", "Verdict", "doctor"), "dcr_format.tools._doctor"),
    **dict.fromkeys(("DEFAULT_GRACE", "GcItem", "GcReport", "gc"), "dcr_format.tools._gc"),
    **dict.fromkeys(
        ("LogRow", "TensorRow", "VersionDetail", "log", "show"), "dcr_format.tools._inspect"
    ),
    **dict.fromkeys(("PlotData", "PlotVersion", "plot", "plot_data"), "dcr_format.tools._plot"),
    **dict.fromkeys(
        ("ReaderInfo", "ReadersReport", "RemovedReaders", "readers", "remove_readers"),
        "dcr_format.tools._readers",
    ),
    **dict.fromkeys(("ReplayResult", "replay"), "dcr_format.tools._replay"),
    "start_from": "dcr_format.tools._start",
    **dict.fromkeys(("VerifyReport", "verify"), "dcr_format.tools._verify"),
}


__getattr__, __dir__ = _lazy_names(globals(), _WHERE)  # imported on first use


__all__ = [
    "DEFAULT_GRACE",
    "Check",
    "CompactResult",
    "DiffReport",
    "DiffRow",
    "DoctorReport",
    "GcItem",
    "GcReport",
    "LogRow",
    "ObjectInfo",
    "PlotData",
    "PlotVersion",
    "Problem",
    "ReaderInfo",
    "ReadersReport",
    "RemovedReaders",
    "ReplayResult",
    "TensorRow",
    "Verdict",
    "VerifyReport",
    "VersionDetail",
    "compact",
    "diff",
    "doctor",
    "gc",
    "log",
    "object_infos",
    "parse_duration",
    "plot",
    "plot_data",
    "readers",
    "remove_readers",
    "replay",
    "show",
    "start_from",
    "verify",
]
