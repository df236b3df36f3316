"""The ``s3://`` backend of :class:`~dcr_format.store.store.Store`: s3fs's client, our own rules.

s3fs owns the connection (credentials, endpoint and region from the standard
AWS environment and config files, ``storage_options`` on top) and the
multipart upload of large objects; every other request is made here on s3fs's
aiobotocore client so that this module decides what is retried and what an
answer means:

- ``put_if_absent`` is a ``PUT`` with ``If-None-Match: *``, carrying a fresh nonce
  in its user metadata (``x-amz-meta-dcr-nonce``). A request may have been re-sent,
  by botocore (``RetryAttempts`` in the response metadata) or by aiohttp (once,
  below botocore and invisibly to it, when the connection drops), so our own
  first attempt may be the object that exists: a 412 is taken as "exists" only
  after a HEAD shows another writer's nonce (ours: the create landed; no HEAD
  answer: unknown, an ``OSError``, which the Store turns into ``StoreError`` and
  the writer into a re-read). Any other error of a re-sent request is unknown
  too. HTTP 409 ``ConditionalRequestConflict`` is a definite refusal (AWS:
  another conditional write to the key was in flight), so it is retried a few
  times. It is never retried after a timeout or a 5xx: those outcomes are
  unknown.
- whether the server honours ``If-None-Match`` at all is found by a probe
  (:meth:`S3Backend.probe`): some S3-compatible servers ignore the header and
  overwrite. The answer is cached per process for each endpoint and bucket.
- listings report each object's ``Size`` and ``LastModified`` (the server's
  clock, whatever the writer's says: gc measures ages with it).
- which failures are transient (5xx, throttling, connection resets, timeouts)
  is decided here (:func:`retryable`, in :attr:`S3Backend.retry`); the Store
  retries reads, plain writes, listings, deletes and the probe with that policy
  (capped exponential backoff, on top of botocore's own retries), never a
  conditional write.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import errno
import hashlib
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal, TypeVar

import botocore.exceptions
import botocore.parsers
import s3fs
from fsspec.asyn import sync

from dcr_format.store._base import (
    TEMP_PREFIX,
    Capabilities,
    Kind,
    NoAtomicCreate,
    ObjectExists,
    ObjectInfo,
    ObjectTooLarge,
    RetryPolicy,
    key_problem,
    listed_size,
    retrying,
    temporary_key_problem,
    utc,
)

__all__ = ["S3Backend"]

T = TypeVar("T")

PART_SIZE = 64 << 20
"""Multipart part size; objects of at least twice this size go up in parts."""
MAX_SINGLE_PUT = 5 << 30  # the S3 limit for one PUT
RETRY_ATTEMPTS = 4
"""Tries of one read, write, listing or delete before its error is raised."""
RETRY_BASE_S = 0.1
RETRY_CAP_S = 5.0
CONFLICT_ATTEMPTS = 4
"""Tries of a conditional write answered 409 ConditionalRequestConflict."""
_DELETE_BATCH = 1000  # the DeleteObjects limit
_PROBE_PREFIX = TEMP_PREFIX + "probe-"  # reserved: never listed, refused by check_key
_NONCE = "dcr-nonce"  # user metadata of conditional PUTs: whose create landed

_RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
    }
)
_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NoSuchBucket", "NotFound"})
_DENIED_CODES = frozenset({"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"})
_TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    botocore.exceptions.HTTPClientError,  # connection closed/refused/reset, read timeouts
    botocore.exceptions.ResponseStreamingError,
    botocore.exceptions.IncompleteReadError,
    botocore.parsers.ResponseParserError,  # throttled servers have sent invalid XML
    botocore.exceptions.FlexibleChecksumError,  # a body altered in transit (CRC32 differs)
    ConnectionError,
    TimeoutError,
    asyncio.TimeoutError,
)
try:  # the body of a response is read through aiohttp
    from aiohttp import ClientPayloadError, ServerDisconnectedError

    _TRANSIENT_ERRORS += (ClientPayloadError, ServerDisconnectedError)
except ImportError:  # pragma: no cover - aiobotocore depends on aiohttp
    pass

_Created = Literal["created", "exists", "unsupported"]

_probe_cache: dict[tuple[str, str], bool] = {}
_probe_lock = threading.Lock()


# --- errors ----------------------------------------------------------------------------


def _status(exc: botocore.exceptions.ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _code(exc: botocore.exceptions.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code") or "")


def _resent(exc: botocore.exceptions.ClientError) -> bool:
    """Whether the client sent the request more than once before this answer."""
    return bool(exc.response.get("ResponseMetadata", {}).get("RetryAttempts"))


def _causes(exc: BaseException) -> Iterable[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        if current.__cause__ is not None or current.__suppress_context__:
            current = current.__cause__
        else:
            current = current.__context__


def _malformed_response(exc: BaseException) -> bool:
    """A plain ValueError raised inside botocore's response parser: a field of an answer
    that does not convert (a garbled timestamp or number in a listing) escapes it unwrapped."""
    if not isinstance(exc, ValueError):
        return False
    tb = exc.__traceback__
    while tb is not None:
        if str(tb.tb_frame.f_globals.get("__name__", "")).endswith("botocore.parsers"):
            return True
        tb = tb.tb_next
    return False


def retryable(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a transient failure worth another try."""
    for cause in _causes(exc):
        if _malformed_response(cause):
            return True
        if isinstance(cause, botocore.exceptions.ClientError):
            status = _status(cause)
            return status >= 500 or status == 429 or _code(cause) in _RETRYABLE_CODES
        if isinstance(cause, _TRANSIENT_ERRORS):
            return True
    return False


def _describe_client_error(exc: botocore.exceptions.ClientError) -> str:
    error = exc.response.get("Error", {})
    code = _code(exc) or "error"
    message = " ".join(str(error.get("Message") or "").split())
    status = _status(exc)
    text = f"{code} (HTTP {status})" if status else code
    return f"{text}: {message}" if message else text


def translate(exc: BaseException) -> BaseException:
    """A built-in ``OSError`` for a botocore or transport error; other errors unchanged."""
    if isinstance(exc, botocore.exceptions.ClientError):
        code, text = _code(exc), _describe_client_error(exc)
        if code in _NOT_FOUND_CODES or _status(exc) == 404:
            return FileNotFoundError(errno.ENOENT, text)
        if code in _DENIED_CODES or _status(exc) == 403:
            return PermissionError(errno.EACCES, text)
        return OSError(errno.EIO, text)
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return TimeoutError(errno.ETIMEDOUT, f"timed out: {exc}")
    if _malformed_response(exc):
        return OSError(errno.EIO, f"malformed response: {exc}")
    if isinstance(exc, (botocore.exceptions.BotoCoreError, *_TRANSIENT_ERRORS)):
        return OSError(errno.EIO, f"{type(exc).__name__}: {exc}")
    return exc


def _policy() -> RetryPolicy:
    """The retry policy of S3 requests (read at each use: tests shorten the waits)."""
    return RetryPolicy(retryable, RETRY_ATTEMPTS, RETRY_BASE_S, RETRY_CAP_S)


# --- request hooks -----------------------------------------------------------------------


def _add_content_md5(params: dict[str, Any], **_: Any) -> None:
    """DeleteObjects with Content-MD5: MinIO-based gateways (JuiceFS) refuse it without."""
    body = params.get("body")
    headers = params.setdefault("headers", {})
    if isinstance(body, bytes | bytearray) and "Content-MD5" not in headers:
        headers["Content-MD5"] = base64.b64encode(hashlib.md5(body).digest()).decode()


# --- backend ---------------------------------------------------------------------------


def split_url(url: str) -> tuple[str, str]:
    """Bucket and root prefix ('' or ending in '/') of an ``s3://bucket/prefix`` URL."""
    rest = url.split("://", 1)[1]
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.rstrip("/")
    if not bucket or "?" in rest or "#" in rest:
        raise ValueError(f"{url!r} is not an s3://bucket/prefix URL")
    if prefix and key_problem(prefix) is not None:
        raise ValueError(f"the prefix of {url!r} is not valid: {key_problem(prefix)}")
    return bucket, prefix + "/" if prefix else ""


class S3Backend:
    """Objects under ``s3://bucket/prefix`` on AWS S3 or an S3-compatible server."""

    kind: Kind = "s3"
    local_root: str | None = None

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None, *, single_writer: bool
    ) -> None:
        self.bucket, self.root = split_url(url)
        self.url = f"s3://{self.bucket}/{self.root}".rstrip("/")
        self.single_writer = single_writer
        options = dict(storage_options or {})
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"max_attempts": 3, "mode": "standard"})
        options["config_kwargs"] = config
        self.fs = s3fs.S3FileSystem(**options)
        self._honoured: bool | None = None
        self._denied: str | None = None  # why these credentials may not write (the probe's PUT)

    # --- plumbing ---

    @property
    def retry(self) -> RetryPolicy:
        """Transient failures (:func:`retryable`) are tried ``RETRY_ATTEMPTS`` times."""
        return _policy()

    def _run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run coroutine function ``fn`` on s3fs's event loop; botocore errors as ``OSError``.

        Tried once: the Store retries what :attr:`retry` calls transient (the cause of
        the ``OSError`` tells), and nothing retries a conditional write.
        """
        try:
            result: T = sync(self.fs.loop, fn, *args)
        except (ObjectExists, ObjectTooLarge, NoAtomicCreate):
            raise
        except Exception as exc:
            translated = translate(exc)
            if translated is exc:
                raise
            raise translated from exc
        return result

    async def _client(self) -> Any:
        await self.fs.set_session()
        client = await self.fs.get_s3(self.bucket)
        if not getattr(client, "_dcr_hooks", False):  # s3fs may replace its client
            client.meta.events.register("before-call.s3.DeleteObjects", _add_content_md5)
            client._dcr_hooks = True
        return client

    def _key(self, key: str) -> str:
        return self.root + key

    # --- capabilities ---

    @property
    def capabilities(self) -> Capabilities:
        honoured = self.conditional_writes()
        if self._denied is not None:  # read-only credentials: reads need no probe's answer
            return Capabilities(
                atomic_create=False,
                listing=True,
                delete=False,
                writable=False,
                read_only=f"its credentials may not write there ({self._denied})",
                batch_delete=True,
            )
        return Capabilities(
            atomic_create=honoured,
            listing=True,
            delete=True,
            conditional_writes=honoured,
            batch_delete=True,
        )

    def _endpoint(self) -> str:
        async def endpoint() -> str:
            return str((await self._client()).meta.endpoint_url)

        return self._run(endpoint)

    def conditional_writes(self) -> bool:
        """Whether the server honours ``If-None-Match: *`` (probed once per process; False
        where these credentials may not write, :attr:`_denied` saying why)."""
        if self._honoured is None and self._denied is None:
            cache_key = (self._endpoint(), self.bucket)
            with _probe_lock:
                if cache_key not in _probe_cache:
                    answer = self.probe()
                    if answer is None:  # this store's credentials only: not for the process
                        return False
                    _probe_cache[cache_key] = answer
                self._honoured = _probe_cache[cache_key]
        return bool(self._honoured)

    def probe_conditional_writes(self) -> bool:
        """Probe now and remember the answer for this process."""
        answer = self.probe()
        if answer is None:
            return False
        cache_key = (self._endpoint(), self.bucket)
        with _probe_lock:
            _probe_cache[cache_key] = self._honoured = answer
        return answer

    def probe(self) -> bool | None:
        """Write a reserved temporary key twice with If-None-Match; refused the second time?
        None where the server refuses these credentials the first write (they may read
        only): :attr:`_denied` says how, and the store reads without the answer."""
        key = self._key(_PROBE_PREFIX + uuid.uuid4().hex)
        try:
            first = self._run(self._create, key, b"1")
        except PermissionError as exc:  # nothing was written: nothing to delete
            self._denied = exc.strerror or str(exc)  # e.g. "AccessDenied (HTTP 403): ..."
            return None
        except BaseException:
            self._delete_probe(key)  # the write may have landed before the failure
            raise
        try:
            if first == "unsupported":
                return False
            if first == "exists":  # a fresh random key cannot exist
                raise OSError(errno.EIO, f"the new probe key {key!r} was refused as existing")
            return self._run(self._create, key, b"2") == "exists"
        finally:
            self._delete_probe(key)

    def _delete_probe(self, key: str) -> None:
        try:
            self._run(self._delete, key)
        except OSError:
            pass  # a left-over probe key is never listed nor read

    # --- requests ---

    def get(self, key: str, max_size: int | None) -> bytes:
        return self._run(self._get, self._key(key), max_size)

    async def _get(self, key: str, max_size: int | None) -> bytes:
        client = await self._client()
        request: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if max_size is not None:
            # Ranged: never more than one byte past the limit, and Content-Range tells the size.
            request["Range"] = f"bytes=0-{max(max_size, 0)}"
        size: int | None
        try:
            response = await client.get_object(**request)
        except botocore.exceptions.ClientError as exc:
            if _status(exc) != 416:
                raise
            data, size = b"", 0  # bytes=0-N is unsatisfiable only for an empty object
        else:
            async with response["Body"] as body:
                size = _total_size(response)
                if max_size is not None and size is not None and size > max_size:
                    raise ObjectTooLarge(size)
                data = await body.read()
        if max_size is not None and len(data) > max_size:
            raise ObjectTooLarge(size)
        return bytes(data)

    def put(self, key: str, data: bytes) -> None:
        payload = data if isinstance(data, bytes) else bytes(data)
        self._run(self._put, self._key(key), payload)

    async def _put(self, key: str, data: bytes) -> None:
        await self._client()
        # s3fs sends one PUT below 2 * chunksize, else a multipart upload with at most
        # max_concurrency parts in flight (bounded memory) that it aborts on failure.
        await self.fs._pipe_file(f"{self.bucket}/{key}", data, chunksize=PART_SIZE)

    def put_if_absent(self, key: str, data: bytes) -> None:
        payload = data if isinstance(data, bytes) else bytes(data)
        if len(payload) > MAX_SINGLE_PUT:
            raise OSError(errno.EFBIG, f"{len(payload)} bytes is more than one S3 PUT takes")
        if self.single_writer:
            # Check, then write: safe only because one writer process alone writes.
            if retrying(lambda: self.exists(key), self.retry):
                raise ObjectExists
        elif not retrying(self.conditional_writes, self.retry):
            raise NoAtomicCreate(
                "conditional writes are not honoured by this server (it ignored If-None-Match)"
            )
        # Never retried here: see the module docstring.
        outcome = self._run(self._create, self._key(key), payload)
        if outcome == "exists":
            raise ObjectExists
        if outcome == "unsupported":
            raise OSError(
                errno.ENOTSUP, "the server does not implement conditional writes (If-None-Match)"
            )

    async def _create(self, key: str, data: bytes) -> _Created:
        """One conditional PUT (``If-None-Match: *``) of ``data`` to the full ``key``.

        'created' (this call's object is there), 'exists' (another writer's object is)
        or 'unsupported' (the server refuses the header). An answer to a re-sent request,
        or a 412 whose writer cannot be read back, is unknown: an ``OSError``. A 409
        ``ConditionalRequestConflict`` is tried again, a few times.
        """
        client = await self._client()
        nonce = uuid.uuid4().hex
        for attempt in range(CONFLICT_ATTEMPTS):
            try:
                await client.put_object(
                    Bucket=self.bucket,
                    Key=key,
                    Body=data,
                    IfNoneMatch="*",
                    Metadata={_NONCE: nonce},
                )
                return "created"
            except botocore.exceptions.ClientError as exc:
                if _status(exc) == 501 or _code(exc) == "NotImplemented":
                    return "unsupported"
                if _status(exc) == 412:
                    # botocore (RetryAttempts) or aiohttp (unseen) may have re-sent the PUT:
                    # the object can be our own, which its nonce tells
                    try:
                        landed = await self._nonce_of(client, key)
                    except Exception as head_exc:
                        raise OSError(
                            errno.EIO,
                            f"{_describe_client_error(exc)}, and the object's writer could not "
                            f"be read back ({type(head_exc).__name__}); the outcome is unknown",
                        ) from head_exc
                    return "created" if landed == nonce else "exists"
                if _resent(exc):
                    raise OSError(
                        errno.EIO,
                        f"{_describe_client_error(exc)} after the request was re-sent; "
                        "an earlier try may have created the object, so the outcome is unknown",
                    ) from exc
                if _status(exc) != 409 or attempt + 1 == CONFLICT_ATTEMPTS:
                    raise
            await asyncio.sleep(_policy().backoff(attempt))
        raise AssertionError("unreachable")

    async def _nonce_of(self, client: Any, key: str) -> str | None:
        """The nonce a conditional PUT stored with ``key`` (None: none, or no such object)."""
        try:
            response = await client.head_object(Bucket=self.bucket, Key=key)
        except botocore.exceptions.ClientError as exc:
            if _status(exc) == 404:
                return None
            raise
        return (response.get("Metadata") or {}).get(_NONCE)

    def exists(self, key: str) -> bool:
        return self._run(self._head, self._key(key)) is not None

    def size(self, key: str) -> int:
        size = self._run(self._head, self._key(key))
        if size is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", key)
        return size

    async def _head(self, key: str) -> int | None:
        client = await self._client()
        try:
            response = await client.head_object(Bucket=self.bucket, Key=key)
        except botocore.exceptions.ClientError as exc:
            if _status(exc) == 404 or _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return int(response["ContentLength"])

    def list(self, prefix: str) -> builtins.list[str]:
        return [info.key for info in self._run(self._list, prefix, key_problem)]

    def list_info(self, prefix: str) -> builtins.list[ObjectInfo]:
        return self._run(self._list, prefix, key_problem)

    def list_temporary(self) -> builtins.list[ObjectInfo]:
        """Probe keys of a process that died between its probe's writes and its delete (the
        probe is the only temporary object, and it lies at the root)."""
        return self._run(self._list, _PROBE_PREFIX, temporary_key_problem)

    def delete_temporary(self, keys: builtins.list[str]) -> None:
        self.delete_many(keys)

    async def _list(
        self, prefix: str, problem: Callable[[str], str | None]
    ) -> builtins.list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` and ``problem`` finds valid."""
        # Straight from the server: no client-side listing cache can hide new objects.
        client = await self._client()
        under = self.root + prefix
        request: dict[str, Any] = {"Bucket": self.bucket, "Prefix": under}
        infos: builtins.list[ObjectInfo] = []
        while True:
            response = await client.list_objects_v2(**request)
            for item in response.get("Contents", ()):
                name = item["Key"]
                if not name.startswith(under) or name.endswith("/"):
                    continue  # directory markers are not objects
                key = name[len(self.root) :]
                if problem(key) is None:
                    # The server's own clock: LastModified is set by S3, not by the writer.
                    modified = utc(item.get("LastModified"))
                    infos.append(ObjectInfo(key, listed_size(item.get("Size")), modified))
            token = response.get("NextContinuationToken")
            if not response.get("IsTruncated") or not token:
                break
            request["ContinuationToken"] = token
        infos.sort()
        return infos

    def delete(self, key: str) -> None:
        self._run(self._delete, self._key(key))

    async def _delete(self, key: str) -> None:
        client = await self._client()
        try:
            await client.delete_object(Bucket=self.bucket, Key=key)
        except botocore.exceptions.ClientError as exc:
            if _status(exc) != 404:
                raise

    def delete_many(self, keys: builtins.list[str]) -> None:
        names = list(dict.fromkeys(self._key(key) for key in keys))
        for start in range(0, len(names), _DELETE_BATCH):
            self._run(self._delete_batch, names[start : start + _DELETE_BATCH])

    async def _delete_batch(self, names: builtins.list[str]) -> None:
        client = await self._client()
        response = await client.delete_objects(
            Bucket=self.bucket,
            Delete={"Objects": [{"Key": name} for name in names], "Quiet": True},
        )
        errors = [e for e in response.get("Errors", ()) if e.get("Code") != "NoSuchKey"]
        if errors:
            first = errors[0]
            raise botocore.exceptions.ClientError(
                {"Error": {"Code": first.get("Code"), "Message": first.get("Message")}},
                "DeleteObjects",
            )


def _total_size(response: dict[str, Any]) -> int | None:
    """The object's full size from a GET response (Content-Range when ranged)."""
    content_range = response.get("ContentRange")
    if content_range:
        total = str(content_range).rpartition("/")[2]
        return int(total) if total.isdigit() else None
    length = response.get("ContentLength")
    return int(length) if length is not None else None
