"""The metrics path: secrets never reach logged configs; W&B mode selection; jsonl records."""

from __future__ import annotations

import json

from pretrain.observability.metrics import JsonlLogger, scrub_secrets, wandb_mode

FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"


def test_scrub_secrets_redacts_keys_and_key_shaped_values():
    config = {
        "wandb": {"api_key": FAKE_KEY, "project": "bert-lamb"},
        "notes": f"run with key {FAKE_KEY}",
        "list": [{"hf_token": "hf_abc"}, 3],
        "lr": 1e-3,
    }
    scrubbed = scrub_secrets(config)
    assert FAKE_KEY not in json.dumps(scrubbed)
    assert scrubbed["wandb"]["project"] == "bert-lamb" and scrubbed["lr"] == 1e-3
    assert scrubbed["list"][0]["hf_token"] == "<redacted>"


def test_wandb_mode_auto(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    assert wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    assert wandb_mode("auto") == "online"
    assert wandb_mode("disabled") == "disabled"


def test_jsonl_logger_appends_records(tmp_path):
    logger = JsonlLogger(tmp_path / "run" / "metrics.jsonl")
    logger.log(1, {"loss": 2.5, "bad": float("nan")})
    logger.log(2, {"loss": 2.0})
    logger.close()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 2.5, "bad": "nan"}, {"step": 2, "loss": 2.0}]
