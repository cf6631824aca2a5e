"""ddtree_numba/config.py: presets, derived sizes, softmax scale, JSON and HF mapping, validation."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from ddtree_numba.config import ModelConfig, RopeScaling, preset_names, yarn_mscale
from reference.weights import parameter_shapes

PRESETS = ("tiny", "small", "kimi-k2")

# A DeepSeek-V3 config.json (spec §6), as Hugging Face writes it.
DEEPSEEK_V3_HF = {
    "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61, "first_k_dense_replace": 3,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_attention_heads": 128,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
    "n_group": 8, "topk_group": 4, "scoring_func": "sigmoid", "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "rope_theta": 10000, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "bos_token_id": 0, "eos_token_id": 1, "topk_method": "noaux_tc", "model_type": "deepseek_v3",
}

# Kimi K2 (256K release) as the third-party config.json copies write it (spec §6), K2.5-style nesting.
KIMI_K2_HF = {"text_config": {
    **DEEPSEEK_V3_HF, "vocab_size": 163840, "first_k_dense_replace": 1, "num_attention_heads": 64,
    "n_routed_experts": 384, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
    "rope_theta": 50000.0, "max_position_embeddings": 262144, "rope_interleave": True,
    "rope_scaling": {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "bos_token_id": 163584, "eos_token_id": 163585, "mask_token_id": 163838, "model_type": "kimi_k2",
}}


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.from_name("tiny")


@pytest.fixture(scope="module")
def kimi() -> ModelConfig:
    return ModelConfig.from_name("kimi-k2")


def test_presets_listed_and_round_trip_through_json():
    assert set(PRESETS) <= set(preset_names())
    for name in PRESETS:
        config = ModelConfig.from_name(name)
        again = ModelConfig.from_json(config.to_json())
        assert again == config and again.notes == config.notes
        assert hash(again) == hash(config)  # frozen, hashable (rope_scaling is a frozen dataclass)


def test_kimi_k2_preset_matches_spec_section_6(kimi):
    c = kimi
    assert (c.n_layers, c.n_dense_layers, c.hidden_size, c.dense_intermediate, c.moe_intermediate) == \
        (61, 1, 7168, 18432, 2048)
    assert (c.n_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_dim, c.qk_rope_dim, c.v_head_dim) == \
        (64, 1536, 512, 128, 64, 128)
    assert (c.n_routed_experts, c.n_activated_experts, c.n_shared_experts) == (384, 8, 1)
    assert (c.n_expert_groups, c.n_limited_groups, c.score_func, c.route_scale, c.norm_topk_prob) == \
        (1, 1, "sigmoid", 2.827, True)
    assert (c.vocab_size, c.rope_theta, c.rope_layout) == (163840, 50000.0, "interleaved")
    assert c.rope_scaling == RopeScaling(factor=64.0, original_max_position_embeddings=4096, beta_fast=1.0,
                                         beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    assert (c.bos_token_id, c.eos_token_id, c.mask_token_id) == (163584, 163585, 163838)
    assert c.kv_cache_dim == 576 and c.qk_head_dim == 192
    # The uncertain values are marked in the preset's "_notes".
    assert {"rms_norm_eps", "rope_scaling"} <= set(c.notes)
    assert "UNCERTAIN" in c.notes["rms_norm_eps"]


def test_softmax_scale_follows_limits_section_2(kimi, tiny):
    assert kimi.softmax_scale == pytest.approx(0.144680, abs=5e-7)  # factor 64
    ds = ModelConfig.from_hf_config(DEEPSEEK_V3_HF)
    assert ds.softmax_scale == pytest.approx(0.135234, abs=5e-7)  # factor 40
    k32 = dataclasses.replace(kimi, rope_scaling=dataclasses.replace(kimi.rope_scaling, factor=32.0))
    assert k32.softmax_scale == pytest.approx(0.130861, abs=5e-7)  # limits §2 truncates to 0.130860
    # No YaRN, or mscale_all_dim 0 (HF rule): plain 1/sqrt(192).
    assert dataclasses.replace(kimi, rope_scaling=None).softmax_scale == 192 ** -0.5
    no_all_dim = dataclasses.replace(kimi.rope_scaling, mscale_all_dim=0.0)
    assert dataclasses.replace(kimi, rope_scaling=no_all_dim).softmax_scale == 192 ** -0.5
    m = 0.1 * math.log(4.0) + 1.0
    assert tiny.softmax_scale == pytest.approx(24 ** -0.5 * m * m, rel=1e-15)
    assert kimi.rope_mscale == 1.0 and ds.rope_mscale == 1.0


def test_yarn_mscale():
    assert yarn_mscale(1.0, 1.0) == 1.0 and yarn_mscale(0.5, 3.0) == 1.0
    assert yarn_mscale(64.0, 1.0) == pytest.approx(1.415888, abs=1e-6)
    assert yarn_mscale(40.0, 0.707) == pytest.approx(0.1 * 0.707 * math.log(40.0) + 1.0)


def test_small_preset_has_real_head_geometry_and_fits_one_gpu(kimi):
    small = ModelConfig.from_name("small")
    for name in ("n_heads", "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim"):
        assert getattr(small, name) == getattr(kimi, name), name
    assert small.softmax_scale == kimi.softmax_scale
    total = small.param_count().total
    assert 2e8 <= total <= 1e9  # a few hundred million: ~2 GB in fp32 on a 141 GB H200
    assert small.n_layers > small.n_dense_layers >= 1 and small.n_expert_groups > 1


def test_param_count_matches_parameter_shapes_on_variants(tiny):
    variants = [
        tiny,
        dataclasses.replace(tiny, q_lora_rank=0),
        dataclasses.replace(tiny, score_func="softmax", norm_topk_prob=False),
        dataclasses.replace(tiny, n_shared_experts=0, n_layers=4, n_dense_layers=2),
        dataclasses.replace(tiny, n_shared_experts=2, n_dense_layers=0),
        ModelConfig.from_name("small"),
    ]
    for config in variants:
        shapes = parameter_shapes(config)
        assert config.param_count().total == sum(math.prod(s) for s in shapes.values())
        # Activated = total minus the routed experts a token does not use.
        per_expert = 3 * config.hidden_size * config.moe_intermediate
        n_moe = config.n_layers - config.n_dense_layers
        unused = n_moe * (config.n_routed_experts - config.n_activated_experts) * per_expert
        assert config.param_count().activated == config.param_count().total - unused


def test_param_count_of_real_models(kimi):
    ds = ModelConfig.from_hf_config(DEEPSEEK_V3_HF).param_count()
    assert ds.total == pytest.approx(671e9, rel=0.005)  # DeepSeek-V3: 671B total, 37B activated
    assert ds.activated == pytest.approx(37e9, rel=0.02)
    k2 = kimi.param_count()
    assert 1.0e12 <= k2.total <= 1.05e12  # Kimi K2: "1T total, 32B activated"
    assert 32e9 <= k2.activated <= 33.5e9


def test_from_hf_config_maps_kimi_k2_to_the_preset(kimi):
    assert ModelConfig.from_hf_config(KIMI_K2_HF) == kimi
    neox = ModelConfig.from_hf_config({**DEEPSEEK_V3_HF, "rope_interleave": False, "q_lora_rank": None})
    assert neox.rope_layout == "neox" and neox.q_lora_rank == 0
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelConfig.from_hf_config({k: v for k, v in DEEPSEEK_V3_HF.items() if k != "num_hidden_layers"})


def test_rope_scaling_dict_is_converted_and_checked(tiny):
    data = tiny.to_dict()
    assert isinstance(data["rope_scaling"], dict)
    assert ModelConfig.from_dict(data).rope_scaling == tiny.rope_scaling
    with pytest.raises(ValueError, match="rope_scaling has unknown key"):
        dataclasses.replace(tiny, rope_scaling={**data["rope_scaling"], "bogus": 1})
    with pytest.raises(ValueError, match="rope_scaling"):
        dataclasses.replace(tiny, rope_scaling={"type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_scaling.type"):
        dataclasses.replace(tiny, rope_scaling={**data["rope_scaling"], "type": "linear"})


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("vocab_size", 0, ValueError),
        ("hidden_size", 64.0, TypeError),
        ("n_layers", True, TypeError),
        ("n_dense_layers", 3, ValueError),
        ("q_lora_rank", -1, ValueError),
        ("qk_rope_dim", 7, ValueError),
        ("n_activated_experts", 9, ValueError),
        ("n_expert_groups", 3, ValueError),
        ("n_limited_groups", 3, ValueError),
        ("score_func", "relu", ValueError),
        ("score_func", 1, TypeError),
        ("route_scale", 0.0, ValueError),
        ("route_scale", float("nan"), ValueError),
        ("norm_topk_prob", 1, TypeError),
        ("rope_theta", 1.0, ValueError),
        ("rope_layout", "gptj", ValueError),
        ("rope_scaling", 4.0, TypeError),
        ("max_seq_len", 0, ValueError),
        ("rms_norm_eps", 0.0, ValueError),
        ("bos_token_id", 512, ValueError),
        ("mask_token_id", -1, ValueError),
    ],
)
def test_validate_names_the_field(tiny, field, value, error):
    with pytest.raises(error, match=field):
        dataclasses.replace(tiny, **{field: value})


def test_routing_constraints(tiny):
    # 2 groups of 4, keep 1: at most 4 candidates.
    with pytest.raises(ValueError, match="n_activated_experts"):
        dataclasses.replace(tiny, n_activated_experts=5)
    assert dataclasses.replace(tiny, n_activated_experts=4).n_activated_experts == 4
    # Sigmoid groups are scored by their top-2 experts: 8 groups of 1 cannot be.
    with pytest.raises(ValueError, match="n_expert_groups"):
        dataclasses.replace(tiny, n_expert_groups=8, n_limited_groups=2)
    assert dataclasses.replace(tiny, n_expert_groups=8, n_limited_groups=2, score_func="softmax").experts_per_group == 1


def test_from_dict_rejects_unknown_and_missing_keys(tiny):
    data = tiny.to_dict()
    with pytest.raises(ValueError, match="n_experts"):
        ModelConfig.from_dict({**data, "n_experts": 8})
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_dict({k: v for k, v in data.items() if k != "hidden_size"})
    assert ModelConfig.from_dict({**data, "_comment": "ignored"}) == tiny
    with pytest.raises(TypeError, match="config"):
        ModelConfig.from_dict([1, 2])
    with pytest.raises(ValueError, match="text"):
        ModelConfig.from_json("{not json")


def test_from_name_unknown_preset():
    with pytest.raises(ValueError, match="name.*available"):
        ModelConfig.from_name("huge")
    with pytest.raises(ValueError, match="name"):
        ModelConfig.from_name("../presets/tiny")
    with pytest.raises(TypeError, match="name"):
        ModelConfig.from_name(3)


def test_random_configs_round_trip_through_json(tiny):
    rng = np.random.default_rng(7)
    for _ in range(20):
        groups = int(rng.choice([1, 2, 4]))
        config = dataclasses.replace(
            tiny,
            n_layers=int(rng.integers(1, 5)),
            n_dense_layers=0,
            q_lora_rank=int(rng.choice([0, 16, 32])),
            qk_rope_dim=int(rng.choice([2, 8, 64])),
            n_expert_groups=groups,
            n_limited_groups=int(rng.integers(1, groups + 1)),
            n_activated_experts=int(rng.integers(1, 3)),
            rope_layout=str(rng.choice(["interleaved", "neox"])),
            rope_scaling=None if rng.random() < 0.3 else tiny.rope_scaling,
            route_scale=float(rng.uniform(0.5, 3.0)),
            eos_token_id=None,
        )
        again = ModelConfig.from_json(config.to_json())
        assert again == config
        assert json.loads(again.to_json()) == json.loads(config.to_json())
