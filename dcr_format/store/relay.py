"""Relay tree: one member of a reader group reads each object; the bytes flow down a tree.

A :class:`RelayStore` stands in for the store of a :class:`~dcr_format.DeltaReader`
on every member of a ``torch.distributed`` process group. The leader (one group
rank) sends each request to the real store and forwards the answer — bytes, or
the error it raised — to its children, which forward it to theirs: member ``r``
(numbered from the leader) sends to ``k*r+1 .. k*r+k`` for a fan-out ``k``
(2: a binary tree, 1: a chain). A payload moves in chunks with point-to-point
sends and receives, so chunk ``i`` travels down the tree while chunk ``i+1``
leaves the leader, and every member forwards a chunk as soon as it has it.
Store egress then grows with the number of groups, not of members.

Nothing is trusted more for having been relayed: each member's reader checks
sizes and sha256 of what it received exactly as it checks what it reads from
the store itself, and a :class:`~dcr_format.DeltaReader` given ``group=`` still
stages on every member and applies only when all staged.

How members stay in step without a request channel:

- Each answer travels as a *round* headed by what was asked (``get``, ``list``,
  ``exists``, ``size`` and the key), whether it succeeded (or the error class
  and message, so an ``ObjectNotFoundError`` is raised with the same text on
  every member), and the payload length.
- A member's request takes the matching round from what it has received, or
  receives rounds (keeping the others) until the matching one arrives. Members
  may therefore ask in any order and from several threads (the reader's fetch
  pool); the leader fetches in parallel and sends the rounds one at a time.
- Where the reader group agrees (before each of its votes), every member calls
  :meth:`RelayStore.end_epoch`: the leader sends an end marker, the others
  receive up to it and drop what nobody asked for. A member that asked for
  something the leader never read learns so at the marker and reads it from
  the store itself; a member that failed half-way drains the rounds it no
  longer wants, so no member waits on it. :class:`~dcr_format.DeltaReader`
  calls it; code that drives a relay by hand calls it on every member at the
  same points.
- Within an epoch an object of at most ``memo_bytes`` is read once: a repeated
  ``get`` of it is answered from memory on every member.

Every member must therefore reach the same agreement points in the same order
(as the reader group already requires) and call a reader's methods outside
``sync`` (``versions``, ``prewarm``) on all members or on none: a member that
calls one alone waits for the leader's next sync to answer it. Members that
read different objects (ranks selecting different tensors) still work: what
only they need they read from the store themselves, which costs store
requests, not correctness (``RelayStore.stats.fallbacks`` counts them).

A relay is a :class:`~dcr_format.store.store.Store` over a relay backend that wraps
the real store (``kind == "relay"``), so keys, size limits and errors are
checked as on any store and any reader takes it where it takes a store. It is
read-only (``capabilities.writable`` is False): writes and deletes raise
:class:`~dcr_format.errors.StoreError` (writers write to the store itself; a
reader then logs that it could not record the names it needs as ``overwrite``).
The group carries CPU tensors with gloo; with an NCCL group the chunks are
staged on the current CUDA device (the tests here run gloo only).
"""

from __future__ import annotations

import builtins
import json
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from dcr_format import errors
from dcr_format.errors import DcrError, StoreError
from dcr_format.store._base import Capabilities, Kind, ObjectInfo, ObjectTooLarge, RetryPolicy
from dcr_format.store.store import Store

__all__ = ["RelayStats", "RelayStore"]

T = TypeVar("T")

DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_CACHE_BYTES = 1 << 30
DEFAULT_MEMO_BYTES = 4 << 20
_HEADER_BYTES = 8192  # one fixed-size header per round: keys are at most 1 KiB
_LENGTH_BYTES = 8
_WINDOW = 64  # receives posted ahead of the chunk being forwarded
_TAG = 0x4443  # point-to-point tag of relay traffic ("DC")
_END = "end"


@dataclass
class RelayStats:
    """What one member's relay did (counters since it was created)."""

    rounds: int = 0
    """Rounds this member sent (the leader) or received (the others)."""
    payload_bytes: int = 0
    """Payload bytes of those rounds."""
    store_requests: int = 0
    """Requests this member sent to the store itself (the leader's, and fallbacks)."""
    fallbacks: int = 0
    """Requests of a non-leader that no round answered, read from the store itself."""
    memo_hits: int = 0
    """Repeated reads of one object within an epoch answered from memory."""
    epochs: int = 0


@dataclass
class _Round:
    op: str
    key: str
    error: str | None = None
    message: str = ""
    payload: bytes = b""
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = len(self.payload)


class _Links:
    """This member's place in the tree: its parent and children as group ranks."""

    def __init__(self, group: Any, leader: int, fanout: int, device: torch.device) -> None:
        self.group = group
        self.size = int(group.size())
        self.rank = int(group.rank())
        if not 0 <= leader < self.size:
            raise ValueError(f"leader {leader} is not a rank of the group (size {self.size})")
        if fanout < 1:
            raise ValueError("fanout must be at least 1")
        self.leader = leader
        self.device = device
        rel = (self.rank - leader) % self.size
        self.parent = None if rel == 0 else ((rel - 1) // fanout + leader) % self.size
        first = fanout * rel + 1
        self.children = [
            (child + leader) % self.size
            for child in range(first, first + fanout)
            if child < self.size
        ]

    def send(self, tensor: torch.Tensor, peer: int) -> Any:
        return self.group.send([tensor], peer, _TAG)

    def recv(self, tensor: torch.Tensor, peer: int) -> Any:
        return self.group.recv([tensor], peer, _TAG)


def _device_for(group: Any) -> torch.device:
    name = ""
    try:
        import torch.distributed as dist

        name = str(dist.get_backend(group))
    except Exception:  # a backend object of its own (not registered with torch.distributed)
        getter = getattr(group, "name", None)
        name = str(getter()) if callable(getter) else ""
    if "nccl" in name.lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _error_class(name: str | None) -> type[DcrError] | None:
    cls = getattr(errors, name or "", None)
    return cls if isinstance(cls, type) and issubclass(cls, DcrError) else None


class _Relay:
    """The relay as a store backend: answers of the store ``inner``, read by the leader
    alone and sent down the tree (the :class:`~dcr_format.store.store.Backend` protocol)."""

    kind: Kind = "relay"
    local_root: str | None = None
    single_writer = False
    retry: RetryPolicy | None = None  # the inner store retries; a lost member is not transient
    capabilities = Capabilities(atomic_create=False, listing=True, delete=False, writable=False)

    def __init__(
        self, inner: Store, links: _Links, *, chunk_bytes: int, cache_bytes: int, memo_bytes: int
    ) -> None:
        self.inner = inner
        self.url = inner.url
        self.chunk_bytes = chunk_bytes
        self.cache_bytes = cache_bytes
        self.memo_bytes = memo_bytes
        self._links = links
        self._lock = threading.Lock()  # one round at a time on the links
        self._memo_lock = threading.Lock()
        self._pending: OrderedDict[int, _Round] = OrderedDict()  # received, not yet asked for
        self._pending_bytes = 0
        self._serial = 0
        self._memo: dict[str, bytes] = {}
        self._memo_size = 0
        self._ended = False  # the leader's end marker of this epoch was received
        self.stats = RelayStats()

    @property
    def is_leader(self) -> bool:
        return self._links.parent is None

    def probe_conditional_writes(self) -> bool:
        return False

    def get(self, key: str, max_size: int | None) -> bytes:
        with self._memo_lock:
            memo = self._memo.get(key)
        if memo is not None:
            self.stats.memo_hits += 1
            data = memo
        else:
            data = self._call(
                "get", key, lambda: self.inner.get(key, max_size=max_size), bytes, bytes
            )
            if len(data) <= self.memo_bytes:
                with self._memo_lock:
                    if key not in self._memo and self._memo_size + len(data) <= self.cache_bytes:
                        self._memo[key] = data
                        self._memo_size += len(data)
        if max_size is not None and len(data) > max_size:
            raise ObjectTooLarge(len(data))
        return data

    def list(self, prefix: str) -> builtins.list[str]:
        return self._call(
            "list",
            prefix,
            lambda: self.inner.list(prefix),
            lambda keys: "\n".join(keys).encode(),
            lambda raw: raw.decode().split("\n") if raw else [],
        )

    def list_info(self, prefix: str) -> builtins.list[ObjectInfo]:
        """Listings with sizes and times are for operator tools on the store itself."""
        raise self._refuse(f"list {prefix!r} with sizes and times")

    def exists(self, key: str) -> bool:
        return self._call(
            "exists",
            key,
            lambda: self.inner.exists(key),
            lambda flag: b"1" if flag else b"0",
            lambda raw: raw == b"1",
        )

    def size(self, key: str) -> int:
        return self._call("size", key, lambda: self.inner.size(key), lambda n: str(n).encode(), int)

    def _refuse(self, action: str) -> StoreError:
        return StoreError(
            f"cannot {action} through a relay of {self.url}: relays are read-only; "
            "writers write to the store itself"
        )

    # Writes never get here (the Store refuses them: capabilities.writable is False).
    def put(self, key: str, data: bytes) -> None:
        raise self._refuse(f"write {key!r}")

    def put_if_absent(self, key: str, data: bytes) -> None:
        raise self._refuse(f"create {key!r}")

    def delete(self, key: str) -> None:
        raise self._refuse(f"delete {key!r}")

    def delete_many(self, keys: builtins.list[str]) -> None:
        raise self._refuse("delete objects")

    def list_temporary(self) -> builtins.list[ObjectInfo]:
        return []  # a relay writes nothing, so it leaves no temporary files

    def delete_temporary(self, keys: builtins.list[str]) -> None:
        raise self._refuse("delete temporary files")

    # --- epochs ---------------------------------------------------------------------------------

    def end_epoch(self) -> None:
        """Send (the leader) or receive up to the end marker; forget the epoch's rounds."""
        with self._lock:
            if self.is_leader:
                self._send(_Round(_END, ""))
            else:
                while not self._ended:
                    if self._receive().op == _END:
                        self._ended = True
            self._ended = False
            self._pending.clear()
            self._pending_bytes = 0
            with self._memo_lock:
                self._memo.clear()
                self._memo_size = 0
            self.stats.epochs += 1

    # --- rounds ---------------------------------------------------------------------------------

    def _call(
        self,
        op: str,
        key: str,
        fetch: Callable[[], T],
        encode: Callable[[T], bytes],
        decode: Callable[[bytes], T],
    ) -> T:
        if self.is_leader:
            self.stats.store_requests += 1
            try:
                value = fetch()
            except Exception as exc:
                self._send_locked(_Round(op, key, type(exc).__name__, str(exc)))
                raise
            self._send_locked(_Round(op, key, payload=encode(value)))
            return value
        answer = self._answer(op, key)
        if answer is None:  # the leader did not read it in this epoch: read it here
            self.stats.store_requests += 1
            self.stats.fallbacks += 1
            return fetch()
        if answer.error is not None:
            cls = _error_class(answer.error)
            if cls is None:
                raise StoreError(
                    f"the relay leader could not {op} {key!r} in {self.url}: "
                    f"{answer.error}: {answer.message}"
                )
            raise cls(answer.message)
        return decode(answer.payload)

    def _answer(self, op: str, key: str) -> _Round | None:
        """The round answering (op, key), receiving rounds until it comes or the epoch ends."""
        with self._lock:
            while True:
                for serial, pending in self._pending.items():
                    if pending.op == op and pending.key == key:
                        del self._pending[serial]
                        self._pending_bytes -= pending.size
                        return pending
                if self._ended:
                    return None
                received = self._receive()
                if received.op == _END:
                    self._ended = True
                    continue
                self._serial += 1
                self._pending[self._serial] = received
                self._pending_bytes += received.size
                while self._pending_bytes > self.cache_bytes and len(self._pending) > 1:
                    _, dropped = self._pending.popitem(last=False)
                    self._pending_bytes -= dropped.size

    def _send_locked(self, answer: _Round) -> None:
        with self._lock:
            self._send(answer)

    def _header(self, answer: _Round, chunk: int) -> tuple[torch.Tensor, bool]:
        """The round's header; a payload that fits travels inside it (one message a round)."""
        fields = {
            "op": answer.op,
            "key": answer.key,
            "error": answer.error,
            "message": answer.message,
            "length": answer.size,
            "chunk": chunk,
        }
        room = _HEADER_BYTES - _LENGTH_BYTES
        raw = json.dumps(fields).encode()
        if len(raw) > room:  # only an error message can be long: cut it to fit
            cut = len(raw) - room + 16
            fields["message"] = answer.message[: max(len(answer.message) - cut, 0)] + " [...]"
            raw = json.dumps(fields).encode()
        inline = len(raw) + answer.size <= room
        head = bytearray(_HEADER_BYTES)
        head[:_LENGTH_BYTES] = len(raw).to_bytes(_LENGTH_BYTES, "little")
        end = _LENGTH_BYTES + len(raw)
        head[_LENGTH_BYTES:end] = raw
        if inline:
            head[end : end + answer.size] = answer.payload
        return torch.frombuffer(head, dtype=torch.uint8).to(self._links.device), inline

    def _send(self, answer: _Round) -> None:
        """The leader: one round to every child (header, then the payload in chunks)."""
        links = self._links
        self.stats.rounds += 1
        self.stats.payload_bytes += answer.size
        if not links.children:
            return
        chunk = self.chunk_bytes
        head, inline = self._header(answer, chunk)
        works = [links.send(head, child) for child in links.children]
        if answer.size and not inline:
            payload = torch.frombuffer(bytearray(answer.payload), dtype=torch.uint8)
            payload = payload.to(links.device)
            for start in range(0, answer.size, chunk):
                piece = payload[start : start + chunk]
                works += [links.send(piece, child) for child in links.children]
        self._wait(works)

    def _receive(self) -> _Round:
        """A non-leader: the next round from the parent, forwarded chunk by chunk."""
        links = self._links
        assert links.parent is not None
        head = torch.empty(_HEADER_BYTES, dtype=torch.uint8, device=links.device)
        self._wait([links.recv(head, links.parent)])
        sends = [links.send(head, child) for child in links.children]
        raw = bytes(head.cpu().numpy())
        length = int.from_bytes(raw[:_LENGTH_BYTES], "little")
        fields = json.loads(raw[_LENGTH_BYTES : _LENGTH_BYTES + length])
        size, chunk = int(fields["length"]), int(fields["chunk"])
        end = _LENGTH_BYTES + length
        payload = b""
        if size and end + size <= _HEADER_BYTES:  # it came inside the header
            payload = raw[end : end + size]
        elif size:
            buffer = torch.empty(size, dtype=torch.uint8, device=links.device)
            pieces = [buffer[start : start + chunk] for start in range(0, size, chunk)]
            posted: deque[Any] = deque()
            for index, piece in enumerate(pieces):
                while len(posted) < _WINDOW and index + len(posted) < len(pieces):
                    posted.append(links.recv(pieces[index + len(posted)], links.parent))
                self._wait([posted.popleft()])
                sends += [links.send(piece, child) for child in links.children]
            payload = bytes(buffer.cpu().numpy())
        self._wait(sends)
        self.stats.rounds += 1
        self.stats.payload_bytes += size
        return _Round(
            fields["op"], fields["key"], fields["error"], fields["message"], payload=payload
        )

    def _wait(self, works: builtins.list[Any]) -> None:
        try:
            for work in works:
                work.wait()
        except RuntimeError as exc:
            raise StoreError(
                f"the relay of {self.url} lost a member (rank {self._links.rank}): {exc}; "
                "restart the group"
            ) from exc


class RelayStore(Store):
    """A read-only :class:`Store` whose objects come from ``store`` through one member.

    ``group`` is the ``torch.distributed`` process group of the members (None:
    the default group); every member wraps the same store with the same
    ``leader`` (a rank of ``group``) and ``fanout``. ``chunk_bytes`` is the size
    of the pieces a payload moves in (the leader's value counts).
    ``cache_bytes`` bounds what a member keeps of rounds it has not asked for
    yet; ``memo_bytes`` is the largest object a repeated ``get`` is answered
    from memory for within an epoch. Pass the relay to ``DeltaReader`` in place
    of the store (with ``group=`` for all-or-nothing applies); see the module
    documentation for the rules members follow.

    It is a Store over a relay backend that wraps ``store``: keys, limits and
    errors are checked as on any store, ``kind`` is ``"relay"`` and
    ``capabilities.writable`` is False (writes raise ``StoreError``). Its
    :meth:`end_epoch` is its own: a reader given a relay calls it where its group
    agrees; a plain :class:`Store` has no epochs.
    """

    def __init__(
        self,
        store: Store,
        group: Any = None,
        *,
        leader: int = 0,
        fanout: int = 2,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        memo_bytes: int = DEFAULT_MEMO_BYTES,
    ) -> None:
        if not isinstance(store, Store):
            raise TypeError(f"store must be a Store, not {type(store).__name__}")
        if chunk_bytes < 1:
            raise ValueError("chunk_bytes must be positive")
        if group is None:
            import torch.distributed as dist

            group = dist.group.WORLD
        links = _Links(group, leader, fanout, _device_for(group))
        self._relay = _Relay(
            store, links, chunk_bytes=chunk_bytes, cache_bytes=cache_bytes, memo_bytes=memo_bytes
        )
        super().__init__(self._relay)

    @property
    def inner(self) -> Store:
        """The store the leader reads from (and members fall back to)."""
        return self._relay.inner

    @property
    def stats(self) -> RelayStats:
        """What this member's relay did (counters since it was created)."""
        return self._relay.stats

    @property
    def is_leader(self) -> bool:
        """Whether this member reads from the store."""
        return self._relay.is_leader

    @property
    def rank(self) -> int:
        """This member's rank in the group."""
        return self._relay._links.rank

    @property
    def children(self) -> tuple[int, ...]:
        """Group ranks this member forwards to."""
        return tuple(self._relay._links.children)

    def end_epoch(self) -> None:
        """Close this epoch: every member calls it at the same points (where the group agrees).

        The leader sends the end marker; the others receive up to it, dropping rounds
        nobody asked for. The memo of repeated reads is cleared.
        """
        self._relay.end_epoch()

    def __repr__(self) -> str:
        links = self._relay._links
        return (
            f"RelayStore({self.url!r}, rank={links.rank}, leader={links.leader}, "
            f"children={list(links.children)})"
        )
