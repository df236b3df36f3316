"""A second custom weight loader, for the tests only: it lets a test read what every
tensor-parallel rank holds, and edit one rank's weights outside dcr.

SGLang calls it like dcr's loader (``update_weights_from_tensor(..., load_format=
"sglang_probe.probe")``) in every scheduler with that rank's model. A request travels in the
name of an empty tensor: ``{"op": "dump", "dir": D}`` saves the rank's parameters (its own
shards, as SGLang placed them) to ``D/rank-<k>.pt``; ``{"op": "edit", "rank": k, "name": N}``
scales parameter ``N`` by 1.5 on rank ``k`` only; ``{"op": "fail-fetch", "rank": k}`` makes
the next shard read of rank ``k``'s dcr reader fail, once (a store error on one rank).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

PREFIX = "sglang-probe:"
LOAD_FORMAT = "sglang_probe.probe"


def request(payload: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Named tensors carrying one probe request."""
    return [(PREFIX + json.dumps(payload), torch.empty(0))]


def probe(model: torch.nn.Module, named_tensors: Any) -> None:
    from sglang.srt.runtime_context import get_parallel

    rank = int(get_parallel().tp_rank)
    for name, _ in named_tensors:
        payload = json.loads(name[len(PREFIX) :])
        if payload["op"] == "dump":
            out = Path(payload["dir"])
            out.mkdir(parents=True, exist_ok=True)
            state = {k: v.detach().clone() for k, v in model.named_parameters()}
            torch.save(state, out / f".rank-{rank}.pt")
            os.replace(out / f".rank-{rank}.pt", out / f"rank-{rank}.pt")
        elif payload.get("rank") != rank:
            continue
        elif payload["op"] == "edit":
            with torch.no_grad():
                param = dict(model.named_parameters())[payload["name"]]
                param.copy_((param.float() * 1.5).to(param.dtype))
        elif payload["op"] == "fail-fetch":
            _fail_next_shard_read(model)


def _fail_next_shard_read(model: torch.nn.Module) -> None:
    from dcr_format.integrations import sglang

    store = sglang._SYNCERS[model].reader.store
    real = store.get

    def get(key: str, **kwargs: Any) -> bytes:
        if key.endswith(".dcrs"):
            del store.get  # once
            raise OSError(f"injected: {key} could not be read on this rank")
        return real(key, **kwargs)

    store.get = get  # type: ignore[method-assign]
