"""Coverage-guided fuzzing (atheris) of every parser of untrusted bytes.

One input drives one parser, chosen by its first byte: the commit record, the
manifest and the store header (``schema.parse``), the shard container
(``decode_shard`` with a declared decoded size), and the position and value
decoders (``decode_positions``, ``decode_values``) with fuzzed counts, sizes and
widths. Any exception that is not a :class:`~dcr_format.DcrError` is a bug and
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
    from dcr_format.codec.dtypes import info_for
    from dcr_format.codec.positions import POSITION_CODINGS, decode_positions
    from dcr_format.codec.shard import decode_shard
    from dcr_format.codec.values import decode_values
    from dcr_format.errors import DcrError
    from dcr_format.schema import CommitRecord, Manifest, StoreHeader, parse

MODELS = (CommitRecord, Manifest, StoreHeader)
WIDTHS = (1, 2, 4, 8, 3, 0)
MAX_DECODED = 64 << 20  # a reader's limit on what one shard may inflate to, for this harness
MAX_COUNT = 1 << 20
_U64 = struct.Struct("<Q")

# An input is: one byte choosing the parser, its parameters, then the bytes it parses.
#   0-2  commit record / manifest / store header      | object
#   3    shard: u64 declared decoded size             | stored shard
#   4    positions: u8 coding, u64 numel, u64 count   | stream
#   5    values: u8 width, u64 count                  | stream


def test_one_input(data: bytes) -> None:
    if not data:
        return
    choice, rest = data[0] % 6, data[1:]
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
        elif choice == 5 and len(rest) >= 9:
            width = WIDTHS[rest[0] % len(WIDTHS)]
            count = _U64.unpack_from(rest, 1)[0] % (MAX_COUNT + 1)
            decode_values("planes", rest[9:], count=count, width=width)
    except DcrError:
        pass  # a named refusal is the right answer to hostile bytes


def seed_corpus(corpus: Path, store: str | None) -> int:
    """Seeds from a store's objects: every JSON object, every shard with its declared decoded
    size, and every positions and values stream with its entry's count, numel and width."""
    corpus.mkdir(parents=True, exist_ok=True)
    seeds: list[bytes] = [b"\x00{}", b"\x03" + bytes(16), b"\x04" + bytes(24), b"\x05" + bytes(16)]
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
                if entry.get("values"):
                    ref = entry["values"]
                    head = bytes([5, WIDTHS.index(width)]) + _U64.pack(entry["changed"])
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
