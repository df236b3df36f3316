"""An engine as a Ray actor (how RL frameworks drive rollout engines): a local Ray instance on
127.0.0.1, one actor holding an in-process ``LLM`` with the ``dcr`` backend, driven by
:class:`DcrWeightSync` through the actor handle and through vLLM's
``RayVLLMWeightSyncClient``. After each update the fused weights in the actor are bit-exact
and its ``get_weight_version`` names the version; a refused update carries the engine's
own message and leaves the engine serving what it held."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import harness
import pytest

from dcr_format.errors import EngineUpdateError
from dcr_format.integrations._vllm_clients import RayClient
from dcr_format.integrations.vllm import DcrInitInfo, DcrWeightSync, engine_report

ray = pytest.importorskip("ray", reason="Ray is not installed in .venv-vllm: run .ci/setup-vllm")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[Any]:
    """A local Ray instance on 127.0.0.1, no dashboard, token authentication with this
    run's token (harness.VLLM_ENV); its workers run the engine in process (dcr's torch
    kernels) and import the tier's harness for the bit checks."""
    pythonpath = os.pathsep.join([str(Path(__file__).parent), os.environ["PYTHONPATH"]])
    assert os.environ["RAY_AUTH_MODE"] == "token"
    ray.init(
        address="local",
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        num_cpus=1,
        object_store_memory=128 * 2**20,
        log_to_driver=False,
        runtime_env={  # over the engine environment the workers inherit
            "env_vars": {
                "PYTHONPATH": pythonpath,
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "DCR_KERNELS": "torch",
            }
        },
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def _greedy(actor: Any) -> list[list[int]]:
    from vllm import SamplingParams

    outs = ray.get(
        actor.generate.remote(
            harness.PROMPTS, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False
        )
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def test_weight_sync_drives_an_llm_actor(tmp_path: Path, local_ray: Any) -> None:
    from vllm import LLM
    from vllm.distributed.weight_transfer import RayVLLMWeightSyncClient

    store, trainer, ckpt = harness.first_version(tmp_path, tied=False)
    actor = local_ray.remote(LLM).remote(
        model=str(ckpt), **harness.ENGINE_ARGS, weight_transfer_config={"backend": "dcr"}
    )
    try:
        info = DcrInitInfo(store=store, reader_id="ray", prefetch=False)
        sync = DcrWeightSync(trainer.writer, actor, info)
        assert isinstance(sync.client, RayClient)
        # a trainer actor can hold the client: it pickles as its handles
        assert ray.cloudpickle.loads(ray.cloudpickle.dumps(sync.client)).handles == [actor]
        sync.init()
        # the handle, then vLLM's own Ray client over the same actor (dcr drives its handles)
        clients = [sync, DcrWeightSync(trainer.writer, RayVLLMWeightSyncClient(actor), info)]
        for step, driver in enumerate(clients, start=1):
            trainer.step()
            version = driver.publish(trainer.export(), step=step)
            assert ray.get(actor.get_weight_version.remote()) == str(version) == str(step)
            bits = ray.get(actor.collective_rpc.remote(harness.fused_bits))
            assert bits == [harness.want_fused(trainer.export())]
            (state,) = ray.get(actor.collective_rpc.remote(engine_report))
            assert state["version"] == version and not state["last"]["unverified"]
        before = _greedy(actor)
        with pytest.raises(EngineUpdateError, match="did not reach version 9") as refused:
            sync.update(9)
        # the engine's own message, not Ray's wrapping of it (a traceback)
        message = str(refused.value)
        assert f"weights: version 9 is not committed: the chain of file://{store}" in message
        assert message.endswith("holds versions 0..2; run `dcr log` to see the committed versions")
        (state,) = ray.get(actor.collective_rpc.remote(engine_report))
        assert state["version"] == 2
        assert _greedy(actor) == before  # still serving what it held
    finally:
        ray.kill(actor)
