"""One-node attention launches (verify_attention.get_decode_kernels, an AR step): the same bits as
the one-launch kernels (which tests/test_kernel_verify_attention.py checks against the reference and
a tree node against them), for the numerics of tiny's tiling (one k-group) and of a two-k-group
tiling like Kimi K2's, at key counts around the chunk and pass edges, tie-heavy inputs, several
requests, a padding slot (zeros) and a request the guards reject (NaN); the plan's choice and its
workspace; on the GPU at Kimi K2's heads and dims (the engine's AR tile)."""
import dataclasses

import numpy as np
import pytest
from numba import cuda

from ddtree_numba.engine.model import _small_tile_config
from ddtree_numba.kernels import verify_attention as va

RNG = np.random.default_rng(20261205)
TINY = _small_tile_config(32, 8, 4)   # tiny's tiling: 4 heads, chunks of 16, one k-group
# two k-groups and 16 softmax lanes a head, as Kimi K2's tiles, at a size the simulator runs quickly
TWO_GROUPS = va.TileConfig(latent_dim=64, rope_dim=16, heads=4, chunk=16, k_slice=16, k_groups=2, qk_rows=1,
                           qk_keys=2, pv_rows=1, pv_dims=4, v_slice=8)


def _inputs(bs, heads, s, dl, dr, ties, rng=RNG):
    if ties:
        draw = lambda *shape: rng.integers(-1, 2, shape).astype(np.float32)   # noqa: E731
    else:
        draw = lambda *shape: rng.standard_normal(shape).astype(np.float32)   # noqa: E731
    return draw(bs, 1, heads, dl), draw(bs, 1, heads, dr), draw(bs, s, dl), draw(bs, s, dr)


@pytest.fixture(autouse=True)
def _any_batch(monkeypatch):
    """The kernels take any batch; the plan gives them one request (DECODE_SPLIT_MAX_BATCH, a
    speed rule): lifted here so that batches are checked too."""
    monkeypatch.setattr(va, "DECODE_SPLIT_MAX_BATCH", 8)


def _both(config, heads, pasts, sizes, s, ties=False, scale=0.137):
    """(out, lse) of the two launches and of the one launch for the same inputs."""
    inputs = _inputs(len(pasts), heads, s, config.latent_dim, config.rope_dim, ties)
    return [_launch(config, heads, pasts, sizes, s, inputs, split, scale) for split in (True, False)]


def _launch(config, heads, pasts, sizes, s, inputs, split, scale=0.137):
    """(out, lse) of the two launches (``split``) or of the one launch for ``inputs`` (_inputs')."""
    bs = len(pasts)
    p = va.plan(bs, 1, heads, s, latent_dim=config.latent_dim, rope_dim=config.rope_dim, config=config)
    assert p.decode_split
    ql, qr, kl, kr = inputs
    vis = np.ones((bs, 1, 1), np.uint32)
    saved = va.DECODE_SPLIT
    try:
        va.DECODE_SPLIT = split
        out = cuda.to_device(np.full((bs, 1, heads, config.latent_dim), 7.0, np.float32))
        lse = cuda.to_device(np.full((bs, 1, heads), 7.0, np.float32))
        ws = cuda.to_device(np.zeros(p.workspace_shape, np.float32))
        # device past / sizes: the kernels' guards, not the host checks, see a bad request
        va.run(p, ql, qr, kl, kr, cuda.to_device(np.array(pasts, np.int32)),
               cuda.to_device(np.array(sizes, np.int32)), vis, scale, out, lse, ws)
        return out.copy_to_host(), lse.copy_to_host()
    finally:
        va.DECODE_SPLIT = saved


def _same(a, b):
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("config", [TINY, TWO_GROUPS], ids=["tiny", "two-groups"])
@pytest.mark.parametrize("past", [0, 1, 15, 16, 17, 31, 47])
def test_decode_launches_match_the_one_launch(config, past):
    """Keys 1 .. 48: one key, a chunk's edge (16), its next key, three chunks."""
    (out2, lse2), (out1, lse1) = _both(config, 4, [past], [1], 48)
    assert _same(out2, out1) and _same(lse2, lse1)
    assert np.isfinite(out2).all()


@pytest.mark.parametrize("config", [TINY, TWO_GROUPS], ids=["tiny", "two-groups"])
def test_decode_launches_ties_batch_padding_and_bad_requests(config):
    """Tie-heavy scores (equal maxima, exact sums) over five requests of different lengths, padding
    slots (size 0, and a negative device size: zeros) and one whose rows pass the cache (past + 1 >
    S: NaN), as the one launch."""
    s = 300   # past DECODE_PASS: the P·V blocks' second pass of probabilities
    pasts, sizes = [299, 5, 40, s, 7], [1, 1, 0, 1, -1]
    (out2, lse2), (out1, lse1) = _both(config, 4, pasts, sizes, s, ties=True)
    assert _same(out2, out1) and _same(lse2, lse1)
    assert (out2[[2, 4]] == 0).all() and (lse2[[2, 4]] == 0).all()   # size 0 and a negative size: zeros
    assert np.isnan(out2[3]).all() and np.isnan(lse2[3]).all()
    assert np.isfinite(out2[[0, 1]]).all()


# a lane's dims in runs of 2 and of 1 (gcd(k_slice / k_groups, 4) < 4: scalar q / k loads, not
# float4s; Kimi K2's tiles always take 4, so only these reach that branch)
PAIR_RUNS = va.TileConfig(latent_dim=64, rope_dim=16, heads=4, chunk=16, k_slice=8, k_groups=4, qk_rows=1,
                          qk_keys=2, pv_rows=1, pv_dims=2, v_slice=8)
SINGLE_RUNS = dataclasses.replace(PAIR_RUNS, k_slice=4)


@pytest.mark.parametrize("config, runs", [(PAIR_RUNS, 2), (SINGLE_RUNS, 1)], ids=["runs-of-2", "runs-of-1"])
def test_decode_launches_with_short_dim_runs(config, runs):
    """Dim runs shorter than a float4 (the score kernel's scalar-load branch): the one launch's
    bits over two requests, a chunk's edge and three chunks, random and tie-heavy."""
    assert np.gcd(config.k_slice // config.k_groups, 4) == runs
    for ties in (False, True):
        (out2, lse2), (out1, lse1) = _both(config, 4, [47, 15], [1, 1], 48, ties=ties)
        assert _same(out2, out1) and _same(lse2, lse1) and np.isfinite(out2).all()


def test_decode_score_layouts_keep_the_bits(monkeypatch):
    """The score kernel's block size and dim runs in flight (DECODE_SCORE_THREADS / _BATCH), its
    heads a block (DECODE_SCORE_HEADS) and the P·V blocks' dims (DECODE_PV_DIMS), all layout, give
    the one launch's bits: a batch past the lane's dims (16, 24 runs: one partial round), one that
    does not divide them (3), half the threads a block (twice the key blocks), score blocks of 2
    heads and of 1, P·V blocks of 4 and 8 of TWO_GROUPS' 64 latent dims. The one launch reads none
    of them: its result is computed once and every layout's two launches compared against it."""
    pasts, sizes, s = [47, 3], [1, 1], 48
    inputs = _inputs(len(pasts), 4, s, TWO_GROUPS.latent_dim, TWO_GROUPS.rope_dim, False)
    out1, lse1 = _launch(TWO_GROUPS, 4, pasts, sizes, s, inputs, False)
    for threads, batch, heads, pv_dims in ((256, 3, 16, 64), (256, 16, 16, 64), (128, 24, 16, 64), (256, 16, 2, 4),
                                           (256, 16, 1, 8)):
        monkeypatch.setattr(va, "DECODE_SCORE_THREADS", threads)
        monkeypatch.setattr(va, "DECODE_SCORE_BATCH", batch)
        monkeypatch.setattr(va, "DECODE_SCORE_HEADS", heads)
        monkeypatch.setattr(va, "DECODE_PV_DIMS", pv_dims)
        sh, _, _, spd, _ = va.decode_geometry(TWO_GROUPS, 4)
        assert sh == min(heads, 4) and spd == min(pv_dims, TWO_GROUPS.latent_dim)
        out2, lse2 = _launch(TWO_GROUPS, 4, pasts, sizes, s, inputs, True)
        assert _same(out2, out1) and _same(lse2, lse1) and np.isfinite(out2).all(), (threads, batch, heads, pv_dims)


def test_decode_pass_is_layout_and_builds_its_own_kernels(monkeypatch):
    """DECODE_PASS (the P·V blocks' keys a pass: a chunk, a size that rounds down to whole chunks,
    four chunks) is read at get_decode_kernels' call, so a new value builds new kernels instead of
    reusing the cached ones, and every value gives the one launch's bits over several passes (the
    one launch reads no DECODE_PASS: its result computed once)."""
    pasts, sizes, s = [130, 9], [1, 1], 131
    inputs = _inputs(len(pasts), 4, s, TWO_GROUPS.latent_dim, TWO_GROUPS.rope_dim, False)
    out1, lse1 = _launch(TWO_GROUPS, 4, pasts, sizes, s, inputs, False)
    for pass_keys in (16, 40, 64):
        before = va.get_decode_kernels(TWO_GROUPS, 4)
        monkeypatch.setattr(va, "DECODE_PASS", pass_keys)
        assert va.get_decode_kernels(TWO_GROUPS, 4) is not before
        out2, lse2 = _launch(TWO_GROUPS, 4, pasts, sizes, s, inputs, True)
        assert _same(out2, out1) and _same(lse2, lse1) and np.isfinite(out2).all(), pass_keys


def test_decode_values_ahead_is_layout(monkeypatch):
    """DECODE_PV_AHEAD (the pass's scores loaded first, value chunks in flight, the first before the
    softmax barrier) gives the one launch's bits. TWO_GROUPS has chunks of 16 keys, so a 256-key pass
    is 16 chunks: one chunk at a time (the layout before), 2 (the default), 3 (not dividing the
    pass's chunks) and 16 (the whole pass) chunks ahead; 2 ahead in 64-key passes (4 chunks); 3
    ahead in 40-key passes, which round down to 32 keys, 2 chunks: ahead clamped to 2. Over several
    passes (300 keys), a cache shorter than the chunks ahead, random inputs; tie-heavy ones at the
    default and the clamped setting (each setting costs a simulated launch: CI time). The one
    launch reads neither setting: its result for each input set is computed once and every
    setting's two launches are compared against it."""
    pasts, sizes, s = [299, 9, 0], [1, 1, 1], 300
    settings = {False: ((1, 256), (2, 256), (3, 256), (16, 256), (2, 64), (3, 40)),
                True: ((2, 256), (3, 40))}
    for ties in (False, True):
        inputs = _inputs(len(pasts), 4, s, TWO_GROUPS.latent_dim, TWO_GROUPS.rope_dim, ties)
        out1, lse1 = _launch(TWO_GROUPS, 4, pasts, sizes, s, inputs, False)
        for ahead, pass_keys in settings[ties]:
            monkeypatch.setattr(va, "DECODE_PV_AHEAD", ahead)
            monkeypatch.setattr(va, "DECODE_PASS", pass_keys)
            out2, lse2 = _launch(TWO_GROUPS, 4, pasts, sizes, s, inputs, True)
            assert _same(out2, out1) and _same(lse2, lse1) and np.isfinite(out2).all(), (ties, ahead, pass_keys)
    with pytest.raises(ValueError, match="pv_ahead"):
        va._decode_kernels(TWO_GROUPS, 4, 256, 16, 16, 64, 256, 0)
    with pytest.raises(TypeError, match="pv_ahead"):
        va._decode_kernels(TWO_GROUPS, 4, 256, 16, 16, 64, 256, 2.5)


def test_plan_decode_split_and_its_workspace(monkeypatch):
    """One node a request, every key in segment 0 and few requests: the two launches, with room
    for the scores."""
    monkeypatch.setattr(va, "DECODE_SPLIT_MAX_BATCH", 1)
    assert not va.plan(2, 1, 64, 1500).decode_split          # two requests: the one launch
    monkeypatch.setattr(va, "DECODE_SPLIT_MAX_BATCH", 2)
    p = va.plan(2, 1, 64, 1500)
    assert p.decode_split and p.merge_free
    first = p.workspace_shape[0]
    assert first * 2 * 64 * 514 >= 2 * 64 * 1500 and first == -(-1500 // 514)
    assert not va.plan(1, 33, 64, 1500).decode_split          # a tree
    assert not va.plan(1, 1, 64, 3000).decode_split           # keys past segment 0: the merge
    saved = va.DECODE_SPLIT
    try:
        va.DECODE_SPLIT = False
        p = va.plan(2, 1, 64, 1500)
        assert not p.decode_split and p.workspace_shape == (1, 2, 1, 64, 514)
    finally:
        va.DECODE_SPLIT = saved


def test_decode_geometry_covers_heads_and_dims():
    for config, heads in ((TINY, 4), (TWO_GROUPS, 4), (va.KIMI_K2_SCORE_FIRST_DECODE_SKIP_CONFIG, 64),
                          (va.KIMI_K2_SCORE_FIRST_DECODE_SKIP_CONFIG, 16)):
        sh, sk, sph, spd, threads = va.decode_geometry(config, heads)
        lanes = config.k_groups * config.chunk // config.qk_keys
        assert heads % sh == 0 and heads % sph == 0 and config.latent_dim % spd == 0
        assert sh * sk * config.k_groups <= 1024 and threads % 32 == 0 and threads >= max(spd, sph * lanes)


@pytest.mark.gpu
@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize("pasts", [[0], [191], [160, 7, 999]])
def test_gpu_decode_launches_match_the_one_launch_at_kimi_k2_dims(monkeypatch, pasts, ahead):
    """The engine's AR tile (64 heads, Dl 512, Dr 64, two k-groups), random and tie-heavy, on the
    GPU, with the P·V chunks one at a time and two ahead (DECODE_PV_AHEAD)."""
    monkeypatch.setattr(va, "DECODE_PV_AHEAD", ahead)
    config = dataclasses.replace(va.KIMI_K2_SCORE_FIRST_DECODE_SKIP_CONFIG)
    for ties in (False, True):
        (out2, lse2), (out1, lse1) = _both(config, 64, pasts, [1] * len(pasts), 1024, ties=ties)
        assert _same(out2, out1) and _same(lse2, lse1), (pasts, ties)
