"""Shared fixtures. The sample data lives outside the repo: ../shared/data or $BERT_SHARED_DATA."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from data.config import REPO_ROOT, default_shared_data_dir

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = default_shared_data_dir()
    if not (path / "PROVENANCE.md").is_file():
        pytest.fail(f"shared sample data not found at {path}; set BERT_SHARED_DATA", pytrace=False)
    return path


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """`data=tiny` (both lengths) with a small trained vocab: it keeps the tiny model's embedding and
    MLM decoder, most of its compute, small."""
    from data.prepare import prepare_in_subprocess

    out = tmp_path_factory.mktemp("data") / "tiny"
    return prepare_in_subprocess(
        out, "data=tiny", "data.tokenizer.vocab_file=null", "data.tokenizer.vocab_size=2000"
    )
