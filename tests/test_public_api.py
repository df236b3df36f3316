"""The public API: ``dcr_format.__all__`` is exactly the list README.md documents, one
``replay``, every error named ``...Error`` in :mod:`dcr_format.errors` with only the bases at
the top level, and every ``dcr_format.X`` the documentation names exists."""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import dcr_format
import dcr_format.errors as errors
import dcr_format.tools

ROOT = Path(__file__).resolve().parent.parent

PUBLIC = {
    # publish
    "DeltaWriter",
    "ProjectionWriter",
    "CommitInfo",
    "ThreadCoordinator",
    "TorchDistributedCoordinator",
    "Layout",
    "owner",
    # sync
    "DeltaReader",
    "SyncResult",
    "RelayStore",
    # targets, and the types a new target is written with
    "Target",
    "StateDictTarget",
    "SafetensorsDirTarget",
    "ModuleTarget",
    "Transaction",
    "Change",
    "Applied",
    "Resident",
    # the store
    "Store",
    "open_store",
    # tools
    "log",
    "show",
    "diff",
    "verify",
    "replay",
    "compact",
    "gc",
    "state_fingerprint",
    "tensor_fingerprint",
    # errors: the bases
    "DcrError",
    "StoreError",
    "FormatError",
    "IntegrityError",
    "CommitError",
    "TargetError",
    "__version__",
}


def _readme_api() -> set[str]:
    """The names between README.md's ``<!-- public-api -->`` markers."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- public-api -->(.*?)<!-- /public-api -->", text, re.S)
    assert match, "README.md lost its <!-- public-api --> ... <!-- /public-api --> section"
    return set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", match.group(1)))


def test_all_is_exactly_the_documented_list() -> None:
    assert len(dcr_format.__all__) == len(set(dcr_format.__all__))  # no name twice
    assert set(dcr_format.__all__) == PUBLIC
    assert _readme_api() == PUBLIC - {"__version__"}
    assert len(PUBLIC) <= 40  # fits on a screen


def test_every_public_name_exists_and_says_what_it_is() -> None:
    for name in PUBLIC - {"__version__"}:
        value = getattr(dcr_format, name)
        assert inspect.getdoc(value), f"dcr_format.{name} has no docstring"
    assert {n for n in vars(dcr_format) if not n.startswith("_")} - PUBLIC <= {
        # subpackages and modules (imported as a side effect of the re-exports)
        n
        for n, v in vars(dcr_format).items()
        if inspect.ismodule(v)
    }


def test_one_replay() -> None:
    assert dcr_format.replay is dcr_format.tools.replay
    assert importlib.util.find_spec("dcr_format.sync.replay") is None
    assert "cache_dir" in inspect.signature(dcr_format.replay).parameters


def _error_classes() -> dict[str, type[BaseException]]:
    return {
        name: value
        for name, value in vars(errors).items()
        if inspect.isclass(value) and issubclass(value, errors.DcrError)
    }


def test_every_error_is_in_errors_named_error_and_a_dcr_error() -> None:
    classes = _error_classes()
    assert set(errors.__all__) == set(classes)
    assert [name for name in classes if not name.endswith("Error")] == []
    for name, cls in classes.items():
        assert cls.__module__ == "dcr_format.errors" and inspect.getdoc(cls), name


def test_only_the_base_errors_are_at_the_top_level() -> None:
    classes = _error_classes()
    bases = {
        name
        for name, cls in classes.items()
        if cls is errors.DcrError
        or any(o is not cls and issubclass(o, cls) for o in classes.values())
    }
    top = {name for name in dcr_format.__all__ if name in classes}
    assert (
        top
        == bases
        == {
            "DcrError",
            "StoreError",
            "FormatError",
            "IntegrityError",
            "CommitError",
            "TargetError",
        }
    )
    for name in bases:
        assert getattr(dcr_format, name) is classes[name]


def test_every_dcr_format_name_the_docs_use_exists() -> None:
    """``dcr_format.X`` and ``from dcr_format import X`` in README.md and docs/ resolve."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for path in files:
        text = path.read_text()
        used = set(re.findall(r"\bdcr_format\.([A-Za-z_]\w*)", text))
        imports = re.findall(r"from dcr_format import (?:\(([^)]*)\)|([^\n(]+))", text)
        for group in (a or b for a, b in imports):
            used.update(n.split(" as ")[0].strip() for n in group.split(",") if n.strip())
        for name in used:
            if (
                not hasattr(dcr_format, name)
                and importlib.util.find_spec(f"dcr_format.{name}") is None
            ):
                missing.append(f"{path.name}: dcr_format.{name}")
    assert missing == []
