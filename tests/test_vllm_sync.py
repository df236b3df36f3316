"""The trainer side of the vLLM integration against a stand-in weight-sync client (the
engine side runs in tests_vllm/)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dcr_format import DeltaWriter
from dcr_format.errors import EngineUpdateError
from dcr_format.integrations.vllm import DcrInitInfo, DcrWeightSync


class Client:
    """Records the four calls; ``update_weights`` fails while ``refuse`` is set (as vLLM
    does, it then ends the session itself: a finish would be refused)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.refuse = False
        self.active = False

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init", init_info))

    def start_weight_update(self) -> None:
        self.active = True
        self.calls.append(("start", None))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.append(("update", update_info))
        if self.refuse:
            self.active = False
            raise RuntimeError("tensor 'w' in the target is not the bits of version 1")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))
        if not self.active:
            raise RuntimeError("finish_weight_update called without a matching start")
        self.active = False


def _sync(tmp_path) -> tuple[DcrWeightSync, Client]:  # type: ignore[no-untyped-def]
    store = str(tmp_path / "store")
    client = Client()
    return DcrWeightSync(DeltaWriter(store), client, DcrInitInfo(store=store)), client


def test_an_update_without_a_version_names_the_newest_to_the_engine(tmp_path):
    sync, client = _sync(tmp_path)
    w = torch.arange(64, dtype=torch.float32).bfloat16()
    sync.writer.publish({"w": w})
    sync.writer.publish({"w": w + 1})
    sync.update()
    # the engine is told the version, and /weight_info reports it
    assert client.calls == [
        ("start", None),
        ("update", {"audit": False, "version": 1}),
        ("finish", "1"),
    ]


def test_a_refused_update_leaves_the_session_to_the_engine(tmp_path):
    sync, client = _sync(tmp_path)
    sync.writer.publish({"w": torch.zeros(8, dtype=torch.bfloat16)})
    client.refuse = True
    with pytest.raises(EngineUpdateError, match="not the bits of version 1"):
        sync.update(0)
    # no finish after the engine ended the session (it would log a second traceback)
    assert [name for name, _ in client.calls] == ["start", "update"]


def test_an_engine_that_refuses_to_start_the_update_raises_the_named_error(tmp_path):
    sync, client = _sync(tmp_path)
    sync.writer.publish({"w": torch.zeros(8, dtype=torch.bfloat16)})

    def refuse() -> None:  # an engine never initialised (sync.init() not called)
        client.calls.append(("start", None))
        raise RuntimeError("the dcr weight-transfer engine is not initialised")

    client.start_weight_update = refuse  # type: ignore[method-assign]
    with pytest.raises(EngineUpdateError, match=r"version 0 .*engine is not initialised"):
        sync.update(0)
    # nothing is sent after a session that never started
    assert [name for name, _ in client.calls] == ["start"]


def test_an_engine_that_cannot_start_dcr_raises_the_named_error_with_its_reason(tmp_path):
    sync, client = _sync(tmp_path)

    def refuse(init_info: dict[str, Any]) -> None:  # as vLLM's HTTP client: status only
        raise OSError("500 Server Error: Internal Server Error for url: /init")

    client.init_weight_transfer_engine = refuse  # type: ignore[method-assign]
    with pytest.raises(EngineUpdateError, match=r"did not start dcr .*500 Server Error"):
        sync.init()


def test_publish_updates_the_engines_and_records_both_times(tmp_path):
    sync, client = _sync(tmp_path)
    assert sync.publish({"w": torch.zeros(8, dtype=torch.bfloat16)}, step=0) == 0
    assert client.calls[-2] == ("update", {"audit": False, "version": 0})
    assert sync.timings[0]["version"] == 0.0
    assert set(sync.timings[0]) == {"version", "publish_seconds", "update_seconds"}
    # a rank without a client publishes only
    quiet = DcrWeightSync(sync.writer, None, sync.init_info)
    assert quiet.publish({"w": torch.ones(8, dtype=torch.bfloat16)}, step=1) == 1
    assert len(client.calls) == 3 and len(quiet.timings) == 1


# --- the engine side's reader, on a vLLM-like model without vLLM -------------------------

from test_module_target import Runtime, checkpoint, step  # noqa: E402

from dcr_format.errors import BaselineMismatchError, VersionNotFoundError  # noqa: E402
from dcr_format.integrations.vllm import DcrUpdateInfo, _Syncer  # noqa: E402


def _at_version_0(tmp_path):  # type: ignore[no-untyped-def]
    """A store holding version 0 of the runtime's checkpoint, and a runtime holding it:
    (store, writer, version 0's state, module)."""
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    state = checkpoint()
    writer.publish(state)
    module = Runtime()
    module.load_weights(state.items())  # the engine's checkpoint: version 0
    return store, writer, state, module


def _engine(tmp_path, claimed: int):  # type: ignore[no-untyped-def]
    store, writer, state, module = _at_version_0(tmp_path)
    writer.publish(step(state, 0))
    info = DcrInitInfo(store=store, version=claimed, prefetch=False, reader_id="engine")
    return writer, module, lambda: _Syncer(module, info, model_dir=None)


def test_an_engine_reports_the_version_it_verified_not_the_one_claimed(tmp_path):
    _, _, start = _engine(tmp_path, claimed=1)
    with pytest.raises(BaselineMismatchError, match="restart the engine on a `dcr replay`"):
        start()
    _, _, start = _engine(tmp_path / "right", claimed=0)
    assert start().version() == 0


def _recorded_engine(tmp_path):  # type: ignore[no-untyped-def]
    """An engine at version 0, and version 1 published after the engine recorded the names
    it transforms: (writer, version 0's state, module, syncer)."""
    store, writer, state, module = _at_version_0(tmp_path)
    info = DcrInitInfo(store=store, version=0, prefetch=False, reader_id="engine")
    syncer = _Syncer(module, info, model_dir=None)
    writer.publish(step(state, 0))  # after the engine recorded the names it transforms
    return writer, state, module, syncer


def test_an_engine_refusal_says_what_to_do_on_an_engine(tmp_path):
    _, _, module, syncer = _recorded_engine(tmp_path)
    with torch.no_grad():
        module.qkv[0, 0] += 1  # changed outside dcr where the next delta changes it
    with pytest.raises(BaselineMismatchError) as caught:
        syncer.update(DcrUpdateInfo())
    assert "restart the engine on a `dcr replay`" in str(caught.value)
    assert "fresh target" not in str(caught.value)
    assert syncer.version() == 0


def test_an_update_holds_the_collector_off_while_it_runs(tmp_path):
    """The engine is paused for the whole update: Python's cyclic collector (a full pass
    walks the engine's heap) is held off while the reader prepares and applies, and is on
    again after, after a refusal too; where the engine had it off, it stays off."""
    import gc

    writer, state, _, syncer = _recorded_engine(tmp_path)
    seen: list[bool] = []
    apply = syncer.reader.apply

    def watched(prepared, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(gc.isenabled())
        return apply(prepared, **kwargs)

    syncer.reader.apply = watched  # type: ignore[method-assign]
    assert gc.isenabled()
    assert syncer.update(DcrUpdateInfo()).version == 1
    assert seen == [False] and gc.isenabled()
    with pytest.raises(VersionNotFoundError):
        syncer.update(DcrUpdateInfo(version=7))
    assert gc.isenabled()
    gc.disable()
    try:
        writer.publish(step(step(state, 0), 1))
        assert syncer.update(DcrUpdateInfo()).version == 2
        assert seen == [False, False] and not gc.isenabled()
    finally:
        gc.enable()


def test_a_workers_background_polls_read_the_head_hint_and_list_seldom(tmp_path, monkeypatch):
    """Each poll of the background preparation reads the small HEAD object; the commit
    records are listed where HEAD names a newer version, and every LIST_SECONDS whatever it
    says (a committer's HEAD write may have failed)."""
    import time

    import dcr_format.integrations.vllm as vllm_integration
    from dcr_format.chain.chain import COMMITS_PREFIX
    from dcr_format.store.store import Store

    lists: list[str] = []
    real_list = Store.list

    def counted(self, prefix=""):  # type: ignore[no-untyped-def]
        lists.append(prefix)
        return real_list(self, prefix)

    monkeypatch.setattr(Store, "list", counted)
    monkeypatch.setattr(vllm_integration, "LIST_SECONDS", 0.5)
    store, writer, state, module = _at_version_0(tmp_path)
    info = DcrInitInfo(store=store, version=0, poll_seconds=0.01, reader_id="engine")
    syncer = _Syncer(module, info, model_dir=None)

    def prepared(version: int) -> bool:
        for _ in range(500):
            if syncer._prepared is not None and syncer._prepared.version == version:
                return True
            time.sleep(0.01)
        return False

    try:
        time.sleep(0.2)  # the first poll lists; then nothing is newer than version 0
        assert COMMITS_PREFIX in lists
        lists.clear()
        time.sleep(0.3)
        assert len(lists) <= 1  # about 20 polls, at most one listing
        state = step(state, 0)
        writer.publish(state)  # HEAD names version 1: listed at the next poll
        assert prepared(1)
        state = step(state, 1)
        writer.publish(state)
        writer.store.put("HEAD", b"1")  # as if the committer's HEAD write had failed
        assert prepared(2)  # found by the listing every LIST_SECONDS
        assert syncer.update(DcrUpdateInfo()).prefetched
        assert syncer.version() == 2
    finally:
        syncer.close()
