"""Greedy generation of fresh engines, one per checkpoint directory given (a process of its
own: two in-process engines cannot share one Python process). Prints one JSON line."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import harness


def main(dirs: list[str], prompts: list[str]) -> None:
    harness.apply_env()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # each engine core its own process
    out = []
    for model in dirs:
        tp = int(os.environ.get("DCR_TEST_TP", "1"))
        llm = harness.engine(Path(model), tensor_parallel_size=tp)
        out.append(harness.greedy(llm, prompts))
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    print("GREEDY " + json.dumps(out), flush=True)


if __name__ == "__main__":
    split = sys.argv.index("--")
    main(sys.argv[1:split], sys.argv[split + 1 :])
