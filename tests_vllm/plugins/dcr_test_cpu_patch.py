"""Test-only vLLM general plugin (found through the dist-info beside it when this directory
is on PYTHONPATH, so every engine-core, worker and server process applies it).

vLLM's CPU build prepacks every unquantized linear weight into a oneDNN/SGL handle after
loading (and empties the parameter), and has no setting to turn that off; this keeps the
weights as plain tensors computed with ``torch.nn.functional.linear`` so that they can be
updated in place. Not part of dcr-format: docs/vllm.md says why.
"""

from __future__ import annotations

from typing import Any

ORIGINAL_DISPATCH: Any = None  # vLLM's own, for the test that dcr fails closed without this


def keep_cpu_weights_updatable() -> None:
    """Replace ``dispatch_cpu_unquantized_gemm`` with one that keeps the weights."""
    import torch
    from vllm.model_executor.layers import utils

    global ORIGINAL_DISPATCH
    if ORIGINAL_DISPATCH is None:
        ORIGINAL_DISPATCH = utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    utils.dispatch_cpu_unquantized_gemm = dispatch
