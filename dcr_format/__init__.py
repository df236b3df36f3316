"""dcr-format: bit-exact delta refit of model weights through object storage.

Trainers publish each optimizer step with :class:`DeltaWriter`; rollout nodes
keep a target at the newest version with :class:`DeltaReader`. Operators inspect,
verify, replay, compact and garbage-collect a chain with :mod:`dcr_format.tools`
(the most used of those are exported here too).

Every error derives from :class:`DcrError`; the category bases are exported here,
each specific error lives in :mod:`dcr_format.errors`. Test support (local S3
servers, a fault proxy, the soak) is :mod:`dcr_format.testing`.
"""

from dcr_format.errors import (
    CommitError,
    DcrError,
    FormatError,
    IntegrityError,
    StoreError,
    TargetError,
)
from dcr_format.fingerprint import state_fingerprint, tensor_fingerprint
from dcr_format.layout import Layout
from dcr_format.readers.module import ModuleTarget
from dcr_format.readers.reader import DeltaReader, SyncResult
from dcr_format.readers.relay import RelayStore
from dcr_format.readers.targets import (
    Applied,
    Change,
    Resident,
    SafetensorsDirTarget,
    StateDictTarget,
    Target,
    Transaction,
)
from dcr_format.store import Store, open_store
from dcr_format.tools import compact, diff, gc, log, replay, show, verify
from dcr_format.writers.coordinate import ThreadCoordinator, TorchDistributedCoordinator
from dcr_format.writers.projection import ProjectionWriter
from dcr_format.writers.writer import CommitInfo, DeltaWriter, owner

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
