"""The DFlash drafter on the device (engine/dflash.py) and its kernels (kernels/draft_attention.py).

Simulator tests use a micro drafter (D = 16, 2 layers, GQA 2/1 heads of 8, block 3, V = 24) so
that a round costs ~1-2 s under the simulator (the batch-invariant linear kernel simulates at a
few ms per output column); one test runs the dflash-tiny preset on tiny's tables. Tolerance
against the float64 reference (reference/dflash.py): |engine - reference| <= 2e-5 · max(1,
max|reference|) under the simulator (measured ~2e-7), 1e-3 · max(1, max|reference|) on a GPU at
dflash-small shapes (FP32 sums over K = 4096 and fused multiply-adds). Batch invariance is bitwise.
``gpu`` tests run the dflash-small preset on an H200 (skipped under the simulator).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from numba import cuda

from ddtree_numba.config import ModelConfig
from ddtree_numba.engine.dflash import DFlashDrafter, device_layouts
from ddtree_numba.kernels import draft_attention as da
from reference.dflash import DFlashConfig, DraftSession, gqa_attention, init_weights, rope_cos_sin
from reference.model import apply_rope, rms_norm
from reference.weights import init_weights as init_target_weights

SIM_TOL = 2e-5
GPU_TOL = 1e-3
MICRO = DFlashConfig(hidden_size=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, intermediate=16,
                     block_size=3, n_target_layers=2, target_layer_ids=(0, 1), mask_token_id=23)
MICRO_VOCAB = 24


def _close(got: np.ndarray, ref: np.ndarray, tol: float) -> None:
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol * max(1.0, float(np.abs(ref).max())))


def _tables(vocab: int, d: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((vocab, d)).astype(np.float32),
            (rng.standard_normal((vocab, d)) / np.sqrt(d)).astype(np.float32))


def _drafter(cfg, weights, embed, lm_head, bs, kv_capacity, prompt_capacity) -> DFlashDrafter:
    return DFlashDrafter(cfg, weights, embed=cuda.to_device(embed), lm_head=cuda.to_device(lm_head),
                         batch_size=bs, kv_capacity=kv_capacity, prompt_capacity=prompt_capacity)


def _random_accept(rng, n_nodes: int, block: int) -> np.ndarray:
    m = int(rng.integers(1, block + 1))
    return np.r_[0, np.sort(rng.choice(np.arange(1, n_nodes), m - 1, replace=False))].astype(np.int32)


def _run_rounds(drafter: DFlashDrafter, plan: dict, rows: list[int], n_rounds: int | None = None) -> list[np.ndarray]:
    """Drive ``drafter`` through the first ``n_rounds`` rounds of ``plan`` (all by default) for the
    requests ``rows`` of it; the logits of each draft."""
    bs, width = len(rows), drafter.config.block_size
    feats = plan["prompt"][rows]
    drafter.begin(cuda.to_device(feats), cuda.to_device(plan["prompt_lens"][rows]))
    start = plan["prompt_lens"][rows].copy()
    out = []
    for rnd in plan["rounds"][:n_rounds]:
        out.append(drafter.draft(cuda.to_device(rnd["bonus"][rows]), cuda.to_device(start)).copy_to_host())
        accepted = np.full((bs, width), -1, np.int32)
        lengths = np.zeros(bs, np.int32)
        for i, r in enumerate(rows):
            acc = rnd["accepted"][r]
            accepted[i, :len(acc)] = acc
            lengths[i] = len(acc)
        drafter.commit(cuda.to_device(rnd["verify"][rows]), cuda.to_device(accepted), cuda.to_device(lengths))
        start = start + lengths
    return out


def _make_plan(cfg: DFlashConfig, vocab: int, prompt_lens: list[int], n_prompt: int, n_rounds: int,
               n_nodes: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    bs = len(prompt_lens)
    rounds = [dict(bonus=rng.integers(0, vocab, bs).astype(np.int32),
                   verify=rng.standard_normal((bs, n_nodes, cfg.feature_dim)).astype(np.float32),
                   accepted=[_random_accept(rng, n_nodes, cfg.block_size) for _ in range(bs)])
              for _ in range(n_rounds)]
    return dict(prompt=rng.standard_normal((bs, n_prompt, cfg.feature_dim)).astype(np.float32),
                prompt_lens=np.array(prompt_lens, np.int32), rounds=rounds)


def _reference_rounds(cfg, weights, embed, lm_head, plan, b) -> list[np.ndarray]:
    session = DraftSession(weights, cfg, embed, lm_head)
    session.begin(plan["prompt"][b, :plan["prompt_lens"][b]])
    start, out = int(plan["prompt_lens"][b]), []
    for rnd in plan["rounds"]:
        out.append(session.draft(int(rnd["bonus"][b]), start))
        session.commit(rnd["verify"][b], rnd["accepted"][b])
        start += len(rnd["accepted"][b])
    return out


# --------------------------------------------------------------------------- the drafter


@pytest.fixture(scope="module")
def micro():
    weights = init_weights(MICRO, seed=4)
    embed, lm_head = _tables(MICRO_VOCAB, MICRO.hidden_size, 5)
    plan = _make_plan(MICRO, MICRO_VOCAB, [3, 6], n_prompt=6, n_rounds=3, n_nodes=5, seed=6)
    drafter = _drafter(MICRO, weights, embed, lm_head, 2, 16, 6)
    batched = _run_rounds(drafter, plan, [0, 1])
    return SimpleNamespace(weights=weights, embed=embed, lm_head=lm_head, plan=plan, batched=batched)


def test_drafter_matches_reference_over_rounds(micro):
    """Three rounds with accepted-index carry, two requests with different prompt lengths."""
    for b in range(2):
        ref = _reference_rounds(MICRO, micro.weights, micro.embed, micro.lm_head, micro.plan, b)
        for got, want in zip(micro.batched, ref):
            assert got.shape == (2, MICRO.horizon, MICRO_VOCAB)
            _close(got[b], want, SIM_TOL)


def test_batch_of_two_equals_each_alone_bitwise(micro):
    """Each request alone over the first two rounds (one accepted-index carry) = its batch row, bit for bit."""
    for b in range(2):
        alone = _run_rounds(_drafter(MICRO, micro.weights, micro.embed, micro.lm_head, 1, 16, 6), micro.plan, [b], 2)
        assert len(alone) == 2
        for got, want in zip(micro.batched, alone):
            np.testing.assert_array_equal(got[b], want[0])


def test_tiny_preset_on_tiny_tables():
    """dflash-tiny with the tiny target's embedding and lm_head: begin, then one draft."""
    cfg = DFlashConfig.from_name("dflash-tiny")
    tiny = ModelConfig.from_name("tiny")
    cfg.check_target(tiny)
    target = init_target_weights(tiny, seed=0)
    embed, lm_head = target["model.embed_tokens.weight"], target["lm_head.weight"]
    weights = init_weights(cfg, seed=1)
    plan = _make_plan(cfg, tiny.vocab_size, [5], n_prompt=5, n_rounds=1, n_nodes=4, seed=2)
    got = _run_rounds(_drafter(cfg, weights, embed, lm_head, 1, 24, 5), plan, [0])
    for g, want in zip(got, _reference_rounds(cfg, weights, embed, lm_head, plan, 0)):
        _close(g[0], want, SIM_TOL)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the simulator computes on the NaN rows
def test_round_mismatch_poisons_only_that_request(micro):
    """A device start that disagrees with the ingested context gives NaN logits for that request."""
    drafter = _drafter(MICRO, micro.weights, micro.embed, micro.lm_head, 2, 16, 6)
    plan = micro.plan
    drafter.begin(cuda.to_device(plan["prompt"]), cuda.to_device(plan["prompt_lens"]))
    start = plan["prompt_lens"] + np.array([0, 1], np.int32)
    logits = drafter.draft(cuda.to_device(plan["rounds"][0]["bonus"]), cuda.to_device(start)).copy_to_host()
    np.testing.assert_array_equal(logits[0], micro.batched[0][0])
    assert np.isnan(logits[1]).all()


def test_drafter_rejects_bad_inputs(micro):
    drafter = _drafter(MICRO, micro.weights, micro.embed, micro.lm_head, 2, 16, 6)
    f = MICRO.feature_dim
    cases = [
        (lambda: drafter.begin(np.zeros((2, 7, f), np.float32), np.array([3, 3], np.int32)), ValueError, "features"),
        (lambda: drafter.begin(np.zeros((2, 6, f)), np.array([3, 3], np.int32)), TypeError, "features"),
        (lambda: drafter.begin(np.zeros((2, 6, f), np.float32), np.array([0, 3], np.int32)), ValueError,
         "prompt_lens"),
        (lambda: drafter.begin(np.zeros((2, 6, f), np.float32), np.array([3], np.int32)), ValueError, "prompt_lens"),
        (lambda: drafter.draft(np.array([1, 2], np.int64), np.array([3, 3], np.int32)), TypeError, "bonus"),
        (lambda: drafter.draft(np.array([1, MICRO_VOCAB], np.int32), np.array([3, 3], np.int32)), ValueError,
         "bonus"),
        (lambda: drafter.draft(np.array([1, 2], np.int32), np.array([3, 17], np.int32)), ValueError, "start"),
        (lambda: drafter.draft(np.array([1, 2, 3], np.int32), np.array([3, 3], np.int32)), ValueError, "bonus"),
        (lambda: drafter.commit(np.zeros((2, 4, f), np.float32), np.array([[1, 2], [0, 1]], np.int32),
                                np.array([2, 2], np.int32)), ValueError, "accepted"),
        (lambda: drafter.commit(np.zeros((2, 4, f), np.float32), np.array([[0, 1], [0, 1]], np.int32),
                                np.array([2, 0], np.int32)), ValueError, "lengths"),
        (lambda: drafter.commit(np.zeros((2, 4, f), np.float32), np.array([[0, 4], [0, 1]], np.int32),
                                np.array([2, 2], np.int32)), ValueError, "index"),
        (lambda: drafter.commit(np.zeros((2, 4, 3), np.float32), np.zeros((2, 2), np.int32),
                                np.ones(2, np.int32)), ValueError, "features"),
        (lambda: DFlashDrafter(MICRO, micro.weights, embed=micro.embed, lm_head=micro.lm_head, batch_size=1,
                               kv_capacity=4, prompt_capacity=4), TypeError, "embed"),
        (lambda: DFlashDrafter(MICRO, micro.weights, embed=cuda.to_device(micro.embed[:20]),
                               lm_head=cuda.to_device(micro.lm_head[:20]), batch_size=1, kv_capacity=4,
                               prompt_capacity=4), ValueError, "mask_token_id"),
        (lambda: DFlashDrafter(MICRO, micro.weights, embed=cuda.to_device(micro.embed),
                               lm_head=cuda.to_device(micro.lm_head[:, :8].copy()), batch_size=1,
                               kv_capacity=4, prompt_capacity=4), ValueError, "lm_head"),
        (lambda: DFlashDrafter(MICRO, micro.weights, embed=cuda.to_device(micro.embed),
                               lm_head=cuda.to_device(micro.lm_head), batch_size=0, kv_capacity=4,
                               prompt_capacity=4), ValueError, "batch_size"),
    ]
    for call, exc, name in cases:
        with pytest.raises(exc, match=name):
            call()


def test_random_picks_the_preset_and_checks_the_capture():
    tiny = ModelConfig.from_name("tiny")
    target = init_target_weights(tiny, seed=0)
    device = SimpleNamespace(embed=cuda.to_device(target["model.embed_tokens.weight"]),
                             lm_head=cuda.to_device(target["lm_head.weight"]))
    model = SimpleNamespace(weights=device, capture_layers=(0, 1), kv_capacity=20, max_rows=8)
    drafter = DFlashDrafter.random(tiny, model, 2, seed=7)
    assert drafter.config == DFlashConfig.from_name("dflash-tiny")
    assert (drafter.horizon, drafter.feature_layers, drafter.kv_capacity, drafter.prompt_capacity) == (3, (0, 1), 20, 8)
    layouts = device_layouts(drafter.config, init_weights(drafter.config, 7))
    np.testing.assert_array_equal(drafter.w["gate_up"].copy_to_host(), layouts["gate_up"])
    with pytest.raises(ValueError, match="capture"):
        DFlashDrafter.random(tiny, SimpleNamespace(**{**vars(model), "capture_layers": (1,)}), 2, seed=7)
    with pytest.raises(ValueError, match="preset"):
        DFlashDrafter.random(ModelConfig.from_name("kimi-k2"), model, 2, seed=7)


def test_device_layouts_fuse_in_kernel_order(micro):
    lay = device_layouts(MICRO, micro.weights)
    w = micro.weights
    kv = 2 * MICRO.n_kv_heads * MICRO.head_dim
    np.testing.assert_array_equal(lay["kv_all"][kv + kv // 2:2 * kv], w["layers.1.self_attn.v_proj.weight"])
    np.testing.assert_array_equal(lay["gate_up"][0, MICRO.intermediate:], w["layers.0.mlp.up_proj.weight"])
    np.testing.assert_array_equal(lay["k_norm"][1], w["layers.1.self_attn.k_norm.weight"])


# --------------------------------------------------------------------------- attention kernel


def _attention_reference(q, kv_block, cache_k, cache_v, lens, scale) -> np.ndarray:
    out = np.empty(q.shape)
    for b in range(q.shape[0]):
        k = np.concatenate([cache_k[b, :lens[b]], kv_block[b, :, 0]]).astype(np.float64)
        v = np.concatenate([cache_v[b, :lens[b]], kv_block[b, :, 1]]).astype(np.float64)
        out[b] = gqa_attention(q[b].astype(np.float64), k, v, scale)
    return out


def _attention_inputs(rng, bs, t, h, hkv, hd, s):
    f = np.float32
    return (rng.standard_normal((bs, t, h, hd)).astype(f), rng.standard_normal((bs, t, 2, hkv, hd)).astype(f),
            rng.standard_normal((bs, s, hkv, hd)).astype(f), rng.standard_normal((bs, s, hkv, hd)).astype(f))


@pytest.mark.parametrize("t, h, hkv, hd, lens, config", [
    (4, 4, 2, 16, [0, 21], None),  # no cache; keys over two chunks of 16
    (3, 6, 2, 8, [12, 13], None),  # 9 queries per group: a second, partial tile
    (5, 2, 1, 8, [3, 11], da.AttentionConfig(head_dim=8, queries=4, chunk=8, threads=32)),  # chunk boundary at 16
])
def test_attention_matches_reference(t, h, hkv, hd, lens, config):
    rng = np.random.default_rng(t * 100 + h)
    q, kvb, ck, cv = _attention_inputs(rng, 2, t, h, hkv, hd, 24)
    lens = np.array(lens, np.int32)
    got = da.draft_attention(q, kvb, ck, cv, lens, hd ** -0.5, config=config)
    _close(got, _attention_reference(q, kvb, ck, cv, lens, hd ** -0.5), 1e-6)


def test_attention_is_batch_invariant_and_guards_lengths():
    rng = np.random.default_rng(1)
    q, kvb, ck, cv = _attention_inputs(rng, 2, 3, 4, 2, 8, 20)
    both = da.draft_attention(q, kvb, ck, cv, np.array([7, 19], np.int32), 8 ** -0.5)
    alone = da.draft_attention(q[1:], kvb[1:], ck[1:], cv[1:], np.array([19], np.int32), 8 ** -0.5)
    np.testing.assert_array_equal(both[1], alone[0])
    p = da.plan(2, 3, 4, 2, 8, 20)
    out = cuda.device_array(q.shape, np.float32)
    da.run(p, cuda.to_device(q), cuda.to_device(kvb), cuda.to_device(ck), cuda.to_device(cv),
           cuda.to_device(np.array([7, 21], np.int32)), 8 ** -0.5, out)  # device length past S
    host = out.copy_to_host()
    np.testing.assert_array_equal(host[0], both[0])
    assert np.isnan(host[1]).all()


def test_attention_rejects_bad_inputs():
    rng = np.random.default_rng(2)
    q, kvb, ck, cv = _attention_inputs(rng, 1, 3, 4, 2, 8, 6)
    lens = np.array([2], np.int32)
    p = da.plan(1, 3, 4, 2, 8, 6)
    out = np.zeros_like(q)
    bad_cache = ck.copy()
    bad_cache[0, 1, 0, 0] = np.nan
    cases = [
        (lambda: da.run(p, q.astype(np.float64), kvb, ck, cv, lens, 0.3, out), TypeError, "q"),
        (lambda: da.run(p, q, kvb[:, :2], ck, cv, lens, 0.3, out), ValueError, "kv_block"),
        (lambda: da.run(p, q, kvb, ck, cv, np.array([7], np.int32), 0.3, out), ValueError, "cache_lens"),
        (lambda: da.run(p, q, kvb, ck, cv, lens.astype(np.int64), 0.3, out), TypeError, "cache_lens"),
        (lambda: da.run(p, q, kvb, bad_cache, cv, lens, 0.3, out), ValueError, "cache_k"),
        (lambda: da.run(p, q, kvb, ck, cv, lens, 0.0, out), ValueError, "scale"),
        (lambda: da.run(p, q, kvb, ck, cv, lens, 0.3, out[:, :, :, :4]), ValueError, "out"),
        (lambda: da.run("plan", q, kvb, ck, cv, lens, 0.3, out), TypeError, "p"),
        (lambda: da.plan(1, 3, 4, 3, 8, 6), ValueError, "n_kv_heads"),
        (lambda: da.plan(1, 3, 4, 2, 8, 6, config=da.default_config(16)), ValueError, "config"),
        (lambda: da.AttentionConfig(head_dim=8, queries=8, chunk=16, threads=48).validate(), ValueError, "config"),
        (lambda: da.AttentionConfig(head_dim=512, queries=16, chunk=32, threads=128).validate(), ValueError,
         "config"),
    ]
    for call, exc, name in cases:
        with pytest.raises(exc, match=name):
            call()


# --------------------------------------------------------------------------- input kernels


def test_norm_rope_and_context_kv_write_match_reference():
    rng = np.random.default_rng(3)
    bs, t, h, hkv, hd, n_l, s = 2, 3, 4, 2, 8, 2, 12
    cfg = MICRO
    cos, sin = (a.astype(np.float32) for a in rope_cos_sin(cfg, np.arange(s + t)))
    q = rng.standard_normal((bs, t, h, hd)).astype(np.float32)
    kvb = rng.standard_normal((bs, t, 2, hkv, hd)).astype(np.float32)
    qw, kw = (1 + 0.1 * rng.standard_normal((2, hd))).astype(np.float32)
    start = np.array([2, 9], np.int32)
    q_out, kv_out = q.copy(), kvb.copy()
    da.norm_rope(q_out, kv_out, qw, kw, cos, sin, start, 1e-6)
    for b in range(bs):
        c64, s64 = rope_cos_sin(cfg, np.arange(start[b], start[b] + t))
        _close(q_out[b], apply_rope(rms_norm(q[b], qw, 1e-6), c64, s64, "neox"), 1e-6)
        _close(kv_out[b, :, 0], apply_rope(rms_norm(kvb[b, :, 0], kw, 1e-6), c64, s64, "neox"), 1e-6)
    np.testing.assert_array_equal(kv_out[:, :, 1], kvb[:, :, 1])  # values untouched

    kv_ctx = rng.standard_normal((bs, 4, n_l, 2, hkv, hd)).astype(np.float32)
    kws = (1 + 0.1 * rng.standard_normal((n_l, hd))).astype(np.float32)
    cache_k = np.full((n_l, bs, s, hkv, hd), 7.0, np.float32)
    cache_v = cache_k.copy()
    base, counts = np.array([1, 8], np.int32), np.array([3, 4], np.int32)
    da.context_kv_write(kv_ctx.copy(), kws, cos, sin, base, counts, cache_k, cache_v, 1e-6)
    for b in range(bs):
        rows = slice(base[b], base[b] + counts[b])
        c64, s64 = rope_cos_sin(cfg, np.arange(base[b], base[b] + counts[b]))
        for layer in range(n_l):
            want = apply_rope(rms_norm(kv_ctx[b, :counts[b], layer, 0], kws[layer], 1e-6), c64, s64, "neox")
            _close(cache_k[layer, b, rows], want, 1e-6)
            np.testing.assert_array_equal(cache_v[layer, b, rows], kv_ctx[b, :counts[b], layer, 1])
        outside = np.ones(s, bool)
        outside[rows] = False
        assert (cache_k[:, b, outside] == 7.0).all() and (cache_v[:, b, outside] == 7.0).all()
    with pytest.raises(ValueError, match="start"):
        da.norm_rope(q, kvb, qw, kw, cos, sin, np.array([2, 13], np.int32), 1e-6)
    with pytest.raises(ValueError, match="base"):
        da.context_kv_write(kv_ctx, kws, cos, sin, np.array([1, 9], np.int32), counts, cache_k, cache_v, 1e-6)
    with pytest.raises(TypeError, match="k_weight"):
        da.context_kv_write(kv_ctx, kws.astype(np.float64), cos, sin, base, counts, cache_k, cache_v, 1e-6)


def test_gather_embed_and_lengths_with_device_guards():
    rng = np.random.default_rng(4)
    src = rng.standard_normal((2, 5, 6)).astype(np.float32)
    index = np.array([[0, 2, 4], [0, 1, -1]], np.int32)
    dst = np.zeros((2, 3, 6), np.float32)
    counts_out = np.zeros(2, np.int32)
    da.gather_rows(src, index, np.array([3, 2], np.int32), dst, counts_out)
    np.testing.assert_array_equal(dst[0], src[0, [0, 2, 4]])
    np.testing.assert_array_equal(dst[1, :2], src[1, :2])
    assert (dst[1, 2] == 0).all() and list(counts_out) == [3, 2]
    d_dst = cuda.to_device(np.zeros((2, 3, 6), np.float32))
    d_counts = cuda.to_device(np.zeros(2, np.int32))
    da.gather_rows(cuda.to_device(src), cuda.to_device(np.array([[0, 9, 1], [0, 1, 2]], np.int32)),
                   cuda.to_device(np.array([2, 4], np.int32)), d_dst, d_counts)  # bad index; count > J
    host = d_dst.copy_to_host()
    assert np.isnan(host[0, 1]).all() and (host[1] == 0).all() and list(d_counts.copy_to_host()) == [2, -1]
    with pytest.raises(ValueError, match="counts"):
        da.gather_rows(src, index, np.array([3, 4], np.int32), dst, counts_out)
    with pytest.raises(ValueError, match="index"):
        da.gather_rows(src, np.array([[0, 5, 1], [0, 1, 2]], np.int32), np.array([2, 2], np.int32), dst, counts_out)

    table = rng.standard_normal((10, 4)).astype(np.float32)
    out = np.zeros((2, 3, 4), np.float32)
    da.block_embed(table, np.array([3, 9], np.int32), np.array([4, 6], np.int32), np.array([4, 6], np.int32), 7, out)
    np.testing.assert_array_equal(out[:, 0], table[[3, 9]])
    np.testing.assert_array_equal(out[:, 1:], np.broadcast_to(table[7], (2, 2, 4)))
    d_out = cuda.to_device(out)
    da.block_embed(cuda.to_device(table), cuda.to_device(np.array([3, 9], np.int32)),
                   cuda.to_device(np.array([4, 5], np.int32)), cuda.to_device(np.array([4, 6], np.int32)), 7, d_out)
    host = d_out.copy_to_host()
    np.testing.assert_array_equal(host[0], out[0])
    assert np.isnan(host[1]).all()
    with pytest.raises(ValueError, match="start"):
        da.block_embed(table, np.array([3, 9], np.int32), np.array([4, 5], np.int32), np.array([4, 6], np.int32),
                       7, out)
    with pytest.raises(ValueError, match="mask_token"):
        da.block_embed(table, np.array([3, 9], np.int32), np.array([4, 6], np.int32), np.array([4, 6], np.int32),
                       10, out)

    lens = cuda.to_device(np.array([3, 5, 2], np.int32))  # device arrays: lens is both output and base
    counts = cuda.to_device(np.array([2, 4, -1], np.int32))
    da.context_lengths(lens, lens, counts, 8, clear=True)
    assert list(lens.copy_to_host()) == [5, -1, -1] and list(counts.copy_to_host()) == [0, 0, 0]
    with pytest.raises(TypeError, match="clear"):
        da.context_lengths(lens, lens, counts, 8, clear=1)


# --------------------------------------------------------------------------- GPU (dflash-small shapes)


@pytest.mark.gpu
def test_gpu_small_preset_matches_reference_and_is_batch_invariant():
    cfg = DFlashConfig.from_name("dflash-small")
    small = ModelConfig.from_name("small")
    weights = init_weights(cfg, seed=1)
    embed, lm_head = _tables(small.vocab_size, cfg.hidden_size, 2)
    plan = _make_plan(cfg, small.vocab_size, [300, 517], n_prompt=517, n_rounds=3, n_nodes=33, seed=3)
    batched = _run_rounds(_drafter(cfg, weights, embed, lm_head, 2, 1024, 517), plan, [0, 1])
    alone = _run_rounds(_drafter(cfg, weights, embed, lm_head, 1, 1024, 517), plan, [1])
    for b in range(2):
        for got, want in zip(batched, _reference_rounds(cfg, weights, embed, lm_head, plan, b)):
            _close(got[b], want, GPU_TOL)
    for got, want in zip(batched, alone):
        np.testing.assert_array_equal(got[1], want[0])


@pytest.mark.gpu
def test_gpu_attention_at_qwen3_heads():
    rng = np.random.default_rng(9)
    q, kvb, ck, cv = _attention_inputs(rng, 3, 16, 16, 4, 128, 2100)
    lens = np.array([0, 1000, 2100], np.int32)
    got = da.draft_attention(q, kvb, ck, cv, lens, 128 ** -0.5)
    _close(got, _attention_reference(q, kvb, ck, cv, lens, 128 ** -0.5), 1e-5)
