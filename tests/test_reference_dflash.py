"""reference/dflash.py: the float64 DFlash drafter (spec §2), its config, weights and round driver (spec §1.6)."""
from __future__ import annotations

import dataclasses
import json
import math

import h5py
import numpy as np
import pytest

from ddtree_numba.config import ModelConfig
from reference.dflash import (
    DFlashConfig,
    DraftSession,
    LayerKV,
    check_weights,
    default_layer_ids,
    draft_forward,
    empty_cache,
    extend_cache,
    init_weights,
    load_weights,
    parameter_shapes,
    save_weights,
)

TIGHT = dict(rtol=1e-10, atol=1e-10)  # the same float64 math in another order / grouping

# A GQA drafter small enough for the loop-by-loop re-derivation below.
SMALL = DFlashConfig(hidden_size=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, intermediate=24,
                     block_size=4, n_target_layers=5, target_layer_ids=(1, 3), mask_token_id=29,
                     rope_theta=10_000.0)
VOCAB = 30


@pytest.fixture(scope="module")
def small_weights() -> dict[str, np.ndarray]:
    return init_weights(SMALL, seed=3, dtype=np.float64)


@pytest.fixture(scope="module")
def tables() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    return rng.standard_normal((VOCAB, SMALL.hidden_size)), rng.standard_normal((VOCAB, SMALL.hidden_size)) / 4


def _random_cache(rng: np.random.Generator, n: int) -> list[LayerKV]:
    shape = (n, SMALL.n_kv_heads, SMALL.head_dim)
    return [LayerKV(rng.standard_normal(shape), rng.standard_normal(shape)) for _ in range(SMALL.n_layers)]


# --------------------------------------------------------------------------- the loop-by-loop re-derivation


def _rms(v: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    return v / math.sqrt(sum(float(x) * float(x) for x in v) / len(v) + eps) * g


def _rope(v: np.ndarray, pos: int, theta: float) -> np.ndarray:
    half = len(v) // 2
    out = np.empty_like(v)
    for i in range(half):
        angle = pos / theta ** (2 * i / len(v))
        out[i] = v[i] * math.cos(angle) - v[i + half] * math.sin(angle)
        out[i + half] = v[i + half] * math.cos(angle) + v[i] * math.sin(angle)
    return out


def _naive_forward(w, cfg, embed, lm_head, feats, ctx_pos, cache, tokens, block_pos) -> np.ndarray:
    """spec §2 written row by row and head by head, nothing vectorised across rows or heads."""
    eps, hd, th = cfg.rms_norm_eps, cfg.head_dim, cfg.rope_theta
    group = cfg.n_heads // cfg.n_kv_heads
    ctx = [_rms(w["fc.weight"] @ f, w["hidden_norm.weight"], eps) for f in feats]
    h = [embed[t].astype(np.float64) for t in tokens]
    for layer in range(cfg.n_layers):
        p = f"layers.{layer}."
        wq, wk, wv = (w[f"{p}self_attn.{n}_proj.weight"] for n in "qkv")
        x = [_rms(hi, w[f"{p}input_layernorm.weight"], eps) for hi in h]
        keys, values = [], []
        for g in range(cfg.n_kv_heads):
            rows = slice(g * hd, (g + 1) * hd)
            k_g = [cache[layer].k[j, g] for j in range(cache[layer].k.shape[0])]
            v_g = [cache[layer].v[j, g] for j in range(cache[layer].v.shape[0])]
            for src, positions in ((ctx, ctx_pos), (x, block_pos)):
                for row, pos in zip(src, positions):
                    k_g.append(_rope(_rms(wk[rows] @ row, w[f"{p}self_attn.k_norm.weight"], eps), pos, th))
                    v_g.append(wv[rows] @ row)
            keys.append(k_g)
            values.append(v_g)
        new_h = []
        for i, xi in enumerate(x):
            heads = []
            for head in range(cfg.n_heads):
                q = _rope(_rms(wq[head * hd:(head + 1) * hd] @ xi, w[f"{p}self_attn.q_norm.weight"], eps),
                          block_pos[i], th)
                k_g, v_g = keys[head // group], values[head // group]
                scores = [float(q @ k) / math.sqrt(hd) for k in k_g]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                heads.append(sum(wt * v for wt, v in zip(weights, v_g)) / sum(weights))
            hi = h[i] + w[f"{p}self_attn.o_proj.weight"] @ np.concatenate(heads)
            post = _rms(hi, w[f"{p}post_attention_layernorm.weight"], eps)
            gate = w[f"{p}mlp.gate_proj.weight"] @ post
            up = w[f"{p}mlp.up_proj.weight"] @ post
            silu = np.array([g_ / (1.0 + math.exp(-g_)) for g_ in gate])
            new_h.append(hi + w[f"{p}mlp.down_proj.weight"] @ (silu * up))
        h = new_h
    return np.stack([lm_head @ _rms(hi, w["norm.weight"], eps) for hi in h[1:]])


@pytest.mark.parametrize("n_cache, n_ctx, n_block", [(0, 5, 4), (3, 2, 4), (4, 0, 3), (0, 0, 2)])
def test_forward_matches_the_naive_rederivation(small_weights, tables, n_cache, n_ctx, n_block):
    rng = np.random.default_rng(100 * n_cache + 10 * n_ctx + n_block)
    embed, lm_head = tables
    cache = _random_cache(rng, n_cache)
    feats = rng.standard_normal((n_ctx, SMALL.feature_dim))
    ctx_pos = np.arange(n_cache, n_cache + n_ctx)
    tokens = rng.integers(0, VOCAB, n_block)
    block_pos = np.arange(n_cache + n_ctx, n_cache + n_ctx + n_block) + rng.integers(0, 50)
    out = draft_forward(small_weights, SMALL, embed, lm_head, feats, ctx_pos, cache, tokens, block_pos)
    naive = _naive_forward(small_weights, SMALL, embed, lm_head, feats, ctx_pos, cache, tokens, block_pos)
    assert out.logits.shape == (n_block - 1, VOCAB)
    np.testing.assert_allclose(out.logits, naive, **TIGHT)
    assert len(out.new_cache) == SMALL.n_layers
    assert all(rows.k.shape == (n_ctx, SMALL.n_kv_heads, SMALL.head_dim) for rows in out.new_cache)


def test_context_split_between_cache_and_new_rows_changes_nothing(small_weights, tables):
    """The cache holds exactly what a previous call would add: ingesting 7 context rows at once,
    or 4 then 3 (via new_cache), or in a permuted order (non-causal: a key set), gives one result."""
    rng = np.random.default_rng(5)
    embed, lm_head = tables
    feats = rng.standard_normal((7, SMALL.feature_dim))
    tokens = np.array([4, 29, 29, 29])
    block_pos = np.arange(7, 11)
    whole = draft_forward(small_weights, SMALL, embed, lm_head, feats, np.arange(7), None, tokens, block_pos)
    first = draft_forward(small_weights, SMALL, embed, lm_head, feats[:4], np.arange(4), None, tokens, block_pos)
    cache = extend_cache(empty_cache(SMALL), first.new_cache)
    second = draft_forward(small_weights, SMALL, embed, lm_head, feats[4:], np.arange(4, 7), cache, tokens, block_pos)
    np.testing.assert_allclose(second.logits, whole.logits, **TIGHT)
    perm = rng.permutation(7)
    shuffled = draft_forward(small_weights, SMALL, embed, lm_head, feats[perm], perm, None, tokens, block_pos)
    np.testing.assert_allclose(shuffled.logits, whole.logits, **TIGHT)
    for layer in range(SMALL.n_layers):  # cache rows depend on (c, position) only
        np.testing.assert_allclose(np.concatenate([first.new_cache[layer].k, second.new_cache[layer].k]),
                                   whole.new_cache[layer].k, **TIGHT)


def test_block_is_non_causal_and_context_rows_ignore_it(small_weights, tables):
    rng = np.random.default_rng(6)
    embed, lm_head = tables
    feats = rng.standard_normal((3, SMALL.feature_dim))
    a = draft_forward(small_weights, SMALL, embed, lm_head, feats, np.arange(3), None, np.array([1, 2, 3, 4]),
                      np.arange(3, 7))
    b = draft_forward(small_weights, SMALL, embed, lm_head, feats, np.arange(3), None, np.array([1, 2, 3, 5]),
                      np.arange(3, 7))
    assert not np.allclose(a.logits[0], b.logits[0])  # row 1 sees row 3 (no causal mask)
    for x, y in zip(a.new_cache, b.new_cache):
        np.testing.assert_array_equal(x.k, y.k)
        np.testing.assert_array_equal(x.v, y.v)


def test_positions_matter_only_relatively(small_weights, tables):
    """RoPE: shifting every context and block position by the same offset leaves the logits."""
    rng = np.random.default_rng(8)
    embed, lm_head = tables
    feats = rng.standard_normal((5, SMALL.feature_dim))
    tokens = np.array([7, 29, 29, 29])
    base = draft_forward(small_weights, SMALL, embed, lm_head, feats, np.arange(5), None, tokens, np.arange(5, 9))
    moved = draft_forward(small_weights, SMALL, embed, lm_head, feats, np.arange(5) + 37, None, tokens,
                          np.arange(5, 9) + 37)
    np.testing.assert_allclose(moved.logits, base.logits, rtol=1e-9, atol=1e-9)
    other = draft_forward(small_weights, SMALL, embed, lm_head, feats, np.arange(5), None, tokens, np.arange(6, 10))
    assert not np.allclose(other.logits, base.logits)


# --------------------------------------------------------------------------- round driver


def test_session_carries_accepted_rows(small_weights, tables):
    """DraftSession = draft_forward over the official carry: prompt, then verify features at acc."""
    rng = np.random.default_rng(9)
    embed, lm_head = tables
    session = DraftSession(small_weights, SMALL, embed, lm_head)
    prompt = rng.standard_normal((6, SMALL.feature_dim))
    session.begin(prompt)
    context, start = [prompt], 6
    for _ in range(4):
        bonus = int(rng.integers(0, VOCAB))
        logits = session.draft(bonus, start)
        feats = np.concatenate(context)
        tokens = np.r_[bonus, [SMALL.mask_token_id] * SMALL.horizon]
        whole = draft_forward(small_weights, SMALL, embed, lm_head, feats, np.arange(start), None, tokens,
                              np.arange(start, start + SMALL.block_size))
        np.testing.assert_allclose(logits, whole.logits, **TIGHT)
        assert session.cache_len == start
        verify = rng.standard_normal((9, SMALL.feature_dim))
        m = int(rng.integers(1, SMALL.block_size + 1))
        accepted = np.r_[0, np.sort(rng.choice(np.arange(1, 9), m - 1, replace=False))]
        session.commit(verify, accepted)
        context.append(verify[accepted])
        start += m


def test_session_rejects_bad_rounds(small_weights, tables):
    embed, lm_head = tables
    session = DraftSession(small_weights, SMALL, embed, lm_head)
    session.begin(np.zeros((3, SMALL.feature_dim)))
    with pytest.raises(ValueError, match="start"):
        session.draft(1, 4)
    with pytest.raises(ValueError, match="bonus"):
        session.draft(VOCAB, 3)
    session.draft(1, 3)
    verify = np.zeros((6, SMALL.feature_dim))
    for bad in ([1, 2], [0, 2, 2], [0, 6], [0, 1, 2, 3, 4]):
        with pytest.raises(ValueError, match="accepted"):
            session.commit(verify, np.array(bad))
    with pytest.raises(ValueError, match="features"):
        session.commit(np.zeros((6, 3)), np.array([0]))


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("n_t, n_d, ids", [
    (64, 10, [1, 8, 14, 21, 28, 34, 41, 48, 54, 61]),
    (64, 5, [1, 16, 31, 46, 61]),
    (28, 5, [1, 7, 13, 19, 25]),
    (61, 6, [1, 12, 24, 35, 47, 58]),
    (7, 3, [1, 2, 4]),  # 1 + 3/2 = 2.5 rounds half to even: 2, not 3
    (6, 2, [1, 3]),
    (64, 1, [32]), (61, 1, [30]), (2, 1, [1]),
])
def test_default_layer_ids(n_t, n_d, ids):
    assert default_layer_ids(n_t, n_d) == ids


def test_default_layer_ids_rejects_bad_counts():
    with pytest.raises(ValueError, match="n_draft_layers"):
        default_layer_ids(8, 0)
    with pytest.raises(TypeError, match="n_target_layers"):
        default_layer_ids(8.0, 2)


@pytest.mark.parametrize("name, target", [("dflash-tiny", "tiny"), ("dflash-small", "small")])
def test_presets_fit_their_targets(name, target):
    cfg = DFlashConfig.from_name(name)
    tcfg = ModelConfig.from_name(target)
    cfg.check_target(tcfg)
    assert cfg.mask_token_id == tcfg.mask_token_id
    assert cfg.horizon == cfg.block_size - 1 and cfg.feature_dim == cfg.n_selected * tcfg.hidden_size
    assert DFlashConfig.from_json(cfg.to_json()) == cfg
    if cfg.n_target_layers >= 4:
        assert list(cfg.target_layer_ids) == default_layer_ids(cfg.n_target_layers, cfg.n_layers)


def test_config_null_ids_mean_the_default_and_errors_name_fields():
    data = json.loads(DFlashConfig.from_name("dflash-small").to_json())
    data["target_layer_ids"] = None
    assert DFlashConfig.from_dict(data).target_layer_ids == (1, 3)
    with pytest.raises(ValueError, match="unknown"):
        DFlashConfig.from_dict({**data, "vocab": 3})
    with pytest.raises(ValueError, match="missing"):
        DFlashConfig.from_dict({k: v for k, v in data.items() if k != "head_dim"})
    with pytest.raises(ValueError, match="name"):
        DFlashConfig.from_name("tiny")
    with pytest.raises(ValueError, match="text"):
        DFlashConfig.from_json("{")
    with pytest.raises(ValueError, match="hidden_size"):
        DFlashConfig.from_name("dflash-tiny").check_target(ModelConfig.from_name("small"))


@pytest.mark.parametrize("change, exc, field", [
    (dict(n_kv_heads=3), ValueError, "n_kv_heads"),
    (dict(head_dim=7), ValueError, "head_dim"),
    (dict(block_size=1), ValueError, "block_size"),
    (dict(target_layer_ids=(1, 1)), ValueError, "target_layer_ids"),
    (dict(target_layer_ids=(5,)), ValueError, "target_layer_ids"),
    (dict(target_layer_ids=()), ValueError, "target_layer_ids"),
    (dict(target_layer_ids=3), TypeError, "target_layer_ids"),
    (dict(hidden_size=0), ValueError, "hidden_size"),
    (dict(n_layers=2.0), TypeError, "n_layers"),
    (dict(rms_norm_eps=0.0), ValueError, "rms_norm_eps"),
    (dict(rope_theta=float("inf")), ValueError, "rope_theta"),
    (dict(mask_token_id=-1), ValueError, "mask_token_id"),
])
def test_config_validation(change, exc, field):
    with pytest.raises(exc, match=field):
        dataclasses.replace(SMALL, **change)


# --------------------------------------------------------------------------- weights


def test_init_is_seeded_and_scaled():
    a = init_weights(SMALL, seed=1)
    assert list(a) == list(parameter_shapes(SMALL))
    assert all(v.dtype == np.float32 for v in a.values())
    b = init_weights(SMALL, seed=1)
    c = init_weights(SMALL, seed=2)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["fc.weight"], c["fc.weight"])
    assert abs(float(np.mean(a["norm.weight"])) - 1.0) < 0.1
    assert a["fc.weight"].std() == pytest.approx(SMALL.feature_dim ** -0.5, rel=0.2)
    with pytest.raises(ValueError, match="seed"):
        init_weights(SMALL, seed=-1)
    with pytest.raises(TypeError, match="dtype"):
        init_weights(SMALL, seed=0, dtype=np.int32)


def test_save_load_round_trip(tmp_path, small_weights):
    path = save_weights(tmp_path / "drafter.h5", small_weights, SMALL)
    weights, cfg = load_weights(path)
    assert cfg == SMALL
    assert set(weights) == set(small_weights)
    assert all(np.array_equal(weights[k], small_weights[k]) for k in weights)
    bad = dict(small_weights, **{"norm.weight": np.full(SMALL.hidden_size, np.nan)})
    with pytest.raises(ValueError, match="norm.weight"):
        save_weights(path, bad, SMALL)
    assert np.array_equal(load_weights(path)[0]["norm.weight"], small_weights["norm.weight"])  # untouched
    with pytest.raises(ValueError, match="path"):
        load_weights(tmp_path / "missing.h5")
    (tmp_path / "junk.h5").write_text("not hdf5")
    with pytest.raises(ValueError, match="path"):
        load_weights(tmp_path / "junk.h5")
    with h5py.File(tmp_path / "noconfig.h5", "w") as f:
        f.create_dataset("fc.weight", data=np.zeros(2))
    with pytest.raises(ValueError, match="config"):
        load_weights(tmp_path / "noconfig.h5")


def test_check_weights_names_the_parameter(small_weights):
    with pytest.raises(ValueError, match="missing parameter 'fc.weight'"):
        check_weights({k: v for k, v in small_weights.items() if k != "fc.weight"}, SMALL)
    with pytest.raises(ValueError, match="unexpected parameter 'extra'"):
        check_weights({**small_weights, "extra": np.zeros(1)}, SMALL)
    with pytest.raises(ValueError, match="layers.1.self_attn.k_norm.weight"):
        check_weights({**small_weights, "layers.1.self_attn.k_norm.weight": np.zeros(3)}, SMALL)
    with pytest.raises(TypeError, match="norm.weight"):
        check_weights({**small_weights, "norm.weight": np.zeros(SMALL.hidden_size, np.int32)}, SMALL)


def test_forward_rejects_bad_inputs(small_weights, tables):
    embed, lm_head = tables
    feats = np.zeros((2, SMALL.feature_dim))
    args = dict(weights=small_weights, config=SMALL, target_embed=embed, target_lm_head=lm_head,
                context_features=feats, ctx_positions=np.arange(2), cache=None, block_tokens=np.array([1, 2]),
                block_positions=np.array([2, 3]))
    draft_forward(**args)
    cases = [
        (dict(context_features=np.zeros((2, 5))), ValueError, "context_features"),
        (dict(context_features=np.full((2, SMALL.feature_dim), np.inf)), ValueError, "context_features"),
        (dict(ctx_positions=np.arange(3)), ValueError, "ctx_positions"),
        (dict(ctx_positions=np.array([0.0, 1.0])), TypeError, "ctx_positions"),
        (dict(block_tokens=np.array([1, VOCAB])), ValueError, "block_tokens"),
        (dict(block_tokens=np.array([], dtype=np.int64), block_positions=np.array([], dtype=np.int64)),
         ValueError, "block_tokens"),
        (dict(block_positions=np.array([-1, 0])), ValueError, "block_positions"),
        (dict(target_embed=embed[:, :3]), ValueError, "target_embed"),
        (dict(target_lm_head=lm_head.astype(np.int64)), TypeError, "target_lm_head"),
        (dict(cache=[LayerKV(np.zeros((1, 2, 8)), np.zeros((2, 2, 8)))] * 2), ValueError, "cache"),
        (dict(cache=empty_cache(SMALL)[:1]), ValueError, "cache"),
        (dict(config=ModelConfig.from_name("tiny")), TypeError, "config"),
    ]
    for change, exc, name in cases:
        with pytest.raises(exc, match=name):
            draft_forward(**{**args, **change})
