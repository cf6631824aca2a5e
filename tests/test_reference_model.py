"""reference/model.py and reference/weights.py: the float64 forward of the MLA + MoE target and its weights."""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import h5py
import numpy as np
import pytest

from ddtree_numba.config import ModelConfig
from reference.model import (
    LayerCache,
    apply_rope,
    causal_visibility,
    empty_cache,
    extend_cache,
    forward,
    mla_absorbed,
    mla_naive,
    moe,
    moe_gate,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    sigmoid,
    swiglu_ffn,
)
from reference.weights import (
    check_weights,
    init_weights,
    load_weights,
    parameter_shapes,
    save_weights,
)

TIGHT = dict(rtol=1e-12, atol=1e-12)  # same math in another order, float64
CACHE = dict(rtol=1e-10, atol=1e-10)  # same math on other row groupings (BLAS blocking differs)


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.from_name("tiny")


@pytest.fixture(scope="module")
def tiny_weights(tiny) -> dict[str, np.ndarray]:
    return init_weights(tiny, seed=0)


def _variants(tiny: ModelConfig) -> list[ModelConfig]:
    """The preset plus every switch flipped: NeoX RoPE, no q low-rank path, softmax routing without
    groups, no YaRN, all-MoE layers without a shared expert."""
    return [
        tiny,
        dataclasses.replace(tiny, rope_layout="neox"),
        dataclasses.replace(tiny, q_lora_rank=0),
        dataclasses.replace(tiny, score_func="softmax", norm_topk_prob=False, n_expert_groups=1,
                            n_limited_groups=1),
        dataclasses.replace(tiny, rope_scaling=None),
        dataclasses.replace(tiny, n_dense_layers=0, n_shared_experts=0),
    ]


def _random_tree(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(parents [n], depths [n], visibility [n, n]) of a random tree whose parents precede their children."""
    parents = np.full(n, -1)
    depths = np.zeros(n, dtype=np.int64)
    vis = np.eye(n, dtype=bool)
    for i in range(1, n):
        parents[i] = rng.integers(0, i)
        depths[i] = depths[parents[i]] + 1
        vis[i] |= vis[parents[i]]
    return parents, depths, vis


def _path(parents: np.ndarray, node: int) -> list[int]:
    """Root ... node."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


# --------------------------------------------------------------------------- small pieces


def test_rms_norm_unit_rms_and_weight():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 32)) * rng.uniform(0.1, 100.0, size=(5, 1))
    w = rng.uniform(0.5, 2.0, 32)
    y = rms_norm(x, np.ones(32), 0.0)
    np.testing.assert_allclose(np.sqrt(np.mean(y * y, axis=-1)), 1.0, rtol=1e-13)
    np.testing.assert_allclose(rms_norm(x, w, 1e-6), rms_norm(x, np.ones(32), 1e-6) * w, rtol=1e-14)


def test_sigmoid_is_stable_and_correct():
    z = np.array([-1000.0, -30.0, -1.0, 0.0, 2.0, 1000.0])
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # underflow to 0 is fine
        s = sigmoid(z)
    np.testing.assert_allclose(s[1:5], 1.0 / (1.0 + np.exp(-z[1:5])), rtol=1e-15, atol=0)
    assert s[0] == 0.0 and s[-1] == 1.0


def test_swiglu_ffn_against_a_loop():
    rng = np.random.default_rng(1)
    x, wg, wu, wd = (rng.standard_normal(s) for s in [(3, 8), (5, 8), (5, 8), (8, 5)])
    expected = np.stack([wd @ ((wg @ r) / (1 + np.exp(-(wg @ r))) * (wu @ r)) for r in x])
    np.testing.assert_allclose(swiglu_ffn(x, wg, wu, wd), expected, rtol=1e-12)


# --------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("layout", ["interleaved", "neox"])
def test_rope_is_a_rotation_that_depends_on_relative_position(tiny, layout):
    rng = np.random.default_rng(2)
    config = dataclasses.replace(tiny, rope_layout=layout)
    t, h, r = 6, 3, config.qk_rope_dim
    q, k = rng.standard_normal((t, h, r)), rng.standard_normal((t, r))
    q_pos, k_pos = rng.integers(0, 200, t), rng.integers(0, 200, t)

    def dots(q_shift: int, k_shift: int) -> np.ndarray:
        """[T, H, T] q·k with queries at q_pos + q_shift and keys at k_pos + k_shift."""
        qr = apply_rope(q, *rope_cos_sin(config, q_pos + q_shift), layout)
        kr = apply_rope(k, *rope_cos_sin(config, k_pos + k_shift), layout)
        np.testing.assert_allclose(np.linalg.norm(qr, axis=-1), np.linalg.norm(q, axis=-1), rtol=1e-13)
        np.testing.assert_allclose(np.linalg.norm(kr, axis=-1), np.linalg.norm(k, axis=-1), rtol=1e-13)
        return np.einsum("ihr,jr->ihj", qr, kr)

    # q·k depends on the position difference only: shifting both changes nothing, one alone does.
    np.testing.assert_allclose(dots(37, 37), dots(0, 0), rtol=1e-10, atol=1e-12)
    assert not np.allclose(dots(37, 0), dots(0, 0))
    # Position 0 is the identity.
    c0, s0 = rope_cos_sin(config, np.zeros(t, dtype=np.int64))
    np.testing.assert_array_equal(apply_rope(q, c0, s0, layout), q)


def test_rope_layouts_pair_different_dims(tiny):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, tiny.qk_rope_dim))
    cos, sin = rope_cos_sin(tiny, np.array([1, 5, 9, 100]))
    inter, neox = apply_rope(x, cos, sin, "interleaved"), apply_rope(x, cos, sin, "neox")
    assert not np.allclose(inter, neox)
    # Interleaved is DeepSeek's complex view: (x[2i] + i x[2i+1]) · e^{i angle}.
    z = (x[:, 0::2] + 1j * x[:, 1::2]) * (cos + 1j * sin)
    np.testing.assert_allclose(inter[:, 0::2], z.real, rtol=1e-13)
    np.testing.assert_allclose(inter[:, 1::2], z.imag, rtol=1e-13)
    # NeoX rotates the halves: x·cos + rotate_half(x)·sin.
    half = tiny.qk_rope_dim // 2
    full_cos, full_sin = np.concatenate([cos, cos], 1), np.concatenate([sin, sin], 1)
    rotate_half = np.concatenate([-x[:, half:], x[:, :half]], 1)
    np.testing.assert_allclose(neox, x * full_cos + rotate_half * full_sin, rtol=1e-13)
    # The same permutation of q and k dims maps one layout onto the other, so q·k are equal.
    perm = np.concatenate([np.arange(0, tiny.qk_rope_dim, 2), np.arange(1, tiny.qk_rope_dim, 2)])
    np.testing.assert_allclose(inter[:, perm], apply_rope(x[:, perm], cos, sin, "neox"), rtol=1e-13)
    with pytest.raises(ValueError, match="layout"):
        apply_rope(x, cos, sin, "gptj")


def test_yarn_frequencies():
    kimi = ModelConfig.from_name("kimi-k2")
    base = 1.0 / 50000.0 ** (np.arange(0, 64, 2) / 64)
    # beta_fast = beta_slow = 1: correction dim 64 ln(4096 / 2π) / (2 ln 50000) = 19.17 -> [19, 20].
    np.testing.assert_allclose(rope_inv_freq(kimi)[:20], base[:20], rtol=1e-15)
    np.testing.assert_allclose(rope_inv_freq(kimi)[20:], base[20:] / 64.0, rtol=1e-15)
    np.testing.assert_allclose(rope_inv_freq(dataclasses.replace(kimi, rope_scaling=None)), base, rtol=1e-15)
    # DeepSeek-V3 (beta 32 / 1, θ 10000, dim 64): range [10, 23]; a linear ramp in between.
    ds = dataclasses.replace(kimi, rope_theta=10000.0, rope_scaling=dataclasses.replace(
        kimi.rope_scaling, factor=40.0, beta_fast=32.0))
    base = 1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)
    ramp = np.clip((np.arange(32) - 10) / 13, 0, 1)
    np.testing.assert_allclose(rope_inv_freq(ds), base / 40 * ramp + base * (1 - ramp), rtol=1e-15)


# --------------------------------------------------------------------------- MLA


def _mla_inputs(rng, t, n_past, h=3, nope=8, v=6, c=16, r=4):
    q_nope, q_rope = rng.standard_normal((t, h, nope)), rng.standard_normal((t, h, r))
    kv_latent, k_rope = rng.standard_normal((n_past + t, c)), rng.standard_normal((n_past + t, r))
    kv_b = rng.standard_normal((h * (nope + v), c)) / 4
    return q_nope, q_rope, kv_latent, k_rope, kv_b


@pytest.mark.parametrize("t, n_past", [(1, 0), (1, 9), (5, 0), (7, 13), (12, 3)])
def test_mla_naive_equals_absorbed(t, n_past):
    rng = np.random.default_rng(100 + 10 * t + n_past)
    q_nope, q_rope, kv_latent, k_rope, kv_b = _mla_inputs(rng, t, n_past)
    vis = (rng.random((t, t)) < 0.5) | np.eye(t, dtype=bool)
    naive = mla_naive(q_nope, q_rope, kv_latent, k_rope, vis, kv_b, 0.3)
    absorbed = mla_absorbed(q_nope, q_rope, kv_latent, k_rope, vis, kv_b, 0.3)
    np.testing.assert_allclose(naive, absorbed, **TIGHT)
    assert naive.shape == (t, 3, 6)


def test_mla_hidden_rows_do_not_matter():
    """What a query may not see cannot change its output; what it sees does."""
    rng = np.random.default_rng(5)
    t, n_past = 6, 4
    q_nope, q_rope, kv_latent, k_rope, kv_b = _mla_inputs(rng, t, n_past)
    _, _, vis = _random_tree(rng, t)
    out = mla_absorbed(q_nope, q_rope, kv_latent, k_rope, vis, kv_b, 0.5)
    changed_latent, changed_rope = kv_latent.copy(), k_rope.copy()
    hidden = np.flatnonzero(~vis[-1])
    changed_latent[n_past + hidden] += 5.0
    changed_rope[n_past + hidden] -= 3.0
    again = mla_naive(q_nope, q_rope, changed_latent, changed_rope, vis, kv_b, 0.5)
    np.testing.assert_allclose(again[-1], out[-1], **TIGHT)
    changed_latent[0] += 1.0  # a cached row: every query sees it
    assert not np.allclose(mla_naive(q_nope, q_rope, changed_latent, changed_rope, vis, kv_b, 0.5)[-1], out[-1])


# --------------------------------------------------------------------------- gate and MoE


def _gate_config(tiny, **changes) -> ModelConfig:
    return dataclasses.replace(tiny, **changes)


@pytest.mark.parametrize("groups, keep, k", [(1, 1, 2), (2, 1, 2), (2, 1, 4), (4, 2, 3), (2, 2, 8)])
def test_moe_gate_properties(tiny, groups, keep, k):
    config = _gate_config(tiny, n_expert_groups=groups, n_limited_groups=keep, n_activated_experts=k)
    rng = np.random.default_rng(groups * 100 + keep * 10 + k)
    t, e, d = 40, config.n_routed_experts, 12
    x, gate_w, bias = rng.standard_normal((t, d)), rng.standard_normal((e, d)), rng.standard_normal(e) * 0.3
    idx, w = moe_gate(x, gate_w, bias, config)
    assert idx.shape == w.shape == (t, k) and idx.dtype == np.int64
    scores = sigmoid(x @ gate_w.T)
    biased = scores + bias
    per_group = e // groups
    for row in range(t):
        assert len(set(idx[row])) == k  # exactly k distinct experts
        # Brute force: best groups by sum of their top-2 biased scores, then best k inside them.
        group_score = np.sort(biased[row].reshape(groups, -1), axis=1)[:, -2:].sum(1)
        kept = np.argsort(-group_score, kind="stable")[:keep]
        allowed = np.concatenate([np.arange(g * per_group, (g + 1) * per_group) for g in kept])
        best = allowed[np.argsort(-biased[row, allowed], kind="stable")[:k]]
        assert set(idx[row]) == set(best)
        assert np.all(np.diff(biased[row, idx[row]]) <= 0)  # descending biased score
        # Weights: unbiased scores of the chosen experts, normalised, times route_scale.
        np.testing.assert_allclose(w[row], scores[row, idx[row]] / scores[row, idx[row]].sum() * config.route_scale,
                                   rtol=1e-13)
    np.testing.assert_allclose(w.sum(1), config.route_scale, rtol=1e-13)


def test_moe_gate_bias_changes_selection_but_not_normalisation(tiny):
    config = _gate_config(tiny, n_expert_groups=1, n_limited_groups=1)
    rng = np.random.default_rng(11)
    x, gate_w = rng.standard_normal((30, 12)), rng.standard_normal((8, 12))
    bias = np.zeros(8)
    bias[5] = 10.0  # expert 5 is always chosen, although its unbiased score is often low
    idx0, w0 = moe_gate(x, gate_w, None, config)
    idx1, w1 = moe_gate(x, gate_w, bias, config)
    assert np.all(idx1[:, 0] == 5) and not np.all(np.any(idx0 == 5, axis=1))
    np.testing.assert_allclose(w1.sum(1), config.route_scale, rtol=1e-13)
    scores = sigmoid(x @ gate_w.T)
    chosen = np.take_along_axis(scores, idx1, 1)
    np.testing.assert_allclose(w1, chosen / chosen.sum(1, keepdims=True) * config.route_scale, rtol=1e-13)
    assert np.all(w1[:, 0] / config.route_scale < 1.0)  # bias never leaks into the weight


def test_moe_gate_ties_go_to_the_lower_index(tiny):
    """A zero gate scores every expert 0.5: groups and experts tie everywhere."""
    config = _gate_config(tiny, n_expert_groups=2, n_limited_groups=1, n_activated_experts=3)
    x = np.random.default_rng(0).standard_normal((5, 12))
    idx, w = moe_gate(x, np.zeros((8, 12)), np.zeros(8), config)
    np.testing.assert_array_equal(idx, np.tile([0, 1, 2], (5, 1)))
    np.testing.assert_allclose(w, config.route_scale / 3, rtol=1e-15)
    # Biased ties: group 1 wins on its top-2 sum, then its experts in index order.
    bias = np.array([0.0, 0, 0, 0, 0.1, 0.1, 0.1, 0.1])
    idx, _ = moe_gate(x, np.zeros((8, 12)), bias, config)
    np.testing.assert_array_equal(idx, np.tile([4, 5, 6], (5, 1)))


def test_moe_gate_softmax_and_single_expert(tiny):
    rng = np.random.default_rng(12)
    x, gate_w = rng.standard_normal((10, 12)), rng.standard_normal((8, 12))
    soft = _gate_config(tiny, score_func="softmax", norm_topk_prob=False, n_expert_groups=1, n_limited_groups=1)
    idx, w = moe_gate(x, gate_w, None, soft)
    logits = x @ gate_w.T
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    np.testing.assert_array_equal(idx, np.argsort(-probs, 1, kind="stable")[:, :2])
    np.testing.assert_allclose(w, np.take_along_axis(probs, idx, 1) * soft.route_scale, rtol=1e-13)
    # Softmax groups are scored by their max.
    grouped = dataclasses.replace(soft, n_expert_groups=4, n_limited_groups=1)
    idx, _ = moe_gate(x, gate_w, None, grouped)
    best_group = probs.reshape(10, 4, 2).max(2).argmax(1)
    assert np.all(idx // 2 == best_group[:, None])
    # k = 1: HF does not renormalise, the weight is the raw score times route_scale.
    one = _gate_config(tiny, n_activated_experts=1)
    idx, w = moe_gate(x, gate_w, None, one)
    np.testing.assert_allclose(w[:, 0], sigmoid(logits)[np.arange(10), idx[:, 0]] * one.route_scale, rtol=1e-14)


def test_moe_equals_dense_mixture(tiny, tiny_weights):
    """The expert loop equals computing every expert for every token and mixing with a dense gate matrix."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((17, tiny.hidden_size))
    prefix = "model.layers.1.mlp."
    w = {k: v.astype(np.float64) for k, v in tiny_weights.items()}
    idx, gate = moe_gate(x, w[f"{prefix}gate.weight"], w[f"{prefix}gate.e_score_correction_bias"], tiny)
    dense_gate = np.zeros((17, tiny.n_routed_experts))
    np.put_along_axis(dense_gate, idx, gate, axis=1)
    expected = sum(
        dense_gate[:, [e]] * swiglu_ffn(x, *(w[f"{prefix}experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down")))
        for e in range(tiny.n_routed_experts))
    expected += swiglu_ffn(x, *(w[f"{prefix}shared_experts.{p}_proj.weight"] for p in ("gate", "up", "down")))
    np.testing.assert_allclose(moe(x, tiny_weights, prefix, tiny), expected, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- forward


def test_forward_naive_equals_absorbed_on_every_variant(tiny):
    rng = np.random.default_rng(20)
    for i, config in enumerate(_variants(tiny)):
        weights = init_weights(config, seed=i)
        tokens = rng.integers(0, config.vocab_size, 9)
        pos = np.arange(9) + int(rng.integers(0, 100))
        past = forward(weights, config, rng.integers(0, config.vocab_size, 5), np.arange(5))
        a = forward(weights, config, tokens, pos, past.new_cache)
        n = forward(weights, config, tokens, pos, past.new_cache, attn="naive")
        np.testing.assert_allclose(a.logits, n.logits, **TIGHT)
        np.testing.assert_allclose(a.hidden, n.hidden, **TIGHT)
        for ra, rn in zip(a.new_cache, n.new_cache):
            np.testing.assert_allclose(ra.latent, rn.latent, **TIGHT)


def test_forward_outputs_and_activation_scale(tiny, tiny_weights):
    tokens = np.array([1, 7, 7, 7, 300, 511, 0, 2])  # repeats and the id extremes
    out = forward(tiny_weights, tiny, tokens, np.arange(8))
    assert out.logits.shape == (8, tiny.vocab_size) and out.logits.dtype == np.float64
    assert out.hidden.shape == (tiny.n_layers + 1, 8, tiny.hidden_size)
    np.testing.assert_array_equal(out.hidden[0], tiny_weights["model.embed_tokens.weight"][tokens])
    assert len(out.new_cache) == tiny.n_layers
    assert all(r.latent.shape == (8, tiny.kv_lora_rank) and r.k_rope.shape == (8, tiny.qk_rope_dim)
               for r in out.new_cache)
    # The same token at different positions gives different logits (RoPE is used).
    assert not np.allclose(out.logits[2], out.logits[3])
    explicit = forward(tiny_weights, tiny, tokens, np.arange(8), None, causal_visibility(8))  # None = causal
    np.testing.assert_array_equal(explicit.logits, out.logits)
    # Activations stay O(1) through a deeper stack, and logits are neither flat nor one-hot.
    deep = dataclasses.replace(tiny, n_layers=8, n_dense_layers=2)
    out = forward(init_weights(deep, seed=3), deep, np.arange(0, 512, 16), np.arange(32))
    rms = np.sqrt(np.mean(out.hidden ** 2, axis=(1, 2)))
    assert np.all((rms > 0.3) & (rms < 3.0)), rms
    assert 0.3 < out.logits.std() < 3.0
    probs = np.exp(out.logits - out.logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    assert np.all(probs.max(1) < 0.5) and np.all(probs.max(1) > 2.0 / tiny.vocab_size)


@pytest.mark.parametrize("config_index", range(6))
def test_prefill_then_decode_equals_one_prefill(tiny, config_index):
    config = _variants(tiny)[config_index]
    weights = init_weights(config, seed=config_index)
    rng = np.random.default_rng(30 + config_index)
    n = 14
    tokens = rng.integers(0, config.vocab_size, n)
    full = forward(weights, config, tokens, np.arange(n))
    # Prefill in random chunks, the last ones one token at a time (decode).
    cuts = sorted({0, n, *rng.integers(1, n - 3, 2).tolist(), n - 3, n - 2, n - 1})
    cache = empty_cache(config)
    logits, hidden = [], []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        out = forward(weights, config, tokens[lo:hi], np.arange(lo, hi), cache)
        cache = extend_cache(cache, out.new_cache)
        logits.append(out.logits)
        hidden.append(out.hidden)
    np.testing.assert_allclose(np.concatenate(logits), full.logits, **CACHE)
    np.testing.assert_allclose(np.concatenate(hidden, axis=1), full.hidden, **CACHE)
    for got, want in zip(cache, full.new_cache):
        np.testing.assert_allclose(got.latent, want.latent, **CACHE)
        np.testing.assert_allclose(got.k_rope, want.k_rope, **CACHE)


@pytest.mark.parametrize("seed, n_nodes, layout", [(0, 1, "interleaved"), (1, 9, "interleaved"),
                                                    (2, 16, "neox"), (3, 12, "interleaved")])
def test_tree_forward_equals_per_path_causal_forward(tiny, seed, n_nodes, layout):
    config = dataclasses.replace(tiny, rope_layout=layout)
    weights = init_weights(config, seed=seed)
    rng = np.random.default_rng(40 + seed)
    past_len = int(rng.integers(1, 8))
    prompt = forward(weights, config, rng.integers(0, config.vocab_size, past_len), np.arange(past_len))
    parents, depths, vis = _random_tree(rng, n_nodes)
    tokens = rng.integers(0, 6, n_nodes)  # few distinct ids: siblings share tokens
    tree = forward(weights, config, tokens, past_len + depths, prompt.new_cache, vis)
    for node in range(n_nodes):
        path = _path(parents, node)
        chain = forward(weights, config, tokens[path], past_len + np.arange(len(path)), prompt.new_cache)
        np.testing.assert_allclose(tree.logits[node], chain.logits[-1], **CACHE)
        np.testing.assert_allclose(tree.hidden[:, node], chain.hidden[:, -1], **CACHE)
        for got, want in zip(tree.new_cache, chain.new_cache):
            np.testing.assert_allclose(got.latent[node], want.latent[-1], **CACHE)
            np.testing.assert_allclose(got.k_rope[node], want.k_rope[-1], **CACHE)


def test_tree_positions_are_depths_not_indices(tiny, tiny_weights):
    """Three identical siblings at depth 1: with depth positions they get equal logits, with index
    positions (the porting trap of limits §2) they do not."""
    depths = np.array([0, 1, 1, 1])
    vis = np.eye(4, dtype=bool)
    vis[1:, 0] = True  # root <- each sibling
    tokens = np.array([3, 9, 9, 9])
    out = forward(tiny_weights, tiny, tokens, 5 + depths, None, vis)
    np.testing.assert_allclose(out.logits[1], out.logits[3], **TIGHT)
    wrong = forward(tiny_weights, tiny, tokens, 5 + np.arange(4), None, vis)
    assert not np.allclose(wrong.logits[1], wrong.logits[3])


def test_forward_rejects_bad_input(tiny, tiny_weights):
    w, c = tiny_weights, tiny
    tok, pos = np.array([1, 2, 3]), np.arange(3)
    cases = [
        (dict(tokens=np.array([1, 512])), ValueError, "tokens"),
        (dict(tokens=np.array([1.0, 2.0])), TypeError, "tokens"),
        (dict(tokens=np.array([], dtype=np.int64)), ValueError, "tokens"),
        (dict(positions=np.arange(2)), ValueError, "positions"),
        (dict(positions=np.array([0, 1, 256])), ValueError, "positions"),
        (dict(visibility=np.zeros((3, 3), dtype=bool)), ValueError, "visibility"),
        (dict(visibility=np.ones((3, 3))), TypeError, "visibility"),
        (dict(visibility=np.ones((3, 2), dtype=bool)), ValueError, "visibility"),
        (dict(cache=[]), ValueError, "cache"),
        (dict(cache=[LayerCache(np.zeros((2, 32)), np.zeros((2, 8))),
                     LayerCache(np.zeros((3, 32)), np.zeros((3, 8)))]), ValueError, r"cache\[1\].latent"),
        (dict(cache=[LayerCache(np.zeros((2, 32)), np.zeros((2, 6)))] * 2), ValueError, r"cache\[0\].k_rope"),
        (dict(cache=[LayerCache(np.full((2, 32), np.nan), np.zeros((2, 8)))] * 2), ValueError, "finite"),
        (dict(attn="flash"), ValueError, "attn"),
        (dict(config=c.to_dict()), TypeError, "config"),
        (dict(weights={k: v for k, v in w.items() if "kv_b_proj" not in k}), ValueError, "kv_b_proj"),
    ]
    for changes, error, match in cases:
        args = dict(weights=w, config=c, tokens=tok, positions=pos, cache=None, visibility=None, attn="absorbed")
        args.update(changes)
        with pytest.raises(error, match=match):
            forward(**args)
    with pytest.raises(ValueError, match="rows"):
        extend_cache(empty_cache(c), [])


# --------------------------------------------------------------------------- weights


def test_parameter_names_follow_hugging_face(tiny):
    names = parameter_shapes(tiny)
    d = tiny.hidden_size
    for name, shape in {
        "model.embed_tokens.weight": (512, d),
        "model.layers.0.self_attn.q_a_proj.weight": (32, d),
        "model.layers.0.self_attn.q_a_layernorm.weight": (32,),
        "model.layers.0.self_attn.q_b_proj.weight": (4 * 24, 32),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (32 + 8, d),
        "model.layers.0.self_attn.kv_a_layernorm.weight": (32,),
        "model.layers.0.self_attn.kv_b_proj.weight": (4 * 32, 32),
        "model.layers.0.self_attn.o_proj.weight": (d, 4 * 16),
        "model.layers.0.input_layernorm.weight": (d,),
        "model.layers.0.post_attention_layernorm.weight": (d,),
        "model.layers.0.mlp.gate_proj.weight": (128, d),
        "model.layers.0.mlp.down_proj.weight": (d, 128),
        "model.layers.1.mlp.gate.weight": (8, d),
        "model.layers.1.mlp.gate.e_score_correction_bias": (8,),
        "model.layers.1.mlp.experts.7.up_proj.weight": (32, d),
        "model.layers.1.mlp.experts.0.down_proj.weight": (d, 32),
        "model.layers.1.mlp.shared_experts.gate_proj.weight": (32, d),
        "model.norm.weight": (d,),
        "lm_head.weight": (512, d),
    }.items():
        assert names[name] == shape, name
    assert "model.layers.1.mlp.gate_proj.weight" not in names  # MoE layer: no dense FFN
    no_q_lora = parameter_shapes(dataclasses.replace(tiny, q_lora_rank=0))
    assert no_q_lora["model.layers.0.self_attn.q_proj.weight"] == (4 * 24, d)
    assert "model.layers.0.self_attn.q_a_proj.weight" not in no_q_lora
    softmax = parameter_shapes(dataclasses.replace(tiny, score_func="softmax"))
    assert "model.layers.1.mlp.gate.e_score_correction_bias" not in softmax


def test_init_weights_is_deterministic_and_keyed_by_name(tiny, tiny_weights):
    again = init_weights(tiny, seed=0)
    assert list(again) == list(parameter_shapes(tiny))
    assert all(np.array_equal(again[k], tiny_weights[k]) for k in again)
    assert all(v.dtype == np.float32 for v in again.values())
    other = init_weights(tiny, seed=1)
    assert not np.array_equal(other["lm_head.weight"], tiny_weights["lm_head.weight"])
    deeper = init_weights(dataclasses.replace(tiny, n_layers=3), seed=0)  # same stream per name
    np.testing.assert_array_equal(deeper["model.layers.1.mlp.gate.weight"],
                                  tiny_weights["model.layers.1.mlp.gate.weight"])
    f64 = init_weights(tiny, seed=0, dtype=np.float64)
    assert f64["lm_head.weight"].dtype == np.float64
    np.testing.assert_allclose(f64["model.norm.weight"], tiny_weights["model.norm.weight"], rtol=1e-7)
    check_weights(f64, tiny)


def test_init_weights_refuses_kimi_and_bad_arguments(tiny):
    with pytest.raises(ValueError, match="never materialized"):
        init_weights(ModelConfig.from_name("kimi-k2"), seed=0)
    with pytest.raises(TypeError, match="seed"):
        init_weights(tiny, seed=1.5)
    with pytest.raises(ValueError, match="seed"):
        init_weights(tiny, seed=-1)
    with pytest.raises(TypeError, match="dtype"):
        init_weights(tiny, seed=0, dtype=np.float16)
    with pytest.raises(TypeError, match="config"):
        init_weights("tiny", seed=0)


def test_save_load_round_trip(tmp_path, tiny, tiny_weights):
    path = save_weights(tmp_path / "tiny.h5", tiny_weights, tiny)
    weights, config = load_weights(path)
    assert config == tiny and config.notes == tiny.notes
    assert set(weights) == set(tiny_weights)
    for name, arr in tiny_weights.items():
        assert weights[name].dtype == arr.dtype
        np.testing.assert_array_equal(weights[name], arr)
    assert os.listdir(tmp_path) == ["tiny.h5"]  # no temp file left
    # Overwrite with another model; a failed save leaves it untouched.
    other = dataclasses.replace(tiny, q_lora_rank=0)
    save_weights(path, init_weights(other, seed=4), other)
    bad = init_weights(other, seed=5)
    bad["lm_head.weight"][0, 0] = np.nan
    with pytest.raises(ValueError, match="lm_head"):
        save_weights(path, bad, other)
    with pytest.raises(ValueError, match="missing parameter"):
        save_weights(path, tiny_weights, other)
    assert load_weights(path)[1] == other and os.listdir(tmp_path) == ["tiny.h5"]
    with pytest.raises(ValueError, match="path"):
        save_weights(tmp_path / "no" / "dir.h5", tiny_weights, tiny)


def test_load_hand_written_checkpoint(tmp_path, tiny):
    """A checkpoint written directly with h5py (HF names, [out, in], float64, config as bytes) loads and
    gives the forward of the same weights."""
    weights = init_weights(tiny, seed=9, dtype=np.float64)
    path = tmp_path / "hand.h5"
    with h5py.File(path, "w") as f:
        f.attrs["config"] = np.bytes_(tiny.to_json().encode())
        for name in sorted(weights, reverse=True):  # any order
            f[name] = weights[name]
    loaded, config = load_weights(path)
    assert config == tiny
    tokens, pos = np.array([4, 8, 15, 16, 23, 42]), np.arange(6)
    np.testing.assert_array_equal(forward(loaded, config, tokens, pos).logits,
                                  forward(weights, tiny, tokens, pos).logits)


def _write(path: Path, weights: dict, config_text: str | None) -> Path:
    with h5py.File(path, "w") as f:
        if config_text is not None:
            f.attrs["config"] = config_text
        for name, arr in weights.items():
            f[name] = arr
    return path


def test_load_rejects_bad_checkpoints(tmp_path, tiny, tiny_weights):
    text = tiny.to_json()
    missing = {k: v for k, v in tiny_weights.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"}
    extra = {**tiny_weights, "model.layers.2.input_layernorm.weight": np.ones(64, np.float32)}
    wrong_shape = {**tiny_weights, "model.layers.0.self_attn.kv_b_proj.weight": np.ones((128, 33), np.float32)}
    wrong_dtype = {**tiny_weights, "model.norm.weight": np.ones(64, np.int32)}
    cases = [
        (missing, text, ValueError, "experts.3.up_proj"),
        (extra, text, ValueError, "layers.2.input_layernorm"),
        (wrong_shape, text, ValueError, "kv_b_proj"),
        (wrong_dtype, text, TypeError, "model.norm.weight"),
        (tiny_weights, None, ValueError, "config"),
        (tiny_weights, text.replace('"hidden_size": 64', '"hidden_size": 65'), ValueError, "shape"),
    ]
    for i, (weights, config_text, error, match) in enumerate(cases):
        path = _write(tmp_path / f"bad{i}.h5", weights, config_text)
        with pytest.raises(error, match=match):
            load_weights(path)
    with h5py.File(tmp_path / "group.h5", "w") as f:
        f.attrs["config"] = text
        f.create_group("model")
    with pytest.raises(ValueError, match="not a dataset"):
        load_weights(tmp_path / "group.h5")
    (tmp_path / "text.h5").write_text("not hdf5")
    with pytest.raises(ValueError, match="HDF5"):
        load_weights(tmp_path / "text.h5")
    with pytest.raises(ValueError, match="does not exist"):
        load_weights(tmp_path / "absent.h5")


def test_param_count_matches_materialized_weights(tiny, tiny_weights):
    assert sum(v.size for v in tiny_weights.values()) == tiny.param_count().total
    assert math.prod(tiny_weights["lm_head.weight"].shape) == tiny.vocab_size * tiny.hidden_size
