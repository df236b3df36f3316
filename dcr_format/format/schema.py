"""Pydantic models of every JSON object in a store (spec/FORMAT.md is normative).

Models are frozen and strict; unknown optional fields are ignored. Objects read
from a store go through :func:`parse`, which refuses an object over its kind's size
limit or of a shape no writer makes (:mod:`dcr_format.format.jsonscan`) before parsing it,
and a newer ``format_version`` or an unknown ``required_features`` entry before
validating the rest. Long arrays are validated fail-fast, so a refused object costs
one error, not one per element.
"""

from __future__ import annotations

import functools
import itertools
import re
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, TypeVar

import pydantic_core
import zstandard
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    FailFast,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    ValidationError,
    model_serializer,
    model_validator,
)

from dcr_format.errors import (
    ArgumentError,
    ReservedNameError,
    SchemaError,
    UnsupportedFeatureError,
    UnsupportedVersionError,
)
from dcr_format.format.features import (
    CHECKPOINT_FILES_FEATURE,
    IMPLICIT_PARENTS_FEATURE,
    MANIFEST_ZSTD_FEATURE,
    POSITIONS_CLASSED_FEATURE,
    VALUES_RANS_FEATURE,
    VALUES_ULP_FEATURE,
    VALUES_ULP_SHIFT_FEATURE,
)
from dcr_format.format.jsonscan import scan
from dcr_format.format.names import (
    CLASSED,
    DTYPE_NAMES,
    OPS,
    POSITION_CODINGS,
    ULP,
    ULP_SHIFT,
    VALUE_CODINGS,
)
from dcr_format.format.shard import frame_size, inflate

FORMAT_NAME: Final = "dcr"
FORMAT_VERSION = 1
PIECES_FEATURE = "pieces"  # entries that carry one disjoint region of a tensor (FORMAT.md §4.8)
KNOWN_FEATURES: frozenset[str] = frozenset(
    {
        PIECES_FEATURE,
        VALUES_RANS_FEATURE,
        POSITIONS_CLASSED_FEATURE,
        MANIFEST_ZSTD_FEATURE,
        VALUES_ULP_FEATURE,
        IMPLICIT_PARENTS_FEATURE,
        VALUES_ULP_SHIFT_FEATURE,
        CHECKPOINT_FILES_FEATURE,
    }
)
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MANIFEST_ZSTD_LEVEL = 19  # a manifest is small and read by every reader: compress it hard
# ... unless its JSON is past 8 KiB. Its compression is on the publish's critical path
# (after the last shard, before the commit), and past a few KiB the higher levels cost far
# more time than the bytes they save next to the shards. Measured on real manifests: 26 KB
# of JSON (84 tensors of a 300 MB model) level 19 15 ms of CPU for 2,613 bytes, level 9
# 0.15 ms for 2,757 (shards of that version at 1% change: 1.27 MB); 96 KB of JSON (327
# tensors) level 15 18 ms for 9.4 KB, level 9 1.1 ms for 10.6 KB (shards: 4.2 MB); 300 KB
# (1,000 tensors) level 15 4.3 ms for 29.4 KB, level 9 2.2 ms for 29.0 KB; 920 KB level 15
# 24 ms, level 9 8 ms, 90 KB both; level 19 took 128-485 ms there
MANIFEST_ZSTD_LARGE_LEVEL = 9
MANIFEST_ZSTD_LARGE_BYTES = 8 << 10
MAX_JSON_BYTES = 64 << 20  # no JSON object of a store is ever larger (the manifest limit)
MAX_HEADER_JSON_BYTES = 64 << 10  # dcr.json: ~200 bytes
MAX_RECORD_JSON_BYTES = 1 << 20  # commit and base records: ~1 KB + ~200 bytes per writer rank
MAX_READER_JSON_BYTES = 1 << 20  # reader records: a list of tensor names
MAX_BASELINE_NAMES = 4096
"""The most names a reader record's ``baseline_names`` lists: so many that a writer which
does not know the member still reads the record (FORMAT.md §3.1: at most 4096 values in
unknown members beyond one per member)."""
MAX_MANIFEST_JSON_BYTES = MAX_JSON_BYTES  # ~330 bytes per entry: ~200,000 entries of one rank

Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
TensorFingerprint = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
Hex32 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
Timestamp = Annotated[
    # [0-9], not \d: the Rust regex engine's \d also matches non-ASCII digits
    str,
    StringConstraints(
        pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?Z$"
    ),
]


def _no_dot_segments(key: str) -> str:
    if any(part in (".", "..") for part in key.split("/")):
        raise ValueError("key has a '.' or '..' segment")
    return key


RelKey = Annotated[
    str,
    StringConstraints(pattern=r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$", max_length=1024),
    AfterValidator(_no_dot_segments),  # '..' would climb out of the store root
]
RESERVED_TENSOR_NAMES: frozenset[str] = frozenset({"__metadata__"})
"""Names no tensor may have: ``__metadata__`` is the key of a safetensors file's header
metadata, so a tensor of that name makes a file safetensors cannot load (FORMAT.md §3.2)."""


MAX_TENSOR_NAME = 1024
"""The most code points a tensor name may have (FORMAT.md Appendix C)."""
_NAME_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_tensor_name(name: object) -> str:
    """Refuse what cannot be a tensor name of the format (FORMAT.md §3.2): not a string, empty,
    over :data:`MAX_TENSOR_NAME` code points or holding a control character
    (:class:`~dcr_format.errors.ArgumentError`), or reserved (:data:`RESERVED_TENSOR_NAMES`,
    :class:`~dcr_format.errors.ReservedNameError`); returns ``name``. Writers call it on
    every name they publish, before anything is uploaded."""
    if not isinstance(name, str):
        raise ArgumentError(f"tensor names must be strings, not {type(name).__name__}")
    if not name:
        raise ArgumentError("a tensor name is empty; give every tensor a name")
    if len(name) > MAX_TENSOR_NAME:
        raise ArgumentError(
            f"tensor name {name[:64]!r}... has {len(name)} characters, over the "
            f"{MAX_TENSOR_NAME} the format allows; shorten it"
        )
    control = _NAME_CONTROL.search(name)
    if control is not None:
        raise ArgumentError(
            f"tensor name {name[:256]!r} holds the control character {control.group()!r}; "
            "rename the tensor"
        )
    if name in RESERVED_TENSOR_NAMES:
        raise ReservedNameError(
            f"tensor name {name!r} is reserved (it is the safetensors header key); "
            "rename the tensor before publishing"
        )
    return name


def _not_reserved(name: str) -> str:
    if name in RESERVED_TENSOR_NAMES:  # a ValueError: pydantic reports it as invalid
        raise ValueError(f"tensor name {name!r} is reserved")
    return name


TensorName = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_TENSOR_NAME, pattern=r"^[^\x00-\x1f\x7f]+$"),
    AfterValidator(_not_reserved),
]
MAX_CHECKPOINT_FILE_BYTES = 64 << 20
"""The largest checkpoint file a version may carry (a tokenizer.json is up to ~35 MB)."""
MAX_CHECKPOINT_FILES_BYTES = 256 << 20
"""The most bytes of checkpoint files one version may carry in all."""
MAX_CHECKPOINT_FILES = 1024
"""The most checkpoint files one version may carry."""
CHECKPOINT_FILE_NAME = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$"
"""The names a checkpoint file may have: a plain file name, neither hidden nor a path."""
DCR_FILE_NAMES: frozenset[str] = frozenset({"dcr-state.json", "model.safetensors.index.json"})
"""Names of a checkpoint directory that a directory target writes itself, with every name
ending in ``.safetensors``: no checkpoint file may have them (FORMAT.md §3.5.6)."""


def is_dcr_file_name(name: str) -> bool:
    """Whether a directory target writes a file of this name itself (tensors, index, state)."""
    return name in DCR_FILE_NAMES or name.endswith(".safetensors")


def _not_dcr_file(name: str) -> str:
    if is_dcr_file_name(name):  # a ValueError: pydantic reports it as invalid
        raise ValueError(f"file name {name!r} is written by directory targets themselves")
    return name


FileName = Annotated[
    str, StringConstraints(pattern=CHECKPOINT_FILE_NAME), AfterValidator(_not_dcr_file)
]
Count = Annotated[int, Field(ge=0, le=(1 << 62))]
Version = Annotated[int, Field(ge=0, le=(1 << 62))]
STEP_LIMIT: Final = 1 << 62  # a commit record's step lies in [-STEP_LIMIT, STEP_LIMIT]
if TYPE_CHECKING:  # the names are tuples known at run time only: a checker sees a str
    DType = str
    Op = str
    PositionCoding = str
    ValueCoding = str
else:
    DType = Literal[DTYPE_NAMES]
    Op = Literal[OPS]
    PositionCoding = Literal[(*POSITION_CODINGS, CLASSED)]
    ValueCoding = Literal[(*VALUE_CODINGS, ULP, ULP_SHIFT)]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")

    def to_json(self) -> bytes:
        """Canonical serialisation: compact JSON, fields in declaration order."""
        return self.model_dump_json().encode()


class StoreHeader(_Model):
    """``dcr.json``: identifies the chain a store root holds."""

    format: Literal["dcr"] = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    required_features: Annotated[tuple[str, ...], FailFast()] = ()
    chain_id: Hex32
    created: Timestamp
    conditional_writes: bool | None = None
    """Whether the server honoured ``If-None-Match: *`` when the chain was created (S3);
    absent (None) where the store sends no conditional request (local disk, memory).
    Informational: a writer asks the store itself, once per process."""

    def to_json(self) -> bytes:
        """As every model, but ``conditional_writes`` is left out when unknown."""
        exclude = {"conditional_writes"} if self.conditional_writes is None else None
        return self.model_dump_json(exclude=exclude).encode()


class ShardRef(_Model):
    """One shard object of a manifest."""

    path: RelKey
    sha256: Sha256
    size: Count
    decoded_size: Count


class StreamRef(_Model):
    """Where one entry's stream sits: a shard index and a stream key inside it."""

    shard: Count
    key: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    coding: str


class PositionsRef(StreamRef):
    """A positions stream and its coding."""

    coding: PositionCoding


class ValuesRef(StreamRef):
    """A values stream and its coding."""

    coding: ValueCoding


Lane = Annotated[int, Field(ge=0, lt=1 << 31)]


class Piece(_Model):
    """An entry's place among the disjoint pieces that together make one canonical tensor.

    ``lanes_before``/``lanes_after`` are the fingerprint lanes (FORMAT.md §9.1) summed
    over the piece's region only, in the parent version and after this one (null before
    for ``full`` pieces); the tensor's lanes are the sums over its ``count`` pieces.
    """

    index: Count
    count: Annotated[int, Field(ge=1, le=1 << 20)]
    lanes_before: tuple[Lane, ...] | None = Field(default=None, min_length=2, max_length=3)
    lanes_after: tuple[Lane, ...] = Field(min_length=2, max_length=3)


class Entry(_Model):
    """One canonical tensor of a manifest: its state after the version and how to get there."""

    name: TensorName
    dtype: DType
    shape: tuple[Count, ...] = Field(max_length=64)
    op: Op
    changed: Count
    positions: PositionsRef | None = None
    values: ValuesRef | None = None
    encoded_bytes: Count = 0
    fingerprint: TensorFingerprint
    parent_fingerprint: TensorFingerprint | None = None
    piece: Piece | None = None
    """Set on a piece of a tensor published by several ranks; absent (not null) otherwise,
    so whole-tensor entries serialise exactly as before the feature existed."""

    @property
    def streams(self) -> tuple[PositionsRef | ValuesRef, ...]:
        """The entry's stream references (positions first), those it has."""
        return tuple(ref for ref in (self.positions, self.values) if ref is not None)

    @model_serializer(mode="wrap")
    def _omit_absent_piece(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict) and data.get("piece") is None:
            data.pop("piece", None)
        return data


class CheckpointFile(_Model):
    """One small file of the checkpoint a version carries (config, tokenizer, chat
    template), stored once under its content's sha256 (FORMAT.md §3.5.6)."""

    name: FileName
    size: Annotated[int, Field(ge=0, le=MAX_CHECKPOINT_FILE_BYTES)]
    sha256: Sha256

    @property
    def key(self) -> str:
        """The object that holds its bytes: ``files/<sha256>``."""
        return file_key(self.sha256)


def file_key(sha256: str) -> str:
    """The key of a checkpoint file's bytes: ``files/<sha256 of the bytes>``."""
    return f"files/{sha256}"


class Manifest(_Model):
    """``objects/<N>/<attempt>/manifest-<rank>.json``: one writer rank's part of a version."""

    format_version: int = FORMAT_VERSION
    required_features: Annotated[tuple[str, ...], FailFast()] = ()
    chain_id: Hex32
    version: Version
    kind: Literal["base", "delta"]
    attempt: Hex32
    rank: Count
    world_size: Annotated[int, Field(ge=1, le=1 << 20)]
    shards: Annotated[tuple[ShardRef, ...], FailFast()]
    entries: Annotated[tuple[Entry, ...], FailFast()]
    files: Annotated[
        tuple[CheckpointFile, ...], FailFast(), Field(max_length=MAX_CHECKPOINT_FILES)
    ] = ()
    """The checkpoint files of the version (rank 0 only, with ``checkpoint-files``), sorted
    by name; absent when there are none, so manifests without files serialise as before."""

    @model_validator(mode="after")
    def _check_files(self) -> Manifest:
        listed = CHECKPOINT_FILES_FEATURE in self.required_features
        if listed != bool(self.files):
            raise ValueError(f"files are listed iff {CHECKPOINT_FILES_FEATURE!r} is required")
        if not self.files:
            return self
        if self.rank != 0:
            raise ValueError("only the manifest of rank 0 lists checkpoint files")
        names = [f.name for f in self.files]
        if any(a >= b for a, b in itertools.pairwise(names)):
            raise ValueError("checkpoint files are not listed once each, in name order")
        if sum(f.size for f in self.files) > MAX_CHECKPOINT_FILES_BYTES:
            raise ValueError(f"checkpoint files exceed {MAX_CHECKPOINT_FILES_BYTES} bytes")
        return self

    @model_serializer(mode="wrap")
    def _omit_absent_files(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict) and not data.get("files"):
            data.pop("files", None)
        return data


class ManifestRef(_Model):
    """A commit record's pointer to one rank's manifest."""

    rank: Count
    path: RelKey
    sha256: Sha256
    size: Count


class Stats(_Model):
    """Sizes of a version, for tooling; readers do not rely on them."""

    tensors: Count
    total_elements: Count
    changed_elements: Count
    payload_bytes: Count
    dense_bytes: Count


class CommitRecord(_Model):
    """``commits/<N>.json``: version N is committed iff this object exists."""

    format_version: int = FORMAT_VERSION
    required_features: Annotated[tuple[str, ...], FailFast()] = ()
    chain_id: Hex32
    version: Version
    kind: Literal["base", "delta"]
    parent: Version | None
    parent_sha256: Sha256 | None
    step: Annotated[int, Field(ge=-STEP_LIMIT, le=STEP_LIMIT)] | None = None
    created: Timestamp
    attempt: Hex32
    world_size: Annotated[int, Field(ge=1, le=1 << 20)]
    manifests: Annotated[tuple[ManifestRef, ...], FailFast()]
    state_fingerprint: Sha256
    stats: Stats


class ReaderRecord(_Model):
    """``readers/<reader-id>.json``: what one reader asks of writers (outside the chain)."""

    format_version: int = FORMAT_VERSION
    reader_id: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._-]{1,128}$")]
    updated: Timestamp
    overwrite: Annotated[tuple[TensorName, ...], FailFast()] = ()
    reads_baseline: bool = True
    """Whether the reader reads the exact old bits of the tensors it holds before applying, so
    it decodes positions coded against them (``classed``, FORMAT.md §6.5)."""
    features: Annotated[tuple[str, ...] | None, FailFast()] = None
    """The features the reader implements (FORMAT.md §12); None (absent): every feature a
    writer may use. A writer's default leaves out the features a record does not list."""
    baseline_names: Annotated[
        tuple[TensorName, ...] | None, FailFast(), Field(max_length=MAX_BASELINE_NAMES)
    ] = None
    """With ``reads_baseline`` false: the tensors whose exact old bits the reader does read
    (or never takes), sorted, each once; writers may code those against the old bits. None
    (absent): none of them. Absent when ``reads_baseline`` is true."""
    baseline_except: Annotated[
        tuple[TensorName, ...] | None, FailFast(), Field(max_length=MAX_BASELINE_NAMES)
    ] = None
    """With ``reads_baseline`` false, instead of ``baseline_names``: the reader reads the
    exact old bits of every tensor but these (sorted, each once; possibly none), for a
    reader that reads them of more tensors than a list of names holds. None (absent): the
    record says it with ``baseline_names``."""
    reads_changed: bool = False
    """With ``reads_baseline`` false: whether the reader reads, of every tensor it holds,
    the exact old bits of each changed element it holds (a tensor-parallel shard), so it
    decodes ``ulp`` values (FORMAT.md §7.5) of every tensor, and ``classed`` positions and
    ``ulp-shift`` values only of those ``baseline_names`` or ``baseline_except`` allow."""

    @model_validator(mode="after")
    def _check_baseline_names(self) -> ReaderRecord:
        for field in ("baseline_names", "baseline_except"):
            names = getattr(self, field)
            if names is None:
                continue
            if self.reads_baseline:
                raise ValueError(f"{field} is given only with reads_baseline false")
            if any(a >= b for a, b in itertools.pairwise(names)):
                raise ValueError(f"{field} are not listed once each, in sorted order")
        if self.baseline_names is not None and self.baseline_except is not None:
            raise ValueError("baseline_names and baseline_except are not given together")
        return self

    def to_json(self) -> bytes:
        """As every model, but ``baseline_names`` and ``baseline_except`` are left out when
        absent, and ``reads_changed`` when false."""
        exclude = {n for n in ("baseline_names", "baseline_except") if getattr(self, n) is None}
        if not self.reads_changed:
            exclude.add("reads_changed")
        return self.model_dump_json(exclude=exclude or None).encode()


M = TypeVar("M", bound=BaseModel)

_JSON_LIMITS: dict[type[BaseModel], int] = {
    StoreHeader: MAX_HEADER_JSON_BYTES,
    CommitRecord: MAX_RECORD_JSON_BYTES,
    Manifest: MAX_MANIFEST_JSON_BYTES,
    ReaderRecord: MAX_READER_JSON_BYTES,
}
_MAX_MESSAGE = 200  # characters of a validator's message quoted in a SchemaError


def json_limit(model: type[BaseModel]) -> int:
    """The size limit of a stored object of kind ``model`` (spec/FORMAT.md Appendix C);
    kinds not listed here (records of other modules) get the record limit."""
    for kind in model.__mro__:
        if kind in _JSON_LIMITS:
            return _JSON_LIMITS[kind]
    return MAX_RECORD_JSON_BYTES


MAX_UNKNOWN_VALUES = 4096
"""Values an object may hold in members this reader does not know, beyond one per member
it knows (room for optional members of later versions)."""


def _models_in(annotation: Any) -> tuple[type[BaseModel], ...]:
    """The models an annotation holds: ``X``, ``X | None``, ``tuple[X, ...]`` give ``X``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return (annotation,)
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found.extend(_models_in(arg))
    return tuple(found)


@functools.cache
def _layout(model: type[BaseModel]) -> tuple[tuple[str, ...], dict[str, type[BaseModel] | None]]:
    """A model's required members, and each member's inner model (None for plain values)."""
    required = tuple(name for name, info in model.model_fields.items() if info.is_required())
    inner: dict[str, type[BaseModel] | None] = {}
    for name, info in model.model_fields.items():
        models = _models_in(info.annotation)
        inner[name] = models[0] if len(models) == 1 else None
    return required, inner


def _count(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + sum(_count(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(_count(v) for v in value)
    return 1


def _check_tree(value: Any, model: type[BaseModel], loc: str) -> tuple[str | None, int, int]:
    """A first pass over the parsed tree, so that validation reports one small error: every
    object the schema reads as a model has its required members, and members the schema
    does not know stay small. Returns (problem, known members, unknown values).

    (A validator reports each missing member with a copy of the whole object it is
    missing from, a big unknown member included; this pass reports the first only.)
    """
    if not isinstance(value, dict):  # a model is a JSON object, whatever else it holds
        return f"{loc or '<root>'}: Input should be an object ({model.__name__})", 1, 0
    required, inner = _layout(model)
    for name in required:
        if name not in value:
            return f"{f'{loc}.{name}' if loc else name}: Field required", 0, 0
    known, unknown = len(value), 0
    for key, member in value.items():
        if key not in inner:
            unknown += _count(member)
            continue
        sub = inner[key]
        if sub is None or member is None:
            continue
        where = f"{loc}.{key}" if loc else key
        if isinstance(member, list):
            known += len(member)
            for index, item in enumerate(member):
                problem, k, u = _check_tree(item, sub, f"{where}.{index}")
                known, unknown = known + k, unknown + u
                if problem is not None:
                    return problem, known, unknown
        else:
            problem, k, u = _check_tree(member, sub, where)
            known, unknown = known + k, unknown + u
            if problem is not None:
                return problem, known, unknown
    return None, known, unknown


def _validate(model: type[M], data: bytes) -> tuple[M | None, str | None]:
    """The model, or its first error as a short line: nothing that holds the input (the
    ValidationError and the values it quotes) outlives this call."""
    try:
        return model.model_validate_json(data, strict=True), None
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_context=False, include_input=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "<root>"
        return None, f"{where[:_MAX_MESSAGE]}: {first['msg'][:_MAX_MESSAGE]}"


def implicit_parents(manifest: Manifest) -> Manifest:
    """``manifest`` (a delta's) as a writer allowed ``implicit-parents`` stores it: the
    feature listed and every whole entry's ``parent_fingerprint`` null (readers take it from
    the parent version's state table, FORMAT.md §3.5.5); pieces keep theirs. A manifest
    with no whole entry that names a parent is returned as it is (the feature unused)."""
    if not any(e.piece is None and e.parent_fingerprint is not None for e in manifest.entries):
        return manifest
    entries = tuple(
        e if e.piece is not None else e.model_copy(update={"parent_fingerprint": None})
        for e in manifest.entries
    )
    features = tuple(sorted({*manifest.required_features, IMPLICIT_PARENTS_FEATURE}))
    return manifest.model_copy(update={"required_features": features, "entries": entries})


def stored_manifest(manifest: Manifest, text: bytes | None = None) -> bytes:
    """The bytes a writer stores for ``manifest``: its JSON (``text`` where the caller has
    it already), or one zstd frame of it (with its content size) when it lists
    ``manifest-zstd`` (FORMAT.md §3.5)."""
    text = manifest.to_json() if text is None else text
    if MANIFEST_ZSTD_FEATURE not in manifest.required_features:
        return text
    large = len(text) > MANIFEST_ZSTD_LARGE_BYTES
    level = MANIFEST_ZSTD_LARGE_LEVEL if large else MANIFEST_ZSTD_LEVEL
    compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return compressor.compress(text)


def manifest_json_size(data: bytes) -> int:
    """The bytes of JSON a stored manifest holds: the content size its zstd frame declares
    (0 where it declares none: :func:`parse_manifest` refuses it), else its length."""
    if data[:4] != _ZSTD_MAGIC:
        return len(data)
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError:
        return 0
    return max(declared, 0)


def parse_manifest(
    data: bytes, *, what: str, admit: Callable[[int], None] | None = None
) -> Manifest:
    """Validate a stored manifest (:func:`stored_manifest`): plain JSON, or a zstd frame of
    it that declares its content size (at most the manifest limit, checked before anything is
    inflated) and lists ``manifest-zstd``; a plain manifest must not list it. ``admit``, where
    given, is told the JSON's size before it is inflated or parsed (and may refuse it)."""
    if data[:4] != _ZSTD_MAGIC:
        if admit is not None:
            admit(len(data))
        manifest = parse(Manifest, data, what=what)
        if MANIFEST_ZSTD_FEATURE in manifest.required_features:
            raise SchemaError(f"{what} lists {MANIFEST_ZSTD_FEATURE!r} but is not compressed")
        return manifest
    declared = frame_size(data, what=what, error=SchemaError)
    if not 0 <= declared <= MAX_MANIFEST_JSON_BYTES:
        raise SchemaError(
            f"{what} declares {declared} decoded bytes (the limit is {MAX_MANIFEST_JSON_BYTES} "
            "and the size must be declared); the object is corrupt or hostile"
        )
    if admit is not None:
        admit(max(declared, len(data)))
    manifest = parse(Manifest, inflate(data, declared, what=what, error=SchemaError), what=what)
    if MANIFEST_ZSTD_FEATURE not in manifest.required_features:
        raise SchemaError(f"{what} is compressed but does not list {MANIFEST_ZSTD_FEATURE!r}")
    return manifest


def parse(model: type[M], data: bytes | str, *, what: str, max_bytes: int | None = None) -> M:
    """Validate an object read from a store; ``what`` names it in errors (its key).

    ``max_bytes`` overrides the kind's size limit (:func:`json_limit`); no limit exceeds
    :data:`MAX_JSON_BYTES`. Refusing a hostile object costs a bounded multiple of its size
    (docs/reliability.md), and the :class:`SchemaError` holds only a short message.
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    limit = min(MAX_JSON_BYTES, json_limit(model) if max_bytes is None else max_bytes)
    if len(raw) > limit:
        raise SchemaError(
            f"{what} is {len(raw)} bytes, over the {limit} byte limit of a {model.__name__}; "
            "the object is corrupt or hostile"
        )
    problem = scan(raw)
    if problem is not None:
        raise SchemaError(
            f"{what} is refused unparsed: {problem}; the object is corrupt or hostile"
        )
    try:
        tree = pydantic_core.from_json(raw)
    except ValueError as exc:  # bad JSON or UTF-8; the message is short and quotes no input
        problem = str(exc)[:_MAX_MESSAGE]
    if problem is not None:
        raise SchemaError(f"{what} is not valid JSON ({problem}); the object is corrupt")
    if not isinstance(tree, dict):
        raise SchemaError(f"{what} is not a JSON object; the object is corrupt")
    version = tree.get("format_version")
    if type(version) is not int:
        raise SchemaError(f"{what} has no integer format_version; the object is corrupt")
    if version > FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"{what} has format_version {version}; this dcr-format reads up to "
            f"{FORMAT_VERSION}: upgrade dcr-format"
        )
    if version < 1:
        raise SchemaError(f"{what} has format_version {version}; versions start at 1")
    features = tree.get("required_features", [])
    if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
        raise SchemaError(f"{what} has a malformed required_features list")
    unknown = sorted(set(features) - KNOWN_FEATURES)
    if unknown:
        raise UnsupportedFeatureError(
            f"{what} requires features {unknown[:8]} that this dcr-format lacks: upgrade dcr-format"
        )
    problem, known_values, unknown_values = _check_tree(tree, model, "")
    del tree, features
    if problem is None and unknown_values > known_values + MAX_UNKNOWN_VALUES:
        problem = f"<root>: {unknown_values} values in unknown members, more than any writer makes"
    if problem is None:
        parsed, problem = _validate(model, raw)
        if parsed is not None:
            return parsed
    raise SchemaError(f"{what} is not a valid {model.__name__}: {problem}")
