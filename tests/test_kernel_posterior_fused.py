"""The lm_head fused with the greedy posterior: linear_argmax + posterior_argmax_parts, and the
walk that merges the parts of the nodes it visits (accept_walk_parts).

The property: for every row, the merged token is bit for bit ``posterior_argmax(linear(...))``
(ties -> lowest id, NaN logits skipped, an all-NaN row -> NO_INDEX, padding rows -1), and each
part holds exactly the largest of ``linear``'s logits in its columns with that logit's lowest
id (the logits are the same bits: the same tile code). The fused walk's (accepted, lengths,
bonus) are bit for bit posterior_argmax_parts + accept_walk's, and reference.accept_batch's on
the merged posterior. Simulator shapes are tiny (parts of 8 columns, one or two warps per
block); ``gpu`` tests use the small preset's and Kimi K2's lm_head (V 32768 x D 2048, V 163840
x D 7168) and the walk at bs 64, B 512 with Kimi K2's parts (P = argmax_parts(163840)).
"""
from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from ddtree_numba.bench.accept_compact import KIMI_VOCAB, PART_WINNER, posterior_parts, random_posterior
from ddtree_numba.kernels import accept as ka
from ddtree_numba.kernels import linear as lin
from ddtree_numba.kernels import registry
from reference import accept_batch
from sim.launch import LaunchConfigError
from tests.test_kernel_accept import (BAD_CSR_VALUES, BAD_TREE_AND_OUTPUTS, GPU_HORIZON, _bs64_budget512_batch,
                                      _follow_deepest, _padded, _parts_of, _random_batch, _tree_walk_args,
                                      _walk_args)

SIM_THREADS = 32  # posterior kernels: one warp per simulated block
NO_INDEX = int(ka.NO_INDEX)


def _dev(a):
    return cuda.to_device(np.ascontiguousarray(a))


def _logits(x, w, nw=None) -> np.ndarray:
    """linear()'s logits [M, N] on the host."""
    out = cuda.to_device(np.full((x.shape[0], w.shape[0]), np.nan, np.float32))
    lin.linear(_dev(x), _dev(w), out, **({} if nw is None else {"norm_weight": _dev(nw)}))
    return out.copy_to_host()


def _parts(x, w, nw=None) -> tuple[np.ndarray, np.ndarray]:
    """linear_argmax()'s (part_val, part_idx) [M, P] on the host (buffers pre-filled with junk:
    every entry must be written)."""
    n_parts = lin.argmax_parts(w.shape[0])
    val = _dev(np.full((x.shape[0], n_parts), 7.5, np.float32))
    idx = _dev(np.full((x.shape[0], n_parts), -9, np.int32))
    lin.linear_argmax(_dev(x), _dev(w), val, idx, **({} if nw is None else {"norm_weight": _dev(nw)}))
    return val.copy_to_host(), idx.copy_to_host()


def _merge(val, idx, sizes, n_cap) -> np.ndarray:
    out = _dev(np.full((len(sizes), n_cap), 99, np.int32))
    ka.posterior_argmax_parts(_dev(val), _dev(idx), np.asarray(sizes, np.int32), out,
                              threads=SIM_THREADS)
    return out.copy_to_host()


def _posterior(logits, sizes, n_cap) -> np.ndarray:
    """posterior_argmax on DEVICE logits [bs * N, V] (device values: NaN is not rejected)."""
    bs = len(sizes)
    out = _dev(np.full((bs, n_cap), 99, np.int32))
    ka.posterior_argmax(_dev(logits.reshape(bs, n_cap, -1)), np.asarray(sizes, np.int32), out,
                        threads=SIM_THREADS)
    return out.copy_to_host()


def _rule(row: np.ndarray) -> tuple[np.float32, int]:
    """(max, lowest id) over the non-NaN values of ``row``; (-inf, NO_INDEX) if there are none."""
    ok = ~np.isnan(row)
    if not ok.any():
        return np.float32(-np.inf), NO_INDEX
    best = row[ok].max()
    return best, int(np.flatnonzero(row == best)[0])


def _check_parts(val, idx, logits) -> None:
    """Every part is exactly the rule over its columns of linear's logits."""
    width = lin.argmax_part_cols(logits.shape[1])
    for m in range(logits.shape[0]):
        for p in range(val.shape[1]):
            best, at = _rule(logits[m, p * width:(p + 1) * width])
            assert idx[m, p] == (at if at == NO_INDEX else p * width + at), (m, p)
            assert val[m, p] == best, (m, p)


def _check_fused(x, w, nw=None, sizes=None) -> np.ndarray:
    """Parts vs linear's logits, merged tokens vs posterior_argmax(linear): one request of M nodes
    unless ``sizes`` splits the rows into requests of equal capacity. Returns the tokens."""
    sizes = [x.shape[0]] if sizes is None else sizes
    n_cap = x.shape[0] // len(sizes)
    logits = _logits(x, w, nw)
    val, idx = _parts(x, w, nw)
    _check_parts(val, idx, logits)
    got = _merge(val, idx, sizes, n_cap)
    np.testing.assert_array_equal(got, _posterior(logits, sizes, n_cap))
    return got


# --- the property ----------------------------------------------------------------------------------

@pytest.mark.parametrize("m_rows,n_cols,k_dim,norm", [
    (3, 37, 70, False),     # 5 parts, the last one 5 columns, N not a multiple of C = 4
    (9, 21, 130, True),     # 3 row tiles (MT 8), rmsnorm prologue, K past one 128-step
    (2, 13, 2100, False),   # two K segments (k_split 2): the combine path
    (1, 3, 5, True),        # one part narrower than a column group
])
def test_fused_is_posterior_argmax_of_linear(m_rows, n_cols, k_dim, norm):
    rng = np.random.default_rng(1000 * n_cols + k_dim)
    x = rng.standard_normal((m_rows, k_dim)).astype(np.float32)
    w = rng.standard_normal((n_cols, k_dim)).astype(np.float32)
    nw = rng.standard_normal(k_dim).astype(np.float32) if norm else None
    _check_fused(x, w, nw)


def test_ties_between_duplicate_weight_rows_go_to_the_lowest_id():
    """Weight row 22 dominates every row's logits and is copied to ids 5, 9 and 13 (under the
    simulator: part 0, and two column groups of part 1), 23 (22's column group) and 36 (the
    last, narrow part): equal logits at 6 ids, the lowest wins: 5, then 9 once row 5 differs."""
    rng = np.random.default_rng(5)
    n_cols, k_dim = 37, 64
    w = rng.standard_normal((n_cols, k_dim)).astype(np.float32)
    x = (rng.standard_normal((4, k_dim)) * 0.1 + 3.0 * w[22]).astype(np.float32)
    for dup in (5, 9, 13, 23, 36):
        w[dup] = w[22]
    assert np.all(_check_fused(x, w) == 5)
    w[5] = -w[5]
    assert np.all(_check_fused(x, w) == 9)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the simulator computes inf * 0
def test_nan_and_infinite_logits_follow_posterior_argmax():
    """Row 0: all-NaN x -> NaN logits -> NO_INDEX. Rows 1 and 2: x = (+-inf, 0, ...) gives logit
    +-inf * w[n, 0]: ties at +inf (the lowest such id wins), -inf, and NaN where w[n, 0] == 0 or
    the weight row holds a NaN (ids 8..15: a whole all-NaN part under the simulator). Row 3:
    finite logits with NaN columns. Then one row whose logits are all -inf or NaN: the lowest
    -inf id wins (a real -inf outranks the empty candidate)."""
    rng = np.random.default_rng(9)
    n_cols, k_dim = 29, 40
    w = rng.standard_normal((n_cols, k_dim)).astype(np.float32)
    w[[2, 4, 7], 0] = 0.0
    w[8:16] = np.nan
    w[20, 3] = np.nan
    x = rng.standard_normal((4, k_dim)).astype(np.float32)
    x[0] = np.nan
    x[1:3] = 0.0
    x[1, 0] = np.inf
    x[2, 0] = -np.inf
    got = _check_fused(x, w)[0]
    clean = ~np.isnan(w).any(axis=1)
    assert got[0] == NO_INDEX
    assert got[1] == np.flatnonzero(clean & (w[:, 0] > 0))[0]
    assert got[2] == np.flatnonzero(clean & (w[:, 0] < 0))[0]
    w[:, 0] = -np.abs(w[:, 0])                  # inf * w[n, 0]: -inf, or NaN (0 and NaN rows)
    logits = _logits(x[1:2], w)[0]
    assert np.all(np.isneginf(logits) | np.isnan(logits)) and np.isneginf(logits).any()
    assert _check_fused(x[1:2], w)[0, 0] == np.flatnonzero(np.isneginf(logits))[0]


def test_padding_rows_get_minus_one_and_are_not_read():
    """Two requests of 3 nodes, sizes (2, 3): node 2 of request 0 is padding."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((6, 48)).astype(np.float32)
    w = rng.standard_normal((19, 48)).astype(np.float32)
    got = _check_fused(x, w, sizes=[2, 3])
    assert got[0, 2] == -1 and np.all(got[1] >= 0)


def test_parts_are_batch_invariant():
    """A row's parts are the same bits alone (MT 1), among 6 (MT 8) and among 11 (2 tiles)."""
    rng = np.random.default_rng(21)
    k_dim, n_cols = 150, 23
    w = rng.standard_normal((n_cols, k_dim)).astype(np.float32)
    nw = rng.standard_normal(k_dim).astype(np.float32)
    row = rng.standard_normal((1, k_dim)).astype(np.float32)
    alone = _parts(row, w, nw)
    for batch, where in ((6, 4), (11, 9)):
        x = (rng.standard_normal((batch, k_dim)) * rng.uniform(0.1, 10.0)).astype(np.float32)
        x[where] = row[0]
        val, idx = _parts(x, w, nw)
        np.testing.assert_array_equal(val[where], alone[0][0])
        np.testing.assert_array_equal(idx[where], alone[1][0])


@pytest.mark.skipif(not cuda.config.ENABLE_CUDASIM, reason="the tree reduction exists only under the simulator")
@pytest.mark.parametrize("m_rows,norm,k_dim", [(9, True, 70), (1, False, 70), (2, False, 2100), (3, True, 4100)])
def test_shuffle_butterfly_ranks_the_same_elements(m_rows, norm, k_dim):
    """The GPU build's transposed butterfly leaves element a of a warp's tile on a lane other
    than a (1 row: lanes 0, 8, 16, 24 own the 4 elements); the parts it ranks are the tree's, bit
    for bit, and every entry is written (poisoned buffers). K 2100 / 4100 split K over 2 / 4
    warps: the segment combine must rank each element on the lane that owns it (a GPU-only bug
    found by running the simulator tests natively)."""
    rng = np.random.default_rng(40 + m_rows)
    n_cols = 37
    x = rng.standard_normal((m_rows, k_dim)).astype(np.float32)
    w = rng.standard_normal((n_cols, k_dim)).astype(np.float32)
    nw = rng.standard_normal(k_dim).astype(np.float32)
    want = _parts(x, w, nw if norm else None)
    plan = lin.plan_linear(m_rows, n_cols, k_dim, kind="argmax")
    kernel = lin.get_kernel("argmax", "rmsnorm" if norm else "none", False, plan.mt, shuffles=True)
    n_parts = lin.argmax_parts(n_cols)
    val = _dev(np.full((m_rows, n_parts), 7.5, np.float32))
    idx = _dev(np.full((m_rows, n_parts), -9, np.int32))
    kernel[(-(-m_rows // plan.mt), n_parts, 1), plan.threads, 0, plan.shared_bytes](
        _dev(x), _dev(w.ravel()), val, idx, _dev(nw if norm else np.ones(1, np.float32)),
        np.float32(1e-6), *plan.geometry(n_cols, k_dim), lin.argmax_part_cols(n_cols))
    np.testing.assert_array_equal(val.copy_to_host(), want[0])
    np.testing.assert_array_equal(idx.copy_to_host(), want[1])


# --- part layout -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n_cols", [1, 3, 4, 8, 9, 37, 255, 256, 257, 1000, 32768, 129280, 163840])
def test_parts_tile_the_columns(n_cols):
    width, parts = lin.argmax_part_cols(n_cols), lin.argmax_parts(n_cols)
    assert width % lin.PART_ALIGN == 0
    assert (parts - 1) * width < n_cols <= parts * width
    assert 1 <= parts <= min(lin.TARGET_PARTS, -(-n_cols // lin.MIN_PART_COLS))


@pytest.mark.parametrize("n_cols", [0, -3, 2.0, True])
def test_part_helpers_reject_bad_n_cols(n_cols):
    with pytest.raises(ValueError if isinstance(n_cols, int) and not isinstance(n_cols, bool)
                       else TypeError, match="n_cols"):
        lin.argmax_parts(n_cols)


# --- bad input -------------------------------------------------------------------------------------

def _good():
    n_parts = lin.argmax_parts(12)
    return dict(x=np.zeros((3, 8), np.float32), w=np.zeros((12, 8), np.float32),
                part_val=np.full((3, n_parts), 7.0, np.float32),
                part_idx=np.full((3, n_parts), 7, np.int32))


@pytest.mark.parametrize("change,exc,name", [
    (dict(x=np.zeros((3, 8), np.float64)), TypeError, "x"),
    (dict(x=np.zeros((3, 9), np.float32)), ValueError, "x"),
    (dict(x=np.zeros((3, 16), np.float32)[:, ::2]), ValueError, "x"),
    (dict(w=np.zeros((8, 12), np.float32).T), ValueError, "w"),
    (dict(w=np.zeros((12, 8), np.int32)), TypeError, "w"),
    (dict(part_val=np.zeros((3, 99), np.float32)), ValueError, "part_val"),
    (dict(part_val=np.zeros((2, 2), np.float32)), ValueError, "part_val"),
    (dict(part_val=[[0.0]]), TypeError, "part_val"),
    (dict(part_idx=np.zeros((3, 2), np.int64)), TypeError, "part_idx"),
    (dict(part_idx=np.zeros((3, 5), np.int32)), ValueError, "part_idx"),
    (dict(norm_weight=np.zeros(7, np.float32)), ValueError, "norm_weight"),
    (dict(norm_weight=np.zeros(8, np.float32), eps=float("nan")), ValueError, "eps"),
    (dict(eps="1e-6"), TypeError, "eps"),
])
def test_linear_argmax_rejects_bad_input_before_any_work(change, exc, name):
    args = _good() | change
    with pytest.raises(exc, match=rf"^{name}\b"):
        lin.linear_argmax(**args)
    if "part_val" not in change:
        assert np.all(args["part_val"] == 7.0)
    if "part_idx" not in change:
        assert np.all(args["part_idx"] == 7)


# --- the fused walk: accept_walk_parts -------------------------------------------------------------

def _run_walk(fn, head, tree, width, *, on_device=True):
    """``fn(*head, *tree, accepted, lengths, bonus)`` (accept_walk or accept_walk_parts) into
    poisoned device outputs; returns them on the host."""
    bs = tree[0].shape[0]
    args = [*head, *tree]
    if on_device:
        args = [_dev(a) for a in args]
    outs = [_dev(np.full(shape, -7, np.int32)) for shape in ((bs, width), (bs,), (bs,))]
    fn(*args, *outs)
    return tuple(o.copy_to_host() for o in outs)


def _check_walk(val, idx, trees, width, *, on_device=True):
    """accept_walk_parts == posterior_argmax_parts + accept_walk, bit for bit, and ==
    reference.accept_batch on the merged posterior (cut to ``width`` nodes: the bonus is then the
    last kept node's posterior). Returns ((accepted, lengths, bonus), merged posterior)."""
    tree = [np.ascontiguousarray(a, np.int32) for a in (trees.child_ptr, trees.child_index, trees.tokens)]
    post = _merge(val, idx, trees.sizes, trees.capacity)
    got = _run_walk(ka.accept_walk_parts, (val, idx), tree, width, on_device=on_device)
    want = _run_walk(ka.accept_walk, (post,), tree, width)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    accepted, lengths, bonus = accept_batch(post, trees)
    accepted = _padded(accepted, max(width, accepted.shape[1]))[:, :width]
    cut = lengths > width
    last = accepted[np.arange(len(lengths)), np.minimum(lengths, width) - 1]
    np.testing.assert_array_equal(got[0], accepted)
    np.testing.assert_array_equal(got[1], np.minimum(lengths, width))
    np.testing.assert_array_equal(got[2], np.where(cut, post[np.arange(len(lengths)), last], bonus))
    return got, post


def _logits_for(rng, post, vocab, *, ties=False, nan=0.0) -> np.ndarray:
    """float32 [bs * N, V] integer logits in [-3, 2] (a ``nan`` fraction NaN) with 3.0 at each row's
    ``post`` token: their argmax is ``post``. ``ties``: 3.0 also at a random higher id of every
    row (the lower, posterior id must win) and at a random id of every fourth row (which wins
    when it is the lower one: the walk then follows the lowest id)."""
    flat = post.reshape(-1).astype(np.int64)
    rows = np.arange(flat.size)
    logits = rng.integers(-3, 3, (flat.size, vocab)).astype(np.float32)
    logits[rng.random(logits.shape) < nan] = np.nan
    logits[rows, flat] = 3.0
    if ties:
        logits[rows, rng.integers(flat, vocab)] = 3.0
        logits[rows[::4], rng.integers(0, vocab, rows[::4].size)] = 3.0
    return logits


def _rule_rows(logits, sizes, n_cap) -> np.ndarray:
    """_rule's id of every real row, -1 on padding rows: [bs, N]."""
    ids = np.array([_rule(row)[1] for row in logits], np.int32).reshape(len(sizes), n_cap)
    ids[np.arange(n_cap)[None, :] >= np.asarray(sizes)[:, None]] = -1
    return ids


@pytest.mark.parametrize("vocab,width,ties,nan,on_device", [
    (40, 8, False, 0.0, True),     # P 5: neither a multiple of 4 nor of 32
    (40, 8, True, 0.1, False),     # tie-heavy, NaN logits, NumPy (host-checked) inputs
    (12, 12, True, 0.0, True),     # P 1
    (70, 2, True, 0.05, True),     # P 35: one lane holds two parts
    (133, 1, False, 0.02, True),   # P 133 > 32 * MERGE_UNROLL: a second, partial round of loads
])
def test_parts_walk_is_merge_then_walk_on_random_batches(vocab, width, ties, nan, on_device):
    """Ragged batch (budgets 0..16, capacity above the largest tree), deep-path posteriors; every
    leaf's posterior is the last token id (the bonus of a walk ending there: the last part wins)."""
    rng = np.random.default_rng(100 * vocab + width)
    trees = _random_batch(rng, 6, 4, vocab, [16, 0, 7, 12, 3, 16], capacity=20, ties=ties)
    post = random_posterior(rng, trees, vocab, follow=0.9)
    post[np.diff(trees.child_ptr, axis=1) == 0] = vocab - 1
    logits = _logits_for(rng, post, vocab, ties=ties, nan=nan)
    val, idx = _parts_of(logits, width)
    assert val.shape[1] == -(-vocab // width)
    (_, _, bonus), merged = _check_walk(val, idx, trees, 5, on_device=on_device)
    np.testing.assert_array_equal(merged, _rule_rows(logits, trees.sizes, trees.capacity))
    if not ties:
        np.testing.assert_array_equal(merged[merged >= 0], post[merged >= 0])
        assert np.any(bonus == vocab - 1)


@pytest.mark.parametrize("budgets,width", [([0], 1), ([0], 3), ([1], 3), ([0, 1, 0, 1], 2)])
def test_parts_walk_single_node_and_one_child_trees(budgets, width):
    """Budget 0 (the root alone: length 1, the root's merged token is the bonus) and budget 1
    (the posterior follows the root's only child), bs 1 and several."""
    rng = np.random.default_rng(len(budgets) + width)
    vocab = 9
    trees = _random_batch(rng, len(budgets), 2, vocab, budgets)
    post = random_posterior(rng, trees, vocab, follow=0.0)
    _follow_deepest(trees, post)
    val, idx = _parts_of(_logits_for(rng, post, vocab), 4)
    (accepted, lengths, bonus), merged = _check_walk(val, idx, trees, width)
    assert lengths.tolist() == [1 + b for b in budgets]
    assert accepted[:, :2].tolist() == [[0, 1] if b else [0, -1][:width] for b in budgets]
    assert bonus[0] == merged[0, lengths[0] - 1]


def test_parts_walk_nan_rows_and_nan_parts():
    """Posteriors follow each request's deepest path. Request 0: the row of its second path
    node is all NaN (parts (-inf, NO_INDEX), as linear_argmax writes them): the walk stops there
    with the bonus NO_INDEX (no child's token). Request 1: an all-NaN root row, written as NaN
    part values (skipped as well): length 1, bonus NO_INDEX. Request 2: every part of its path
    rows but the winner's is a NaN value or all-NaN: the whole path is accepted."""
    rng = np.random.default_rng(41)
    vocab, width = 24, 5  # P 5, the last part 4 columns
    trees = _random_batch(rng, 3, 4, vocab, [12, 12, 12], capacity=14)
    post = random_posterior(rng, trees, vocab, follow=0.0)
    _follow_deepest(trees, post)
    path, full, _ = accept_batch(post, trees)
    assert full.min() >= 3
    logits = _logits_for(rng, post, vocab)
    n_cap = trees.capacity
    logits[path[0, 1]] = np.nan
    val, idx = _parts_of(logits, width)
    val[n_cap] = np.nan
    for node in path[2, :full[2]]:
        row = 2 * n_cap + node
        keep = post[2, node] // width
        val[row, np.arange(val.shape[1]) != keep] = np.nan
        idx[row, (keep + 1) % val.shape[1]] = ka.NO_INDEX
    (accepted, lengths, bonus), _ = _check_walk(val, idx, trees, full.max())
    assert lengths.tolist() == [2, 1, full[2]] and bonus[:2].tolist() == [NO_INDEX, NO_INDEX]
    np.testing.assert_array_equal(accepted[2, :full[2]], path[2, :full[2]])


def test_parts_walk_truncates_to_the_buffer_width():
    """A buffer narrower than the path keeps its first W nodes (W 1: the root alone), and the
    bonus is the last kept node's merged token; a wider buffer is padded with -1."""
    rng = np.random.default_rng(43)
    vocab = 7
    trees = _random_batch(rng, 2, 4, vocab, [12, 9])
    post = random_posterior(rng, trees, vocab, follow=0.0)
    _follow_deepest(trees, post)
    depth = int(trees.depths.max())
    assert depth >= 2
    val, idx = _parts_of(_logits_for(rng, post, vocab, ties=True), 3)
    for width in (1, 2, depth, depth + 4):
        _check_walk(val, idx, trees, width)


def test_parts_walk_malformed_device_csr_matches_accept_walk():
    """test_kernel_accept's malformed device CSR (ranges past N and below 0, children outside
    [1, N)), posterior given as one part per row: clamped as accept_walk clamps it."""
    tokens = np.array([[7, 10, 20, 30, 40, 50]] * 2, np.int32)
    child_ptr = np.array([[-2, 1, 1, 1, 1, 1, 1], [0, 2, 2, 9, 9, 9, 9]], np.int32)
    child_index = np.array([[1, 0, 0, 0, 4, 5], [-1, 2, 7, 3, 0, 4]], np.int32)
    post = np.array([[50, 0, 0, 0, 0, 0], [20, 0, 40, 0, 33, 0]], np.int32)
    tree = (child_ptr, child_index, tokens)
    parts = (np.zeros((12, 1), np.float32), post.reshape(12, 1))
    got = _run_walk(ka.accept_walk_parts, parts, tree, 4)
    want = _run_walk(ka.accept_walk, (post,), tree, 4)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert got[0].tolist() == [[0, -1, -1, -1], [0, 2, 4, -1]] and got[2].tolist() == [50, 33]


def test_parts_walk_registration_and_shared_memory_limit():
    """Registered for the compile check at the walk's block size; N 4096 needs 48 KiB + 4 B of
    shared memory (3 staged int32 rows): refused by the launch check, nothing written."""
    assert registry.get("accept_walk_parts").block_threads == ka.WALK_THREADS
    assert registry.get("accept_walk_parts").kernel is ka.accept_walk_parts_kernel
    assert ka.walk_shared_bytes(4095, posterior=False) <= 48 * 1024 < ka.walk_shared_bytes(4096, posterior=False)
    args = _parts_walk_args(_walk_args(n_cap=4096, bs=1), n_parts=1)
    with pytest.raises(LaunchConfigError, match="shared memory"):
        ka.accept_walk_parts(**args)
    assert np.all(args["accepted"] == 7)


def _parts_walk_args(walk_args=None, n_parts=5):
    """test_kernel_accept's walk arguments (bs 2, N 4, W 3 unless given), the posterior replaced by
    zero parts [bs * N, n_parts]."""
    args = dict(_walk_args() if walk_args is None else walk_args)
    rows = args.pop("posterior").size
    return dict(part_val=np.zeros((rows, n_parts), np.float32), part_idx=np.zeros((rows, n_parts), np.int32),
                **args)


@pytest.mark.parametrize("change,error,name", [
    (dict(part_val=np.zeros((8, 5), np.float64)), TypeError, "part_val"),
    (dict(part_val=[[0.0] * 5] * 8), TypeError, "part_val"),
    (dict(part_val=np.zeros(40, np.float32)), ValueError, "part_val"),
    (dict(part_val=np.zeros((8, 10), np.float32)[:, ::2]), ValueError, "part_val"),
    (dict(part_val=np.zeros((8, 0), np.float32), part_idx=np.zeros((8, 0), np.int32)), ValueError, "part_val"),
    (dict(part_idx=np.zeros((8, 5), np.int64)), TypeError, "part_idx"),
    (dict(part_idx=np.zeros((8, 4), np.int32)), ValueError, "part_idx"),          # another P
    (dict(part_idx=np.zeros((7, 5), np.int32)), ValueError, "part_idx"),
    (dict(part_idx=np.zeros((8, 10), np.int32)[:, ::2]), ValueError, "part_idx"),
    (dict(child_ptr=np.zeros((2, 5), np.int64)), TypeError, "child_ptr"),
    (dict(child_ptr=np.zeros((2, 1), np.int32)), ValueError, "child_ptr"),        # N 0: no root
    (dict(child_ptr=np.zeros((4, 3), np.int32)), ValueError, "child_index"),      # bs * N 8: then [4, 2]
    (dict(child_ptr=np.zeros((2, 4), np.int32)), ValueError, "child_ptr"),        # bs * N != rows
] + BAD_TREE_AND_OUTPUTS)
def test_parts_walk_rejects_bad_arguments_before_any_work(change, error, name):
    """Every argument's dtype, rank, shape and contiguity; outputs untouched."""
    args = _parts_walk_args() | change
    with pytest.raises(error, match=rf"^{name}\b"):
        ka.accept_walk_parts(**args)
    for out in {"accepted", "lengths", "bonus"} - set(change):
        assert np.all(args[out] == (7 if out == "accepted" else 0)), out


@pytest.mark.parametrize("edit, name", BAD_CSR_VALUES)
def test_parts_walk_rejects_bad_host_csr_values_before_any_work(edit, name):
    """NumPy CSR values are checked as accept_walk checks them (the parts are not: any float32
    maximum is valid, NaN included)."""
    args = _tree_walk_args()
    edit(args)
    args = _parts_walk_args(args)
    args["part_val"][:] = np.nan
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        ka.accept_walk_parts(**args)
    assert np.all(args["accepted"] == 7)
    edit_free = _parts_walk_args(_tree_walk_args())
    edit_free["part_val"][:] = np.nan
    ka.accept_walk_parts(**edit_free)
    assert edit_free["lengths"].tolist() == [1, 1] and edit_free["bonus"].tolist() == [NO_INDEX] * 2

# --- H200: the small preset's and Kimi K2's lm_head --------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("n_cols,k_dim,rows", [(32768, 2048, (1, 64)), (163840, 7168, (1, 5))])
def test_gpu_lm_head_shapes(n_cols, k_dim, rows):
    """Fused vs posterior_argmax(linear) on device, rmsnorm prologue. The last row's logits peak
    at weight row N - 1, copied to ids 5000, N // 3 and N // 3 + 2 (other parts, one column group
    maybe): id 5000 must win. Its parts must be the same bits alone and among 63 or 4 rows."""
    rng = np.random.default_rng(n_cols)
    w = rng.standard_normal((n_cols, k_dim), dtype=np.float32)
    top = n_cols - 1
    for dup in (5000, n_cols // 3, n_cols // 3 + 2):
        w[dup] = w[top]
    d_w = _dev(w)
    nw = _dev(np.abs(1.0 + 0.1 * rng.standard_normal(k_dim)).astype(np.float32))
    x_all = rng.standard_normal((max(rows), k_dim), dtype=np.float32)
    x_all[-1] += 0.5 * np.sqrt(k_dim) * w[top]
    n_parts = lin.argmax_parts(n_cols)
    first = None
    for m_rows in rows:
        x = _dev(x_all[-m_rows:])
        sizes = np.array([m_rows], np.int32)
        logits = cuda.device_array((m_rows, n_cols), np.float32)
        lin.linear(x, d_w, logits, norm_weight=nw)
        want = cuda.device_array((1, m_rows), np.int32)
        ka.posterior_argmax(logits.reshape(1, m_rows, n_cols), sizes, want)
        val = cuda.device_array((m_rows, n_parts), np.float32)
        idx = cuda.device_array((m_rows, n_parts), np.int32)
        lin.linear_argmax(x, d_w, val, idx, norm_weight=nw)
        got = cuda.device_array((1, m_rows), np.int32)
        ka.posterior_argmax_parts(val, idx, sizes, got)
        np.testing.assert_array_equal(got.copy_to_host(), want.copy_to_host())
        assert got.copy_to_host()[0, -1] == 5000
        last = val.copy_to_host()[-1:], idx.copy_to_host()[-1:]
        _check_parts(*last, logits.copy_to_host()[-1:])
        if first is None:
            first = last
        else:
            np.testing.assert_array_equal(last[0], first[0])
            np.testing.assert_array_equal(last[1], first[1])


@pytest.mark.gpu
def test_gpu_parts_walk_kimi_bs64_budget512():
    """bs 64 trees at B 512 (N 513, L 16), Kimi K2's V 163840 cut into P = argmax_parts(V) parts
    (posterior_parts: the posterior token's part holds the row's maximum); K = B makes these trees
    wide and shallow (depth <= 3), so walks of up to 4 nodes.
    Ties: every third row repeats its maximum in a later part (the posterior id still wins) and
    every seventh in an earlier one (the lower id wins, the walk follows it); rows all NaN
    (NaN values and (-inf, NO_INDEX) parts) and single NaN parts. Fused vs merge + walk on
    device, and vs accept_batch."""
    rng = np.random.default_rng(104)
    trees, post = _bs64_budget512_batch(rng)
    val, idx = posterior_parts(rng, post, KIMI_VOCAB)
    n_parts = lin.argmax_parts(KIMI_VOCAB)
    assert val.shape == (64 * 513, n_parts)
    winner = post.reshape(-1) // lin.argmax_part_cols(KIMI_VOCAB)  # tree tokens < 4096: part 0-2
    rows = np.arange(0, val.shape[0], 3)
    later = rng.integers(winner[rows] + 1, n_parts)
    val[rows, later] = PART_WINNER
    rows = np.arange(1, val.shape[0], 7)
    earlier = rows[winner[rows] > 0]
    val[earlier, 0] = PART_WINNER
    val[rng.integers(0, val.shape[0], 200), rng.integers(0, n_parts, 200)] = np.nan
    val[rng.integers(0, val.shape[0], 40)] = np.nan
    dead = rng.integers(0, val.shape[0], 40)
    val[dead], idx[dead] = -np.inf, ka.NO_INDEX
    (_, lengths, _), merged = _check_walk(val, idx, trees, GPU_HORIZON + 1)
    assert lengths.max() >= 3 and np.any(merged == NO_INDEX)
