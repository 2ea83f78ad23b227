"""`save_model=true` (finetune.runner.save_model_folder): a whole folder or none; a full disk is one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import SafetensorError
from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

from data.config import default_shared_data_dir
from finetune.runner import save_model_folder


@pytest.fixture
def model_and_tokenizer():
    config = BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    tokenizer = BertTokenizerFast(
        vocab_file=str(default_shared_data_dir() / "vocab" / "bert-base-uncased-vocab.txt")
    )
    return BertForSequenceClassification(config), tokenizer


def test_the_folder_is_replaced_whole(tmp_path: Path, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "stale.txt").write_text("from an earlier fine-tune")
    save_model_folder(model, tokenizer, folder)
    names = {path.name for path in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names and "stale.txt" not in names
    assert [path.name for path in tmp_path.iterdir()] == ["model"]  # no temporary or displaced folder left
    assert BertForSequenceClassification.from_pretrained(folder).config.hidden_size == 16


def test_a_full_disk_is_one_line_and_keeps_the_earlier_folder(
    tmp_path: Path, model_and_tokenizer, monkeypatch
):
    model, tokenizer = model_and_tokenizer
    folder = tmp_path / "model"
    save_model_folder(model, tokenizer, folder)
    before = sorted(path.name for path in folder.iterdir())

    def full_disk(self, directory, *args, **kwargs):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "config.json").write_text("{}")  # a partial write
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(BertForSequenceClassification, "save_pretrained", full_disk)
    with pytest.raises(ValueError) as raised:
        save_model_folder(model, tokenizer, folder)
    message = str(raised.value)
    assert message == (
        f"save_model: {folder} not saved (Error while serializing: I/O error: No space left on device "
        "(os error 28)); the earlier one is kept"
    )
    assert sorted(path.name for path in folder.iterdir()) == before
    assert [path.name for path in tmp_path.iterdir()] == ["model"]
    with pytest.raises(ValueError, match="nothing written"):
        save_model_folder(model, tokenizer, tmp_path / "new")
    assert not (tmp_path / "new").exists()
