"""Small-tree attention launches (verify_attention.get_tree_kernels: a B 32 tree's verify): the same
bits as the one-launch kernels (which tests/test_kernel_verify_attention.py checks against the
reference, and a tree node against the AR step of its path), for one, two and four k-groups, random
trees and chains, tie-heavy inputs, key counts around the chunk and pass edges, padding nodes
(zeros), a request the guards reject and a path past ``max_path`` (NaN); the layout knobs; the plan's
choice and its workspace; on the GPU at Kimi K2's heads and dims (the engine's 33-node tile)."""
import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from ddtree_numba.engine.model import _small_tile_config
from ddtree_numba.kernels import verify_attention as va
from reference import pack_visibility

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_kernel_verify_attention import TILED, TINY, _batch, _reference, _same_bits  # noqa: E402

ENGINE_TINY = _small_tile_config(32, 8, 4)   # the tiny preset's tiling: 4 heads, chunks of 16, one k-group
# the one launch in the score-first layout with the dead-key skip (the engine's 33-node tile's kernel)
SCORE_FIRST = dataclasses.replace(TILED, score_keys=32, skip_dead_keys=True)
CONFIGS = [TINY, TILED, ENGINE_TINY, SCORE_FIRST]
IDS = ["two-groups", "four-groups", "engine-tiny", "score-first"]


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    """Score blocks of 8 x 8 (the engine's 64 x 32 is layout: the simulator runs a thread a Python
    thread) and any batch (TREE_SPLIT_MAX_BATCH is a speed rule: lifted so batches are checked)."""
    monkeypatch.setattr(va, "TREE_SCORE_ROWS", 8)
    monkeypatch.setattr(va, "TREE_SCORE_KEYS", 8)
    monkeypatch.setattr(va, "TREE_SPLIT_MAX_BATCH", 8)


def _both(inputs: dict, cfg: va.TileConfig, heads: int, scale: float = 0.3, s: int | None = None,
          device_lengths: bool = False):
    """(out, lse) of the two tree launches and of the one launch, on poisoned outputs; the kernels
    launched by the first."""
    return [_launch(inputs, cfg, heads, split, scale, s, device_lengths) for split in (True, False)]


def _launch(inputs: dict, cfg: va.TileConfig, heads: int, split: bool, scale: float = 0.3, s: int | None = None,
            device_lengths: bool = False):
    """(out, lse) of the two tree launches (``split``: the kernels launched checked to be
    get_tree_kernels') or of the one launch (checked to launch others), on poisoned outputs."""
    bs, tc = inputs["q_latent"].shape[:2]
    s = inputs["kv_latent"].shape[1] if s is None else s
    packed = dict(inputs, visibility=pack_visibility(inputs["visibility"]))
    dev = {k: cuda.to_device(np.ascontiguousarray(v)) for k, v in packed.items()}
    kernels = []
    saved, launch = va.TREE_SPLIT, va.launch
    try:
        va.TREE_SPLIT = split
        p = va.plan(bs, tc, heads, s, latent_dim=cfg.latent_dim, rope_dim=cfg.rope_dim, split_size=va.DEFAULT_SPLIT_SIZE,
                    config=cfg)
        assert p.tree_split is split and p.merge_free
        out = cuda.to_device(np.full((bs, tc, heads, cfg.latent_dim), 7.0, np.float32))
        lse = cuda.to_device(np.full((bs, tc, heads), 7.0, np.float32))
        ws = cuda.to_device(np.full(p.workspace_shape, 7.0, np.float32))
        va.launch = lambda kernel, *a, **k: (kernels.append(kernel), launch(kernel, *a, **k))  # noqa: E731
        lengths = (dev["past_lens"], dev["tree_sizes"]) if device_lengths else (
            packed["past_lens"], packed["tree_sizes"])
        va.run(p, dev["q_latent"], dev["q_rope"], dev["kv_latent"], dev["k_rope"], *lengths, dev["visibility"],
               scale, out, lse, ws)
    finally:
        va.TREE_SPLIT, va.launch = saved, launch
    tree_kernels = list(va.get_tree_kernels(cfg, heads)[:2])
    assert (kernels == tree_kernels) is split and kernels
    return out.copy_to_host(), lse.copy_to_host()


def _clean(inputs: dict) -> dict:
    """Stale cache rows past each request as zeros (the host checks reject NaN in rows they read)."""
    return dict(inputs, kv_latent=np.nan_to_num(inputs["kv_latent"]), k_rope=np.nan_to_num(inputs["k_rope"]))


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
@pytest.mark.parametrize("past, size, tc, chain", [
    (0, 5, 6, False),      # no cached rows, a padding node
    (13, 9, 9, False),     # keys across a chunk edge
    (20, 7, 8, True),      # a chain: paths up to 7
    (15, 16, 16, False),   # the first tree key on a chunk's last position (position 15)
    (54, 12, 12, True),    # past 2 x TREE_PASS (32) positions: the deepest nodes' keys in three passes of
                           # probabilities and value rows (the middle one loaded a pass ahead, loading the next)
])
def test_tree_launches_match_the_one_launch(cfg, past, size, tc, chain):
    heads = 4 if cfg is ENGINE_TINY else 2
    rng = np.random.default_rng(past * 100 + size)
    inputs, _ = _batch(rng, cfg, heads, [past], [size], tc, past + tc + 3, chain)
    (out2, lse2), (out1, lse1) = _both(_clean(inputs), cfg, heads)
    assert _same_bits(out2, out1) and _same_bits(lse2, lse1)
    assert np.isfinite(out2[0, :size]).all() and not out2[0, size:].any() and not lse2[0, size:].any()


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_tree_launches_ties_batches_padding_and_bad_requests(cfg):
    """Tie-heavy scores (equal maxima, exact sums) over four requests of different sizes: an idle
    slot (size 0: zeros), one whose rows pass the cache (device lengths, past + size > S: NaN for
    its live nodes, zeros past them) and two live ones; against the reference too."""
    heads = 4 if cfg is ENGINE_TINY else 2
    rng = np.random.default_rng(7)
    s = 40
    inputs, _ = _batch(rng, cfg, heads, [33, 0, 5, 30], [5, 0, 4, 6], 6, s)
    for name in ("q_latent", "q_rope", "kv_latent", "k_rope"):
        inputs[name] = rng.integers(-1, 2, inputs[name].shape).astype(np.float32)
    inputs["past_lens"][3] = 36        # 36 + 6 > S = 40: the guards reject it
    (out2, lse2), (out1, lse1) = _both(inputs, cfg, heads, device_lengths=True)
    assert _same_bits(out2, out1) and _same_bits(lse2, lse1)
    assert not out2[1].any() and not lse2[1].any()
    assert np.isnan(out2[3]).all() and np.isnan(lse2[3]).all()
    assert not out2[2, 4:].any() and not out2[0, 5:].any()
    live = {k: v[[0, 2]] for k, v in inputs.items()}
    live["past_lens"] = inputs["past_lens"][[0, 2]]
    ref_out, ref_lse = _reference(live, 0.3)
    for i, (b, size) in enumerate(((0, 5), (2, 4))):
        rel = np.linalg.norm(out2[b, :size] - ref_out[i, :size]) / np.linalg.norm(ref_out[i, :size])
        assert rel <= 1e-5


@pytest.mark.parametrize("past, size, tc, chain, ties", [(13, 9, 9, False, False), (54, 12, 12, True, False),
                                                      (13, 9, 9, False, True)])
def test_tree_launches_with_one_dim_runs(past, size, tc, chain, ties):
    """k_slice 2 over 2 k-groups: a lane's dims one at a time and the scores' staging one float a
    move (k_slice not a whole float4; every preset's tiles take float4s): the one launch's bits
    across a chunk's edge and past TREE_PASS positions, random and tie-heavy (equal maxima)."""
    cfg = dataclasses.replace(TINY, k_slice=2)
    rng = np.random.default_rng(past + 1)
    inputs, _ = _batch(rng, cfg, 2, [past], [size], tc, past + tc + 3, chain)
    if ties:
        for name in ("q_latent", "q_rope", "kv_latent", "k_rope"):
            inputs[name] = rng.integers(-1, 2, inputs[name].shape).astype(np.float32)
    (out2, lse2), (out1, lse1) = _both(_clean(inputs), cfg, 2)
    assert _same_bits(out2, out1) and _same_bits(lse2, lse1)
    assert np.isfinite(out2[0, :size]).all() and not out2[0, size:].any()


def test_tree_wider_than_a_visibility_word_and_single_nodes():
    """Tc = 40 (two visibility words: ranks across word 32 in the path table), a request of one node
    and one of none, in one batch."""
    rng = np.random.default_rng(5)
    inputs, _ = _batch(rng, TINY, 2, [9, 20, 4], [37, 1, 0], 40, 60, chain=False)
    (out2, lse2), (out1, lse1) = _both(_clean(inputs), TINY, 2)
    assert _same_bits(out2, out1) and _same_bits(lse2, lse1)
    assert np.isfinite(out2[0, :37]).all() and np.isfinite(out2[1, :1]).all() and not out2[2].any()


def test_tree_root_equals_the_one_node_launches():
    """A tree's root (it sees the prefix and itself) gives the bits of the AR step's two launches
    (decode_split) on the same rows."""
    rng = np.random.default_rng(9)
    inputs, _ = _batch(rng, TILED, 2, [21], [5], 5, 30)
    (out2, lse2), _ = _both(_clean(inputs), TILED, 2)
    root = {k: v[:, :1] if k in ("q_latent", "q_rope") else v for k, v in _clean(inputs).items()}
    root["tree_sizes"] = np.ones(1, np.int32)
    root["visibility"] = pack_visibility(np.ones((1, 1, 1), bool))
    p = va.plan(1, 1, 2, 30, latent_dim=TILED.latent_dim, rope_dim=TILED.rope_dim, config=TILED)
    assert p.decode_split
    out = cuda.device_array((1, 1, 2, TILED.latent_dim), np.float32)
    lse = cuda.device_array((1, 1, 2), np.float32)
    va.run(p, *(cuda.to_device(np.ascontiguousarray(root[k])) for k in ("q_latent", "q_rope", "kv_latent",
                                                                       "k_rope", "past_lens", "tree_sizes",
                                                                       "visibility")),
           0.3, out, lse, p.allocate_workspace())
    assert _same_bits(out.copy_to_host()[0, 0], out2[0, 0]) and _same_bits(lse.copy_to_host()[0, 0], lse2[0, 0])


def test_tree_path_past_max_path_gives_nan():
    """A chain longer than max_path: its deep nodes NaN (device lengths: no host check), the
    shallow ones as the one launch."""
    cfg = dataclasses.replace(TINY, max_path=4)
    rng = np.random.default_rng(3)
    inputs, _ = _batch(rng, cfg, 2, [9], [6], 6, 20, chain=True)
    (out2, lse2), (out1, lse1) = _both(_clean(inputs), cfg, 2, device_lengths=True)
    assert _same_bits(out2, out1) and _same_bits(lse2, lse1)
    assert np.isnan(out2[0, 4:]).all() and np.isfinite(out2[0, :4]).all()


# 4 staging moves a 16-dim slice row, one k-group: score blocks of 3 or 6 threads then leave the
# staging lanes (TPR a row) not dividing a row's moves or the block (guards that 2-move rows never reach)
WIDE_SLICE = va.TileConfig(latent_dim=32, rope_dim=16, heads=4, chunk=8, k_slice=16, k_groups=1, qk_rows=1,
                           qk_keys=1, pv_rows=1, pv_dims=4, v_slice=8, max_path=16, merge_threads=32)


@pytest.mark.parametrize("rows, keys", [
    (12, 8),   # 6 threads, 4 lanes a row: 2 idle
    (12, 4),   # 3 threads: a second column pass, past the slice for 2 of its lanes
    (4, 4),    # 1 thread: 4 column passes
])
def test_tree_scores_staging_lanes_and_guards(monkeypatch, rows, keys):
    """The scores launch's staging on fixed lanes (TPR lanes a row, ROW_STEP rows at once) where the
    block's threads and a row's moves do not divide each other: the one launch's bits."""
    monkeypatch.setattr(va, "TREE_SCORE_ROWS", rows)
    monkeypatch.setattr(va, "TREE_SCORE_KEYS", keys)
    rng = np.random.default_rng(5)
    inputs, _ = _batch(rng, WIDE_SLICE, 4, [13, 4], [6, 3], 6, 21)
    (out2, lse2), (out1, lse1) = _both(_clean(inputs), WIDE_SLICE, 4)
    assert _same_bits(out2, out1) and _same_bits(lse2, lse1)
    assert np.isfinite(out2[0, :6]).all() and np.isfinite(out2[1, :3]).all()


TREE_LAYOUTS = [
    dict(TREE_SCORE_ROWS=4, TREE_SCORE_KEYS=4),      # one thread tile a k-group lane
    dict(TREE_SCORE_ROWS=16, TREE_SCORE_KEYS=12),    # 12 keys: 3 key tiles, rows not a power of two
    dict(TREE_PV_HEADS=1, TREE_PV_DIMS=4),           # one head and 4 dims a P·V block
    dict(TREE_PV_HEADS=2, TREE_PV_DIMS=2),           # scalar value staging (2 dims)
    dict(TREE_PASS=8),                               # a pass of one chunk
    dict(TREE_PV_HEADS=64, TREE_PV_DIMS=4),          # 64 heads on 32 threads: lse in a loop (a 2-node tree)
    dict(TREE_SCORE_TILE=2),                         # 2 x 2 score tiles (rows and keys: the fixture's 8 x 8)
    dict(TREE_SCORE_TILE=8, TREE_SCORE_ROWS=16, TREE_SCORE_KEYS=16),   # 8 x 8 tiles, 2 x 2 of them a k-group
]


def test_tree_layouts_keep_the_bits(monkeypatch):
    """Every layout knob in TREE_LAYOUTS gives the one launch's bits; each is read at
    get_tree_kernels' call, so a changed setting builds its own kernels (the cached ones keep their
    geometry). The one launch reads no knob: its bits for each input set (2 heads, a 7-node tree;
    64 heads, a 2-node tree) are computed once for every layout."""
    one = {}
    for knobs in TREE_LAYOUTS:
        with monkeypatch.context() as patch:
            before = va.get_tree_kernels(TILED, 2)
            for name, value in knobs.items():
                patch.setattr(va, name, value)
            assert va.get_tree_kernels(TILED, 2) is not before, knobs
            heads, past, size = (2, 23, 7) if knobs.get("TREE_PV_HEADS", 0) < 64 else (64, 3, 2)
            rng = np.random.default_rng(11)
            inputs, _ = _batch(rng, TILED, heads, [past], [size], size, past + size + 3)
            inputs = _clean(inputs)
            if heads not in one:
                one[heads] = _launch(inputs, TILED, heads, False)
            out1, lse1 = one[heads]
            out2, lse2 = _launch(inputs, TILED, heads, True)
            assert _same_bits(out2, out1) and _same_bits(lse2, lse1) and np.isfinite(out2).all(), knobs


def test_plan_tree_split_and_its_workspace(monkeypatch):
    """2 .. TREE_SPLIT_MAX_NODES nodes, few requests, every key in segment 0: the two launches,
    with room for the scores [bs, Tc, H, S]; else the one launch."""
    monkeypatch.setattr(va, "TREE_SPLIT_MAX_BATCH", 1)
    monkeypatch.setattr(va, "TREE_SPLIT", True)
    p = va.plan(1, 33, 64, 1500)
    assert p.tree_split and not p.decode_split and p.merge_free
    first = p.workspace_shape[0]
    assert first * 33 * 64 * 514 >= 33 * 64 * 1500 and first == -(-1500 // 514)
    assert not va.plan(2, 33, 64, 1500).tree_split            # two requests
    assert not va.plan(1, 1, 64, 1500).tree_split             # one node: the AR step's launches
    assert not va.plan(1, va.TREE_SPLIT_MAX_NODES + 1, 64, 1500).tree_split
    assert not va.plan(1, 33, 64, 3000).tree_split            # keys past segment 0: the merge
    monkeypatch.setattr(va, "TREE_SPLIT", False)
    assert va.plan(1, 33, 64, 1500).workspace_shape == (1, 1, 33, 64, 514)


def test_tree_geometry():
    for cfg, heads in ((TINY, 2), (TILED, 2), (va.KIMI_K2_SCORE_FIRST_TREE_SKIP_CONFIG, 64)):
        tq, tk, threads, th, spd = va.tree_geometry(cfg, heads)
        r = va.TREE_SCORE_TILE
        assert tq % r == 0 and tk % r == 0
        assert threads == (tq // r) * (tk // r) * cfg.k_groups <= 1024
        assert heads % th == 0 and cfg.latent_dim % spd == 0


def test_tree_geometry_past_the_limits_raises(monkeypatch):
    """A layout knob whose blocks pass the static shared memory raises ValueError, before a launch."""
    monkeypatch.setattr(va, "TREE_PASS", 512)
    with pytest.raises(ValueError, match="tree geometry: static shared memory"):
        va.get_tree_kernels(va.KIMI_K2_SCORE_FIRST_TREE_SKIP_CONFIG, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("past, sizes", [(0, [33]), (192, [33]), (999, [17]), (160, [33, 20, 0])])
def test_gpu_tree_launches_match_the_one_launch_at_kimi_k2_dims(monkeypatch, past, sizes):
    """The engine's 33-node tile (64 heads, Dl 512, Dr 64, two k-groups) at the engine's tree
    geometry, random trees and chains, random and tie-heavy, on the GPU."""
    monkeypatch.undo()   # the engine's 64 x 32 score blocks
    monkeypatch.setattr(va, "TREE_SPLIT_MAX_BATCH", 8)
    cfg = va.KIMI_K2_SCORE_FIRST_TREE_SKIP_CONFIG
    rng = np.random.default_rng(past + len(sizes))
    for chain in (False, True):
        for ties in (False, True):
            inputs, _ = _batch(rng, cfg, 64, [past] * len(sizes), sizes, 33, 1024, chain)
            if ties:
                for name in ("q_latent", "q_rope", "kv_latent", "k_rope"):
                    inputs[name] = rng.integers(-1, 2, inputs[name].shape).astype(np.float32)
            (out2, lse2), (out1, lse1) = _both(_clean(inputs), cfg, 64, scale=0.1447)
            assert _same_bits(out2, out1) and _same_bits(lse2, lse1), (past, sizes, chain, ties)
