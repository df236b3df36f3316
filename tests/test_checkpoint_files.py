"""A version carries its checkpoint's small files (FORMAT.md §3.5.6): a directory pulled
from the chain loads with ``from_pretrained``, each file is sent only when it changes, and
a reader checks every file before it changes its target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dcr_format import DeltaReader, DeltaWriter, SafetensorsDirTarget, StateDictTarget, replay
from dcr_format.chain.chain import Chain
from dcr_format.cli.main import cli
from dcr_format.errors import ArgumentError, ChecksumMismatchError, UnsupportedFeatureError
from dcr_format.publish._files import directory_files
from dcr_format.store.store import Store, open_store
from dcr_format.targets.directory import DIR_STATE_FILE
from dcr_format.tools import compact, verify

transformers = pytest.importorskip("transformers")  # in the test extra; skip only if absent

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def _save_checkpoint(path: Path, seed: int) -> dict[str, torch.Tensor]:
    """A tiny Llama saved as Hugging Face saves it (from a config, nothing downloaded), with
    a tokenizer and a chat template; returns its tensors."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _run(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _file_puts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ``files/`` keys every store puts from now on."""
    puts: list[str] = []
    put = Store.put

    def recording(self: Store, key: str, data: bytes) -> None:
        if key.startswith("files/"):
            puts.append(key)
        put(self, key, data)

    monkeypatch.setattr(Store, "put", recording)
    return puts


def test_cli_publish_and_pull_give_a_checkpoint_that_loads(tmp_path, monkeypatch) -> None:
    store, cache = str(tmp_path / "store"), str(tmp_path / "cache")
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    tensors = _save_checkpoint(ckpt, seed=0)
    sent, _ = directory_files(ckpt)
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(sent)
    assert "model.safetensors" not in sent
    puts = _file_puts(monkeypatch)
    _run("publish", str(ckpt), "--store", store, "--cache-dir", cache)
    assert len(puts) == len(set(sent.values()))  # each distinct file once
    _run("pull", "--store", store, "--into", str(out))

    for name, data in sent.items():
        assert (out / name).read_bytes() == data, name
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    loaded = model.state_dict()
    assert sorted(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name].view(torch.uint8), tensor.view(torch.uint8)), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == TEMPLATE
    assert tokenizer("w1 w2")["input_ids"][-2:] == [4, 5]

    # the next step: new weights, the config changed, the tokenizer files unchanged
    _save_checkpoint(ckpt, seed=1)
    config = json.loads((ckpt / "config.json").read_text())
    config["max_position_embeddings"] = 48
    (ckpt / "config.json").write_text(json.dumps(config))
    puts.clear()
    _run("publish", str(ckpt), "--store", store, "--cache-dir", cache)
    assert len(puts) == 1  # the config only
    assert Chain(open_store(store)).store.get(puts[0]) == (ckpt / "config.json").read_bytes()
    _run("pull", "--store", store, "--into", str(out))
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 48
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.config.max_position_embeddings == 48

    puts.clear()  # nothing changed but the step: no file is sent
    _run("publish", str(ckpt), "--store", store, "--cache-dir", cache, "--step", "3")
    assert puts == []


def test_show_lists_the_files_a_version_carries(tmp_path) -> None:
    store = str(tmp_path / "store")
    state = {"w": torch.arange(8, dtype=torch.float32)}
    writer = DeltaWriter(store)
    writer.publish(state, files={"config.json": b'{"a": 1}', "tokenizer.json": b"{}"})
    state["w"][0] += 1
    writer.publish(state)  # files=None: the previous version's files
    lines = _run("show", "1", "--store", store).splitlines()
    assert lines[4] == "files config.json (8 B), tokenizer.json (2 B)"
    detail = json.loads(_run("show", "1", "--store", store, "--format", "json"))
    assert detail["files"] == {"config.json": 8, "tokenizer.json": 2}
    writer.publish(state, files={}, allow_empty=True)  # no files: no line
    assert not _run("show", "2", "--store", store).splitlines()[4].startswith("files")


def test_files_follow_the_versions_into_every_directory(tmp_path, monkeypatch) -> None:
    store = str(tmp_path / "store")
    state = {"w": torch.arange(8, dtype=torch.float32)}
    writer = DeltaWriter(store)
    writer.publish(state, files={"config.json": b'{"a": 1}', "tokenizer.json": b"{}"})
    out = tmp_path / "out"
    target = SafetensorsDirTarget(out)
    reader = DeltaReader(store, target)
    reader.sync()
    (out / "notes.txt").write_text("mine")  # the user's own file: carried forward
    assert json.loads((out / DIR_STATE_FILE).read_text())["files"].keys() == {
        "config.json",
        "tokenizer.json",
    }

    puts = _file_puts(monkeypatch)
    state["w"][0] = 9.0
    writer.publish(state)  # files=None: the previous version's files, nothing sent
    assert puts == []
    reader.sync()
    assert (out / "config.json").read_bytes() == b'{"a": 1}'

    reopened = DeltaWriter(store)  # a new process continues the chain's files
    state["w"][1] = 9.0
    reopened.publish(state, files={"config.json": b'{"a": 2}', "tokenizer.json": b"{}"})
    assert len(puts) == 1
    (out / "tokenizer.json").write_text("edited")  # a file of the chain edited by hand
    reader.sync()
    assert (out / "config.json").read_bytes() == b'{"a": 2}'
    assert (out / "tokenizer.json").read_bytes() == b"{}"  # the chain's bytes again

    state["w"][2] = 9.0
    reopened.publish(state, files={"config.json": b'{"a": 2}'})  # the tokenizer is gone
    reader.sync()
    assert not (out / "tokenizer.json").exists()
    assert (out / "notes.txt").read_text() == "mine"

    fresh = tmp_path / "replayed"
    replay(store, 3, fresh)
    assert sorted(p.name for p in fresh.iterdir()) == [
        "config.json",
        DIR_STATE_FILE,
        "model.safetensors",
    ]
    replay(store, 1, tmp_path / "old")
    assert (tmp_path / "old" / "tokenizer.json").read_bytes() == b"{}"

    dict_target = StateDictTarget({})  # a dict keeps no files and fetches none
    DeltaReader(store, dict_target).sync()
    assert torch.equal(dict_target.tensors["w"], state["w"])


def test_a_damaged_file_is_refused_before_the_directory_changes(tmp_path) -> None:
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    writer.publish({"w": torch.zeros(4)}, files={"config.json": b"{}"})
    out = tmp_path / "out"
    reader = DeltaReader(store, SafetensorsDirTarget(out))
    reader.sync()
    before = out.resolve()
    info = writer.publish({"w": torch.ones(4)}, files={"config.json": b'{"b": 1}'})
    assert verify(store).ok
    [key] = [k for k in open_store(store).list("files/") if k != "files/" + _sha(b"{}")]
    (Path(store) / key).write_bytes(b'{"b": 2}')  # same size, other bytes
    with pytest.raises(ChecksumMismatchError):
        reader.sync()
    assert out.resolve() == before and (out / "config.json").read_bytes() == b"{}"
    assert json.loads((out / DIR_STATE_FILE).read_text())["version"] == info.version - 1
    report = verify(store)
    assert [(p.version, p.key) for p in report.problems] == [(info.version, key)]


def test_a_compacted_base_carries_the_files(tmp_path) -> None:
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    writer.publish({"w": torch.zeros(4)}, files={"config.json": b"{}"})
    writer.publish({"w": torch.ones(4)}, files={"config.json": b'{"v": 1}'})
    assert compact(store, 1).created
    chain = Chain(open_store(store))
    chain.store.delete_many(chain.store.list("objects/00000000000000000000/"))
    chain.store.delete_many(["commits/00000000000000000000.json"])
    out = tmp_path / "out"
    result = DeltaReader(store, SafetensorsDirTarget(out)).sync()
    assert result.applied_versions == (1,)
    assert (out / "config.json").read_bytes() == b'{"v": 1}'


def test_files_are_checked_before_anything_is_uploaded(tmp_path) -> None:
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    for files in (
        {"model.safetensors": b""},
        {"sub/config.json": b""},
        {".hidden": b""},
        {"config.json": "text"},
        {"big.txt": bytes(64 << 20) + b"x"},
    ):
        with pytest.raises(ArgumentError):
            writer.publish({"w": torch.zeros(2)}, files=files)  # type: ignore[arg-type]
    assert not (Path(store) / "files").exists()
    assert writer.version is None


def test_a_reader_without_the_feature_refuses_files(tmp_path, monkeypatch) -> None:
    from dcr_format.format import schema

    store = str(tmp_path / "store")
    DeltaWriter(store).publish({"w": torch.zeros(2)}, files={"config.json": b"{}"})
    monkeypatch.setattr(schema, "KNOWN_FEATURES", schema.KNOWN_FEATURES - {"checkpoint-files"})
    target = StateDictTarget({})
    with pytest.raises(UnsupportedFeatureError, match="checkpoint-files"):
        DeltaReader(store, target).sync()
    assert target.resident() is None


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()
