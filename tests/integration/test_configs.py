"""Every shipped config composes against its schema (a YAML that drifts fails here)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from data.config import REPO_ROOT, PrepareConfig, to_object

DATA_CONFIGS = sorted(p.stem for p in (REPO_ROOT / "conf/data").glob("*.yaml"))


@pytest.mark.parametrize("name", DATA_CONFIGS)
def test_data_config_composes(name: str):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="prepare", overrides=[f"data={name}"])
    obj = to_object(cfg)
    assert isinstance(obj, PrepareConfig)
    assert obj.data.name == name
    assert Path(obj.data.shards.output_dir).is_absolute()


def test_unknown_key_fails_at_composition():
    with (
        initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"),
        pytest.raises(Exception) as info,
    ):
        compose(config_name="prepare", overrides=["data=sample", "data.instances.sead=1"])
    assert "sead" in str(info.value)
