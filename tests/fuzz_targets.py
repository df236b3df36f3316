"""Coverage-guided fuzzing (atheris) of every parser of untrusted bytes.

One input drives one parser, chosen by its first byte: the commit record, the
manifest and the store header (``schema.parse``), the shard container
(``decode_shard`` with a declared decoded size), the position and value decoders
(``decode_positions``, ``decode_values`` in ``planes`` and ``rans``) with fuzzed counts,
sizes and widths, and an ``xor`` entry of a fixed bfloat16 tensor (:data:`OLD`) in any
position and value coding, those decoded against the old bits included (``classed``,
``ulp``, ``ulp-shift``), through ``decode_delta``, ``resolve`` and ``apply_change`` into a
copy of it. Any exception that is not a :class:`~dcr_format.DcrError` is a bug and
stops the run with the input that caused it; libFuzzer's ``-rss_limit_mb`` and
``-malloc_limit_mb`` catch unbounded memory.

    # seed a corpus from the objects of a store (or let the run start empty)
    .venv/bin/python tests/fuzz_targets.py --seed-corpus CORPUS_DIR --from-store STORE
    # fuzz for ten minutes
    .venv/bin/python tests/fuzz_targets.py CORPUS_DIR -max_total_time=600 -max_len=65536 \
        -rss_limit_mb=2048

tests/test_fuzz.py seeds a corpus from its chain and runs a short bounded run
(``-runs=50000``, ``$DCR_ATHERIS_RUNS``).
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["dcr_format"]):
    import numpy as np
    import torch

    from dcr_format.codings.classed import encode_classed
    from dcr_format.codings.positions import decode_positions, encode_positions
    from dcr_format.codings.ulp import to_ulp
    from dcr_format.codings.values import decode_values, encode_xor_values
    from dcr_format.delta.delta import apply_change, decode_delta, resolve
    from dcr_format.errors import DcrError
    from dcr_format.format.dtypes import info_for
    from dcr_format.format.features import EncodeOptions
    from dcr_format.format.names import CLASSED, POSITION_CODINGS, ULP, ULP_SHIFT, VALUE_CODINGS
    from dcr_format.format.schema import CommitRecord, Manifest, StoreHeader, parse
    from dcr_format.format.shard import decode_shard

MODELS = (CommitRecord, Manifest, StoreHeader)
WIDTHS = (1, 2, 4, 8, 3, 0)
MAX_DECODED = 64 << 20  # a reader's limit on what one shard may inflate to, for this harness
MAX_COUNT = 1 << 20
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
BASELINE_POSITIONS = (*POSITION_CODINGS, CLASSED)
BASELINE_VALUES = (*VALUE_CODINGS, ULP, ULP_SHIFT)
OLD = (torch.from_numpy(np.random.default_rng(0).standard_normal(4096)) * 0.02).to(torch.bfloat16)
"""The old bits every input of choice 6 decodes against."""

# An input is: one byte choosing the parser, its parameters, then the bytes it parses.
#   0-2  commit record / manifest / store header      | object
#   3    shard: u64 declared decoded size             | stored shard
#   4    positions: u8 coding, u64 numel, u64 count   | stream
#   5    values: u8 width, u8 coding, u64 count       | stream
#   6    an xor entry of OLD: u8 positions coding, u8 values coding, u64 count,
#        u32 positions length                          | positions stream, values stream


def test_one_input(data: bytes) -> None:
    if not data:
        return
    choice, rest = data[0] % 7, data[1:]
    try:
        if choice <= 2:
            parse(MODELS[choice], rest, what="fuzz")
        elif choice == 3 and len(rest) >= 8:
            declared = _U64.unpack_from(rest)[0] % (MAX_DECODED + 1)
            decode_shard(rest[8:], decoded_size=declared)
        elif choice == 4 and len(rest) >= 17:
            coding = POSITION_CODINGS[rest[0] % len(POSITION_CODINGS)]
            numel = _U64.unpack_from(rest, 1)[0]
            count = _U64.unpack_from(rest, 9)[0] % (MAX_COUNT + 1)
            decode_positions(coding, rest[17:], count=count, numel=numel)
        elif choice == 5 and len(rest) >= 10:
            width = WIDTHS[rest[0] % len(WIDTHS)]
            coding = VALUE_CODINGS[rest[1] % len(VALUE_CODINGS)]
            count = _U64.unpack_from(rest, 2)[0] % (MAX_COUNT + 1)
            decode_values(coding, rest[10:], count=count, width=width)
        elif choice == 6 and len(rest) >= 14:
            baseline_entry(rest)
    except DcrError:
        pass  # a named refusal is the right answer to hostile bytes


def baseline_entry(rest: bytes) -> torch.Tensor:
    """Choice 6: an ``xor`` entry of :data:`OLD` decoded, completed and applied to a copy
    of it (returned)."""
    positions = BASELINE_POSITIONS[rest[0] % len(BASELINE_POSITIONS)]
    values = BASELINE_VALUES[rest[1] % len(BASELINE_VALUES)]
    count = _U64.unpack_from(rest, 2)[0] % (OLD.numel() + 1)
    cut = 14 + _U32.unpack_from(rest, 10)[0]
    target = OLD.clone()
    delta = decode_delta(
        "xor",
        info_for("bfloat16"),
        OLD.numel(),
        count,
        positions=(positions, rest[14:cut]),
        values=(values, rest[cut:]),
    )
    apply_change(target, resolve(delta, target))
    return target


def baseline_seeds() -> list[bytes]:
    """Inputs of choice 6 that decode: a step of OLD in each coding against the old bits."""
    rng = np.random.default_rng(1)
    old = OLD.view(torch.uint16).numpy()
    new = OLD.clone()
    new[torch.from_numpy(rng.random(OLD.numel()) < 0.03)] *= 1 + 2.0**-7
    where = np.flatnonzero(new.view(torch.uint16).numpy() != old)
    before, after = old[where], new.view(torch.uint16).numpy()[where]
    seeds = []
    for features in ((), ("values-rans",), ("values-ulp",), ("values-ulp-shift",)):
        coding, stream = encode_xor_values(
            before ^ after,
            to_ulp(before, after),
            old=before,
            dtype="bfloat16",
            codings=EncodeOptions.allowing(features).codings,
        )
        for positions, placed in (
            ("rice", encode_positions(where, coding="rice")[1]),
            (CLASSED, encode_classed(where, old, "bfloat16")),
        ):
            head = bytes([6, BASELINE_POSITIONS.index(positions), BASELINE_VALUES.index(coding)])
            seeds.append(head + _U64.pack(where.size) + _U32.pack(len(placed)) + placed + stream)
    return seeds


def seed_corpus(corpus: Path, store: str | None) -> int:
    """Seeds from a store's objects: every JSON object, every shard with its declared decoded
    size, and every positions and values stream with its entry's count, numel and width."""
    corpus.mkdir(parents=True, exist_ok=True)
    seeds: list[bytes] = [b"\x00{}", b"\x03" + bytes(16), b"\x04" + bytes(24), b"\x05" + bytes(17)]
    seeds += baseline_seeds()
    if store is not None:
        root = Path(store)
        seeds.append(b"\x02" + (root / "dcr.json").read_bytes())
        seeds += [b"\x00" + p.read_bytes() for p in sorted((root / "commits").glob("*.json"))]
        for path in sorted(root.rglob("manifest-*.json")):
            raw = path.read_bytes()
            seeds.append(b"\x01" + raw)
            manifest = json.loads(raw)
            streams = []
            for ref in manifest["shards"]:
                stored = (root / ref["path"]).read_bytes()
                seeds.append(b"\x03" + _U64.pack(ref["decoded_size"]) + stored)
                streams.append(decode_shard(stored, decoded_size=ref["decoded_size"]))
            for entry in manifest["entries"]:
                numel = 1
                for dim in entry["shape"]:
                    numel *= dim
                width = info_for(entry["dtype"]).width
                if entry.get("positions"):
                    ref = entry["positions"]
                    coding = POSITION_CODINGS.index(ref["coding"])
                    head = bytes([4, coding]) + _U64.pack(numel) + _U64.pack(entry["changed"])
                    seeds.append(head + bytes(streams[ref["shard"]][ref["key"]]))
                if entry.get("values") and entry["values"]["coding"] in VALUE_CODINGS:
                    ref = entry["values"]
                    coding = VALUE_CODINGS.index(ref["coding"])
                    head = bytes([5, WIDTHS.index(width), coding]) + _U64.pack(entry["changed"])
                    seeds.append(head + bytes(streams[ref["shard"]][ref["key"]]))
    for index, seed in enumerate(seeds):
        (corpus / f"seed-{index:04d}").write_bytes(seed)
    return len(seeds)


def main(argv: list[str]) -> None:
    if "--seed-corpus" in argv:
        corpus = Path(argv[argv.index("--seed-corpus") + 1])
        store = argv[argv.index("--from-store") + 1] if "--from-store" in argv else None
        print(f"{seed_corpus(corpus, store)} seeds in {corpus}")
        return
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
