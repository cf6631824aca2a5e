"""MLA absorbs in segment order (ddtree_numba.kernels.absorb).

Under the simulator the order itself is checked bit for bit against a NumPy emulation (the
simulator's fma is a*b + c in float32); everywhere the split kernel (few rows) and the tile kernel
(many rows) give the same bits for every row, alone or among many (batch invariance: an AR step
and a tree verify of the same path agree), and the result is within 1e-5 * sum |x| |w| of float64.
"""
import numpy as np
import pytest
from numba import cuda

from ddtree_numba.kernels import absorb as ab
from ddtree_numba.kernels.registry import _REGISTRY
from sim.launch import check_launch

RNG = np.random.default_rng(20261202)
SIMULATED = bool(cuda.config.ENABLE_CUDASIM)


def _rand(*shape, rng=RNG):
    return rng.standard_normal(shape).astype(np.float32)


def _run(x, w_kn, plan=None, x_dev=None):
    out = cuda.to_device(np.full((x.shape[0], w_kn.shape[0], w_kn.shape[2]), np.nan, np.float32))
    ab.absorb(cuda.to_device(x) if x_dev is None else x_dev, cuda.to_device(w_kn), out, plan=plan)
    return out.copy_to_host()


def _split(x, w_kn):
    m, g, k = x.shape
    return ab._split_plan(m, g, w_kn.shape[2], k)


def _tile(x, w_kn, sm_count=132):
    """The tile kernel's plan at any row count (K % 4 == 0)."""
    m, g, k = x.shape
    return ab._tile_plan(m, g, w_kn.shape[2], k, sm_count)


def _emulate(x, w_kn):
    """The documented order in float32 with the simulator's fma (a*b + c, two roundings): 32 fmas
    a segment, zeros past K."""
    m_rows, groups, k_dim = x.shape
    out = np.empty((m_rows, groups, w_kn.shape[2]), np.float32)
    k_pad = -(-k_dim // ab.SEGMENT) * ab.SEGMENT
    x = np.concatenate([x, np.zeros((m_rows, groups, k_pad - k_dim), np.float32)], axis=2)
    w_kn = np.concatenate([w_kn, np.zeros((groups, k_pad - k_dim, w_kn.shape[2]), np.float32)], axis=1)
    for g in range(groups):
        total = np.full((m_rows, w_kn.shape[2]), -0.0, np.float32)
        for k0 in range(0, k_dim, ab.SEGMENT):
            p = np.zeros_like(total)
            for k in range(k0, k0 + ab.SEGMENT):
                p = (x[:, g, k:k + 1] * w_kn[g, k][None, :]).astype(np.float32) + p
            total = total + p
        out[:, g] = total
    return out


def _assert_close(out, x, w_kn):
    ref = np.einsum("mgk,gkn->mgn", x.astype(np.float64), w_kn.astype(np.float64))
    bound = 1e-5 * np.einsum("mgk,gkn->mgn", np.abs(x.astype(np.float64)), np.abs(w_kn.astype(np.float64))) + 1e-30
    assert np.all(np.isfinite(out))
    assert np.all(np.abs(out - ref) <= bound)


def _same_bits(a, b):
    np.testing.assert_array_equal(a.view(np.int32), b.view(np.int32))


SHAPES = [  # (M, G, K, N): segments whole and partial, K < one segment, every split row tile, tiles
    (1, 2, 64, 8), (1, 3, 100, 12), (2, 2, 31, 4), (3, 1, 1, 4), (4, 2, 33, 16), (8, 2, 96, 8),
    (2, 2, 64, 8), (3, 2, 68, 8), (4, 1, 128, 4),
    (9, 2, 40, 20), (13, 1, 72, 12), (33, 2, 64, 36), (17, 3, 36, 8),
]


@pytest.mark.skipif(not SIMULATED, reason="the GPU fma rounds once; the emulation models the simulator")
@pytest.mark.parametrize("m_rows, groups, k_dim, n_cols", SHAPES)
def test_absorb_is_the_documented_order(m_rows, groups, k_dim, n_cols):
    x, w = _rand(m_rows, groups, k_dim), _rand(groups, k_dim, n_cols)
    want = _emulate(x, w)
    _same_bits(_run(x, w), want)
    _same_bits(_run(x, w, plan=_split(x, w)), want)


@pytest.mark.skipif(not SIMULATED, reason="the GPU fma rounds once; the emulation models the simulator")
@pytest.mark.parametrize("m_rows, k_dim, lanes", [(1, 200, 2), (1, 100, 1), (2, 161, 2), (5, 129, 4)])
def test_split_lanes_with_several_segments_keep_the_order(m_rows, k_dim, lanes):
    """Fewer segment lanes than segments: a lane runs its first segment from the weights it loaded
    before the PDL wait, then its later segments (and, past one row, later batches) loading their
    own; partial last segments included. The documented order, bit for bit."""
    x, w = _rand(m_rows, 2, k_dim), _rand(2, k_dim, 8)
    mt = next(t for t in ab.SPLIT_ROW_TILES if t >= m_rows)
    threads = lanes * 2   # two column quads: N 8
    plan = ab.AbsorbPlan("split", mt, lanes, 0, 0, (1, -(-m_rows // mt), 2), threads,
                         ab.split_shared_bytes(k_dim, mt, lanes, threads))
    assert -(-k_dim // ab.SEGMENT) > lanes
    _same_bits(_run(x, w, plan=plan), _emulate(x, w))


@pytest.mark.skipif(not SIMULATED, reason="the GPU fma rounds once; the emulation models the simulator")
def test_signed_zeros_and_exact_cancellation_follow_the_order():
    """Tie-heavy inputs: small integers (exact products, sums cancelling to zero), -0.0 entries,
    whole zero rows and columns; the chain from +0.0 and the sum from -0.0 decide every zero's sign."""
    rng = np.random.default_rng(7)
    x = rng.integers(-2, 3, (12, 2, 70)).astype(np.float32)
    w = rng.integers(-2, 3, (2, 70, 16)).astype(np.float32)
    x[3] = -0.0
    x[5, :, :40] = -0.0
    w[:, :, 4] = -0.0
    want = _emulate(x, w)
    for plan in (None, _split(x, w)):
        got = _run(x, w, plan=plan)
        _same_bits(got, want)
    assert np.signbit(want[3]).sum() == 0   # a zero row: (+0 chains) summed from -0.0 give +0.0


@pytest.mark.parametrize("m_rows, groups, k_dim, n_cols", SHAPES)
def test_split_and_tile_kernels_agree_and_match_float64(m_rows, groups, k_dim, n_cols):
    """The split kernel against the tile kernel (forced at every row count where K % 4 == 0) and
    against the default plan's choice, bit for bit; float64 within the bound."""
    x, w = _rand(m_rows, groups, k_dim), _rand(groups, k_dim, n_cols)
    split = _run(x, w, plan=_split(x, w))
    _assert_close(split, x, w)
    _same_bits(_run(x, w), split)
    if k_dim % 4 == 0:
        assert _tile(x, w).kind == "tile"
        _same_bits(_run(x, w, plan=_tile(x, w)), split)


@pytest.mark.parametrize("mt, col_quads, sm_count", [(4, (32,), 1), (8, (16,), 1), (8, (32,), 1),
                                                     (4, (32, 16, 8), 10**6)])   # (no width fills the SMs: the narrowest)
def test_tile_layouts_agree_with_the_split_kernel(monkeypatch, mt, col_quads, sm_count):
    """Tile layouts the H200 plan does not pick for the simulator's small shapes: 4 or 8 rows a
    thread, 16 or 32 column quads, several row blocks (grid y > 1: 40 rows past the 256-thread
    limit of 32 quads at 4 rows a thread) and partial column slabs; every one gives the split
    kernel's bits."""
    monkeypatch.setattr(ab, "TILE_ROWS", mt)
    monkeypatch.setattr(ab, "TILE_COL_QUADS", col_quads)
    x, w = _rand(40 if mt == 4 else 70, 2, 72), _rand(2, 72, 36)
    plan = _tile(x, w, sm_count)
    assert plan.mt == mt and plan.col_quads == (col_quads[0] if sm_count == 1 else col_quads[-1])
    if plan.col_quads == 32:
        assert plan.grid[1] > 1
    _same_bits(_run(x, w, plan=plan), _run(x, w, plan=_split(x, w)))


def _tile_lanes(x, w_kn, lanes, mt=4, col_quads=8, row_groups=None):
    """A tile plan with ``lanes`` segment lanes (forced: the plan's own choice may differ)."""
    m, g, _ = x.shape
    rg = row_groups or min(-(-m // mt), ab.TILE_MAX_THREADS // (col_quads * lanes))
    return ab.tile_block_plan(mt, col_quads, rg, lanes, m, g, w_kn.shape[2])


@pytest.mark.parametrize("m_rows, k_dim, mt, row_groups", [(9, 72, 4, None), (21, 160, 4, 2), (33, 192, 4, None),
                                                         (12, 128, 8, None), (5, 4, 4, None)])
def test_segment_lanes_keep_the_order(m_rows, k_dim, mt, row_groups):
    """The tile kernel with 2 segment lanes: rounds of whole segments (K 192 / 128), a last round
    with a lane past the last segment (K 72: 3 segments; K 160: 5; K 4: one partial segment),
    8 rows a thread, three row blocks (21 rows, 2 row groups); the split kernel's bits and, under
    the simulator, the emulated order. Signed zeros: a zero row, -0.0 entries."""
    x, w = _rand(m_rows, 2, k_dim), _rand(2, k_dim, 36)
    x[1] = -0.0
    w[:, :, 5] = -0.0
    plan = _tile_lanes(x, w, 2, mt, row_groups=row_groups)
    assert plan.lanes == 2 and ab._fits(plan, m_rows, 2, 36, k_dim, True)
    got = _run(x, w, plan=plan)
    _same_bits(got, _run(x, w, plan=_split(x, w)))
    if SIMULATED:
        _same_bits(got, _emulate(x, w))
    _assert_close(got, x, w)


@pytest.mark.parametrize("mt, col_quads, row_groups, lanes, blocks_per_sm", [(4, 8, 2, 1, 4), (4, 16, 4, 1, 3),
                                                                         (8, 8, 2, 2, 2), (4, 16, 10, 1, 4)])
def test_pair_lanes_and_block_counts_keep_the_bits(mt, col_quads, row_groups, lanes, blocks_per_sm):
    """The tile kernel's 2 x 2 lane squares (``pairs``) and launch-bound block counts: layout only,
    so the split kernel's bits (and under the simulator the emulated order) at 33 rows (rows past M
    in the last square), K 72 (a partial round with two lanes), N 36 (a partial column slab)."""
    x, w = _rand(33, 2, 72), _rand(2, 72, 36)
    x[3] = -0.0
    want = _run(x, w, plan=_split(x, w))
    for pairs in (False, True):
        plan = ab.tile_block_plan(mt, col_quads, row_groups, lanes, 33, 2, 36, blocks_per_sm, pairs)
        assert (plan.blocks_per_sm, plan.pairs) == (blocks_per_sm, pairs) and ab._fits(plan, 33, 2, 36, 72, True)
        got = _run(x, w, plan=plan)
        _same_bits(got, want)
        if SIMULATED:
            _same_bits(got, _emulate(x, w))
    with pytest.raises(ValueError, match="pairs"):
        ab.tile_block_plan(4, 8, 3, 1, 33, 2, 36, 2, True)   # pairs need an even row-group count
    with pytest.raises(ValueError, match="blocks_per_sm"):
        ab.tile_block_plan(4, 8, 2, 1, 33, 2, 36, 5)


def test_tile_plan_runs_a_tree_verify_in_one_wave():
    """The H200's (132 SMs) 33-row absorbs of ``small`` / Kimi K2 (64 heads): the q absorb (K 128,
    N 512) in 16 x 9 blocks (36 rows, not 32 x 5's 40) at 4 blocks an SM, 512 blocks in one wave;
    the value absorb (K 512, N 128) in 8 x 10 blocks with 2 segment lanes in 2 x 2 lane squares at
    2 an SM (256 blocks, one wave already; 9 row groups rounded up to even for the squares); a
    1056-row prefill keeps 32 x 8 at 2 (many waves either way)."""
    def shape(p):
        return p.col_quads, p.row_groups, p.lanes, p.blocks_per_sm, p.pairs, p.grid
    assert shape(ab._tile_plan(33, 64, 512, 128, 132)) == (16, 9, 1, 4, False, (8, 1, 64))
    assert shape(ab._tile_plan(33, 64, 128, 512, 132)) == (8, 10, 2, 2, True, (4, 1, 64))
    assert shape(ab._tile_plan(1056, 64, 512, 128, 132)) == (32, 8, 1, 2, False, (4, 33, 64))
    for rows in range(9, 260, 7):
        for n_cols, k_dim in ((512, 128), (128, 512)):
            plan = ab._tile_plan(rows, 64, n_cols, k_dim, 132)
            blocks = int(np.prod(plan.grid))
            assert plan.grid[1] * plan.row_groups * plan.mt >= rows and plan.grid[0] * plan.col_quads * 4 >= n_cols
            if plan.blocks_per_sm > ab.TILE_BLOCKS_PER_SM:   # only to put a grid in one wave, at the fewest
                assert plan.lanes == 1 and (plan.blocks_per_sm - 1) * 132 < blocks <= plan.blocks_per_sm * 132
            if plan.blocks_per_sm == ab.WAVE_BLOCKS_PER_SM:   # 96-112 registers: no more threads than compile clean
                assert plan.threads <= ab.WAVE_THREADS
            # lane squares exactly where a block runs PAIR_LANES lanes and an even row-group count fits
            assert not plan.pairs or (plan.lanes == ab.PAIR_LANES and plan.row_groups % 2 == 0)
            if plan.lanes == ab.PAIR_LANES and not plan.pairs:
                even = plan.row_groups + plan.row_groups % 2
                assert not ab._tile_block_ok(plan.mt, plan.col_quads, even, plan.lanes, plan.blocks_per_sm, True)
    wide = ab._tile_plan(20, 64, 1024, 128, 132)   # 32 x 5, 160 threads: 4 an SM would spill on sm_90
    assert (wide.col_quads, wide.row_groups, wide.threads, int(np.prod(wide.grid))) == (32, 5, 160, 512)
    assert wide.blocks_per_sm == ab.TILE_BLOCKS_PER_SM   # 512 blocks need 4 an SM for one wave: not taken
    assert ab._tile_plan(20, 64, 768, 128, 132).blocks_per_sm == 3   # 384 blocks: one wave at 3


def test_tile_stages_fit_the_default_shared_memory():
    """Many rows at 8 rows a thread and 32 column quads: the plan trims the row groups so that the
    two stages fit TILE_SMEM (the kernel's dynamic shared memory, checked by the launch check)."""
    saved = ab.TILE_ROWS, ab.TILE_COL_QUADS
    try:
        for mt in ab.TILE_ROW_TILES:
            for cq in ab.TILE_COL_QUADS:
                ab.TILE_ROWS, ab.TILE_COL_QUADS = mt, (cq,)
                plan = ab._tile_plan(4096, 64, 512, 128, 132)
                assert plan.shared_bytes == ab.tile_shared_bytes(mt, cq, plan.row_groups, plan.lanes) <= ab.TILE_SMEM
                check_launch(plan.grid, plan.threads, plan.shared_bytes)   # the default limit, no opt-in
                assert plan.threads == cq * plan.row_groups * plan.lanes <= ab.TILE_MAX_THREADS
    finally:
        ab.TILE_ROWS, ab.TILE_COL_QUADS = saved
    assert ab.tile_shared_bytes(8, 32, 8) > ab.TILE_SMEM   # (the cap is needed: 50176 bytes)


def test_a_row_alone_equals_the_row_among_many():
    """Batch invariance: row r of a 19-row launch (tile kernel) is row r run alone (split kernel)."""
    x, w = _rand(19, 2, 48), _rand(2, 48, 16)
    many = _run(x, w)
    assert ab.plan_absorb(19, 2, 16, 48).kind == "tile" and ab.plan_absorb(1, 2, 16, 48).kind == "split"
    for r in (0, 7, 18):
        _same_bits(_run(x[r:r + 1], w)[0], many[r])


def test_views_of_wider_rows_and_unaligned_rows():
    """x as q[:, :, :nope] of wider rows (16-byte aligned: the tile kernel), and rows that start off
    16 bytes (the split kernel at any row count): the same bits."""
    wide = _rand(11, 2, 24)
    w = _rand(2, 16, 8)
    d_wide = cuda.to_device(wide)
    aligned = _run(wide[:, :, :16], w, x_dev=d_wide[:, :, :16])
    _same_bits(aligned, _run(np.ascontiguousarray(wide[:, :, :16]), w))
    shifted = cuda.to_device(np.concatenate([np.zeros(1, np.float32), wide.ravel()]))[1:].reshape(11, 2, 24)
    assert not ab._rows_aligned(shifted[:, :, 1:17])
    got = _run(wide[:, :, 1:17], w, x_dev=shifted[:, :, 1:17])
    _same_bits(got, _run(np.ascontiguousarray(wide[:, :, 1:17]), w))
    _assert_close(got, np.ascontiguousarray(wide[:, :, 1:17]), w)


def test_plans():
    for rows in (1, 2, 3, 5, 8):
        plan = ab.plan_absorb(rows, 64, 512, 128)
        assert plan.kind == "split" and plan.mt >= rows and plan.grid[1] == 1
    q = ab.plan_absorb(1, 64, 512, 128)    # small's AR q absorb: 4 segments, 32 quads a block
    v = ab.plan_absorb(1, 64, 128, 512)    # value absorb: 16 segments, 8 quads
    assert (q.lanes, q.grid, q.shared_bytes) == (4, (4, 1, 64), 4 * 4 * 128)
    assert (v.lanes, v.grid, v.shared_bytes) == (16, (4, 1, 64), 4 * 16 * 32)
    for rows in (9, 33, 64, 513):
        for n_cols, k_dim in ((512, 128), (128, 512)):
            plan = ab.plan_absorb(rows, 64, n_cols, k_dim)
            assert plan.kind == "tile" and plan.threads == plan.col_quads * plan.row_groups * plan.lanes \
                <= ab.TILE_MAX_THREADS and plan.lanes in ab.TILE_SEG_LANES
            assert plan.shared_bytes == ab.tile_shared_bytes(plan.mt, plan.col_quads, plan.row_groups, plan.lanes) \
                <= ab.TILE_SMEM
            assert plan.grid[0] * plan.col_quads * 4 >= n_cols and plan.grid[1] * plan.row_groups * plan.mt >= rows
            assert (plan.grid[1] - 1) * plan.row_groups * plan.mt < rows   # no empty row block
    v33 = ab.plan_absorb(33, 64, 128, 512)   # small's 33-row value absorb: 16 segments, two lanes
    assert (v33.lanes, v33.col_quads, v33.row_groups, v33.threads, v33.pairs) == (2, 8, 10, 160, True)
    assert ab.plan_absorb(33, 64, 512, 128, rows_aligned=False).kind == "split"
    assert ab.plan_absorb(33, 2, 16, 30).kind == "split"   # K % 4 != 0: no 16-byte x reads


def test_registered_for_the_compile_check():
    names = [n for n in _REGISTRY if n.startswith("absorb_")]
    assert {"absorb_split_mt1_l4", "absorb_split_mt1_l16"} <= set(names)
    assert any(n.startswith("absorb_tile_") for n in names)


def test_a_bad_plan_is_refused_on_an_empty_launch_too():
    out = np.full((3, 2, 8), np.nan, np.float32)[:0]
    with pytest.raises(ValueError, match="^plan"):
        ab.absorb(_rand(3, 2, 4)[:0], _rand(2, 4, 8), out, plan=ab.AbsorbPlan("nonsense", 3, 99, 0, 0, (0, 0, 0), 7, -1))
    with pytest.raises(ValueError, match="^plan"):   # grid y past CUDA's limit: the launch check refuses it
        ab.absorb(_rand(2, 2, 8), _rand(2, 8, 4), np.zeros((2, 2, 4), np.float32),
                  plan=ab.AbsorbPlan("split", 1, 1, 0, 0, (1, 70000, 2), 8, 128))


def test_empty_launches_write_nothing():
    out = np.full((3, 2, 8), np.nan, np.float32)[:0]   # slices keep their strides (an empty array's are 0)
    assert ab.absorb(_rand(3, 2, 4)[:0], _rand(2, 4, 8), out) is out


def _shifted(shape):
    """A C-contiguous float32 array whose data starts 4 bytes past 16."""
    return np.zeros(int(np.prod(shape)) + 4, np.float32)[1:1 + int(np.prod(shape))].reshape(shape)


_TILE_PLAN = ab._tile_plan(2, 2, 4, 8, 132)


@pytest.mark.parametrize("call, error, name", [
    (lambda o: ab.absorb(np.zeros((2, 2, 8), np.float64), _rand(2, 8, 4), o), TypeError, "x"),
    (lambda o: ab.absorb(_rand(2, 2, 8), _rand(2, 8, 6), o), ValueError, "w_kn"),
    (lambda o: ab.absorb(_rand(2, 2, 8), _rand(2, 8, 4)[:, :, ::2], o), ValueError, "w_kn"),
    (lambda o: ab.absorb(_rand(2, 2, 4), _rand(2, 8, 8)[:, :4, :4], o), ValueError, "w_kn must be C-contiguous"),
    (lambda o: ab.absorb(_rand(2, 2, 2048), _rand(2, 2048, 4), o), ValueError, "w_kn"),
    (lambda o: ab.absorb(_rand(2, 2, 8), _shifted((2, 8, 4)), o), ValueError, "w_kn must start on 16 bytes"),
    (lambda o: ab.absorb(_rand(2, 3, 8), _rand(2, 8, 4), o), ValueError, "x must have shape"),
    (lambda o: ab.absorb(_rand(3, 2, 8), _rand(2, 8, 4), o), ValueError, "out must have shape"),
    (lambda o: ab.absorb(_rand(2, 2, 8), _rand(2, 8, 4), o, plan=(1, 2)), TypeError, "plan"),
    (lambda o: ab.absorb(_rand(2, 2, 8), _rand(2, 8, 4), o, plan=ab.plan_absorb(2, 3, 4, 8)), ValueError, "plan"),
    (lambda o: ab.absorb(_rand(2, 2, 64), _rand(2, 64, 4), o, plan=ab.plan_absorb(2, 2, 4, 8)), ValueError, "plan"),
    (lambda o: ab.absorb(_rand(2, 2, 8), _rand(2, 8, 4), o,   # a tile plan short of threads
                         plan=ab.AbsorbPlan("tile", 4, 1, 8, 1, (1, 1, 2), 4, _TILE_PLAN.shared_bytes)), ValueError, "plan"),
    (lambda o: ab.absorb(_rand(2, 2, 8), _rand(2, 8, 4), o,   # a split kernel that does not exist
                         plan=ab.AbsorbPlan("split", 3, 1, 0, 0, (1, 1, 2), 128, 4096)), ValueError, "plan"),
])
def test_bad_arguments_raise_before_any_launch(call, error, name):
    out = np.full((2, 2, 4), 7.0, np.float32)
    with pytest.raises(error, match="^" + name):
        call(out)
    assert np.all(out == 7.0)


@pytest.mark.gpu
@pytest.mark.parametrize("m_rows", [1, 5, 9, 33, 64, 129])
@pytest.mark.parametrize("k_dim, n_cols", [(128, 512), (512, 128)])
def test_gpu_small_preset_shapes(m_rows, k_dim, n_cols):
    """small's absorbs (64 heads; q: K 128, N 512; value: K 512, N 128) on the GPU: the chosen
    kernel against the split kernel bit for bit, and float64."""
    x, w = _rand(m_rows, 64, k_dim), _rand(64, k_dim, n_cols)
    got = _run(x, w)
    split = _run(x, w, plan=_split(x, w))
    _assert_close(got, x, w)
    _same_bits(got, split)
    _same_bits(_run(x, w, plan=_tile(x, w)), split)   # the tile kernel at every row count, 1 included
    for lanes in ab.TILE_SEG_LANES:                    # and with each number of segment lanes (8 row
        plan = _tile_lanes(x, w, lanes, row_groups=min(-(-m_rows // 4), 8))   # groups: within 48 KiB)
        assert plan.shared_bytes <= ab.TILE_SMEM
        _same_bits(_run(x, w, plan=plan), split)
    _same_bits(got[m_rows // 2], _run(x[m_rows // 2:m_rows // 2 + 1], w)[0])
