"""The ``dcr`` ``WeightTransferEngine`` (imports vLLM: loaded by vLLM's factory only when an
engine selects the ``dcr`` backend; :func:`dcr_format.integrations.vllm.register`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from dcr_format.integrations.vllm import (
    DcrInitInfo,
    DcrUpdateInfo,
    UpdateReport,
    _parse,
    _Syncer,
    worker_syncer,
)

__all__ = ["DcrWeightTransferEngine"]


@dataclass
class _InitInfo(DcrInitInfo, WeightTransferInitInfo):
    """:class:`DcrInitInfo` as vLLM's typed init info."""


@dataclass
class _UpdateInfo(DcrUpdateInfo, WeightTransferUpdateInfo):
    """:class:`DcrUpdateInfo` as vLLM's typed update info."""


class DcrWeightTransferEngine(WeightTransferEngine[_InitInfo, _UpdateInfo]):
    """Keeps the worker's model at a version of a dcr chain, in place, through its loader.

    ``init_transfer_engine`` opens the store, checks that the model's weights can be
    updated in place, learns how the loader places every tensor (and records the names
    it transforms for writers), and starts preparing new versions in the background;
    ``update_weights`` applies the version named (default: the newest) — all of it or,
    on any failure, nothing. ``start_weight_update``/``finish_weight_update`` have nothing
    to do: the weights change in place.
    """

    init_info_cls = _InitInfo
    update_info_cls = _UpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._syncer: _Syncer | None = None

    def parse_init_info(self, init_dict: dict[str, Any]) -> _InitInfo:
        """Strict: an unknown field is an error naming the known ones."""
        return _parse(_InitInfo, init_dict, "init_info")

    def parse_update_info(self, update_dict: dict[str, Any]) -> _UpdateInfo:
        """Strict: an unknown field is an error naming the known ones."""
        return _parse(_UpdateInfo, update_dict, "update_info")

    def init_transfer_engine(self, init_info: _InitInfo) -> None:
        """Open the store and prewarm the loader (again on a second call, which keeps the
        version the model holds)."""
        previous, self._syncer = self._syncer, None
        self._syncer = worker_syncer(self.model, init_info, self.vllm_config, previous)

    def start_weight_update(self) -> None:
        """Nothing to set up: the version is applied in place by ``update_weights``."""
        self._require()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Apply the version named in ``update_info`` (the base class would also synchronize
        an accelerator, which a CPU engine lacks)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu" and torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: _UpdateInfo) -> None:
        """Reach the version: prepared in the background or now, then applied."""
        self._require().update(update_info)

    def finish_weight_update(self) -> None:
        """Nothing to finalize: the weights were changed in place."""

    @property
    def last_update(self) -> UpdateReport | None:
        """What the last update did on this worker."""
        return None if self._syncer is None else self._syncer.last

    def _require(self) -> _Syncer:
        if self._syncer is None:
            raise RuntimeError(
                "the dcr weight-transfer engine is not initialised: call "
                "init_weight_transfer_engine with the store first"
            )
        return self._syncer

    def shutdown(self) -> None:
        """Stop the background preparation."""
        if self._syncer is not None:
            self._syncer.close()
            self._syncer = None
