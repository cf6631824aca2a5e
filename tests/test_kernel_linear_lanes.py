"""Many-row products in k-lane warps (ddtree_numba.kernels.linear_lanes): the same bits as linear
for every prologue and residual, on random, tie-heavy and signed-zero inputs, at edge sizes (one
row, a tile and one, columns past a tile, a partial last k step, several K segments restaged);
the plan's shared-memory rule; bad input rejected before a launch; the engine's LANE_PRODUCTS
switch keeps a forward's logits. Under the simulator linear itself is checked against a NumPy
emulation of the order (tests/test_kernel_linear.py), so agreeing with it bit for bit checks the
lanes kernel's order too."""
import numpy as np
import pytest
from numba import cuda

from ddtree_numba.kernels import linear as lin
from ddtree_numba.kernels import linear_lanes as ll
from tests.linear_checks import dev as _dev, product_inputs as _inputs, prologue_kwargs as _kwargs

RNG = np.random.default_rng(20261207)


def _both(x, w, prologue, norm, res, row_tile=ll.ROW_TILE):
    """(linear's output, linear_lanes') for the same inputs."""
    outs = []
    for fn in (lin.linear, ll.linear_lanes):
        out = cuda.to_device(np.full((x.shape[0], w.shape[0]), np.nan, np.float32))
        extra = {"row_tile": row_tile} if fn is ll.linear_lanes else {}
        fn(_dev(x), _dev(w), out, **_kwargs(prologue, norm, res), **extra)
        outs.append(out.copy_to_host())
    return outs


def _same_bits(a, b):
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("prologue,residual,kind", [
    ("none", False, "random"), ("none", True, "ties"), ("rmsnorm", False, "random"),
    ("rmsnorm", True, "zeros"), ("swiglu", True, "random"), ("swiglu", False, "ties")])
def test_lanes_match_linear(prologue, residual, kind):
    """33 rows (three 11-row tiles), 40 columns (a second, partial column tile), K 256."""
    x, w, norm, res = _inputs(33, 40, 256, prologue, residual, kind, RNG)
    ref, got = _both(x, w, prologue, norm, res)
    assert _same_bits(ref, got), (prologue, residual, kind)


@pytest.mark.parametrize("m,n,k,row_tile", [
    (1, 7, 128, 11),     # one row, fewer columns than a column group
    (12, 33, 132, 11),   # a tile and one row; K 132: a partial last step (one k-lane's quad)
    (9, 64, 2056, 4),    # K 2056: two segments of 9 steps, restaged per column tile and segment
    (5, 32, 2688, 1),    # one-row tiles, three segments (the last short), a partial last step
    (16, 5, 64, 16)])    # a 16-row tile, K under one step
def test_lanes_edge_sizes(m, n, k, row_tile):
    for prologue, residual in (("rmsnorm", True), ("none", False)):
        x, w, norm, res = _inputs(m, n, k, prologue, residual, "random", RNG)
        ref, got = _both(x, w, prologue, norm, res, row_tile)
        assert _same_bits(ref, got), (m, n, k, row_tile, prologue)


def test_lanes_residual_in_place():
    """residual may be out itself (each element read before it is written)."""
    x, w, _, res = _inputs(20, 36, 384, "none", True, "random", RNG)
    ref = _dev(res)
    lin.linear(_dev(x), _dev(w), ref, residual=ref)
    out = _dev(res)
    ll.linear_lanes(_dev(x), _dev(w), out, residual=out)
    assert _same_bits(ref.copy_to_host(), out.copy_to_host())


def test_lanes_kernels_agree_across_layouts():
    """The kernel's layout knobs (reduction rounds, weight ring slots) never change the bits."""
    x, w, norm, _ = _inputs(11, 40, 384, "rmsnorm", False, "ties", RNG)
    grid, smem, geometry = ll.plan_lanes(11, 40, 384)
    outs = []
    for rounds, unroll in ((1, 2), (3, 3), (4, 4)):   # 3 steps: the 4-slot ring's loads clamped
        kernel = ll.get_lanes_kernel("rmsnorm", False, 11, rounds, unroll)
        out = cuda.to_device(np.full((11, 40), np.nan, np.float32))
        w_d = _dev(w)
        smem_r = 4 * (11 * geometry[3] * lin.STEP + ll._red_floats(rounds))
        if smem_r > ll.SHARED_BUDGET_SIM:
            continue
        kernel[grid, ll.THREADS, 0, smem_r](_dev(x), w_d.reshape(-1), out, out, _dev(norm), np.float32(1e-6),
                                            *geometry)
        outs.append(out.copy_to_host())
    ref = np.full((11, 40), np.nan, np.float32)
    ref_d = _dev(ref)
    lin.linear(_dev(x), _dev(w), ref_d, norm_weight=_dev(norm), eps=1e-6)
    assert len(outs) == 3 and all(_same_bits(ref_d.copy_to_host(), o) for o in outs)


def test_lanes_plan_and_rules():
    """A plan where the rows and partials fit the budget, None where they do not; the engine's rule."""
    grid, smem, geometry = ll.plan_lanes(33, 40, 256)
    assert grid[0] == 3 and smem == 4 * (11 * 256 + ll._red_floats(ll.ROUND_ROWS))
    assert geometry == (40, 256, 1, 2, 2)
    assert ll.plan_lanes(33, 40, 1 << 20) is None            # 11 rows of a 2048-step segment
    assert ll._red_stride(2) % 32 == 4 and ll._red_stride(11) % 32 == 4
    x = _dev(np.ones((33, 256), np.float32))
    w = _dev(np.ones((40, 256), np.float32))
    assert ll.takes(x, w) and not ll.takes(x[:ll.MIN_ROWS - 1], w)
    assert not ll.supported(_dev(np.ones((33, 258), np.float32)), _dev(np.ones((40, 258), np.float32)))   # K % 4


def test_lanes_bad_input_rejected_before_launch():
    w = _dev(np.ones((8, 256), np.float32))
    out = cuda.to_device(np.full((20, 8), np.nan, np.float32))
    with pytest.raises(ValueError, match="row_tile"):
        ll.linear_lanes(_dev(np.ones((20, 256), np.float32)), w, out, row_tile=0)
    with pytest.raises(ValueError, match="row_tile"):
        ll.linear_lanes(_dev(np.ones((20, 256), np.float32)), w, out, row_tile=True)
    with pytest.raises(ValueError, match="x, w, norm_weight"):   # rows off 16 bytes (a column-offset view)
        ll.linear_lanes(_dev(np.ones((20, 257), np.float32))[:, 1:], w, out)
    with pytest.raises(ValueError):                              # K mismatch (check_linear_args)
        ll.linear_lanes(_dev(np.ones((20, 128), np.float32)), w, out)
    with pytest.raises(TypeError):                               # float64 input
        ll.linear_lanes(_dev(np.ones((20, 256))), w, out)
    with pytest.raises(ValueError):                              # a bad kernel specialisation
        ll.get_lanes_kernel("gelu", False)
    assert np.isnan(out.copy_to_host()).all()                    # nothing written


def test_engine_lane_products_keep_the_logits(monkeypatch):
    """tiny's 20-row forward with LANE_PRODUCTS 2 (every many-row linear product in the lanes kernel)
    gives the default forward's logits, bit for bit."""
    from ddtree_numba.bench.profile_forward import forward_inputs
    from ddtree_numba.config import ModelConfig
    from ddtree_numba.engine import model as em
    from ddtree_numba.engine.model import TargetModel
    from reference.weights import init_weights

    config = ModelConfig.from_name("tiny")
    weights = init_weights(config, 0)
    logits = []
    for lanes in (0, 2):
        monkeypatch.setattr(em, "LANE_PRODUCTS", lanes)
        model = TargetModel(config, weights, batch_size=1, kv_capacity=64, max_rows=20)
        model.advance(cuda.to_device(np.array([8], np.int32)))
        model.forward(*forward_inputs(20, 8))
        logits.append(model.buffers.logits.copy_to_host())
    assert _same_bits(logits[0], logits[1])


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k,prologue,residual", [
    ("w_a", 1344, 2048, "rmsnorm", False), ("w_q", 12288, 768, "rmsnorm", False),
    ("wo", 2048, 8192, "none", True), ("w2", 2048, 5632, "swiglu", True)])
def test_gpu_lanes_match_linear_at_small_shapes(name, n, k, prologue, residual):
    """small's 33-row products on the GPU: linear_lanes against linear, bit for bit, random and tie-heavy."""
    for kind in ("random", "ties"):
        x, w, norm, res = _inputs(33, n, k, prologue, residual, kind, RNG)
        ref, got = _both(x, w, prologue, norm, res)
        assert _same_bits(ref, got), (name, kind)
