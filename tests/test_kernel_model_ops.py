"""Model-op kernels (embedding, RMSNorm, RoPE tables, MLA cache write / query RoPE, MoE routing,
CSR and combine) against reference/model.py.

Tolerances (float32 kernels vs the float64 reference on the same float32 inputs): RMSNorm, kv
norm, RoPE and the MoE combine |err| <= ATOL + RTOL * |ref| with RTOL = 1e-5, ATOL = 1e-5 (a few
float32 roundings of O(1) values); the embedding and every integer output (expert ids, CSR) are
bit-exact.

Routing rule. Selection is computed in float32 on the device and compared with
``reference.model.moe_gate`` run in float64 on the same float32 inputs. Ids must be equal on every
row except where the float64 reference has a *near-tie*: the gap between the last kept and the
first dropped candidate (group scores, then the selection values among the kept groups) lies in
(0, NEAR_TIE); float32 rounding (~1e-6 here) can order such a pair either way. Exact ties (gap 0,
from identical inputs) are not exempt: both sides must resolve them to the lower index.

Simulator tests use tiny shapes (plus kv_lora 512 / rope 64 / H 4 once); ``gpu`` tests run the
small and kimi-k2 shapes on a GPU.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from numba.core import types as nbtypes
import pytest
from numba import cuda

from ddtree_numba.config import ModelConfig
from ddtree_numba.kernels import model_ops as mo
from ddtree_numba.kernels import registry
from reference import model as rm
from reference.weights import init_weights
from sim.launch import launch

RTOL = 1e-5
ATOL = 1e-5
W_RTOL = 1e-5  # routing weights
W_ATOL = 2e-6
NEAR_TIE = 1e-4
TINY = ModelConfig.from_name("tiny")
SENTINEL = np.float32(-7.5)


def _dev(a: np.ndarray):
    return cuda.to_device(np.ascontiguousarray(a))


def _close(actual: np.ndarray, expected: np.ndarray, rtol: float = RTOL, atol: float = ATOL) -> None:
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# --- embedding -------------------------------------------------------------------------------

def test_embed_copies_rows_into_a_view():
    rng = np.random.default_rng(1)
    table = rng.standard_normal((50, 40)).astype(np.float32)
    tokens = np.array([0, 49, 7, 7, 23], np.int32)
    wide = np.full((5, 48), SENTINEL, np.float32)
    d_wide = _dev(wide)
    mo.embed(tokens, _dev(table), d_wide[:, 3:43])
    got = d_wide.copy_to_host()
    assert _same_bits(np.ascontiguousarray(got[:, 3:43]), table[tokens])
    assert np.all(got[:, :3] == SENTINEL) and np.all(got[:, 43:] == SENTINEL)


def test_embed_bad_device_ids_give_nan_rows():
    rng = np.random.default_rng(2)
    table = rng.standard_normal((9, 33)).astype(np.float32)
    out = cuda.device_array((4, 33), np.float32)
    mo.embed(_dev(np.array([-1, 3, 9, 8], np.int32)), _dev(table), out)
    got = out.copy_to_host()
    assert np.all(np.isnan(got[[0, 2]]))
    assert _same_bits(got[[1, 3]], table[[3, 8]])


# --- RMSNorm ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dim, eps", [(1, 1e-6), (37, 1e-6), (300, 1e-2), (2100, 1e-6)])  # 2100: two
def test_rms_norm_matches_reference(dim, eps):                       # batches of ROW_LOADS a lane + a tail
    rng = np.random.default_rng(dim)
    x = (3.0 * rng.standard_normal((3, dim))).astype(np.float32)
    weight = (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
    out = cuda.device_array((3, dim), np.float32)
    mo.rms_norm(_dev(x), _dev(weight), eps, out)
    _close(out.copy_to_host(), rm.rms_norm(x, weight.astype(np.float64), eps))


def _emulate_rms_norm(x, weight, eps):
    """The kernel's documented order in float32 (the simulator rounds a*b and + apart): lane l sums
    x[j]^2 for j = l, l + 32, ... ascending, the 32 partials are added in lane order, rms =
    sqrt(total / D + eps), and each output is x / rms * weight."""
    m_rows, dim = x.shape
    out = np.empty_like(x)
    for m in range(m_rows):
        partial = np.zeros(32, np.float32)
        for j in range(dim):
            partial[j % 32] = np.float32(partial[j % 32] + np.float32(x[m, j] * x[m, j]))
        total = np.float32(0.0)
        for lane in range(32):
            total = np.float32(total + partial[lane])
        rms = np.sqrt(np.float32(total / np.float32(dim) + np.float32(eps)))
        out[m] = x[m] / rms * weight
    return out


@pytest.mark.skipif(not mo.simulator_active(), reason="the GPU fuses a*b + c; the emulation models the simulator")
@pytest.mark.parametrize("dim", [37, 512, 1024, 1056, 2100])
def test_rms_norm_order_is_the_documented_one(dim):
    """The loads batched ROW_LOADS a lane ahead of the sums (whole batches, then one guarded
    partial batch: 37 and 512 have only that) keep the documented order: the bits of a NumPy
    emulation of it, written to a separate output and in place."""
    rng = np.random.default_rng(dim)
    x = (3.0 * rng.standard_normal((2, dim))).astype(np.float32)
    weight = (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
    want = _emulate_rms_norm(x, weight, 1e-6)
    out = cuda.device_array((2, dim), np.float32)
    mo.rms_norm(_dev(x), _dev(weight), 1e-6, out)
    assert _same_bits(out.copy_to_host(), want)
    inplace = _dev(x)
    mo.rms_norm(inplace, _dev(weight), 1e-6, inplace)
    assert _same_bits(inplace.copy_to_host(), want)


def test_rms_norm_view_in_place_batch_and_launch_shape_invariant(monkeypatch):
    """A column slice normed in place equals a separate output, and every row's bits are the
    same alone, in a batch, and with the GPU launch shape (2 blocks of 4 warps)."""
    rng = np.random.default_rng(3)
    dim = 70
    fused = rng.standard_normal((6, 90)).astype(np.float32)
    weight = (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
    d_w = _dev(weight)
    x = np.ascontiguousarray(fused[:, 10:80])
    batch = cuda.device_array((6, dim), np.float32)
    mo.rms_norm(_dev(x), d_w, 1e-6, batch)
    batch = batch.copy_to_host()
    d_fused = _dev(fused)
    view = d_fused[:, 10:80]
    mo.rms_norm(view, d_w, 1e-6, view)  # in place
    got = d_fused.copy_to_host()
    assert _same_bits(np.ascontiguousarray(got[:, 10:80]), batch)
    assert _same_bits(got[:, :10], fused[:, :10]) and _same_bits(got[:, 80:], fused[:, 80:])
    alone = cuda.device_array((1, dim), np.float32)
    mo.rms_norm(_dev(x[4:5]), d_w, 1e-6, alone)
    assert _same_bits(alone.copy_to_host(), batch[4:5])
    monkeypatch.setattr(mo, "simulator_active", lambda: False)
    shaped = cuda.device_array((6, dim), np.float32)
    mo.rms_norm(_dev(x), d_w, 1e-6, shaped)
    assert _same_bits(shaped.copy_to_host(), batch)


# --- RoPE tables -----------------------------------------------------------------------------

@pytest.mark.parametrize("scaling", ["tiny", "none", "amplitude"])
def test_rope_tables_match_reference(scaling):
    config = TINY
    if scaling == "none":
        config = dataclasses.replace(TINY, rope_scaling=None)
    elif scaling == "amplitude":  # mscale != mscale_all_dim: cos / sin carry HF's YaRN amplitude
        config = dataclasses.replace(TINY, rope_scaling={**dataclasses.asdict(TINY.rope_scaling), "mscale": 2.0})
        assert config.rope_mscale != 1.0
    cos, sin = mo.rope_tables(config, 100)
    ref_cos, ref_sin = rm.rope_cos_sin(config, np.arange(100))
    assert cos.dtype == sin.dtype == np.float32 and cos.shape == (100, config.qk_rope_dim // 2)
    assert _same_bits(cos, ref_cos.astype(np.float32)) and _same_bits(sin, ref_sin.astype(np.float32))


def test_rope_tables_bad_arguments():
    with pytest.raises(TypeError, match="config"):
        mo.rope_tables({"qk_rope_dim": 8}, 10)
    with pytest.raises(TypeError, match="capacity"):
        mo.rope_tables(TINY, 10.0)
    for capacity in (0, TINY.max_seq_len + 1):
        with pytest.raises(ValueError, match="capacity"):
            mo.rope_tables(TINY, capacity)


# --- MLA cache write and query RoPE ------------------------------------------------------------

@pytest.mark.parametrize("layout", ["interleaved", "neox"])
def test_mla_ops_match_reference_mla_project(layout):
    """kv_a taken from the fused [q_a | kv_a] output (a view), cache rows scattered into a combined
    [rows, C + R] cache (views), one padding row; query RoPE in place; against mla_project."""
    config = dataclasses.replace(TINY, rope_layout=layout)
    weights = init_weights(config, seed=5)
    prefix = "model.layers.0.self_attn."
    rng = np.random.default_rng(6)
    m, c, r, h = 5, config.kv_lora_rank, config.qk_rope_dim, config.n_heads
    nope, q_lora = config.qk_nope_dim, config.q_lora_rank
    x = rm.rms_norm(rng.standard_normal((m, config.hidden_size)), 1.0, 1e-6).astype(np.float32)
    positions = np.array([0, 3, 3, 77, 255], np.int32)  # a shared position, the last table row
    cos64, sin64 = rm.rope_cos_sin(config, positions.astype(np.int64))
    ref = rm.mla_project(x.astype(np.float64), weights, prefix, config, cos64, sin64)

    fused = np.concatenate([x @ weights[f"{prefix}q_a_proj.weight"].T,
                            x @ weights[f"{prefix}kv_a_proj_with_mqa.weight"].T], axis=1)  # [M, q_lora + C + R]
    cos, sin = mo.rope_tables(config, 256)
    cache_rows = np.array([9, 0, -1, 4, 11], np.int32)
    cache = np.full((12, c + r), SENTINEL, np.float32)
    d_cache, d_fused = _dev(cache), _dev(fused.astype(np.float32))
    mo.mla_kv_write(d_fused[:, q_lora:], _dev(weights[f"{prefix}kv_a_layernorm.weight"]), config.rms_norm_eps,
                    _dev(cos), _dev(sin), positions, cache_rows, d_cache[:, :c], d_cache[:, c:], layout=layout)
    got = d_cache.copy_to_host()
    real = cache_rows >= 0
    _close(got[cache_rows[real], :c], ref.latent[real])
    _close(got[cache_rows[real], c:], ref.k_rope[real])
    untouched = np.setdiff1d(np.arange(12), cache_rows[real])
    assert np.all(got[untouched] == SENTINEL)

    q_low = rm.rms_norm(x.astype(np.float64) @ weights[f"{prefix}q_a_proj.weight"].T.astype(np.float64),
                        weights[f"{prefix}q_a_layernorm.weight"], config.rms_norm_eps)
    q = (q_low @ weights[f"{prefix}q_b_proj.weight"].T).reshape(m, h, nope + r).astype(np.float32)
    d_q = _dev(q)
    mo.mla_q_rope(d_q, _dev(cos), _dev(sin), _dev(positions), d_q[:, :, nope:], layout=layout)
    got_q = d_q.copy_to_host()
    _close(got_q[:, :, nope:], ref.q_rope)
    assert _same_bits(np.ascontiguousarray(got_q[:, :, :nope]), np.ascontiguousarray(q[:, :, :nope]))


def test_mla_ops_kimi_shapes():
    """kv_lora 512, rope 64, 4 heads of nope 128 with Kimi K2's YaRN tables, both layouts."""
    config = ModelConfig.from_name("kimi-k2")
    rng = np.random.default_rng(7)
    m, c, r, nope, h = 2, 512, 64, 128, 4
    cos, sin = mo.rope_tables(config, 4096)
    positions = np.array([4095, 17], np.int32)
    cos64, sin64 = rm.rope_cos_sin(config, positions.astype(np.int64))
    kv = rng.standard_normal((m, c + r)).astype(np.float32)
    norm_w = (1.0 + 0.1 * rng.standard_normal(c)).astype(np.float32)
    q = rng.standard_normal((m, h, nope + r)).astype(np.float32)
    d_cos, d_sin = _dev(cos), _dev(sin)
    for layout in ("interleaved", "neox"):
        latent = cuda.device_array((3, c), np.float32)
        k_rope = cuda.device_array((3, r), np.float32)
        mo.mla_kv_write(_dev(kv), _dev(norm_w), 1e-6, d_cos, d_sin, _dev(positions), _dev(np.array([2, 0], np.int32)),
                        latent, k_rope, layout=layout)
        _close(latent.copy_to_host()[[2, 0]], rm.rms_norm(kv[:, :c], norm_w.astype(np.float64), 1e-6))
        _close(k_rope.copy_to_host()[[2, 0]], rm.apply_rope(kv[:, c:].astype(np.float64), cos64, sin64, layout))
        out = cuda.device_array((m, h, r), np.float32)
        mo.mla_q_rope(_dev(q), d_cos, d_sin, _dev(positions), out, layout=layout)
        _close(out.copy_to_host(), rm.apply_rope(q[:, :, nope:].astype(np.float64), cos64, sin64, layout))


def test_mla_ops_device_guards():
    """Device positions outside the table give NaN RoPE rows (the latent is still written);
    device cache rows past the cache are skipped like padding."""
    rng = np.random.default_rng(8)
    c, r = 6, 4
    cos, sin = mo.rope_tables(TINY, 16)
    cos, sin = _dev(cos[:, :r // 2]), _dev(sin[:, :r // 2])
    kv = rng.standard_normal((3, c + r)).astype(np.float32)
    latent = _dev(np.full((4, c), SENTINEL, np.float32))
    k_rope = _dev(np.full((4, r), SENTINEL, np.float32))
    positions = _dev(np.array([16, -1, 2], np.int32))
    mo.mla_kv_write(_dev(kv), _dev(np.ones(c, np.float32)), 1e-6, cos, sin, positions,
                    _dev(np.array([0, 1, 4], np.int32)), latent, k_rope, layout="neox")
    got_latent, got_rope = latent.copy_to_host(), k_rope.copy_to_host()
    _close(got_latent[:2], rm.rms_norm(kv[:2, :c], 1.0, 1e-6))
    assert np.all(np.isnan(got_rope[:2]))
    assert np.all(got_latent[2:] == SENTINEL) and np.all(got_rope[2:] == SENTINEL)
    out = cuda.device_array((3, 2, r), np.float32)
    mo.mla_q_rope(_dev(rng.standard_normal((3, 2, 5 + r)).astype(np.float32)), cos, sin, positions, out,
                  layout="interleaved")
    got = out.copy_to_host()
    assert np.all(np.isnan(got[:2])) and np.all(np.isfinite(got[2]))


def _rope_case(rng, m: int, h: int, nope: int, c: int, r: int):
    cos, sin = mo.rope_tables(TINY, 32)
    return dict(q=rng.standard_normal((m, h, nope + r)).astype(np.float32),
                kv=rng.standard_normal((m, c + r)).astype(np.float32),
                norm_w=(1.0 + 0.1 * rng.standard_normal(c)).astype(np.float32),
                cos=np.ascontiguousarray(cos[:, :r // 2]), sin=np.ascontiguousarray(sin[:, :r // 2]),
                positions=rng.integers(0, 32, m).astype(np.int32))


@pytest.mark.parametrize("layout", ["interleaved", "neox"])
def test_mla_rope_kv_write_is_the_two_kernels(layout):
    """The engine's one launch: the query RoPE (in place, as the engine calls it) and the cache
    write give the bits of mla_q_rope and mla_kv_write; padding rows (cache row -1) are skipped
    and the other cache rows left as they were."""
    rng = np.random.default_rng(12)
    m, h, nope, c, r = 5, 3, 6, 8, 4
    case = _rope_case(rng, m, h, nope, c, r)
    cache_rows = np.array([3, -1, 0, 6, 2], np.int32)
    d_cos, d_sin, d_pos = _dev(case["cos"]), _dev(case["sin"]), _dev(case["positions"])
    results = []
    for fused in (False, True):
        d_q = _dev(case["q"])
        latent = _dev(np.full((8, c), SENTINEL, np.float32))
        k_rope = _dev(np.full((8, r), SENTINEL, np.float32))
        kv_args = (_dev(case["kv"]), _dev(case["norm_w"]), 1e-6, d_cos, d_sin, d_pos, _dev(cache_rows), latent, k_rope)
        if fused:
            mo.mla_rope_kv_write(d_q, d_q[:, :, nope:], *kv_args, layout=layout)
        else:
            mo.mla_q_rope(d_q, d_cos, d_sin, d_pos, d_q[:, :, nope:], layout=layout)
            mo.mla_kv_write(*kv_args, layout=layout)
        results.append([a.copy_to_host() for a in (d_q, latent, k_rope)])
    for want, got in zip(*results):
        assert _same_bits(got, want)
    q, latent, k_rope = results[1]
    assert np.array_equal(q[:, :, :nope], case["q"][:, :, :nope])      # the nope part untouched
    assert np.all(latent[[1, 4, 5, 7]] == SENTINEL) and np.all(k_rope[[1, 4, 5, 7]] == SENTINEL)
    _close(latent[[3, 0, 6, 2]], rm.rms_norm(case["kv"][[0, 2, 3, 4], :c], case["norm_w"].astype(np.float64), 1e-6))


@pytest.mark.parametrize("name, change", [
    ("q", lambda a: dict(a, q=a["q"][:4])),                       # rows differ from kv_a's
    ("kv_a", lambda a: dict(a, kv_a=a["kv_a"][:, :-1])),          # C + R columns
    ("q_out", lambda a: dict(a, q_out=np.zeros((5, 2, 4), np.float32))),   # heads differ from q's
    ("q_out", lambda a: dict(a, q_out=np.zeros((5, 3, 2), np.float32))),   # rope width differs from k_rope's
    ("positions", lambda a: dict(a, positions=np.full(5, 40, np.int32))),
    ("cache_rows", lambda a: dict(a, cache_rows=np.array([0, 0, 1, 2, 3], np.int32))),
])
def test_mla_rope_kv_write_checks_before_launching(name, change):
    """Both halves' checks run before the one launch: a bad argument names itself and leaves
    every output as it was."""
    rng = np.random.default_rng(13)
    case = _rope_case(rng, 5, 3, 6, 8, 4)
    q_out = np.full((5, 3, 4), SENTINEL, np.float32)
    latent = np.full((8, 8), SENTINEL, np.float32)
    k_rope = np.full((8, 4), SENTINEL, np.float32)
    args = dict(q=case["q"], q_out=q_out, kv_a=case["kv"], kv_norm_weight=case["norm_w"], eps=1e-6,
                cos=case["cos"], sin=case["sin"], positions=case["positions"],
                cache_rows=np.array([3, -1, 0, 6, 2], np.int32), kv_latent=latent, k_rope=k_rope)
    args = change(args)
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        mo.mla_rope_kv_write(**args, layout="neox")
    assert np.all(q_out == SENTINEL) and np.all(latent == SENTINEL) and np.all(k_rope == SENTINEL)


# --- MoE routing -------------------------------------------------------------------------------

def _routing_config(**changes) -> ModelConfig:
    return dataclasses.replace(TINY, **changes)


ROUTING_CASES = {
    "tiny": {},  # sigmoid + bias, 2 groups keep 1, k 2
    "ungrouped": dict(n_routed_experts=12, n_expert_groups=1, n_limited_groups=1, n_activated_experts=3),
    "softmax": dict(score_func="softmax", n_expert_groups=4, n_limited_groups=2, norm_topk_prob=False),
    "sigmoid_no_bias": dict(n_routed_experts=16, n_expert_groups=4, n_limited_groups=2, n_activated_experts=3),
    "k1": dict(n_activated_experts=1, route_scale=1.0),
    # D 600: 37-38 values a thread, past one batch of DOT_LOADS (16 partials a logit)
    "wide": dict(hidden_size=600, score_func="softmax", n_expert_groups=4, n_limited_groups=2),
}


def _route(config, xn, gate_w, bias, grid=False):
    """Run moe_route (``grid``: the expert grid, its counts checked back at zero); returns (ids,
    weights, row_offsets, row_index, slot_of) on the host."""
    m, k, e = xn.shape[0], config.n_activated_experts, config.n_routed_experts
    outs = (cuda.device_array((m, k), np.int32), cuda.device_array((m, k), np.float32),
            cuda.device_array(e + 1, np.int32), cuda.device_array(m * k, np.int32),
            cuda.device_array((m, k), np.int32))
    scratch = _grid_scratch(m, e) if grid else {}
    mo.moe_route(_dev(xn), _dev(gate_w), None if bias is None else _dev(bias), config, *outs, **scratch)
    if grid:
        assert not scratch["counts"].copy_to_host().any()   # zeros again for the next launch
    return tuple(o.copy_to_host() for o in outs)


def _grid_scratch(m: int, e: int) -> dict:
    """The expert grid's caller-owned scratch: logits (any values) and zero counts."""
    return dict(logits=_dev(np.full((m, e), SENTINEL, np.float32)), counts=_dev(np.zeros(m, np.int32)))


def _reference_route(config, xn, gate_w, bias):
    """moe_gate in float64 on the float32 inputs: ids ascending, their weights, and each row's
    near-tie gap (group scores, then the selection values among the kept groups)."""
    x, w = xn.astype(np.float64), gate_w.astype(np.float64)
    b = None if bias is None else bias.astype(np.float64)
    ids, weights = rm.moe_gate(x, w, b, config)
    order = np.argsort(ids, axis=1)
    logits = x @ w.T
    scores = rm.sigmoid(logits) if config.score_func == "sigmoid" else rm.softmax(logits)
    choice = scores if b is None else scores + b
    t, g, k = xn.shape[0], config.n_expert_groups, config.n_activated_experts
    gap = np.full(t, np.inf)
    if g > 1:
        grouped = choice.reshape(t, g, -1)
        group_score = (np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1) if b is not None
                       else grouped.max(axis=-1))  # [T, G]
        ranked = -np.sort(-group_score, axis=1)
        if config.n_limited_groups < g:
            gap = ranked[:, config.n_limited_groups - 1] - ranked[:, config.n_limited_groups]
        kept = np.zeros((t, g), bool)
        np.put_along_axis(kept, np.argsort(-group_score, axis=1, kind="stable")[:, :config.n_limited_groups],
                          True, axis=1)
        choice = np.where(kept[:, :, None], grouped, -np.inf).reshape(t, -1)
    ranked = -np.sort(-choice, axis=1)
    if k < ranked.shape[1]:
        expert_gap = ranked[:, k - 1] - ranked[:, k]
        gap = np.minimum(gap, np.where(np.isfinite(expert_gap), expert_gap, np.inf))
    return np.take_along_axis(ids, order, 1), np.take_along_axis(weights, order, 1), gap


def _expected_csr(ids: np.ndarray, n_experts: int):
    """row_offsets, row_index, slot_of for ids [M, k] (distinct per row): entries by (expert, row)."""
    m, k = ids.shape
    flat = ids.ravel()
    rows = np.repeat(np.arange(m), k)
    order = np.lexsort((rows, flat))
    offsets = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=n_experts))]).astype(np.int32)
    slot_of = np.empty(m * k, np.int32)
    slot_of[order] = np.arange(m * k)
    return offsets, rows[order].astype(np.int32), slot_of.reshape(m, k)


def _check_routing(config, xn, gate_w, bias, allow_near_ties=True, grid=False):
    ids, weights, offsets, row_index, slot_of = _route(config, xn, gate_w, bias, grid)
    ref_ids, ref_w, gap = _reference_route(config, xn, gate_w, bias)
    near = (gap > 0) & (gap < NEAR_TIE)
    if not allow_near_ties:
        assert not near.any(), "the tie-heavy input must have exact ties or clear gaps only"
    assert near.mean() <= 0.25, "too many near-ties for a meaningful comparison"
    ok = ~near
    assert np.array_equal(ids[ok], ref_ids[ok])
    np.testing.assert_allclose(weights[ok], ref_w[ok], rtol=W_RTOL, atol=W_ATOL)
    assert np.all(np.diff(ids, axis=1) > 0)  # ascending expert ids (distinct)
    for got, want in zip((offsets, row_index, slot_of), _expected_csr(ids, config.n_routed_experts)):
        assert np.array_equal(got, want)
    return ids, gap


@pytest.mark.parametrize("grid", [False, True], ids=["rows", "experts"])
@pytest.mark.parametrize("case", sorted(ROUTING_CASES))
def test_moe_route_matches_reference(case, grid):
    config = _routing_config(**ROUTING_CASES[case])
    rng = np.random.default_rng(len(case))
    e, d = config.n_routed_experts, config.hidden_size
    xn = rng.standard_normal((6, d)).astype(np.float32)
    gate_w = (rng.standard_normal((e, d)) / np.sqrt(d)).astype(np.float32)
    with_bias = config.has_gate_bias and case != "sigmoid_no_bias"
    bias = (0.1 * rng.standard_normal(e)).astype(np.float32) if with_bias else None
    _check_routing(config, xn, gate_w, bias, grid=grid)


# One crafted row per case: equal selection values listed before a larger one inside the kept
# groups, so a list that let a later equal value overtake an earlier one would pick differently.
CRAFTED_LOGITS = {
    "tiny": ([0.5, 0.5, 1.0, 0.0, 0.5, 0.5, 1.0, 0.0], [0, 2]),  # groups tie too: group 0 wins
    "sigmoid_no_bias": ([0.5, 0.5, 1.0, 0.0] * 4, [0, 2, 6]),  # four tied groups: 0 and 1 kept
    "softmax": ([0.5, 0.5, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0], [0, 4]),
}


@pytest.mark.parametrize("grid", [False, True], ids=["rows", "experts"])
@pytest.mark.parametrize("case", sorted(CRAFTED_LOGITS))
def test_moe_route_tie_heavy_inputs_are_bit_exact(case, grid):
    """Logits from {0, 1/2, 1} (one-hot rows: exact in float32 and float64), the tiny case's bias
    1/8 on group 0: many exact ties between experts and between groups, every other gap >= 0.0025
    (no negative logits: sigmoid(-a) + sigmoid(a) = 2 sigmoid(0) would make top-2 sums tie only
    up to rounding). All rows must match, lower indices first. Row 0 has every logit 0, row 1 the
    crafted logits."""
    config = _routing_config(**ROUTING_CASES[case])
    rng = np.random.default_rng(11)
    e, d = config.n_routed_experts, config.hidden_size
    crafted, expected = CRAFTED_LOGITS[case]
    gate_w = rng.choice([0.0, 0.5, 1.0], size=(e, d)).astype(np.float32)
    gate_w[:, 0] = crafted
    xn = np.zeros((16, d), np.float32)
    xn[np.arange(1, 16), np.r_[0, rng.integers(1, d, 14)]] = 1.0  # logit = one weight, exactly
    bias = np.repeat(np.float32([0.125, 0.0]), e // 2) if config.has_gate_bias and case == "tiny" else None
    ids, gap = _check_routing(config, xn, gate_w, bias, allow_near_ties=False, grid=grid)
    assert np.count_nonzero(gap == 0) >= 3  # the tie rule decides the selection on several rows
    assert np.array_equal(ids[1], expected)
    if bias is None:
        assert np.array_equal(ids[0], np.arange(config.n_activated_experts))  # all equal: lowest ids


# Tie-heavy routing at more shapes: one group and 4 (keep 2); E = 64, more than the simulator's
# 32-thread block (each thread ranks several experts); k = 1, 4, 8, 32; groups of one expert
# (softmax: a group scores its max). Bias: one value per group (so top-2 sums tie exactly or
# differ by >= 0.006), per expert with one group.
TIE_CASES = {
    "g1_e12_k1": dict(n_routed_experts=12, n_expert_groups=1, n_limited_groups=1, n_activated_experts=1),
    "g1_e64_k8": dict(n_routed_experts=64, n_expert_groups=1, n_limited_groups=1, n_activated_experts=8),
    "g1_e64_k32": dict(n_routed_experts=64, n_expert_groups=1, n_limited_groups=1, n_activated_experts=32),
    "g4_keep2_e16_k4": dict(n_routed_experts=16, n_expert_groups=4, n_limited_groups=2, n_activated_experts=4),
    "g4_keep2_e64_k8": dict(n_routed_experts=64, n_expert_groups=4, n_limited_groups=2, n_activated_experts=8),
    "g16_keep5_softmax": dict(score_func="softmax", n_routed_experts=16, n_expert_groups=16, n_limited_groups=5,
                              n_activated_experts=4),
}


# The expert grid (grid=True) at two of them: 64 experts each a block's loop under the simulator.
@pytest.mark.parametrize("case,with_bias,grid", [(case, with_bias, grid) for case in sorted(TIE_CASES)
                                                  for with_bias in (True, False) for grid in (False, True)
                                                  if with_bias <= ("score_func" not in TIE_CASES[case])
                                                  and (not grid or case in ("g4_keep2_e16_k4", "g1_e64_k8"))])
def test_moe_route_ranks_ties_at_many_shapes(case, with_bias, grid):
    """Logits from {-1000, 0, 1/2, 1} (one-hot rows; sigmoid / softmax of -1000 is exactly +0.0):
    exact ties between experts, between groups and at zero, every other gap >= 0.0025. Every
    row must match the reference (lower indices first); row 0 (every logit 0) without a bias
    picks experts 0..k-1."""
    config = _routing_config(**TIE_CASES[case])
    rng = np.random.default_rng(21)
    e, d, g = config.n_routed_experts, config.hidden_size, config.n_expert_groups
    gate_w = rng.choice([-1000.0, 0.0, 0.5, 1.0], p=[0.2, 0.3, 0.3, 0.2], size=(e, d)).astype(np.float32)
    xn = np.zeros((16, d), np.float32)
    xn[np.arange(1, 16), rng.integers(0, d, 15)] = 1.0  # logit = one weight, exactly
    bias = None
    if with_bias:
        levels = rng.choice([0.0, 0.125], size=g if g > 1 else e)
        bias = np.repeat(levels, e // levels.size).astype(np.float32)
    ids, gap = _check_routing(config, xn, gate_w, bias, allow_near_ties=False, grid=grid)
    assert np.count_nonzero(gap == 0) >= 3  # the tie rule decides the selection on several rows
    if bias is None:
        assert np.array_equal(ids[0], np.arange(config.n_activated_experts))


@pytest.mark.parametrize("grid", [False, True], ids=["rows", "experts"])
@pytest.mark.parametrize("k", [4, 7])
def test_moe_route_nan_scores_rank_last(k, grid):
    """NaN scores (a NaN input row; NaN gate rows for experts 1, 2 and groups 2, 3) rank as -inf:
    a group of them scores -inf, and they are picked only when the kept groups hold fewer than k
    finite values, lowest index first (k = 7: six finite ones). The reference, given those
    experts' bias as -inf instead, picks the same ids; a row picking a NaN score has NaN weights."""
    config = _routing_config(n_routed_experts=16, n_expert_groups=4, n_limited_groups=2, n_activated_experts=k)
    rng = np.random.default_rng(22)
    d = config.hidden_size
    xn = rng.standard_normal((5, d)).astype(np.float32)
    xn[2] = np.nan
    gate_w = (rng.standard_normal((16, d)) / np.sqrt(d)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(16)).astype(np.float32)
    dead = np.r_[1, 2, 8:16]
    gate_w[dead] = np.nan
    ids, weights, *_ = _route(config, xn, gate_w, bias, grid)
    clean_w, dead_bias = gate_w.copy(), bias.copy()
    clean_w[dead], dead_bias[dead] = 0.0, -np.inf
    with np.errstate(invalid="ignore"):  # k = 7: the expert gap is -inf - -inf
        ref_ids, ref_w, gap = _reference_route(config, xn, clean_w, dead_bias)
    live = np.arange(5) != 2
    assert not np.any((gap[live] > 0) & (gap[live] < NEAR_TIE))
    assert np.array_equal(ids[live], ref_ids[live])
    assert np.array_equal(ids[2], np.arange(k))  # all -inf: groups 0, 1 kept, their lowest ids
    nan_rows = ~live | np.isin(ids, dead).any(axis=1)
    assert np.count_nonzero(nan_rows) == (5 if k == 7 else 1)
    assert np.all(np.isnan(weights[nan_rows]))
    np.testing.assert_allclose(weights[~nan_rows], ref_w[~nan_rows], rtol=W_RTOL, atol=W_ATOL)


def test_moe_route_empty_experts():
    """A bias that makes experts 2 and 5 win every row: every other expert gets no entry."""
    config = _routing_config(n_expert_groups=1, n_limited_groups=1)
    rng = np.random.default_rng(12)
    xn = rng.standard_normal((5, config.hidden_size)).astype(np.float32)
    gate_w = (0.1 * rng.standard_normal((8, config.hidden_size))).astype(np.float32)
    bias = np.zeros(8, np.float32)
    bias[[2, 5]] = 4.0
    ids, _ = _check_routing(config, xn, gate_w, bias)
    assert np.all(ids == [2, 5])


@pytest.mark.parametrize("case", ["softmax", "wide"])
def test_moe_route_batch_and_launch_shape_invariant(monkeypatch, case):
    """GPU shapes (one 128-thread block per row, a 128-thread CSR block) give the simulator
    shape's bits, and a row routed alone gives the bits it gets in a batch."""
    config = _routing_config(**ROUTING_CASES[case])
    rng = np.random.default_rng(13)
    xn = rng.standard_normal((3, config.hidden_size)).astype(np.float32)
    gate_w = (rng.standard_normal((8, config.hidden_size)) / 8).astype(np.float32)
    simulated = _route(config, xn, gate_w, None)
    alone = _route(config, xn[1:2], gate_w, None)
    monkeypatch.setattr(mo, "simulator_active", lambda: False)
    batch = _route(config, xn, gate_w, None)
    for a, b in zip(batch, simulated):
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert np.array_equal(alone[0], batch[0][1:2]) and _same_bits(alone[1], batch[1][1:2])
    for loads in (7, 32):   # the gate partials' loads in flight (DOT_LOADS): layout, not numerics
        monkeypatch.setattr(mo, "DOT_LOADS", loads)
        for a, b in zip(_route(config, xn, gate_w, None), simulated):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), loads


@pytest.mark.parametrize("grid", [False, True], ids=["rows", "experts"])
@pytest.mark.parametrize("case", sorted(ROUTING_CASES))
def test_moe_route_one_row_writes_the_csr_launch_s_values(monkeypatch, case, grid):
    """One row (an AR step): the routing block's inline CSR (ROUTE_CSR_INLINE) writes every value
    the CSR launch writes, the same integers, on random, tie-heavy and NaN-score rows."""
    config = _routing_config(**ROUTING_CASES[case])
    rng = np.random.default_rng(17)
    e, d = config.n_routed_experts, config.hidden_size
    gate_w = (rng.standard_normal((e, d)) / 8).astype(np.float32)
    bias = (0.1 * rng.standard_normal(e)).astype(np.float32)
    rows = [rng.standard_normal((1, d)).astype(np.float32),
            rng.integers(-1, 2, (1, d)).astype(np.float32),      # ties: small integers
            np.zeros((1, d), np.float32)]                        # every logit equal
    tie_gate = rng.integers(-1, 2, (e, d)).astype(np.float32)
    nan_gate = gate_w.copy()
    nan_gate[1] = np.nan                                         # a NaN score ranks last
    for xn, gw in zip(rows + rows[:1], [gate_w, tie_gate, gate_w, nan_gate]):
        got = {}
        for inline in (True, False):
            monkeypatch.setattr(mo, "ROUTE_CSR_INLINE", inline)
            outs = tuple(cuda.to_device(np.full(o.shape, -7, o.dtype)) for o in _route_outputs(config, 1))
            launched = []
            with monkeypatch.context() as mp:   # count the launches: one with the CSR inline
                mp.setattr(mo, "launch", lambda kernel, *a, _l=mo.launch: (launched.append(kernel), _l(kernel, *a))[1])
                mo.moe_route(_dev(xn), _dev(gw), _dev(bias), config, *outs, **(_grid_scratch(1, e) if grid else {}))
            assert len(launched) == (1 if inline else 2) and (mo.moe_csr_kernel in launched) is not inline
            got[inline] = [o.copy_to_host() for o in outs]
        for a, b in zip(got[True], got[False]):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
        assert not np.any(got[True][2] == -7) and not np.any(got[True][3] == -7)   # every value written


def _route_outputs(config, m: int) -> tuple:
    k, e = config.n_activated_experts, config.n_routed_experts
    return (cuda.device_array((m, k), np.int32), cuda.device_array((m, k), np.float32),
            cuda.device_array(e + 1, np.int32), cuda.device_array(m * k, np.int32),
            cuda.device_array((m, k), np.int32))


@pytest.mark.parametrize("case", ["softmax", "wide"])
@pytest.mark.parametrize("rows", [3, 1])
def test_moe_route_with_its_rmsnorm_is_the_two_launches(monkeypatch, case, rows):
    """x and norm_weight given: the routing launch writes xn = rms_norm(x) before its gate reads
    it. xn and every routing output are the bits of rms_norm then moe_route, at the simulator's
    launch shape and at the GPU's (a block a row: its first warp normalises, the rest wait); one
    row (an AR step) in one launch, its CSR written by the routing block (ROUTE_CSR_NORM_LOADS
    loads a lane in its RMSNorm: the same bits)."""
    config = _routing_config(**ROUTING_CASES[case])
    rng = np.random.default_rng(14)
    d = config.hidden_size
    x = rng.standard_normal((rows, d)).astype(np.float32)
    norm_w = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    gate_w = (rng.standard_normal((8, d)) / 8).astype(np.float32)
    bias = (0.01 * rng.standard_normal(8)).astype(np.float32)
    for gpu_shape in (False, True):
        if gpu_shape:
            monkeypatch.setattr(mo, "simulator_active", lambda: False)
        xn = cuda.device_array((rows, d), np.float32)
        mo.rms_norm(_dev(x), _dev(norm_w), 1e-6, xn)
        want = [xn.copy_to_host(), *_route(config, xn.copy_to_host(), gate_w, bias)]
        fused_xn = _dev(np.full((rows, d), SENTINEL, np.float32))
        outs = _route_outputs(config, rows)
        launched = []
        with monkeypatch.context() as mp:
            mp.setattr(mo, "launch", lambda kernel, *a, _l=mo.launch: (launched.append(kernel), _l(kernel, *a))[1])
            mo.moe_route(fused_xn, _dev(gate_w), _dev(bias), config, *outs, x=_dev(x), norm_weight=_dev(norm_w),
                         eps=1e-6)
        assert len(launched) == (1 if rows == 1 else 2)
        got = [fused_xn.copy_to_host(), *(o.copy_to_host() for o in outs)]
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _route_grid_all(config, x, norm_w, gate_w, bias):
    """The expert grid with its RMSNorm: (xn, logits, ids, weights, row_offsets, row_index, slot_of)
    on the host, the counts checked back at zero."""
    m, d, e = x.shape[0], config.hidden_size, config.n_routed_experts
    xn = _dev(np.full((m, d), SENTINEL, np.float32))
    outs = _route_outputs(config, m)
    scratch = _grid_scratch(m, e)
    mo.moe_route(xn, _dev(gate_w), _dev(bias), config, *outs, x=_dev(x), norm_weight=_dev(norm_w),
                 eps=config.rms_norm_eps, **scratch)
    assert not scratch["counts"].copy_to_host().any()
    return (xn.copy_to_host(), scratch["logits"].copy_to_host(), *(o.copy_to_host() for o in outs))


@pytest.mark.parametrize("rows", [3, 1])
def test_moe_route_grid_launch_shapes_and_batches_give_the_same_bits(monkeypatch, rows):
    """The expert grid's results do not depend on its launch: the simulator's one block (the lane
    sums as a shared-memory tree) against a block per (expert, row) of 64 threads (the warps'
    butterflies, 8 lanes a thread, the row's last block selecting), every output the same bits,
    xn and the logits too; at hidden 600 (2 values a lane, zeros past 600) also 32-thread blocks
    (16 lanes a thread) and 3 blocks a row looping over the experts (as a many-row launch's) in a
    grid of 2 rows looping over the rows. A row routed alone gets its bits in the batch. At one
    row also tiny's 64 (448 of the 512 lanes zeros: the simulator's tree skips their groups) and
    hidden 4096 (8 values a lane, the most it takes)."""
    configs = [_routing_config(**ROUTING_CASES["wide"])]
    if rows == 1:   # tiny's hidden, and MAX_ROUTE_LOADS values a lane (hidden 4096), the most it takes
        configs += [_routing_config(**ROUTING_CASES["tiny"]),
                    _routing_config(hidden_size=mo.ROUTE_LANES * mo.MAX_ROUTE_LOADS, n_routed_experts=4,
                                    n_expert_groups=1, n_limited_groups=1)]
    for config in configs:
        rng = np.random.default_rng(23)
        d, e = config.hidden_size, config.n_routed_experts
        x = rng.standard_normal((rows, d)).astype(np.float32)
        norm_w = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
        gate_w = (rng.standard_normal((e, d)) / 8).astype(np.float32)
        bias = (0.01 * rng.standard_normal(e)).astype(np.float32)
        want = _route_grid_all(config, x, norm_w, gate_w, bias)
        assert np.isfinite(want[1]).all() and not (want[0] == SENTINEL).any()
        with monkeypatch.context() as mp:
            mp.setattr(mo, "simulator_active", lambda: False)
            # (64, 3, 2): 3 blocks a row each looping over experts, a grid of 2 rows looping over rows
            shapes = ((64, None, None), (32, None, None), (64, 3, 2)) if config is configs[0] else ((64, None, None),)
            for threads, blocks, grid_y in shapes:
                mp.setattr(mo, "ROUTE_GRID_THREADS", threads)
                if blocks:
                    mp.setattr(mo, "route_grid_blocks", lambda n_experts, m, sm_count: blocks)
                    mp.setattr(mo, "MAX_GRID_Y", grid_y)
                for got, ref in zip(_route_grid_all(config, x, norm_w, gate_w, bias), want):
                    assert _same_bits(got, ref), (threads, blocks)
        alone = _route_grid_all(config, x[-1:], norm_w, gate_w, bias)
        for got, ref in zip(alone[:4], want[:4]):
            assert _same_bits(got, ref[-1:])


@pytest.mark.parametrize("case", ["wide", "softmax"])
def test_moe_route_grid_rmsnorm_matches_reference_and_routes_its_own_rows(case):
    """The expert grid's RMSNorm is within RTOL / ATOL of the float64 reference, its logits within
    the same of xn · gate_w (float64 on the written xn), and the routing of the written xn (no
    RMSNorm: the same values feed the same lane chains) gives every output's bits; the routing
    itself matches the reference on the written xn (near-tie rule)."""
    config = _routing_config(**ROUTING_CASES[case])
    rng = np.random.default_rng(24)
    d, e = config.hidden_size, config.n_routed_experts
    x = rng.standard_normal((5, d)).astype(np.float32)
    norm_w = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    gate_w = (rng.standard_normal((e, d)) / np.sqrt(d)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(e)).astype(np.float32)
    xn, logits, *outs = _route_grid_all(config, x, norm_w, gate_w, bias)
    _close(xn, rm.rms_norm(x, norm_w.astype(np.float64), config.rms_norm_eps))
    _close(logits, xn.astype(np.float64) @ gate_w.T.astype(np.float64))
    for got, want in zip(outs, _route(config, xn, gate_w, bias, grid=True)):
        assert _same_bits(got, want)
    _check_routing(config, xn, gate_w, bias, grid=True)


@pytest.mark.parametrize("name, change, exc", [
    ("logits", lambda a: dict(a, counts=None), ValueError),                  # one without the other
    ("logits", lambda a: dict(a, logits=a["logits"][:2]), ValueError),
    ("logits", lambda a: dict(a, logits=a["logits"].astype(np.float64)), TypeError),
    ("counts", lambda a: dict(a, counts=a["counts"].astype(np.int64)), TypeError),
    ("counts", lambda a: dict(a, counts=a["counts"][:2]), ValueError),
    ("config", lambda a: dict(a, config=dataclasses.replace(TINY, hidden_size=512 * 8 + 4)), ValueError),
])
def test_moe_route_grid_arguments_are_checked_first(name, change, exc):
    """The expert grid's scratch (both or neither, shapes, dtypes) and its hidden-size bound are
    checked before any launch: no output written."""
    args = change(dict(config=_routing_config(**ROUTING_CASES["tiny"]),
                       logits=np.zeros((3, 8), np.float32), counts=np.zeros(3, np.int32)))
    config = args.pop("config")
    xn = np.full((3, config.hidden_size), SENTINEL, np.float32)
    outs = tuple(np.full(o.shape, -7, o.dtype) for o in _route_outputs(TINY, 3))
    with pytest.raises(exc, match=rf"^{name}\b"):
        mo.moe_route(xn, np.ones((8, config.hidden_size), np.float32), None, config, *outs, **args)
    assert np.all(xn == SENTINEL) and all(np.all(o == -7) for o in outs)


@pytest.mark.parametrize("name, change", [
    ("x", lambda a: dict(a, norm_weight=None)),                         # one without the other
    ("x", lambda a: dict(a, x=a["x"][:2])),                              # rows differ from xn's
    ("norm_weight", lambda a: dict(a, norm_weight=a["norm_weight"][:-1])),
    ("eps", lambda a: dict(a, eps=0.0)),
])
def test_moe_route_rmsnorm_arguments_are_checked_first(name, change):
    config = _routing_config(**ROUTING_CASES["softmax"])
    rng = np.random.default_rng(15)
    d = config.hidden_size
    xn = np.full((3, d), SENTINEL, np.float32)
    args = change(dict(x=rng.standard_normal((3, d)).astype(np.float32), norm_weight=np.ones(d, np.float32),
                       eps=1e-6))
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        mo.moe_route(xn, np.ones((8, d), np.float32), None, config, *_route_outputs(config, 3), **args)
    assert np.all(xn == SENTINEL)


def test_csr_kernel_over_several_chunks():
    """300 rows (two CSR chunks of 256), 20 experts of which some empty, k = 3."""
    rng = np.random.default_rng(14)
    m, k, e = 300, 3, 20
    ids = np.stack([np.sort(rng.choice(np.r_[0:6, 9:17], k, replace=False)) for _ in range(m)]).astype(np.int32)
    outs = (cuda.device_array(e + 1, np.int32), cuda.device_array(m * k, np.int32), cuda.device_array((m, k), np.int32))
    launch(mo.moe_csr_kernel, 1, mo.SIM_THREADS, 0, 0, _dev(ids), *outs)
    for got, want in zip(outs, _expected_csr(ids, e)):
        assert np.array_equal(got.copy_to_host(), want)


# --- MoE combine -------------------------------------------------------------------------------

def test_moe_pipeline_matches_reference_moe():
    """route -> expert FFNs per CSR entry (on the host, standing in for expert_linear) -> combine,
    against reference.model.moe for the tiny model's MoE layer, residual added."""
    config = TINY
    weights = init_weights(config, seed=15)
    prefix = "model.layers.1.mlp."
    rng = np.random.default_rng(16)
    m, d, k = 5, config.hidden_size, config.n_activated_experts
    xn = rm.rms_norm(rng.standard_normal((m, d)), 1.0, 1e-6).astype(np.float32)
    residual = rng.standard_normal((m, d)).astype(np.float32)
    ids, weights_k, offsets, row_index, slot_of = _route(config, xn, weights[f"{prefix}gate.weight"],
                                                         weights[f"{prefix}gate.e_score_correction_bias"])

    def ffn(rows, name):
        mats = (weights[f"{prefix}{name}.{p}_proj.weight"].astype(np.float64) for p in ("gate", "up", "down"))
        return rm.swiglu_ffn(xn[rows].astype(np.float64), *mats)

    expert_out = np.zeros((m * k, d), np.float32)
    for e in range(config.n_routed_experts):
        seg = slice(offsets[e], offsets[e + 1])
        if offsets[e + 1] > offsets[e]:
            expert_out[seg] = ffn(row_index[seg], f"experts.{e}")
    shared = ffn(np.arange(m), "shared_experts").astype(np.float32)
    d_x = _dev(residual)
    mo.moe_combine(d_x, _dev(expert_out), _dev(slot_of), _dev(weights_k), _dev(shared), d_x)  # in place
    expected = residual + rm.moe(xn.astype(np.float64), weights, prefix, config)
    _close(d_x.copy_to_host(), expected)


def test_moe_combine_order_views_and_guards():
    """No shared expert, x / out as views; the sum is over slots in order; a device slot outside
    [0, M·k) gives a NaN row."""
    rng = np.random.default_rng(17)
    m, k, d = 3, 2, 10
    x = rng.standard_normal((m, d + 4)).astype(np.float32)
    expert_out = rng.standard_normal((m * k, d)).astype(np.float32)
    slot_of = np.array([[5, 0], [1, 2], [3, 4]], np.int32)
    topk_w = rng.random((m, k)).astype(np.float32)
    d_x = _dev(x)
    out = cuda.device_array((m, d), np.float32)
    mo.moe_combine(d_x[:, 4:], _dev(expert_out), slot_of, topk_w, None, out)
    expected = x[:, 4:].astype(np.float64) + np.einsum("ms,msd->md", topk_w, expert_out[slot_of])
    _close(out.copy_to_host(), expected)
    bad = _dev(np.array([[0, 1], [2, 6], [3, -1]], np.int32))
    mo.moe_combine(d_x[:, 4:], _dev(expert_out), bad, _dev(topk_w), None, out)
    got = out.copy_to_host()
    assert np.all(np.isfinite(got[0])) and np.all(np.isnan(got[1:]))


# --- argument checks ---------------------------------------------------------------------------

def _valid_args():
    """Valid host arguments for every wrapper (tiny shapes)."""
    rng = np.random.default_rng(18)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    cos, sin = mo.rope_tables(TINY, 8)
    m, k, e, d = 2, 2, 8, TINY.hidden_size
    return {
        "embed": dict(tokens=np.array([1, 2], np.int32), table=f32(5, 4), out=f32(2, 4)),
        "rms_norm": dict(x=f32(2, 6), weight=f32(6), eps=1e-6, out=f32(2, 6)),
        "mla_kv_write": dict(kv_a=f32(2, 12), kv_norm_weight=f32(4), eps=1e-6, cos=cos, sin=sin,
                             positions=np.array([0, 7], np.int32), cache_rows=np.array([1, -1], np.int32),
                             kv_latent=f32(3, 4), k_rope=f32(3, 8), layout="neox"),
        "mla_q_rope": dict(q=f32(2, 3, 10), cos=cos, sin=sin, positions=np.array([0, 1], np.int32),
                           out=f32(2, 3, 8), layout="interleaved"),
        "moe_route": dict(xn=f32(m, d), gate_w=f32(e, d), bias=f32(e), config=TINY,
                          topk_ids=np.zeros((m, k), np.int32), topk_w=f32(m, k),
                          row_offsets=np.zeros(e + 1, np.int32), row_index=np.zeros(m * k, np.int32),
                          slot_of=np.zeros((m, k), np.int32)),
        "moe_combine": dict(x=f32(m, 4), expert_out=f32(m * k, 4), slot_of=np.array([[0, 1], [2, 3]], np.int32),
                            topk_w=f32(m, k), shared_out=f32(m, 4), out=f32(m, 4)),
    }


BAD_INPUTS = [
    ("embed", "tokens", np.array([1, 2], np.int64), TypeError),
    ("embed", "tokens", np.array([1, 5], np.int32), ValueError),
    ("embed", "tokens", np.zeros(0, np.int32), ValueError),
    ("embed", "table", np.zeros((5, 4), np.float64), TypeError),
    ("embed", "out", np.zeros((3, 4), np.float32), ValueError),
    ("embed", "out", np.zeros((2, 8), np.float32)[:, ::2], ValueError),
    ("rms_norm", "x", np.zeros((2, 6), np.float16), TypeError),
    ("rms_norm", "x", np.zeros((0, 6), np.float32), ValueError),
    ("rms_norm", "weight", np.zeros(5, np.float32), ValueError),
    ("rms_norm", "eps", 0.0, ValueError),
    ("rms_norm", "eps", "1e-6", TypeError),
    ("rms_norm", "out", np.zeros((2, 6, 1), np.float32), ValueError),
    ("mla_kv_write", "kv_a", np.zeros((2, 11), np.float32), ValueError),
    ("mla_kv_write", "kv_norm_weight", np.zeros(5, np.float32), ValueError),
    ("mla_kv_write", "cos", np.zeros((8, 3), np.float32), ValueError),
    ("mla_kv_write", "sin", np.zeros((7, 4), np.float32), ValueError),
    ("mla_kv_write", "positions", np.array([0, 8], np.int32), ValueError),
    ("mla_kv_write", "positions", np.array([0, 1], np.int64), TypeError),
    ("mla_kv_write", "cache_rows", np.array([3, -1], np.int32), ValueError),
    ("mla_kv_write", "cache_rows", np.array([1, 1], np.int32), ValueError),
    ("mla_kv_write", "k_rope", np.zeros((4, 8), np.float32), ValueError),
    ("mla_kv_write", "layout", "rotary", ValueError),
    ("mla_kv_write", "layout", 0, TypeError),
    ("mla_q_rope", "q", np.zeros((2, 3, 7), np.float32), ValueError),
    ("mla_q_rope", "out", np.zeros((2, 3, 7), np.float32), ValueError),
    ("mla_q_rope", "positions", np.array([0, -1], np.int32), ValueError),
    ("moe_route", "config", "tiny", TypeError),
    ("moe_route", "config", dataclasses.replace(TINY, n_routed_experts=1024, n_expert_groups=1, n_limited_groups=1),
     ValueError),
    ("moe_route", "xn", np.zeros((2, 63), np.float32), ValueError),
    ("moe_route", "gate_w", np.zeros((7, 64), np.float32), ValueError),
    ("moe_route", "bias", np.zeros(8, np.float64), TypeError),
    ("moe_route", "bias", np.full(8, np.nan, np.float32), ValueError),
    ("moe_route", "topk_ids", np.zeros((2, 3), np.int32), ValueError),
    ("moe_route", "topk_w", np.zeros((2, 2), np.int32), TypeError),
    ("moe_route", "row_offsets", np.zeros(8, np.int32), ValueError),
    ("moe_route", "row_index", np.zeros(5, np.int32), ValueError),
    ("moe_route", "slot_of", np.zeros((2, 2), np.int64), TypeError),
    ("moe_combine", "x", np.zeros((2, 4), np.int32), TypeError),
    ("moe_combine", "expert_out", np.zeros((3, 4), np.float32), ValueError),
    ("moe_combine", "slot_of", np.array([[0, 1], [2, 4]], np.int32), ValueError),
    ("moe_combine", "topk_w", np.zeros((2, 3), np.float32), ValueError),
    ("moe_combine", "shared_out", np.zeros((2, 5), np.float32), ValueError),
    ("moe_combine", "out", np.zeros((2, 4), np.float64), TypeError),
]


@pytest.mark.parametrize("func, arg, value, exc", BAD_INPUTS,
                         ids=[f"{f}-{a}-{i}" for i, (f, a, _, _) in enumerate(BAD_INPUTS)])
def test_bad_inputs_raise_naming_the_argument(func, arg, value, exc):
    args = _valid_args()[func]
    before = {name: v.copy() for name, v in args.items() if isinstance(v, np.ndarray)}
    args[arg] = value
    with pytest.raises(exc, match=arg):
        getattr(mo, func)(**args)
    for name, v in before.items():  # nothing half-written
        if name != arg:
            assert np.array_equal(args[name], v, equal_nan=True)


def test_kernels_are_registered():
    names = {"embed_rows", "rms_norm_rows", "mla_kv_write", "mla_q_rope", "mla_rope_kv_write", "moe_route",
             "moe_route_norm", "moe_route_nobias", "moe_route_norm_nobias", "moe_route_csr", "moe_combine",
             "moe_combine_noshared", "moe_route_grid_l4_norm", "moe_route_grid_l4_norm_csr1", "moe_route_grid_l4"}
    for name in names:
        spec = registry.get(name)
        assert spec.signatures and spec.block_threads is not None
        for signature in spec.signatures:   # a GPU launch cannot pass None (sim.launch rejects it)
            assert all(t != nbtypes.none for t in signature), (name, signature)
    assert registry.get("moe_route").kernel is mo.moe_route_kernel(False, True)
    assert registry.get("moe_route_norm_nobias").kernel is mo.moe_route_kernel(True, False)
    assert registry.get("moe_combine_noshared").kernel is mo.moe_combine_kernel(False)
    assert mo.route_grid_loads(ModelConfig.from_name("small").hidden_size) == 4   # the engine's expert grid
    assert registry.get("moe_route_grid_l4_norm_csr1").kernel is \
        mo.moe_route_grid_kernel(True, True, True, mo.ROUTE_GRID_THREADS, 4)
    assert mo.route_grid_loads(ModelConfig.from_name("kimi-k2").hidden_size) > mo.MAX_ROUTE_LOADS   # the row layout


# --- GPU (real shapes) ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["small", "kimi-k2"])
def test_gpu_real_shapes(preset):
    """At the preset's shapes: RMSNorm, kv write, query RoPE, routing in both layouts (near-tie rule)
    + CSR and the combine against the reference; every op's rows bit-identical when launched alone."""
    config = ModelConfig.from_name(preset)
    rng = np.random.default_rng(19)
    m, d, e, k = 96, config.hidden_size, config.n_routed_experts, config.n_activated_experts
    c, r, h, nope = config.kv_lora_rank, config.qk_rope_dim, config.n_heads, config.qk_nope_dim
    x = rng.standard_normal((m, d)).astype(np.float32)
    w = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    out = cuda.device_array((m, d), np.float32)
    mo.rms_norm(_dev(x), _dev(w), config.rms_norm_eps, out)
    normed = out.copy_to_host()
    _close(normed, rm.rms_norm(x, w.astype(np.float64), config.rms_norm_eps))
    one = cuda.device_array((1, d), np.float32)
    mo.rms_norm(_dev(x[37:38]), _dev(w), config.rms_norm_eps, one)
    assert _same_bits(one.copy_to_host(), normed[37:38])

    cos, sin = mo.rope_tables(config, 8192)
    positions = rng.integers(0, 8192, m).astype(np.int32)
    cos64, sin64 = rm.rope_cos_sin(config, positions.astype(np.int64))
    kv = rng.standard_normal((m, c + r)).astype(np.float32)
    norm_w = (1.0 + 0.1 * rng.standard_normal(c)).astype(np.float32)
    cache_rows = rng.permutation(2 * m)[:m].astype(np.int32)
    latent = cuda.device_array((2 * m, c), np.float32)
    k_rope = cuda.device_array((2 * m, r), np.float32)
    mo.mla_kv_write(_dev(kv), _dev(norm_w), config.rms_norm_eps, _dev(cos), _dev(sin), _dev(positions),
                    _dev(cache_rows), latent, k_rope, layout=config.rope_layout)
    _close(latent.copy_to_host()[cache_rows], rm.rms_norm(kv[:, :c], norm_w.astype(np.float64), config.rms_norm_eps))
    _close(k_rope.copy_to_host()[cache_rows], rm.apply_rope(kv[:, c:].astype(np.float64), cos64, sin64,
                                                            config.rope_layout))
    q = rng.standard_normal((m, h, nope + r)).astype(np.float32)
    q_out = cuda.device_array((m, h, r), np.float32)
    mo.mla_q_rope(_dev(q), _dev(cos), _dev(sin), _dev(positions), q_out, layout=config.rope_layout)
    _close(q_out.copy_to_host(), rm.apply_rope(q[:, :, nope:].astype(np.float64), cos64, sin64, config.rope_layout))
    fused_q = cuda.device_array((m, h, r), np.float32)     # the engine's one launch: the same bits
    fused_latent = cuda.device_array((2 * m, c), np.float32)
    fused_rope = cuda.device_array((2 * m, r), np.float32)
    mo.mla_rope_kv_write(_dev(q), fused_q, _dev(kv), _dev(norm_w), config.rms_norm_eps, _dev(cos), _dev(sin),
                         _dev(positions), _dev(cache_rows), fused_latent, fused_rope, layout=config.rope_layout)
    assert _same_bits(fused_q.copy_to_host(), q_out.copy_to_host())
    assert _same_bits(fused_latent.copy_to_host()[cache_rows], latent.copy_to_host()[cache_rows])
    assert _same_bits(fused_rope.copy_to_host()[cache_rows], k_rope.copy_to_host()[cache_rows])

    gate_w = (rng.standard_normal((e, d)) / np.sqrt(d)).astype(np.float32)
    bias = (0.01 * rng.standard_normal(e)).astype(np.float32)
    ids, _ = _check_routing(config, normed, gate_w, bias)
    alone = _route(config, normed[5:6], gate_w, bias)
    batch = _route(config, normed, gate_w, bias)
    assert np.array_equal(alone[0], ids[5:6]) and _same_bits(alone[1], batch[1][5:6])
    fused_xn = _dev(np.full((m, d), SENTINEL, np.float32))   # the RMSNorm inside the routing launch
    outs = (cuda.device_array((m, k), np.int32), cuda.device_array((m, k), np.float32),
            cuda.device_array(e + 1, np.int32), cuda.device_array(m * k, np.int32), cuda.device_array((m, k), np.int32))
    mo.moe_route(fused_xn, _dev(gate_w), _dev(bias), config, *outs, x=_dev(x), norm_weight=_dev(w),
                 eps=config.rms_norm_eps)
    assert _same_bits(fused_xn.copy_to_host(), normed)
    for got, want in zip(outs, batch):
        assert np.array_equal(got.copy_to_host().view(np.uint32), want.view(np.uint32))

    # the expert grid (the engine's routing at small's shapes): its RMSNorm against the reference, its
    # routing of its own xn (near-tie rule, CSR), the same bits without the RMSNorm, and a row alone
    # (E blocks a row) as in the batch of 96 (a few blocks a row, each looping over experts)
    if mo.route_grid_loads(d) <= mo.MAX_ROUTE_LOADS:   # small (kimi-k2's hidden keeps the row layout)
        grid = _route_grid_all(config, x, w, gate_w, bias)
        _close(grid[0], rm.rms_norm(x, w.astype(np.float64), config.rms_norm_eps))
        _check_routing(config, grid[0], gate_w, bias, grid=True)
        for got, want in zip(_route(config, grid[0], gate_w, bias, grid=True), grid[2:]):
            assert _same_bits(got, want)
        for got, want in zip(_route_grid_all(config, x[5:6], w, gate_w, bias)[:4], grid[:4]):
            assert _same_bits(got, want[5:6])

    _, weights_k, _, _, slot_of = batch
    expert_out = rng.standard_normal((m * k, d)).astype(np.float32)
    shared = rng.standard_normal((m, d)).astype(np.float32)
    combined = cuda.device_array((m, d), np.float32)
    mo.moe_combine(_dev(x), _dev(expert_out), _dev(slot_of), _dev(weights_k), _dev(shared), combined)
    expected = x + (np.einsum("ms,msd->md", weights_k.astype(np.float64), expert_out[slot_of]) + shared)
    _close(combined.copy_to_host(), expected, atol=1e-4)
