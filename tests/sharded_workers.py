"""Worker processes of tests/test_sharded.py: a tiny Llama trained with AdamW on gloo ranks
(FSDP2, FSDP2 over tensor parallelism, HSDP), published from its DTensor shards.

``python sharded_workers.py ROLE RANK WORLD PORT WORK`` writes ``WORK/ROLE-RANK.json``.
Every check that needs the gathered model gathers it here, outside ``publish``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

STEPS = 3
VOCAB = 67  # divides by neither 2 nor 4: uneven shards of the embeddings


def config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )


def build(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(config())


def tensor_parallel(model: torch.nn.Module, tp_mesh: Any) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:  # type: ignore[union-attr]
        parallelize_module(layer, tp_mesh, plan)


def shard(model: torch.nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train_step(model: torch.nn.Module, optimizer: Any, step: int, data_rank: int) -> None:
    generator = torch.Generator().manual_seed(1000 * step + data_rank)
    ids = torch.randint(0, VOCAB, (2, 8), generator=generator)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def published(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a trainer passes to publish: its state dict in bf16 (DTensors stay DTensors),
    and one plain tensor beside them."""
    from dcr_format.integrations.vllm import trainer_state

    state = trainer_state(model)
    state["extra.scale"] = torch.arange(5, dtype=torch.bfloat16)
    return state


def gathered(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose bits differ (or that one side lacks)."""
    wrong = sorted(set(a) ^ set(b))
    for name in set(a) & set(b):
        x, y = a[name], b[name]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(-1), y.view(-1)):
            if x.dtype == torch.bfloat16 and y.dtype == torch.bfloat16:
                if torch.equal(x.view(torch.int16), y.view(torch.int16)):
                    continue
            wrong.append(name)
    return wrong


class Run:
    """One model's writer and (on rank 0) its reader holding the full model."""

    def __init__(self, root: str, rank: int, world: int, **options: Any) -> None:
        from dcr_format import DeltaReader, DeltaWriter, StateDictTarget
        from dcr_format.publish.coordinate import TorchDistributedCoordinator

        self.rank = rank
        self.writer = DeltaWriter(
            root,
            rank=rank,
            world_size=world,
            coordinator=TorchDistributedCoordinator(),
            **options,
        )
        self.target = StateDictTarget({})
        self.reader = DeltaReader(root, self.target) if rank == 0 else None
        self.wrong: list[list[str]] = []
        self.collectives: list[dict[str, Any]] = []
        self.baseline_bytes = 0

    def publish(self, model: torch.nn.Module, step: int, *, stream: bool = False) -> None:
        from dcr_format.testing.collectives import counted_collectives

        state = published(model)
        with counted_collectives() as seen:
            if stream:
                self.writer.publish(self.stream(model), step=step)
            else:
                self.writer.publish(state, step=step)
        self.collectives.append(
            {"calls": dict(seen.calls), "bytes": seen.bytes, "functional": dict(seen.functional)}
        )
        self.baseline_bytes = sum(
            t.numel() * t.element_size() for t in self.writer.baseline.values()
        )
        full = gathered(state)  # the test's gather, outside publish
        if self.reader is not None:
            self.reader.sync()
            self.wrong.append(same_bits(self.target.tensors, full))

    def stream(self, model: torch.nn.Module) -> Any:
        """A converter's stream: each (name, tensor) made when asked for (a fresh bf16
        DTensor), counting how many earlier ones are still alive at each request."""
        import gc
        import weakref

        alive: list[weakref.ref[torch.Tensor]] = []
        self.held = 0
        for name, param in model.state_dict().items():
            gc.collect()
            self.held = max(self.held, sum(r() is not None for r in alive))
            tensor = param.detach().to(torch.bfloat16)
            alive.append(weakref.ref(getattr(tensor, "_local_tensor", tensor)))
            yield name, tensor
            del tensor
        yield "extra.scale", torch.arange(5, dtype=torch.bfloat16)

    def result(self) -> dict[str, Any]:
        return {
            "held": getattr(self, "held", None),
            "wrong": self.wrong,
            "collectives": self.collectives,
            "baseline_bytes": self.baseline_bytes,
        }


def shard_bytes(state: dict[str, torch.Tensor]) -> int:
    from torch.distributed.tensor import DTensor

    return sum((v.to_local() if isinstance(v, DTensor) else v).numel() * 2 for v in state.values())


def role_fsdp(rank: int, world: int, work: Path) -> dict[str, Any]:
    """FSDP2 on every rank, a vocabulary that does not divide; then rank 1 dies mid-publish."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from dcr_format.errors import (
        ArgumentError,
        IncompleteVersionError,
        UnsupportedPlacementError,
    )
    from dcr_format.publish._sharded import ShardedPart

    mesh = init_device_mesh("cpu", (world,))
    model = build()
    shard(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = Run(str(work / "fsdp"), rank, world, commit_timeout=3.0)
    # deltas of shards that are one run of their canonical tensor: by the fused pass, and
    # at which canonical offsets
    run_entry = ShardedPart._run_entry
    fused: list[int] = []

    def counted(self: ShardedPart, key: Any, owned: Any, *args: Any) -> Any:
        found = run_entry(self, key, owned, *args)
        if found is not None:
            fused.append(owned[0].canonical_view.offset)
        return found

    ShardedPart._run_entry = counted  # type: ignore[method-assign]
    for step in range(STEPS):
        train_step(model, optimizer, step, rank)
        run.publish(model, step)
    ShardedPart._run_entry = run_entry  # type: ignore[method-assign]
    out = run.result()
    out["fused"], out["fused_offset"] = len(fused), max(fused, default=0)
    out["shard_bytes"] = shard_bytes(published(model))

    # a partial sum is refused by name, on every rank, before anything is written
    partial = DTensor.from_local(torch.ones(3, dtype=torch.bfloat16), mesh, [Partial()])
    refusing = Run(str(work / "partial"), rank, world)
    try:
        refusing.writer.publish({"p": partial})
        out["partial"] = "published"
    except UnsupportedPlacementError as exc:
        out["partial"] = str(exc)

    # a stream that begins with a plain tensor is published as plain tensors: a DTensor
    # later in it is refused by name, on every rank
    stream = iter([("plain", torch.ones(2, dtype=torch.bfloat16)), ("p", partial)])
    try:
        Run(str(work / "mixed"), rank, world).writer.publish(stream)
        out["mixed"] = "published"
    except ArgumentError as exc:
        out["mixed"] = str(exc)
    # one writer for a model sharded over two ranks: refused before anything is written
    if rank == 0:
        from dcr_format import DeltaWriter

        try:
            DeltaWriter(work / "solo").publish(published(model))
            out["solo"] = "published"
        except ArgumentError as exc:
            out["solo"] = str(exc)
    # shards keep no baseline cache: a rank given one refuses, and the version is abandoned
    try:
        cached = {"cache_dir": str(work / "cache")} if rank == 1 else {}
        Run(str(work / "cached"), rank, world, **cached).writer.publish(published(model))
        out["cached"] = "published"
    except (ArgumentError, IncompleteVersionError) as exc:
        out["cached"] = f"{type(exc).__name__}: {exc}"
    (work / f"fsdp-{rank}.json").write_text(json.dumps(out))  # what a dying rank leaves
    # rank 1 dies inside its publish of the next step: no commit may appear
    train_step(model, optimizer, STEPS, rank)
    if rank == 1:  # dies after coding a few of its tensors
        original = ShardedPart._code
        calls = []

        def dying(self: ShardedPart, *args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) > 4:
                os._exit(17)
            return original(self, *args, **kwargs)

        ShardedPart._code = dying  # type: ignore[method-assign]
    try:
        run.writer.publish(published(model), step=STEPS)
        out["killed"] = "committed"
    except IncompleteVersionError:
        out["killed"] = "incomplete"
    return out


def role_restart(rank: int, world: int, work: Path) -> dict[str, Any]:
    """Restarted ranks: the same training to the step that died, then publishing on."""
    from torch.distributed.device_mesh import init_device_mesh

    from dcr_format.integrations.vllm import DcrInitInfo, DcrWeightSync
    from dcr_format.testing.collectives import counted_collectives

    mesh = init_device_mesh("cpu", (world,))
    model = build()
    shard(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS + 1):
        train_step(model, optimizer, step, rank)
    from dcr_format.chain.chain import Chain
    from dcr_format.store.store import open_store

    # (the chain's newest version, read without asking the writer, which would restore)
    out: dict[str, Any] = {"reopened_at": Chain(open_store(work / "fsdp")).latest()}
    run = Run(str(work / "fsdp"), rank, world)
    run.publish(model, STEPS)
    train_step(model, optimizer, STEPS + 1, rank)
    # the trainer integration passes the shards on (no engines here: client None)
    sync = DcrWeightSync(run.writer, None, DcrInitInfo(store=str(work / "fsdp")))
    with counted_collectives() as seen:
        out["sync_version"] = sync.publish(published(model), step=STEPS + 1)
    run.collectives.append(
        {"calls": dict(seen.calls), "bytes": seen.bytes, "functional": dict(seen.functional)}
    )
    full = gathered(published(model))  # a collective: on every rank
    if run.reader is not None:
        run.reader.sync()
        run.wrong.append(same_bits(run.target.tensors, full))
    return out | run.result()


def role_mesh(rank: int, world: int, work: Path) -> dict[str, Any]:
    """On a 2 x 2 mesh: FSDP2 over tensor parallelism, then HSDP (replicate x shard)."""
    from torch.distributed.device_mesh import init_device_mesh

    out: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build()
    tensor_parallel(model, mesh["tp"])
    shard(model, mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = Run(str(work / "tp"), rank, world)
    dp_rank = mesh.get_local_rank("dp")
    for step in range(STEPS):
        train_step(model, optimizer, step, dp_rank)
        run.publish(model, step, stream=step == STEPS - 1)  # the last one as a stream
    out["tp"] = run.result()
    out["tp_placements"] = sorted(
        {str(getattr(v, "placements", "plain")) for v in model.state_dict().values()}
    )
    out["tp_shard_bytes"] = shard_bytes(published(model))

    hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = build(seed=1)
    shard(model, hsdp_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = Run(str(work / "hsdp"), rank, world)
    for step in range(STEPS):
        train_step(model, optimizer, step, hsdp_mesh.get_local_rank("replicate"))
        run.publish(model, step)
    out["hsdp"] = run.result()
    out["hsdp_shard_bytes"] = shard_bytes(published(model))
    return out


ROLES = {"fsdp": role_fsdp, "restart": role_restart, "mesh": role_mesh}


def main() -> None:
    role, rank, world, port, work = sys.argv[1:6]
    rank_i, world_i, path = int(rank), int(world), Path(work)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank_i, world_size=world_i
    )
    try:
        result = ROLES[role](rank_i, world_i, path)
    except BaseException:
        result = {"error": traceback.format_exc()}
    (path / f"{role}-{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # a peer may have died: do not wait for it in the group's teardown


if __name__ == "__main__":
    main()
