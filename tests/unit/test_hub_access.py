"""Offline compute nodes (#17 item 2): a hub dataset that cannot be reached fails in seconds, in one line
that names the dataset and the ways forward; no retries, no traceback, no partial output."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data import hub_access
from data.documents import DataError

REPO_ROOT = Path(__file__).resolve().parents[2]
PROXIES = hub_access.PROXY_VARIABLES


@pytest.fixture
def no_proxy_no_offline(monkeypatch):
    for name in (*PROXIES, *hub_access.OFFLINE_VARIABLES):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    "value, expected", [("1", True), ("TRUE", True), ("on", True), ("0", False), ("", False)]
)
def test_offline_variable(monkeypatch, no_proxy_no_offline, value, expected):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", value)
    assert (hub_access.offline_variable() == "HF_DATASETS_OFFLINE") is expected


def test_probe_sees_a_listening_endpoint_and_a_closed_one(monkeypatch, no_proxy_no_offline):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
        assert hub_access.hub_unreachable(seconds=2) is None
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")  # closed now: refused at once
    started = time.monotonic()
    reason = hub_access.hub_unreachable(seconds=2)
    assert reason is not None and f"127.0.0.1:{port}" in reason
    assert time.monotonic() - started < 4
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.nonexistent.invalid")
    assert "hub.nonexistent.invalid:443" in (hub_access.hub_unreachable(seconds=2) or "")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.nonexistent.invalid:3128")
    assert hub_access.hub_unreachable(seconds=2) is None  # through a proxy only the request can tell


def test_unreachable_hub_fails_before_asking_it(monkeypatch, no_proxy_no_offline):
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.nonexistent.invalid")
    calls = []
    with pytest.raises(DataError) as error:
        hub_access.load_from_hub(lambda: calls.append(1), "org/dataset", "do this or that")
    message = str(error.value)
    assert "\n" not in message and calls == []
    assert message.startswith("org/dataset: the Hugging Face hub cannot be reached (")
    assert message.endswith("; do this or that")


def test_offline_mode_asks_the_cache_and_turns_its_miss_into_one_line(monkeypatch, no_proxy_no_offline):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.nonexistent.invalid")  # not probed in offline mode

    def cache_miss():
        raise ConnectionError("Couldn't reach 'org/dataset' on the Hub (OfflineModeIsEnabled)\nmore")

    with pytest.raises(
        DataError, match=r"^org/dataset: not in the local cache and HF_HUB_OFFLINE=1 is set; x$"
    ):
        hub_access.load_from_hub(cache_miss, "org/dataset", "x")
    assert hub_access.load_from_hub(lambda: "cached", "org/dataset", "x") == "cached"


# each case is a `python -m data.prepare` process: `make test` runs the offline variable (the cluster recipe);
# an unreachable endpoint is checked in process above (test_unreachable_hub_fails_before_asking_it)
@pytest.mark.parametrize(
    "env",
    [
        {"HF_DATASETS_OFFLINE": "1"},
        pytest.param({"HF_ENDPOINT": "https://hub.nonexistent.invalid"}, marks=pytest.mark.slow),
    ],
)
def test_prepare_from_the_hub_offline_is_one_line_and_fast(tmp_path, env):
    """The headline data step on an offline node: exit 2 within seconds, one line naming the dataset
    and the ways forward, nothing written that looks complete."""
    out = tmp_path / "prepared"
    clean = {k: v for k, v in os.environ.items() if k not in (*PROXIES, *hub_access.OFFLINE_VARIABLES)}
    started = time.monotonic()
    command = [sys.executable, "-m", "data.prepare", "data=hub_tiny", f"data.shards.output_dir={out}"]
    proc = subprocess.run(
        [*command, "show_progress=false"], cwd=REPO_ROOT, env={**clean, **env}, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert time.monotonic() - started < 60
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "wikimedia/wikipedia/20231101.en" in errors[0] and "data.shards.output_dir" in errors[0]
    assert errors[0].count("wikimedia/wikipedia") == 1, errors[0]
    assert not list(out.rglob("manifest.json"))


def test_finetune_task_from_the_hub_offline(monkeypatch, no_proxy_no_offline):
    from finetune.tasks import TASKS, glue, squad
    from finetune.tasks.spec import FINETUNE_WAYS_FORWARD

    monkeypatch.setenv("HF_ENDPOINT", "https://hub.nonexistent.invalid")
    loads = (
        lambda: glue._load_hub(TASKS["sst2"], "dev", None),
        lambda: next(squad._hub_records(TASKS["squad"], "dev")),
    )
    for load in loads:
        with pytest.raises(DataError) as error:
            load()
        assert "cannot be reached" in str(error.value) and str(error.value).endswith(FINETUNE_WAYS_FORWARD)
