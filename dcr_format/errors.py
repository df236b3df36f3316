"""One error hierarchy for dcr-format.

Every error derives from :class:`DcrError`; specific errors also derive from the
matching built-in so ``except FileNotFoundError`` and friends keep working.
Messages are one line and say what to do.
"""

from __future__ import annotations

__all__ = [
    "AliasedTensorError",
    "ApplyError",
    "ArgumentError",
    "BaselineCodingError",
    "BaselineMismatchError",
    "CapabilityError",
    "ChainBrokenError",
    "ChecksumMismatchError",
    "CommitConflictError",
    "CommitError",
    "CommitStateUnknownError",
    "DcrError",
    "DecodeLimitError",
    "EngineUpdateError",
    "FingerprintMismatchError",
    "FormatError",
    "GraceTooShortError",
    "GroupAbortError",
    "IncompleteVersionError",
    "IntegrityError",
    "InvalidKeyError",
    "MissingTensorError",
    "NotInPlaceError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "ObjectTooLargeError",
    "OverwriteRequiredError",
    "PositionsError",
    "ReservedNameError",
    "SchemaError",
    "ShardError",
    "StalePreparedError",
    "StoreError",
    "StoreNotInitializedError",
    "TargetBusyError",
    "TargetChangedError",
    "TargetError",
    "TargetLayoutError",
    "TargetNotUpdatableError",
    "TargetUnreadableError",
    "UnchangedVersionError",
    "UnsupportedDtypeError",
    "UnsupportedFeatureError",
    "UnsupportedPlacementError",
    "UnsupportedVersionError",
    "ValuesError",
    "VersionNotFoundError",
]


class DcrError(Exception):
    """Base class of every error raised by dcr-format."""


# --- store -------------------------------------------------------------------


class StoreError(DcrError, OSError):
    """The object store failed to carry out a request."""


class ObjectNotFoundError(StoreError, FileNotFoundError):
    """An object the caller asked for does not exist in the store."""


class ObjectExistsError(StoreError, FileExistsError):
    """A create-if-absent found the object already there."""


class StoreNotInitializedError(StoreError, FileNotFoundError):
    """The store root holds no ``dcr.json`` header (no chain was ever created there)."""


class InvalidKeyError(DcrError, ValueError):
    """A key would leave the store root or is not a well-formed relative key."""


class CapabilityError(DcrError, RuntimeError):
    """The store lacks a capability the operation needs (for example atomic create)."""


# --- format / hostile bytes ----------------------------------------------------


class FormatError(DcrError, ValueError):
    """Bytes read from a store do not form a valid object of this format."""


class SchemaError(FormatError):
    """A JSON object (header, commit record, manifest) does not validate."""


class UnsupportedVersionError(FormatError):
    """The object declares a ``format_version`` this reader does not know."""


class UnsupportedFeatureError(FormatError):
    """The object lists a ``required_features`` entry this reader does not implement."""


class ShardError(FormatError):
    """A shard container is truncated, oversized, or its layout is inconsistent."""


class PositionsError(FormatError):
    """A positions stream does not decode to sorted, unique, in-range indices."""


class ValuesError(FormatError):
    """A values stream does not decode to the declared number of elements."""


class ObjectTooLargeError(FormatError):
    """A stored object is larger than the caller allows it to be."""


class DecodeLimitError(FormatError):
    """Streams declare more decoded bytes than the reader's limits let it hold."""


class UnsupportedDtypeError(DcrError, TypeError):
    """A tensor has a dtype the format cannot carry bit-exactly."""


# --- integrity -----------------------------------------------------------------


class IntegrityError(DcrError, ValueError):
    """Stored bytes or tensor contents do not match what the chain records."""


class ChecksumMismatchError(IntegrityError):
    """An object's size or sha256 differs from the value recorded for it."""


class ChainBrokenError(IntegrityError):
    """A commit record does not link to its parent (hash chain or version numbers)."""


class FingerprintMismatchError(IntegrityError):
    """A decoded tensor's fingerprint differs from the one the chain records."""


class BaselineMismatchError(IntegrityError):
    """The target does not hold the exact bits of the version a delta applies to."""


# --- commits / chain -----------------------------------------------------------


class CommitError(DcrError):
    """A version could not be committed."""


class CommitConflictError(CommitError, FileExistsError):
    """Another writer committed this version first; this attempt is safe to discard."""


class CommitStateUnknownError(CommitError, TimeoutError):
    """The commit request's outcome is unknown; never delete this attempt's objects."""


class IncompleteVersionError(CommitError, TimeoutError):
    """Not every writer rank delivered a valid manifest in time; nothing was committed."""


class MissingTensorError(DcrError, ValueError):
    """A publish lacks a tensor the previous version has (only a base may drop tensors)."""


class GroupAbortError(DcrError, RuntimeError):
    """Another rank of a reader group failed, so no rank applied the version."""


class VersionNotFoundError(DcrError, LookupError):
    """The requested version is not committed in this chain."""


# --- targets ---------------------------------------------------------------------


class TargetError(DcrError, ValueError):
    """The target cannot take this version (missing tensor, wrong shape or dtype)."""


class OverwriteRequiredError(TargetError):
    """A target's load path transforms a tensor (cast, scaling, overlap), so it cannot take
    that tensor as ``xor``; writers must send it as ``overwrite`` (FORMAT.md §8.4)."""


class BaselineCodingError(TargetError):
    """A version codes a tensor's positions against its old bits (feature
    ``positions-classed``), and this target cannot read those bits in canonical coordinates
    (a module behind its loader): its reader record asks writers not to."""


class ApplyError(DcrError, RuntimeError):
    """Applying a version failed; the target was rolled back to its previous version."""


class StalePreparedError(DcrError, RuntimeError):
    """A prepared version no longer fits its target (the target moved since, or the version
    was prepared by another reader): prepare it again."""


class TargetBusyError(TargetError):
    """Another sync holds the target (for a directory's lock file, the message names the
    holder's pid and host)."""


class TargetChangedError(TargetError):
    """Another sync moved the target to a new version while this one was planning."""


class TargetLayoutError(TargetError):
    """The target path or its sidecar is not laid out as dcr keeps it (e.g. a linked sidecar)."""


class TargetUnreadableError(TargetError):
    """The target's files cannot be read or written (state file, safetensors, permissions)."""


class AliasedTensorError(TargetError):
    """Two tensors of a dict target share storage without being the same view (tied weights
    that overlap partially), so an in-place change through one would corrupt the other."""


class NotInPlaceError(TargetError):
    """A version would replace or remove a tensor the caller gave a dict target (another
    dtype or shape, or a base without it), which whatever holds that tensor (a model) would
    never see; nothing was changed."""


class ReservedNameError(DcrError, ValueError):
    """A tensor name is reserved (``__metadata__`` is the safetensors header key)."""


class ArgumentError(DcrError, ValueError):
    """A value passed to a dcr-format constructor or call is out of range or inconsistent."""


class UnchangedVersionError(CommitError):
    """A publish asked not to commit an empty version found every tensor unchanged; nothing
    was committed."""


class GraceTooShortError(DcrError, ValueError):
    """gc's grace period is shorter than the writers' commit timeout, so it could delete an
    attempt a writer is still committing."""


class UnsupportedPlacementError(DcrError, ValueError):
    """A distributed tensor is placed in a way that holds no weights to publish (a
    ``Partial`` sum not yet reduced), or this rank holds none of it."""


class TargetNotUpdatableError(TargetError):
    """A runtime computes from a copy of a weight that its loader cannot reach (vLLM's CPU
    build prepacks linear weights), so it cannot be updated in place; nothing was changed."""


class EngineUpdateError(DcrError, RuntimeError):
    """An inference engine did not reach the requested version, or could not start dcr (its
    message says why); an engine driven through the dcr backend then keeps its previous
    weights and serves on."""
