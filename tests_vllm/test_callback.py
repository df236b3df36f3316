"""A ``transformers.Trainer`` with dcr's ``TrainerCallback``: every optimizer step is
published and the in-process engine follows it, bit-exact."""

from __future__ import annotations

from pathlib import Path

import harness
import pytest
import torch

from dcr_format.integrations.vllm import DcrInitInfo, DcrWeightSync, dcr_trainer_callback

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")


class _Batches(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1)
        self.rows = torch.randint(4, harness.VOCAB_SIZE, (8, 16), generator=gen)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def test_trainer_callback_publishes_every_optimizer_step(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import transformers

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # the trainer gives its model and writer; its loop is unused
    store, trainer, ckpt = harness.first_version(tmp_path, tied=False)
    llm = harness.engine(ckpt, weight_transfer_config={"backend": "dcr"})
    sync = DcrWeightSync(trainer.writer, llm, DcrInitInfo(store=store, prefetch=False))
    sync.init()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    hf = transformers.Trainer(
        model=trainer.model,
        args=args,
        train_dataset=_Batches(),
        callbacks=[dcr_trainer_callback(sync)],
    )
    hf.train()
    assert [int(t["version"]) for t in sync.timings] == [1, 2, 3]
    engine = llm.llm_engine.model_executor.driver_worker.worker.weight_transfer_engine
    assert engine.last_update is not None and engine.last_update.version == 3
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()
    state = trainer.export()
    for i in range(2):
        qkv = torch.cat([state[f"model.layers.{i}.self_attn.{x}_proj.weight"] for x in "qkv"])
        got = model.model.layers[i].self_attn.qkv_proj.weight
        assert torch.equal(got.view(torch.int16), qkv.view(torch.int16))
