"""Subprocess side of test_hostile_memory.py: run one hostile case, print its cost as JSON.

``python tests/memory_workers.py json <case>|all <bytes>``: parse hostile JSON objects.
``python tests/memory_workers.py manifest <bytes>``: parse a valid manifest (for comparison).
``python tests/memory_workers.py sync <store>``: sync a fresh target from a store.

Each prints ``{"peak": <bytes>, "seconds": <s>, "error": <name>, "message": <text>,
"context": <bool>}``: the peak resident memory the call added (VmHWM after it, minus the
resident size just before it, with freed heap returned to the system first), so zstd's and
pydantic-core's native allocations count (tracemalloc sees neither).
"""

from __future__ import annotations

import ctypes
import gc
import inspect
import json
import sys
import time
from collections.abc import Callable

FIELDS = {
    "format_version": 1,
    "chain_id": "c" * 32,
    "version": 1,
    "kind": "delta",
    "parent": 0,
    "parent_sha256": "a" * 64,
    "created": "2026-01-01T00:00:00.000000Z",
    "attempt": "b" * 32,
    "world_size": 1,
    "state_fingerprint": "d" * 64,
}


def _obj(members: dict, raw: dict[str, bytes]) -> bytes:
    """A JSON object of ``members`` plus raw (already JSON) members."""
    parts = [json.dumps({k: v})[1:-1].encode() for k, v in members.items()]
    parts += [json.dumps(k).encode() + b":" + v for k, v in raw.items()]
    return b"{" + b",".join(parts) + b"}"


def _repeat(item: bytes, size: int) -> bytes:
    return b"[" + b",".join([item] * (size // (len(item) + 1))) + b"]"


def json_case(case: str, size: int) -> tuple[str, bytes]:
    """(model name, bytes) of a hostile object of about ``size`` bytes."""
    half = size // 2
    cases: dict[str, Callable[[], bytes]] = {
        "nested lists": lambda: b"[" * half + b"]" * half,
        "nested lists in a member": lambda: _obj(
            FIELDS, {"manifests": b"[" * (half - 200) + b"]" * (half - 200)}
        ),
        "flat empty lists": lambda: _obj(FIELDS, {"manifests": _repeat(b"[]", size)}),
        "flat empty objects": lambda: _obj(FIELDS, {"manifests": _repeat(b"{}", size)}),
        "flat small ints": lambda: _obj(FIELDS, {"manifests": _repeat(b"7", size)}),
        "flat 3-digit ints": lambda: _obj(FIELDS, {"manifests": _repeat(b"777", size)}),
        "flat short strings": lambda: _obj(FIELDS, {"manifests": _repeat(b'"ab"', size)}),
        "long string": lambda: _obj(FIELDS, {"chain_id": b'"' + b"a" * size + b'"'}),
        "deep objects": lambda: b'{"a":' * (size // 6) + b"1" + b"}" * (size // 6),
        "many unknown keys": lambda: _obj(FIELDS, {f"k{i}": b"77" for i in range(size // 10)}),
        "missing members, huge unknown member": lambda: _obj(
            {"format_version": 1}, {"junk": _repeat(b"777", size)}
        ),
        "nested record missing members, huge unknown member": lambda: _obj(
            FIELDS, {"stats": _obj({}, {"junk": _repeat(b'"abc"', size)})}
        ),
    }
    return "CommitRecord", cases[case]()


JSON_CASES = [
    "nested lists",
    "nested lists in a member",
    "flat empty lists",
    "flat empty objects",
    "flat small ints",
    "flat 3-digit ints",
    "flat short strings",
    "long string",
    "deep objects",
    "many unknown keys",
    "missing members, huge unknown member",
    "nested record missing members, huge unknown member",
]


MANIFEST_ENTRY = (
    b'{"name":"model.layers.0.self_attn.q_proj.weight","dtype":"bfloat16","shape":[4096,4096],'
    b'"op":"xor","changed":12345,"positions":{"shard":0,"key":"0.p","coding":"rice"},'
    b'"values":{"shard":0,"key":"0.v","coding":"planes"},"encoded_bytes":1234,'
    b'"fingerprint":"' + b"0" * 32 + b'","parent_fingerprint":"' + b"1" * 32 + b'"}'
)


def _status(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(call: Callable[[], object]) -> dict:
    """Run ``call``; its added peak resident memory, time and error."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as handle:  # resets VmHWM to the current RSS
        handle.write("5")
    before = _status("VmRSS")
    started = time.perf_counter()
    error, message, context = None, "", False
    try:
        call()
    except Exception as exc:  # what the case ends in is the point
        error, message = type(exc).__name__, str(exc)
        context = exc.__context__ is not None or exc.__cause__ is not None
        del exc
    seconds = time.perf_counter() - started
    peak = _status("VmHWM") - before
    return {
        "peak": peak,
        "seconds": seconds,
        "error": error,
        "message": message[:2000],
        "message_len": len(message),
        "context": context,
    }


def main(argv: list[str]) -> None:
    if argv[0] == "json":  # argv[1]: a case, or "all" (a report per case, one process)
        from dcr_format.format import schema

        def one(case: str) -> dict:
            name, data = json_case(case, int(argv[2]))
            model = getattr(schema, name)
            limits = {"max_bytes": len(data)}  # these cases test shape, not size
            if "max_bytes" not in inspect.signature(schema.parse).parameters:  # no size limits
                limits = {}
            return measure(lambda: schema.parse(model, data, what="obj", **limits))

        if argv[1] == "all":
            result = {case: one(case) for case in JSON_CASES}
        else:
            result = one(argv[1])
    elif argv[0] == "manifest":  # a valid manifest of about argv[1] bytes, for comparison
        from dcr_format.format import schema

        count = int(argv[1]) // (len(MANIFEST_ENTRY) + 1)
        entries = b",".join(
            MANIFEST_ENTRY.replace(b"layers.0.", b"layers.%d." % i) for i in range(count)
        )
        data = _obj(
            {k: v for k, v in FIELDS.items() if k not in ("parent", "parent_sha256", "created")}
            | {"rank": 0, "shards": []},
            {"entries": b"[" + entries + b"]"},
        )
        result = measure(lambda: schema.parse(schema.Manifest, data, what="manifest"))
    elif argv[0] == "sync":
        from dcr_format import DeltaReader, StateDictTarget

        reader = DeltaReader(argv[1], StateDictTarget({}))
        result = measure(reader.sync)
    else:
        raise SystemExit(f"unknown worker command {argv[0]!r}")
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
