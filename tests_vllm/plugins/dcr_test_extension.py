"""Test-only worker extension: dcr's own extension plus what the tests reach into a served
engine for (its fused parameters' bits; an edit made outside dcr)."""

from __future__ import annotations

from typing import Any

import torch

from dcr_format.integrations.vllm import DcrWorkerExtension
from dcr_format.testing.tiny_llama import fused_bits


class ProbeExtension(DcrWorkerExtension):
    """``collective_rpc`` probes for tests_vllm/test_serve.py."""

    def _model(self) -> Any:
        worker: Any = self
        return worker.model_runner.get_model()

    def test_fused_bits(self) -> list[list[int]]:
        """The bits of every fused qkv_proj and gate_up_proj, in layer order."""
        return fused_bits(self._model())

    def test_poke(self) -> None:
        """Flip the lowest bit of one qkv_proj element, outside dcr (call again to undo)."""
        weight = self._model().model.layers[0].self_attn.qkv_proj.weight
        with torch.no_grad():
            bits = weight.view(torch.int16)
            bits[0, 0] ^= 1
