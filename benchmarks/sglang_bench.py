"""The pause of a dcr update in SGLang against a dense ``update_weights_from_tensor`` of the
same bits, on the same engine, in one run (medians of several steps).

An offline ``sglang.Engine`` serves a Llama built from a config (no hub); each step changes a
fraction of every tensor's bf16 elements, publishes it with DeltaWriter and lets the engine's
loader prepare it in the background, then times, as the trainer sees them, both updates
(begin, load, end):

- dcr: ``DcrSGLangSync.update`` (the loader applies the prepared version in place; the
  engine's own figure, the apply inside the scheduler, is shown too);
- dense: ``update_weights_from_tensor`` of the whole state dict of the same version through
  the model's ``load_weights`` (the tensors already in this process's memory).

    .venv-sglang/bin/python benchmarks/sglang_bench.py [--hidden 512] [--layers 4]
        [--vocab 8192] [--steps 5] [--change 0.03] [--tp 1]

With ``--tp 2`` the engine's two tensor-parallel ranks form a reader group: each prepares
its shards of the version in the background, the ranks agree in the update that every one
holds it and apply together, and the dense update is split per rank by SGLang.

On a CPU without sgl-kernel the test shims of tests_sglang/shims are put on the path.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent / "tests_sglang"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--change", type=float, default=0.03, help="fraction changed a step")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    args = parser.parse_args()

    if args.device == "cpu":
        sys.path.insert(0, str(HERE))
        import harness

        harness.apply_env()
        os.environ.update(harness.tp_env(args.tp))
    import sglang
    import torch
    import transformers

    from dcr_format import DeltaWriter, replay
    from dcr_format.integrations.sglang import LOAD_FORMAT, DcrSGLangSync
    from dcr_format.integrations.vllm import DcrInitInfo, canonical_state
    from dcr_format.testing.tiny_llama import llama_config

    sys.path.insert(0, str(HERE))
    import harness

    heads = max(args.hidden // 64, 1)
    config = llama_config(
        vocab=args.vocab,
        hidden=args.hidden,
        intermediate=args.hidden * 3,
        layers=args.layers,
        heads=heads,
        kv_heads=max(heads // 2, 1),
        max_positions=256,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    state = canonical_state(transformers.LlamaForCausalLM(config))
    params = sum(t.numel() for t in state.values())
    gen = torch.Generator().manual_seed(1)

    def step() -> None:
        for tensor in state.values():
            flat = tensor.view(-1)
            k = max(int(flat.numel() * args.change), 1)
            at = torch.randint(0, flat.numel(), (k,), generator=gen)
            flat[at] = (flat[at].float() * (1 + 2**-6)).to(tensor.dtype)

    tmp = Path(tempfile.mkdtemp(prefix="dcr-sglang-bench-"))
    store = str(tmp / "store")
    writer = DeltaWriter(store)
    writer.publish(state, step=0)
    ckpt = tmp / "ckpt"
    replay(store, 0, ckpt)
    config.save_pretrained(ckpt)
    harness.save_tokenizer(ckpt)
    engine_args = {**harness.ENGINE_ARGS, "device": args.device, "tp_size": args.tp}
    engine = sglang.Engine(model_path=str(ckpt), custom_weight_loader=[LOAD_FORMAT], **engine_args)
    rows = []
    try:
        sync = DcrSGLangSync(writer, engine, DcrInitInfo(store=store))
        sync.init()
        for i in range(args.steps + 1):  # the first step warms both paths, not counted
            step()
            version = int(writer.publish(state, step=i + 1).version)
            time.sleep(2.0)  # generation time: the engine prepares the version meanwhile
            started = time.perf_counter()
            report = sync.update(version)
            dcr = time.perf_counter() - started
            started = time.perf_counter()
            engine.begin_weight_update()
            engine.update_weights_from_tensor(list(state.items()), flush_cache=True)
            engine.end_weight_update()
            dense = time.perf_counter() - started
            if i:
                inside = 0.0 if report.prefetched else report.prepare_seconds
                rows.append((dcr, report.apply_seconds, dense, report.prefetched, inside))
    finally:
        engine.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    dcr_pause = statistics.median(r[0] for r in rows)
    apply = statistics.median(r[1] for r in rows)
    dense = statistics.median(r[2] for r in rows)
    print(
        f"SGLang {sglang.__version__}, device {args.device}, tensor parallel {args.tp}, "
        f"{params / 1e6:.1f}M parameters "
        f"({params * 2 / 1e6:.1f} MB bf16, {len(state)} tensors), {args.change:.0%} changed a "
        f"step, medians of {len(rows)} steps (prefetched: {sum(r[3] for r in rows)})"
    )
    print("| what stops generation | seconds |")
    print("|---|---|")
    where = "in the background" if all(r[3] for r in rows) else "in the update where not ahead"
    prepare = statistics.median(r[4] for r in rows)
    print(f"| dcr update (begin, load, end; prepared {where}) | {dcr_pause:.4f} |")
    print(f"| of which preparing (fetch, verify) inside the pause | {prepare:.4f} |")
    print(f"| of which the apply inside the engine | {apply:.4f} |")
    print(f"| dense update_weights_from_tensor of the same bits | {dense:.4f} |")
    print(f"dcr pause / dense: {dcr_pause / dense:.2f}x")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
