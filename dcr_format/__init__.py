"""dcr-format: bit-exact delta refit of model weights through object storage.

Trainers publish each optimizer step with :class:`DeltaWriter`; rollout nodes
keep a target at the newest version with :class:`DeltaReader`. Operators inspect,
verify, replay, compact and garbage-collect a chain with :mod:`dcr_format.tools`
(the most used of those are exported here too).

Every error derives from :class:`DcrError`; the category bases are exported here,
each specific error lives in :mod:`dcr_format.errors`. Test support (local S3
servers, a fault proxy, the soak) is :mod:`dcr_format.testing`.
"""

import typing as _typing

from dcr_format.system.lazy import lazy_names as _lazy_names

if _typing.TYPE_CHECKING:
    from dcr_format.chain.layout import Layout
    from dcr_format.delta.fingerprint import state_fingerprint, tensor_fingerprint
    from dcr_format.errors import (
        CommitError,
        DcrError,
        FormatError,
        IntegrityError,
        StoreError,
        TargetError,
    )
    from dcr_format.publish._canonical import owner
    from dcr_format.publish._info import CommitInfo
    from dcr_format.publish.coordinate import ThreadCoordinator, TorchDistributedCoordinator
    from dcr_format.publish.projection import ProjectionWriter
    from dcr_format.publish.writer import DeltaWriter
    from dcr_format.store.relay import RelayStore
    from dcr_format.store.store import Store, open_store
    from dcr_format.sync.reader import DeltaReader, SyncResult
    from dcr_format.targets.change import Applied, Change, Resident
    from dcr_format.targets.dict import StateDictTarget
    from dcr_format.targets.directory import SafetensorsDirTarget
    from dcr_format.targets.module import ModuleTarget
    from dcr_format.targets.protocol import Target, Transaction
    from dcr_format.tools import compact, diff, gc, log, replay, show, verify

# Each public name and the module that defines it: imported on first use, so that
# ``import dcr_format`` (and the ``dcr`` command, which imports what each command needs)
# does not load torch, numba and every layer up front.
_WHERE: dict[str, str] = {
    **dict.fromkeys(
        ("CommitError", "DcrError", "FormatError", "IntegrityError", "StoreError", "TargetError"),
        "dcr_format.errors",
    ),
    **dict.fromkeys(("state_fingerprint", "tensor_fingerprint"), "dcr_format.delta.fingerprint"),
    "Layout": "dcr_format.chain.layout",
    "ModuleTarget": "dcr_format.targets.module",
    **dict.fromkeys(("DeltaReader", "SyncResult"), "dcr_format.sync.reader"),
    "RelayStore": "dcr_format.store.relay",
    **dict.fromkeys(("Applied", "Change", "Resident"), "dcr_format.targets.change"),
    **dict.fromkeys(("Target", "Transaction"), "dcr_format.targets.protocol"),
    "StateDictTarget": "dcr_format.targets.dict",
    "SafetensorsDirTarget": "dcr_format.targets.directory",
    **dict.fromkeys(("Store", "open_store"), "dcr_format.store.store"),
    **dict.fromkeys(
        ("compact", "diff", "gc", "log", "replay", "show", "verify"), "dcr_format.tools"
    ),
    **dict.fromkeys(
        ("ThreadCoordinator", "TorchDistributedCoordinator"), "dcr_format.publish.coordinate"
    ),
    "ProjectionWriter": "dcr_format.publish.projection",
    "CommitInfo": "dcr_format.publish._info",
    "DeltaWriter": "dcr_format.publish.writer",
    "owner": "dcr_format.publish._canonical",
}


__getattr__, __dir__ = _lazy_names(globals(), _WHERE)  # imported on first use


__version__ = "0.1.0"

# The public API, by job (tests/test_public_api.py holds the same list; README.md shows it).
__all__ = [  # noqa: RUF022 (grouped by job, as README.md lists them; not sorted)
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
    # errors: the bases (every error is in dcr_format.errors)
    "DcrError",
    "StoreError",
    "FormatError",
    "IntegrityError",
    "CommitError",
    "TargetError",
    "__version__",
]
