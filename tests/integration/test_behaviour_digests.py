"""The refactors keep behaviour bit for bit: LAMB, 1-bit LAMB and DeepSpeed's 1-bit LAMB give the
baseline commit's parameters after 20 steps on 2 ranks (`behaviour_digests`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration import behaviour_digests as digests

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict[str, str]:
    fixture = json.loads(digests.FIXTURE.read_text())
    assert set(fixture["runs"]) == set(digests.RUNS), "the fixture and the runs name different variants"
    return digests.baseline_digests(fixture, tmp_path_factory.mktemp("baseline"))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return digests.prepare_data(tmp_path_factory.mktemp("digest-data") / "tiny")


@pytest.mark.parametrize("name", list(digests.RUNS))
def test_a_run_gives_the_baseline_parameters(name: str, baseline: dict, data: Path, tmp_path: Path):
    digest = digests.run_digest(digests.REPO_ROOT, data, tmp_path / name, digests.RUNS[name])
    assert digest == baseline[name], f"{name}: the parameters after 20 steps differ from the baseline's"
