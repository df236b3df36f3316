"""dcr-format: bit-exact delta refit of model weights through object storage.

Trainers publish each optimizer step with :class:`DeltaWriter`; rollout nodes
keep a target at the newest version with :class:`DeltaReader`. Operators inspect,
verify, compact and garbage-collect a chain with :mod:`dcr_format.tools` (the most
used of those are exported here too).
"""

from dcr_format.errors import *  # noqa: F403
from dcr_format.errors import __all__ as _error_names
from dcr_format.fingerprint import state_fingerprint, tensor_fingerprint
from dcr_format.layout import Layout
from dcr_format.readers.module import ModuleTarget
from dcr_format.readers.reader import DeltaReader, SyncResult
from dcr_format.readers.relay import RelayStore
from dcr_format.readers.replay import replay
from dcr_format.readers.targets import SafetensorsDirTarget, StateDictTarget, Target
from dcr_format.store import Store, open_store
from dcr_format.tools import compact, diff, gc, log, show, verify
from dcr_format.writers.coordinate import ThreadCoordinator, TorchDistributedCoordinator
from dcr_format.writers.projection import ProjectionWriter
from dcr_format.writers.writer import CommitInfo, DeltaWriter, owner

__version__ = "0.1.0"

__all__ = [
    *_error_names,
    "CommitInfo",
    "DeltaReader",
    "DeltaWriter",
    "Layout",
    "ModuleTarget",
    "ProjectionWriter",
    "RelayStore",
    "SafetensorsDirTarget",
    "StateDictTarget",
    "Store",
    "SyncResult",
    "Target",
    "ThreadCoordinator",
    "TorchDistributedCoordinator",
    "__version__",
    "compact",
    "diff",
    "gc",
    "log",
    "open_store",
    "owner",
    "replay",
    "show",
    "state_fingerprint",
    "tensor_fingerprint",
    "verify",
]
