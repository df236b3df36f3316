"""Test-only vLLM general plugin (found through the dist-info beside it when this directory
is on PYTHONPATH, so every engine-core, worker and server process applies it).

vLLM's CPU build prepacks every unquantized linear weight into a oneDNN/SGL handle after
loading (and empties the parameter), and the stacked expert weights of a mixture-of-experts
layer (``w13_weight``, ``w2_weight``) into its grouped-GEMM layout, and has no setting to turn
either off; this keeps the weights as plain tensors, computed with
``torch.nn.functional.linear`` and with vLLM's own CPU MoE kernel on a copy packed at each
call, so that they can be updated in place. Not part of dcr-format: docs/vllm.md says why.
"""

from __future__ import annotations

from typing import Any

ORIGINAL_DISPATCH: Any = None  # vLLM's own, for the test that dcr fails closed without this
ORIGINAL_MOE: Any = None  # vLLM's own CPU MoE weight processing (the same)


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
    _keep_moe_weights()


def _keep_moe_weights() -> None:
    """Keep CPU MoE expert stacks in the loader's layout; pack a copy for each kernel call."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    experts = cpu_moe.CPUUnquantizedExperts
    global ORIGINAL_MOE
    if ORIGINAL_MOE is not None:
        return
    ORIGINAL_MOE = experts.process_weights_after_loading
    own_apply = experts.apply

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        self._use_zentorch = False
        self._pad_moe_intermediate(layer)

    def apply(self: Any, *args: Any, w1: Any, w2: Any, **kwargs: Any) -> Any:
        w1 = ops.cpu_prepack_moe_weight(w1, self.isa)
        w2 = ops.cpu_prepack_moe_weight(w2, self.isa)
        return own_apply(self, *args, w1=w1, w2=w2, **kwargs)

    experts.process_weights_after_loading = process_weights_after_loading
    experts.apply = apply
