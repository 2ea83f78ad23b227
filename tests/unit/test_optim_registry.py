"""Registry, typed configs and their YAMLs, BERT parameter groups."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from data.config import REPO_ROOT
from pretrain.optim import (
    OPTIMIZERS,
    Lamb,
    LambConfig,
    OnebitAdamConfig,
    OnebitLamb,
    OnebitLambConfig,
    OnebitLambDeepspeedConfig,
    build_optimizer,
    needs_gradient_allreduce,
    param_groups,
)
from pretrain.optim.onebit_lamb import DEEPSPEED_ALGORITHM

OPTIM_DIR = REPO_ROOT / "conf" / "optim"


def test_every_registry_entry_has_a_yaml_and_back():
    assert sorted(p.stem for p in OPTIM_DIR.glob("*.yaml")) == sorted(OPTIMIZERS)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_yaml_keys_match_the_dataclass_and_merge(name):
    _, config_class = OPTIMIZERS[name]
    raw = OmegaConf.load(OPTIM_DIR / f"{name}.yaml")
    assert list(raw.pop("defaults")) == [f"{name}_schema", "_self_"]
    assert set(raw.keys()) == {f.name for f in dataclasses.fields(config_class)}, "YAML and dataclass drifted"
    config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(config_class), raw))
    assert isinstance(config, config_class) and config.name == name
    assert config == config_class(), "YAML values differ from the dataclass defaults"


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_yaml_composes_through_hydra(name):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose(overrides=[f"+optim={name}"])
    assert isinstance(OmegaConf.to_object(cfg.optim), OPTIMIZERS[name][1])


def test_misspelt_key_fails_at_composition():
    with (
        initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"),
        pytest.raises(Exception) as info,
    ):
        compose(overrides=["+optim=onebit_lamb", "optim.freez_step=10"])
    assert "freez_step" in str(info.value)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: OnebitLambConfig(freeze_step=0), "optim.freeze_step must be >= 1"),
        (lambda: LambConfig(lr=0.0), "optim.lr must be > 0"),
        (lambda: LambConfig(min_coeff=1.0, max_coeff=0.5), "optim.min_coeff"),
        (lambda: OnebitLambDeepspeedConfig(coeff_beta=1.0), "optim.coeff_beta"),
        (lambda: OnebitLambDeepspeedConfig(min_coeff=1.0, max_coeff=0.5), "optim.min_coeff"),
        (lambda: OnebitLambDeepspeedConfig(factor_min=0.0), "optim.factor_min"),
        (lambda: OnebitLambConfig(variance_refresh=1), "optim.variance_refresh must be 0"),
        (lambda: OnebitLambConfig(max_coeff=0.0), "optim.max_coeff"),
        (lambda: OnebitLambConfig(max_grad_norm=-1.0), "optim.max_grad_norm"),
        (lambda: OnebitLambDeepspeedConfig(name="onebit_lamb"), "optim.name"),
        (lambda: OnebitAdamConfig(beta2=1.0), "optim.beta2"),
        (lambda: OnebitAdamConfig(name="onebit_lamb"), "optim.name"),
        # DeepSpeed's exchange has no row-scaled groups to put the FFN intermediates in
        (lambda: OnebitAdamConfig(ffn_row_scales=True), "optim.ffn_row_scales needs the per_column"),
    ],
)
def test_config_checks_name_the_key(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


def test_structured_merge_rejects_a_string_for_an_enum():
    with pytest.raises(Exception, match="variant"):
        OmegaConf.merge(OmegaConf.structured(LambConfig), {"variant": "paper"})


def _tiny_bert():
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16,
    )  # fmt: skip
    return BertForPreTraining(config)


@pytest.fixture(scope="module")
def bert():
    return _tiny_bert()


def test_bert_param_groups(bert):
    groups = param_groups(bert, 0.01, max_seq_length=10)
    names = {id(p): n for n, p in bert.named_parameters()}
    decay, no_decay, positions = ([names[id(p)] for p in g["params"]] for g in groups)
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0, 0.01]
    assert all("bias" in n or "LayerNorm" in n for n in no_decay)
    assert not any("bias" in n or "LayerNorm" in n for n in decay)
    assert "bert.pooler.dense.weight" in decay and "bert.pooler.dense.bias" in no_decay  # pooler kept
    assert positions == ["bert.embeddings.position_embeddings.weight"]
    assert groups[2]["exp_avg_mask"][:, 0].tolist() == [1.0] * 10 + [0.0] * 6
    everything = [id(p) for g in groups for p in g["params"]]
    assert sorted(everything) == sorted(names) and len(set(everything)) == len(everything)
    assert len(param_groups(bert, 0.01)) == 2


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_build_and_step_every_optimizer(name, bert, caplog):
    _, config_class = OPTIMIZERS[name]
    config = config_class(freeze_step=1) if "onebit" in name else config_class()
    optimizer = build_optimizer(name, config, param_groups(bert, config.weight_decay, max_seq_length=10))
    if "onebit" in name:
        assert isinstance(optimizer.param_groups[2]["exp_avg_mask"], torch.Tensor)
    else:
        assert "exp_avg_mask ignored" in caplog.text
    if name == "adamw":
        assert optimizer.param_groups[0]["fused"] is True
    assert needs_gradient_allreduce(optimizer)
    for p in bert.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    assert needs_gradient_allreduce(optimizer) is ("onebit" not in name)


def test_build_optimizer_rejects_unknown_names_and_wrong_configs(bert):
    with pytest.raises(ValueError, match="unknown optimizer"):
        build_optimizer("sgd", LambConfig(), param_groups(bert))
    with pytest.raises(ValueError, match="LambConfig"):
        build_optimizer("lamb", OnebitLambConfig(), param_groups(bert))
    assert isinstance(build_optimizer("lamb", LambConfig(), param_groups(bert)), Lamb)
    assert isinstance(build_optimizer("onebit_lamb", OnebitLambConfig(), param_groups(bert)), OnebitLamb)


def test_a_row_scaled_vector_is_averaged_element_by_element():
    from pretrain.optim.onebit import Compression, ExchangeOptions

    bias, matrix = torch.zeros(6), torch.zeros(3, 4)
    blocks = ExchangeOptions(Compression.per_column).blocks([matrix, bias], {id(bias), id(matrix)}, pad=2)
    assert [(b.numel, b.row_length) for b in blocks] == [(12, 4), (6, 1), (2, 2)]
    assert ExchangeOptions(Compression.deepspeed).blocks([matrix, bias], set(), pad=0) is None


def test_per_column_gives_every_other_matrix_a_scale_per_column():
    from pretrain.optim.onebit import Compression, ExchangeOptions

    embedding, matrix, bias = torch.zeros(5, 4), torch.zeros(3, 4), torch.zeros(6)
    options = ExchangeOptions(Compression.per_column)
    blocks = options.blocks([embedding, matrix, bias], {id(embedding)}, pad=2)
    # the embedding keeps a scale per row; the matrix travels transposed: 4 columns of 3 elements
    assert [(b.numel, b.row_length) for b in blocks] == [(20, 4), (12, 3), (6, 6), (2, 2)]
    assert options.transposed([embedding, matrix, bias], {id(embedding)}) == [False, True, False]
    assert Compression.per_column.row_scales and not Compression.deepspeed.row_scales
    # exact_vectors: the 1-D tensors with one scale per element
    exact = ExchangeOptions(Compression.per_column, exact_vectors=True)
    assert [(b.numel, b.row_length) for b in exact.blocks([bias], set(), pad=0)] == [(6, 1)]


def test_scale_dtype_reaches_the_compressed_allreduce():
    from pretrain.comm.compressed_allreduce import ScaleDtype
    from pretrain.optim import OnebitLamb
    from pretrain.optim.config import OnebitLambConfig

    assert OnebitLambConfig().optimizer_kwargs()["algorithm"].exchange.scale_dtype is ScaleDtype.bfloat16
    assert OnebitLambDeepspeedConfig().exchange_kwargs()["scale_dtype"] is ScaleDtype.float32
    optimizer = OnebitLamb(
        [torch.nn.Parameter(torch.zeros(3))], algorithm=DEEPSPEED_ALGORITHM.replace(scale_dtype="bfloat16")
    )
    assert optimizer.exchange.scale_dtype is ScaleDtype.bfloat16 and ScaleDtype.bfloat16.bytes == 2
    with pytest.raises(ValueError, match="float16"):
        OnebitLamb(
            [torch.nn.Parameter(torch.zeros(3))], algorithm=DEEPSPEED_ALGORITHM.replace(scale_dtype="float16")
        )


def test_changed_options_name_what_a_resume_changes():
    from pretrain.optim.config import OnebitLambConfig

    saved = OnebitLambConfig(variance_refresh=0, max_coeff=0.3).options()
    assert saved["variance_refresh"] == "0" and saved["eps"] == "1e-06"
    changed = OnebitLambConfig().changed_options(saved)
    assert sorted(changed) == ["max_coeff 0.3 -> 10.0", "variance_refresh 0 -> 64"]
    assert OnebitLambConfig().changed_options(OnebitLambConfig().options()) == []
    assert OnebitLambConfig().changed_options(None) == []  # a checkpoint from before the record


def test_the_two_presets_build_the_two_algorithms():
    """optim=onebit_lamb_deepspeed is DeepSpeed's algorithm (OnebitLamb's own defaults); optim=onebit_lamb
    is this project's, whatever the user tunes."""
    from pretrain.optim.lamb import LambVariant
    from pretrain.optim.onebit import Compression, ExchangeOptions
    from pretrain.optim.onebit_lamb import ONEBIT_LAMB_ALGORITHM, TrustRatio

    def build(name, config):
        return build_optimizer(name, config, [{"params": [torch.nn.Parameter(torch.zeros(3, 2))]}])

    deepspeed = build("onebit_lamb_deepspeed", OnebitLambDeepspeedConfig())
    defaults = OnebitLamb([torch.nn.Parameter(torch.zeros(3, 2))])
    assert deepspeed.exchange == defaults.exchange == ExchangeOptions()
    assert deepspeed.algorithm == defaults.algorithm == DEEPSPEED_ALGORITHM
    assert deepspeed.variance_refresh == 0 and not deepspeed.algorithm.live_vector_variance
    ours = build("onebit_lamb", OnebitLambConfig(variance_refresh=16, max_coeff=0.3))
    assert ours.exchange.compression is Compression.per_column and ours.exchange.precondition
    assert ours.exchange.exact_vectors and ours.exchange.scale_dtype.value == "bfloat16"
    assert ours.algorithm == ONEBIT_LAMB_ALGORITHM
    assert (ours.algorithm.warmup, ours.algorithm.trust_ratio) == (LambVariant.nvlamb, TrustRatio.live)
    assert ours.algorithm.live_vector_variance and ours.variance_refresh == 16 and ours.max_coeff == 0.3
