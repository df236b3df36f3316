"""The weight-sync clients :class:`~dcr_format.integrations.vllm.DcrWeightSync` drives: an
in-process ``vllm.LLM``, Ray actors holding engines, and any client with vLLM's four
methods (the HTTP one); and the engine's own message out of a failed call. Imports neither
vLLM nor Ray."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LLMClient", "RayClient", "as_client", "engine_message"]


class LLMClient:
    """An in-process ``vllm.LLM`` as a weight-sync client (its methods take request dicts)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


@dataclass(frozen=True)
class _InitRequest:
    """``init_weight_transfer_engine``'s argument for an engine actor (``LLM`` and
    ``AsyncLLM`` read its ``init_info``)."""

    init_info: dict[str, Any]


@dataclass(frozen=True)
class _UpdateRequest:
    """``update_weights``' argument for an engine actor (they read its ``update_info``)."""

    update_info: dict[str, Any]


class RayClient:
    """Ray actors holding an ``LLM`` or ``AsyncLLM`` as one weight-sync client: each call
    goes to every actor and waits for all. The engines have applied a version when
    ``update_weights`` returns (dcr's transfer is read from the store inside the call).
    Picklable: it holds only the actor handles."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = list(handles)

    def _all(self, method: str, *args: Any) -> None:
        import ray

        ray.get([getattr(h, method).remote(*args) for h in self.handles])

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all("init_weight_transfer_engine", _InitRequest(init_info))

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._all("update_weights", _UpdateRequest(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", weight_version)


def _is_actor(obj: object) -> bool:
    """A Ray actor handle (told without importing Ray)."""
    kind = type(obj)
    return kind.__name__ == "ActorHandle" and kind.__module__.split(".")[0] == "ray"


def as_client(client: Any) -> Any:
    """``client`` as a ``VLLMWeightSyncClient``: an ``LLM`` is adapted; a Ray actor handle
    of an ``LLM``/``AsyncLLM`` (or a list of them), and vLLM's ``RayVLLMWeightSyncClient``
    (its handles), are driven by dcr's Ray client, which makes the same calls; anything
    else with the four methods (the HTTP client) is used as is."""
    if hasattr(client, "llm_engine"):
        return LLMClient(client)
    handles = client if isinstance(client, list) else [client]
    if type(client).__name__ == "RayVLLMWeightSyncClient":
        handles = list(client.handles)
    if handles and all(_is_actor(h) for h in handles):
        return RayClient(handles)
    for method in (
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
    ):
        if not callable(getattr(client, method, None)):
            raise TypeError(
                f"{type(client).__name__} is not a weight-sync client (no {method}); pass "
                "vLLM's HTTPVLLMWeightSyncClient, an LLM, or Ray actors of LLM/AsyncLLM "
                "(handles or RayVLLMWeightSyncClient)"
            )
    return client


def engine_message(exc: BaseException) -> str:
    """The engine's own message: an HTTP error's JSON body, the error a Ray actor raised,
    else the exception's text."""
    cause = getattr(exc, "cause", None)  # a Ray task error: the actor's own exception
    if isinstance(cause, BaseException) and cause is not exc:
        return engine_message(cause)
    response = getattr(exc, "response", None)
    if response is not None:
        try:
            body = response.json()
            message = body.get("error", {}).get("message") if isinstance(body, dict) else None
        except ValueError:
            message = None
        text = message or getattr(response, "text", "") or ""
        if text:
            return " ".join(str(text).split())[:2000]
    return " ".join(str(exc).split())[:2000]
