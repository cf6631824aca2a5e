"""Posterior (argmax / Philox Gumbel-max) and acceptance-walk kernels against the reference.

Simulator tests: tiny shapes (V <= 300, N <= 24, one or two warps for the posterior rows); every
output is an integer and must be bit-exact against reference.sample_posterior / accept_batch and
the golden files. ``gpu`` tests run Kimi K2 shapes on the H200 (skipped under the simulator).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from numba import cuda, njit

from ddtree_numba.bench.accept_compact import random_posterior
from ddtree_numba.golden import read_all
from ddtree_numba.kernels import accept as ka
from ddtree_numba.kernels import registry
from reference import accept_batch, build_tree_batch, philox4x32, sample_posterior, topk_log_probs
from reference.golden_cases import batch_from_vars, tree_from_vars
from reference.sampling import GREEDY_TEMPERATURE
from reference.tree import TreeBatch
from sim.launch import LaunchConfigError

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "golden"
SIM_THREADS = 32  # one warp: the cheapest simulated block


# --- helpers ---------------------------------------------------------------------------------

def _argmax(logits, sizes, threads=SIM_THREADS) -> np.ndarray:
    """posterior_argmax into a device buffer, returned on the host."""
    out = cuda.device_array(logits.shape[:2], np.int32)
    ka.posterior_argmax(logits, sizes, out, threads=threads)
    return out.copy_to_host()


def _sample(logits, sizes, temperatures, seeds, positions, threads=SIM_THREADS) -> np.ndarray:
    out = cuda.device_array(logits.shape[:2], np.int32)
    ka.posterior_sample(logits, sizes, np.asarray(temperatures, np.float64), seeds, positions, out,
                        threads=threads)
    return out.copy_to_host()


def _reference_rows(logits, sizes, temperatures, seeds, positions) -> np.ndarray:
    """reference.sample_posterior per request; padding rows -1 (as the kernel writes them)."""
    expected = np.full(logits.shape[:2], -1, np.int32)
    for b, n in enumerate(sizes):
        expected[b, :n] = sample_posterior(logits[b, :n], float(temperatures[b]),
                                           int(np.uint64(seeds[b])), positions[b, :n])
    return expected


def _walk(post, trees: TreeBatch, width: int, *, on_device: bool = True):
    """accept_walk on a TreeBatch -> (accepted [bs, width], lengths [bs], bonus [bs]) on the host."""
    bs = trees.batch_size
    # np.array copies: a [None] view of a 1-D golden array has stride 0 on its unit axis, and a
    # numba device array made from it is then not C-contiguous (the simulator cannot tell)
    args = [np.array(a, dtype=np.int32) for a in (post, trees.child_ptr, trees.child_index, trees.tokens)]
    if on_device:
        args = [cuda.to_device(a) for a in args]
    accepted = cuda.device_array((bs, width), np.int32)
    lengths = cuda.device_array(bs, np.int32)
    bonus = cuda.device_array(bs, np.int32)
    ka.accept_walk(*args, accepted, lengths, bonus)
    return accepted.copy_to_host(), lengths.copy_to_host(), bonus.copy_to_host()


def _random_batch(rng, bs, n_pos, vocab, budgets, capacity=None, *, ties=False) -> TreeBatch:
    """Trees grown the official way (top-k of random logits -> heap); ``ties`` quantises logits."""
    logits = rng.standard_normal((bs * n_pos, vocab)) * 2.0
    if ties:
        logits = np.round(logits)  # many equal log-probs: heap ties by rank path
    k = max(1, min(int(max(budgets)), vocab))
    lp, ids = topk_log_probs(logits, k)
    return build_tree_batch(lp.reshape(bs, n_pos, k), ids.reshape(bs, n_pos, k), np.asarray(budgets),
                            rng.integers(0, vocab, bs), capacity=capacity)




def _padded(accepted: np.ndarray, width: int) -> np.ndarray:
    out = np.full((accepted.shape[0], width), -1, np.int32)
    out[:, :accepted.shape[1]] = accepted
    return out


# --- Philox ----------------------------------------------------------------------------------

KNOWN_ANSWERS = [  # Random123 kat_vectors, philox4x32_10: counter, key, output
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("typed", [False, True], ids=["python", "numba-typed"])
def test_philox_device_function_known_answers_and_reference(typed):
    """The device function's source, run as Python and compiled with numba's integer typing
    (the typing the GPU build uses: a stray int64 would turn uint64 arithmetic into float64)."""
    fn = njit(ka._philox4x32_10.py_func) if typed else ka._philox4x32_10.py_func
    rng = np.random.default_rng(7)
    cases = KNOWN_ANSWERS + [(tuple(rng.integers(0, 2**32, 4)), tuple(rng.integers(0, 2**32, 2)), None)
                             for _ in range(20)]
    for counter, key, answer in cases:
        got = tuple(int(x) for x in fn(*(np.uint64(c) for c in counter), *(np.uint64(k) for k in key)))
        expected = philox4x32(np.array(counter, np.uint32), np.array(key, np.uint32))
        assert got == tuple(int(x) for x in expected)
        if answer is not None:
            assert got == answer


def test_philox_golden_vectors():
    case = read_all(GOLDEN / "sampling.h5")["philox"]
    fn = njit(ka._philox4x32_10.py_func)
    for counter, key, bits in zip(case.in_counter.values, case.in_key.values, case.out_bits.values):
        got = fn(*(np.uint64(c) for c in counter), *(np.uint64(k) for k in key))
        assert [int(x) for x in got] == bits.tolist()


def test_gumbel_device_function_matches_golden_noise():
    """Noise of (seed, position, token) from the device functions == reference gumbel_noise."""
    case = read_all(GOLDEN / "sampling.h5")["gumbel"]
    philox, gumbel = njit(ka._philox4x32_10.py_func), njit(ka._gumbel.py_func)
    seed = np.uint64(case.in_seed.values)
    vocab = int(case.in_vocab_size.values)
    for row, position in enumerate(case.in_positions.values.astype(np.uint64)):
        for v in range(vocab):
            words = philox(np.uint64(v >> 2), position & ka.MASK32, position >> ka.SHIFT32, np.uint64(0),
                           seed & ka.MASK32, seed >> ka.SHIFT32)
            assert gumbel(words[v & 3]) == pytest.approx(case.out_noise.values[row, v], rel=1e-15, abs=0)


def test_greedy_threshold_is_the_reference_one():
    assert ka.GREEDY_TEMPERATURE == GREEDY_TEMPERATURE


# --- greedy posterior ------------------------------------------------------------------------

@pytest.mark.parametrize("vocab, threads", [(1, 32), (37, 32), (64, 64), (300, 32)])
def test_argmax_random_rows(vocab, threads):
    """Random rows (V = 300 with 32 threads runs the unrolled loop once, then the tail)."""
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((2, 3, vocab)).astype(np.float32)
    sizes = np.array([3, 2], np.int32)
    got = _argmax(logits, sizes, threads)
    expected = np.argmax(logits, axis=2).astype(np.int32)
    expected[1, 2] = -1  # padding row
    np.testing.assert_array_equal(got, expected)


def test_argmax_ties_go_to_the_lowest_id():
    rng = np.random.default_rng(3)
    logits = rng.integers(-2, 3, (2, 3, 300)).astype(np.float32)  # ~60 tokens share the maximum
    logits[0, 0] = 1.5  # a constant row: token 0
    logits[1, 0, 299] = 9.0  # the last token (in the tail loop) is the only maximum
    logits[1, 1] = -1e30  # very negative, still finite
    logits[1, 1, [70, 290]] = -1e29  # a tie between two threads' candidates, unrolled and tail
    got = _argmax(cuda.to_device(logits), np.array([3, 3], np.int32))
    np.testing.assert_array_equal(got, np.argmax(logits, axis=2))
    assert got[0, 0] == 0 and got[1, 0] == 299 and got[1, 1] == 70


# --- merged parts (the lm_head-fused argmax) -------------------------------------------------

def _parts_of(logits: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, per column block of ``width``: (largest non-NaN value, its lowest id), or
    (-inf, NO_INDEX) for an all-NaN block (what linear.linear_argmax writes)."""
    rows, vocab = logits.shape
    n_parts = -(-vocab // width)
    val = np.full((rows, n_parts), -np.inf, np.float32)
    idx = np.full((rows, n_parts), ka.NO_INDEX, np.int32)
    for r in range(rows):
        for p in range(n_parts):
            block = logits[r, p * width:(p + 1) * width]
            if not np.isnan(block).all():
                best = np.nanmax(block)
                val[r, p] = best
                idx[r, p] = p * width + np.flatnonzero(block == best)[0]
    return val, idx


@pytest.mark.parametrize("vocab, width, threads", [(27, 6, 32), (40, 1, 64)])
def test_argmax_parts_merge_is_posterior_argmax_of_the_full_rows(vocab, width, threads):
    """Tie-heavy integer logits with NaN entries, -inf, an all-NaN block and an all-NaN row, cut
    into parts; 40 parts of one column run the lanes' loop twice; 9 rows over 2-warp blocks
    leave a warp idle. Padding rows hold junk parts that must not be read."""
    rng = np.random.default_rng(vocab)
    bs, n_cap = 3, 3
    logits = rng.integers(-2, 3, (bs * n_cap, vocab)).astype(np.float32)
    logits[rng.random(logits.shape) < 0.1] = np.nan
    logits[0, :width] = np.nan                   # an all-NaN block
    logits[1] = np.nan                           # an all-NaN row: NO_INDEX, as posterior_argmax
    logits[2] = -np.inf
    logits[2, [3, 5]] = np.nan                   # -inf is a real logit: the lowest id wins
    sizes = np.array([3, 3, 2], np.int32)
    val, idx = _parts_of(logits, width)
    val[8], idx[8] = np.nan, -5                  # request 2, node 2: padding
    out = cuda.device_array((bs, n_cap), np.int32)
    ka.posterior_argmax_parts(cuda.to_device(val), cuda.to_device(idx), cuda.to_device(sizes), out,
                              threads=threads)
    want = _argmax(cuda.to_device(logits.reshape(bs, n_cap, vocab)), sizes)
    np.testing.assert_array_equal(out.copy_to_host(), want)
    assert want[0, 1] == ka.NO_INDEX and want[0, 2] == 0 and want[2, 2] == -1


def _parts_args():
    return dict(part_val=np.zeros((6, 4), np.float32), part_idx=np.zeros((6, 4), np.int32),
                sizes=np.array([3, 1], np.int32), out=np.full((2, 3), 7, np.int32))


@pytest.mark.parametrize("change, error, name", [
    (dict(part_val=np.zeros((6, 4), np.float64)), TypeError, "part_val"),
    (dict(part_val=np.zeros((6, 0), np.float32), part_idx=np.zeros((6, 0), np.int32)), ValueError,
     "part_val"),
    (dict(part_val=np.zeros((6, 8), np.float32)[:, ::2]), ValueError, "part_val"),
    (dict(part_idx=np.zeros((6, 4), np.int64)), TypeError, "part_idx"),
    (dict(part_idx=np.zeros((6, 3), np.int32)), ValueError, "part_idx"),
    (dict(out=np.zeros((3, 3), np.int32)), ValueError, "out"),
    (dict(out=np.zeros((2, 3), np.int64)), TypeError, "out"),
    (dict(sizes=np.array([4, 1], np.int32)), ValueError, "sizes"),
    (dict(sizes=np.array([3, 1, 1], np.int32)), ValueError, "sizes"),
    (dict(threads=48), ValueError, "threads"),
])
def test_argmax_parts_rejects_bad_arguments_before_any_work(change, error, name):
    args = _parts_args() | change
    with pytest.raises(error, match=rf"^{name}\b"):
        ka.posterior_argmax_parts(**args)
    if "out" not in change:
        assert np.all(args["out"] == 7)


# --- sampled posterior -----------------------------------------------------------------------

def test_sample_matches_reference_mixed_temperatures():
    """One launch: greedy (T = 0 and T just below the threshold) and sampled requests; int32 and
    int64 positions; 64-bit seeds (also given as int64) and positions past 2**32."""
    rng = np.random.default_rng(11)
    bs, n_cap, vocab = 4, 3, 45  # V not a multiple of 4: the last Philox group is partial
    logits = (rng.standard_normal((bs, n_cap, vocab)) * 2).astype(np.float32)
    logits[1, 0, :] = np.round(logits[1, 0, :])  # ties under greedy
    sizes = np.array([3, 3, 2, 3], np.int32)
    temperatures = [0.7, 0.0, 1.3, GREEDY_TEMPERATURE * 0.99]
    seeds = np.array([12345, 2**64 - 1, 0xDEADBEEF12345678, 7], np.uint64)
    positions = np.array([[5, 6, 6], [0, 1, 1], [2**32 - 1, 2**32, 2**32], [9, 10, 11]], np.int64)
    expected = _reference_rows(logits, sizes, temperatures, seeds, positions)
    np.testing.assert_array_equal(_sample(logits, sizes, temperatures, seeds, positions), expected)
    low = positions.copy()
    low[2] = [3, 4, 4]
    expected_low = _reference_rows(logits, sizes, temperatures, seeds, low)
    got = _sample(logits, sizes, temperatures, seeds.view(np.int64), low.astype(np.int32), threads=64)
    np.testing.assert_array_equal(got, expected_low)


def test_sample_depends_on_position_not_on_node_index():
    """Two nodes at the same position with the same logits draw the same token (siblings share
    noise); the same logits at another position draw independently (spec §1.4 convention)."""
    rng = np.random.default_rng(12)
    row = (rng.standard_normal(64) * 0.5).astype(np.float32)  # flat: the noise decides
    logits = np.tile(row, (1, 3, 1))  # [1, 3, 64]
    positions = np.array([[40, 41, 41]], np.int64)
    got = _sample(logits, np.array([3], np.int32), [1.0], np.array([99], np.uint64), positions)
    assert got[0, 1] == got[0, 2]
    expected = [sample_posterior(row[None], 1.0, 99, np.array([p]))[0] for p in (40, 41)]
    assert got[0, :2].tolist() == expected


@pytest.mark.parametrize("name", ["greedy", "t0_7", "t1_3"])
def test_sample_golden(name):
    case = read_all(GOLDEN / "sampling.h5")[name]
    logits = case.in_logits.values.astype(np.float32)[None]  # [1, T, V]
    assert np.array_equal(logits[0], case.in_logits.values)  # stored as float32 already
    n_rows = logits.shape[1]
    got = _sample(logits, np.array([n_rows], np.int32), [float(case.in_temperature.values)],
                  np.array([case.in_seed.values], np.uint64), case.in_positions.values[None])
    np.testing.assert_array_equal(got[0], case.out_tokens.values)


# --- walk ------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed, ties", [(21, False), (22, True)])
def test_walk_random_batches(seed, ties):
    """Ragged batch (budgets 0..16, capacity above the largest tree), deep-path posteriors."""
    rng = np.random.default_rng(seed)
    budgets = [16, 0, 7, 12, 3, 16]
    trees = _random_batch(rng, 6, 4, 6, budgets, capacity=20, ties=ties)
    post = random_posterior(rng, trees, 6, follow=0.85)
    post[:, -1] = -1  # padding rows: ignored
    accepted, lengths, bonus = accept_batch(post, trees)
    width = 5  # L + 1
    got = _walk(post, trees, width)
    np.testing.assert_array_equal(got[0], _padded(accepted, width))
    np.testing.assert_array_equal(got[1], lengths)
    np.testing.assert_array_equal(got[2], bonus)
    assert lengths.max() > 2  # the posteriors did follow deep paths


def test_walk_wide_root_and_token_zero():
    """A root with 44 children (two 32-lane scans), token id 0 accepted at depth 1 and 2."""
    k, budget = 44, 46
    lp = np.empty((2, 2, k))
    lp[:, 0] = -3.87 - np.linspace(0.0, 0.005, k)  # flat depth 1: it takes 44 of the 46 nodes
    lp[:, 1] = -10.0
    lp[:, 1, 0] = -0.01
    ids = np.stack([np.stack([np.arange(1, k + 1), np.arange(k)])] * 2)  # [2, 2, K]
    ids[0, 0, -1] = 0  # request 0: the last root child (node 44) has token id 0
    trees = build_tree_batch(lp, ids, [budget, budget], [5, 6])
    assert trees.child_ptr[:, 1].min() == k
    post = np.full((2, trees.capacity), 3, np.int32)
    post[0, 0] = 0  # request 0: root -> node 44 (its last child)
    post[1, 0], post[1, 1] = 1, 0  # request 1: root -> node 1 -> node 45 (token 0)
    accepted, lengths, bonus = accept_batch(post, trees)
    assert accepted[0, 1] == k and accepted[1].tolist() == [0, 1, k + 1]
    got = _walk(post, trees, 3, on_device=False)
    np.testing.assert_array_equal(got[0], _padded(accepted, 3))
    np.testing.assert_array_equal(got[1], lengths)
    np.testing.assert_array_equal(got[2], bonus)


def _follow_deepest(trees: TreeBatch, post: np.ndarray) -> None:
    """Make each request's posterior follow the path to its deepest (first) node, in place."""
    for b in range(trees.batch_size):
        node = int(np.argmax(trees.depths[b]))
        while node > 0:
            parent = int(trees.parents[b, node])
            post[b, parent] = trees.tokens[b, node]
            node = parent


def test_walk_truncates_to_the_buffer_width():
    """A buffer narrower than the path keeps its first W nodes; the bonus is the posterior of the
    last kept node (the target's own next token); a wider buffer is padded with -1."""
    rng = np.random.default_rng(24)
    trees = _random_batch(rng, 1, 4, 5, [12])
    post = random_posterior(rng, trees, 5, follow=0.0)
    _follow_deepest(trees, post)
    accepted, lengths, _ = accept_batch(post, trees)
    assert lengths[0] == trees.depths.max() + 1 >= 3
    narrow = _walk(post, trees, 2)
    np.testing.assert_array_equal(narrow[0][0], accepted[0, :2])
    assert narrow[1][0] == 2 and narrow[2][0] == post[0, accepted[0, 1]]
    wide = _walk(post, trees, 9)
    np.testing.assert_array_equal(wide[0], _padded(accepted, 9))


@pytest.mark.parametrize("name", ["random_a", "random_b", "random_c", "full_depth", "root_only", "batch"])
def test_walk_golden(name):
    case = read_all(GOLDEN / "accept.h5")[name]
    if name == "batch":
        trees = batch_from_vars(case, "in_tree_")
        post = case.in_posterior_tokens.values
        expected = (case.out_accepted.values, case.out_lengths.values, case.out_bonus.values)
    else:
        tree = tree_from_vars(case, "in_tree_")
        n = tree.n_nodes
        trees = TreeBatch(np.array([n], np.int32), tree.tokens[None], tree.parents[None], tree.depths[None],
                          tree.ranks[None], tree.scores[None], tree.visibility[None], tree.child_ptr[None],
                          np.concatenate([tree.child_index, [-1]]).astype(np.int32)[None])
        post = case.in_posterior_tokens.values[None]
        expected = (case.out_accepted.values[None], np.array([case.out_length.values]),
                    np.array([case.out_bonus.values]))
    width = int(trees.depths.max()) + 1
    got = _walk(post, trees, width)
    np.testing.assert_array_equal(got[0], _padded(expected[0], width))
    np.testing.assert_array_equal(got[1], expected[1])
    np.testing.assert_array_equal(got[2], expected[2])


def test_walk_malformed_device_csr_is_never_read_out_of_bounds():
    """Device values are not checked on the host: a child range reaching past N or below 0 is
    clamped to the staged [N] slots and children outside [1, N) are skipped (under the
    simulator an index >= N raises IndexError; a negative one would silently wrap, which the
    expected outputs would catch)."""
    n_cap = 6
    tokens = np.array([[7, 10, 20, 30, 40, 50]] * 2, np.int32)
    child_ptr = np.array([[-2, 1, 1, 1, 1, 1, 1],  # root range [-2, 1) -> [0, 1)
                          [0, 2, 2, 9, 9, 9, 9]], np.int32)  # node 2: [2, 9) -> [2, 6)
    child_index = np.array([[1, 0, 0, 0, 4, 5],  # wrapped reads at -2, -1 would find 4, 5
                            [-1, 2, 7, 3, 0, 4]], np.int32)  # -1, 7 and 0 are skipped
    post = np.array([[50, 0, 0, 0, 0, 0],  # token 50 is node 5's, reachable only by wrapping
                     [20, 0, 40, 0, 33, 0]], np.int32)
    accepted = cuda.device_array((2, 4), np.int32)
    lengths = cuda.device_array(2, np.int32)
    bonus = cuda.device_array(2, np.int32)
    ka.accept_walk(*(cuda.to_device(a) for a in (post, child_ptr, child_index, tokens)),
                   accepted, lengths, bonus)
    assert tokens.shape[1] == n_cap
    assert accepted.copy_to_host().tolist() == [[0, -1, -1, -1], [0, 2, 4, -1]]
    assert lengths.copy_to_host().tolist() == [1, 3]
    assert bonus.copy_to_host().tolist() == [50, 33]


def test_argmax_then_walk_end_to_end():
    """Target logits whose argmax follows the tree -> posterior_argmax -> accept_walk on device."""
    rng = np.random.default_rng(25)
    vocab = 8
    trees = _random_batch(rng, 2, 3, vocab, [9, 5])
    want = random_posterior(rng, trees, vocab, follow=0.9)
    logits = rng.standard_normal((2, trees.capacity, vocab)).astype(np.float32)
    np.put_along_axis(logits, want[..., None].astype(np.int64), 5.0, axis=2)  # argmax = want
    post = cuda.device_array(want.shape, np.int32)
    ka.posterior_argmax(cuda.to_device(logits), cuda.to_device(trees.sizes), post, threads=SIM_THREADS)
    host_post = post.copy_to_host()
    accepted, lengths, bonus = accept_batch(host_post, trees)
    got = _walk(host_post, trees, 4)
    np.testing.assert_array_equal(got[0], _padded(accepted, 4))
    np.testing.assert_array_equal(got[1], lengths)
    np.testing.assert_array_equal(got[2], bonus)


# --- argument checks -------------------------------------------------------------------------

def _posterior_args():
    logits = np.zeros((2, 3, 8), np.float32)
    return dict(logits=logits, sizes=np.array([3, 1], np.int32), out=np.full((2, 3), 7, np.int32))


def _logits_with(value: float, b: int, i: int) -> np.ndarray:
    """float32 [2, 3, 8] zeros with ``value`` at token 5 of row (b, i)."""
    logits = np.zeros((2, 3, 8), np.float32)
    logits[b, i, 5] = value
    return logits


@pytest.mark.parametrize("change, error, name", [
    (dict(logits=np.zeros((2, 3, 8), np.float64)), TypeError, "logits"),
    (dict(logits=[[[0.0]]]), TypeError, "logits"),
    (dict(logits=np.zeros((2, 24), np.float32)), ValueError, "logits"),
    (dict(logits=np.zeros((2, 3, 16), np.float32)[:, :, ::2]), ValueError, "logits"),
    (dict(logits=np.zeros((2, 3, 0), np.float32), out=np.zeros((2, 3), np.int32)), ValueError, "logits"),
    (dict(sizes=np.array([3, 1], np.int64)), TypeError, "sizes"),
    (dict(sizes=np.array([3], np.int32)), ValueError, "sizes"),
    (dict(sizes=np.array([4, 1], np.int32)), ValueError, "sizes"),
    (dict(sizes=np.array([3, 0], np.int32)), ValueError, "sizes"),
    (dict(out=np.zeros((2, 3), np.int64)), TypeError, "out"),
    (dict(out=np.zeros((2, 4), np.int32)), ValueError, "out"),
    (dict(logits=_logits_with(np.nan, 0, 2)), ValueError, "logits"),  # request 0 has 3 real rows
    (dict(logits=_logits_with(-np.inf, 1, 0)), ValueError, "logits"),
])
def test_argmax_rejects_bad_arguments_before_any_work(change, error, name):
    args = _posterior_args() | change
    with pytest.raises(error, match=rf"^{name}\b"):
        ka.posterior_argmax(**args)
    if "out" not in change:
        assert np.all(args["out"] == 7)


@pytest.mark.parametrize("threads, error", [(48, ValueError), (0, ValueError), (2048, ValueError),
                                            (64.0, TypeError), (True, TypeError)])
def test_threads_checked(threads, error):
    with pytest.raises(error, match=r"^threads\b"):
        ka.posterior_argmax(**_posterior_args(), threads=threads)


def test_block_sizes_are_capped_at_the_registered_block_threads():
    """Each wrapper accepts blocks up to the kernel's registered block_threads (which the compile
    check verifies against its registers) and refuses larger ones before any work."""
    assert registry.get("posterior_argmax").block_threads == ka.MAX_ARGMAX_THREADS == 1024
    assert registry.get("posterior_sample").block_threads == ka.MAX_SAMPLE_THREADS
    assert registry.get("accept_walk").block_threads == ka.WALK_THREADS
    assert registry.get("posterior_argmax_parts").block_threads == ka.MAX_MERGE_THREADS
    args = _sample_args()
    with pytest.raises(ValueError, match=r"^threads\b"):
        ka.posterior_sample(**args, threads=ka.MAX_SAMPLE_THREADS + 32)
    assert np.all(args["out"] == 7)


def _sample_args():
    return _posterior_args() | dict(temperatures=np.array([0.5, 0.0]), seeds=np.array([1, 2], np.uint64),
                                    positions=np.zeros((2, 3), np.int64))


@pytest.mark.parametrize("change, error, name", [
    (dict(temperatures=np.array([0.5, 0.0], np.float32)), TypeError, "temperatures"),
    (dict(temperatures=np.array([0.5])), ValueError, "temperatures"),
    (dict(temperatures=np.array([0.5, -1.0])), ValueError, "temperatures"),
    (dict(temperatures=np.array([0.5, np.nan])), ValueError, "temperatures"),
    (dict(seeds=np.array([1, 2], np.int32)), TypeError, "seeds"),
    (dict(seeds=np.array([1, 2, 3], np.uint64)), ValueError, "seeds"),
    (dict(positions=np.zeros((2, 3), np.uint32)), TypeError, "positions"),
    (dict(positions=np.zeros((2, 2), np.int64)), ValueError, "positions"),
    (dict(positions=np.full((2, 3), -1, np.int64)), ValueError, "positions"),
    (dict(logits=_logits_with(np.inf, 0, 1)), ValueError, "logits"),
    (dict(logits=_logits_with(np.nan, 1, 0)), ValueError, "logits"),
])
def test_sample_rejects_bad_arguments_before_any_work(change, error, name):
    args = _sample_args() | change
    with pytest.raises(error, match=rf"^{name}\b"):
        ka.posterior_sample(**args)
    assert np.all(args["out"] == 7)


def _walk_args(n_cap=4, bs=2):
    z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    return dict(posterior=z(bs, n_cap), child_ptr=z(bs, n_cap + 1), child_index=z(bs, n_cap), tokens=z(bs, n_cap),
                accepted=np.full((bs, 3), 7, np.int32), lengths=z(bs), bonus=z(bs))


# Bad tree / output arguments of both walks (accept_walk, and accept_walk_parts in
# test_kernel_posterior_fused): changes of _walk_args() (bs 2, N 4, W 3).
BAD_TREE_AND_OUTPUTS = [
    (dict(child_index=np.zeros((2, 4), np.int64)), TypeError, "child_index"),
    (dict(child_index=np.zeros((2, 5), np.int32)), ValueError, "child_index"),
    (dict(tokens=np.zeros((2, 5), np.int32)), ValueError, "tokens"),
    (dict(tokens=np.zeros((2, 8), np.int32)[:, ::2]), ValueError, "tokens"),
    (dict(accepted=np.zeros((2, 0), np.int32)), ValueError, "accepted"),
    (dict(accepted=np.zeros((3, 3), np.int32)), ValueError, "accepted"),
    (dict(lengths=np.zeros(2, np.uint32)), TypeError, "lengths"),
    (dict(bonus=np.zeros(3, np.int32)), ValueError, "bonus"),
    (dict(bonus="zeros"), TypeError, "bonus"),
]


@pytest.mark.parametrize("change, error, name", [
    (dict(posterior=np.zeros((2, 4), np.int64)), TypeError, "posterior"),
    (dict(posterior=np.zeros((2, 0), np.int32), child_ptr=np.zeros((2, 1), np.int32),
          child_index=np.zeros((2, 0), np.int32), tokens=np.zeros((2, 0), np.int32)), ValueError, "posterior"),
    (dict(child_ptr=np.zeros((2, 4), np.int32)), ValueError, "child_ptr"),
] + BAD_TREE_AND_OUTPUTS)
def test_walk_rejects_bad_arguments_before_any_work(change, error, name):
    args = _walk_args() | change
    with pytest.raises(error, match=rf"^{name}\b"):
        ka.accept_walk(**args)
    if "accepted" not in change:
        assert np.all(args["accepted"] == 7)


def test_non_finite_host_logits_in_padding_rows_are_ignored():
    """Only real rows (i < sizes[b]) must be finite: padding rows are never read."""
    rng = np.random.default_rng(31)
    logits = rng.standard_normal((2, 3, 8)).astype(np.float32)
    logits[1, 1:] = np.nan  # request 1 has one real row
    sizes = np.array([3, 1], np.int32)
    expected = np.argmax(np.nan_to_num(logits), axis=2).astype(np.int32)
    expected[1, 1:] = -1
    np.testing.assert_array_equal(_argmax(logits, sizes), expected)
    got = _sample(logits, sizes, [0.0, 0.0], np.array([1, 2], np.uint64), np.zeros((2, 3), np.int64))
    np.testing.assert_array_equal(got, expected)


def _tree_walk_args():
    """Two well-formed padded trees, N = 4: request 0 is 0 -> {1, 2}, 2 -> 3; request 1 is 0 -> 1
    (nodes 2, 3 padding: posterior -1, child_index -1)."""
    return _walk_args() | dict(
        posterior=np.array([[0, 0, 0, 0], [0, 0, -1, -1]], np.int32),
        child_ptr=np.array([[0, 2, 2, 3, 3], [0, 1, 1, 1, 1]], np.int32),
        child_index=np.array([[1, 2, 3, -1], [1, -1, -1, -1]], np.int32),
        tokens=np.array([[9, 0, 4, 5], [9, 3, -1, -1]], np.int32))


def _set(key: str, index, value: int):
    """An edit of one host value of the _tree_walk_args() argument ``key``."""
    return lambda args: args[key].__setitem__(index, value)


BAD_CSR_VALUES = [  # edits of _tree_walk_args()'s CSR, rejected by both walks
    (_set("child_ptr", (0, 2), 1), "child_ptr"),  # decreasing: [0, 2, 1, 3, 3]
    (_set("child_ptr", (1, 0), -1), "child_ptr"),
    (_set("child_ptr", (0, slice(3, None)), 4), "child_ptr"),  # > N - 1
    (_set("child_index", (0, 2), 4), "child_index"),  # >= N on a real entry
    (_set("child_index", (1, 0), 0), "child_index"),  # the root is nobody's child
    (_set("child_index", (0, 0), -1), "child_index"),
]


@pytest.mark.parametrize("edit, name", [
    (_set("posterior", (1, 1), -1), "posterior"),  # node 1 of request 1 is real
    (_set("posterior", (0, 3), -5), "posterior"),
] + BAD_CSR_VALUES)
def test_walk_rejects_bad_host_values_before_any_work(edit, name):
    args = _tree_walk_args()
    edit(args)
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        ka.accept_walk(**args)
    assert np.all(args["accepted"] == 7)


def test_walk_host_values_ignore_padding():
    """Negative posteriors on padding nodes and -1 padding child_index entries are accepted."""
    args = _tree_walk_args()
    args["posterior"][0] = [4, 0, 5, 0]  # request 0: root -> node 2 (token 4) -> node 3 (token 5)
    args["posterior"][1, 0] = 3  # request 1: root -> node 1 (token 3)
    ka.accept_walk(**args)
    assert args["accepted"].tolist() == [[0, 2, 3], [0, 1, -1]]
    assert args["lengths"].tolist() == [3, 2] and args["bonus"].tolist() == [0, 0]


def test_walk_capacity_over_the_shared_memory_limit():
    """N = 3072 needs 48 KiB + 4 B of shared memory: refused by the launch check, not launched."""
    args = _walk_args(n_cap=3072, bs=1)
    assert ka.walk_shared_bytes(3071) <= 48 * 1024 < ka.walk_shared_bytes(3072)
    with pytest.raises(LaunchConfigError, match="shared memory"):
        ka.accept_walk(**args)
    assert np.all(args["accepted"] == 7)


# --- H200: real shapes -----------------------------------------------------------------------

KIMI_VOCAB = 163840


@pytest.mark.gpu
def test_gpu_argmax_kimi_vocab():
    """bs 8 x N 65 rows of V = 163840 (340 MB): random and bf16-quantised (tie-heavy) logits."""
    rng = np.random.default_rng(101)
    bs, n_cap = 8, 65
    sizes = rng.integers(1, n_cap + 1, bs).astype(np.int32)
    sizes[0] = n_cap
    for quantise in (False, True):
        logits = rng.standard_normal((bs, n_cap, KIMI_VOCAB), dtype=np.float32) * 3
        if quantise:
            logits = (logits.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)  # bf16 values
            logits = np.round(logits)  # many exact maxima per row
        got = _argmax(cuda.to_device(logits), sizes, threads=ka.ARGMAX_THREADS)
        expected = np.argmax(logits, axis=2).astype(np.int32)
        expected[np.arange(n_cap)[None, :] >= sizes[:, None]] = -1
        np.testing.assert_array_equal(got, expected)


@pytest.mark.gpu
def test_gpu_sample_kimi_vocab():
    """Greedy and sampled requests at V = 163840 against the reference, bit for bit."""
    rng = np.random.default_rng(102)
    bs, n_cap = 4, 17
    logits = rng.standard_normal((bs, n_cap, KIMI_VOCAB), dtype=np.float32) * 2
    sizes = np.array([17, 9, 17, 1], np.int32)
    temperatures = np.array([0.0, 0.7, 1.0, 1.3])
    seeds = rng.integers(0, 2**63, bs, dtype=np.int64).astype(np.uint64) * np.uint64(2) + np.uint64(1)
    depths = rng.integers(0, 16, (bs, n_cap))
    positions = (np.array([[3000], [0], [2**32 - 8], [77]]) + depths).astype(np.int64)
    got = _sample(cuda.to_device(logits), sizes, temperatures, seeds, positions, threads=ka.ARGMAX_THREADS)
    np.testing.assert_array_equal(got, _reference_rows(logits, sizes, temperatures, seeds, positions))


GPU_HORIZON = 16  # L of the bs 64, B 512 walks


def _bs64_budget512_batch(rng: np.random.Generator, vocab: int = 4096) -> tuple[TreeBatch, np.ndarray]:
    """64 trees at B = 512 (L = GPU_HORIZON, K = B, budgets in [B / 2, B], the first B) and their
    deep-path posteriors (also the fused walk's GPU test)."""
    bs, budget = 64, 512
    budgets = rng.integers(budget // 2, budget + 1, bs)
    budgets[0] = budget
    trees = _random_batch(rng, bs, GPU_HORIZON, vocab, budgets, capacity=budget + 1)
    return trees, random_posterior(rng, trees, vocab, follow=0.9)


@pytest.mark.gpu
def test_gpu_walk_bs64_budget512():
    """64 trees at B = 512 (L = 16, K = B) with deep-path posteriors, against accept_batch."""
    trees, post = _bs64_budget512_batch(np.random.default_rng(103))
    n_pos = GPU_HORIZON
    accepted, lengths, bonus = accept_batch(post, trees)
    got = _walk(post, trees, n_pos + 1)
    np.testing.assert_array_equal(got[0], _padded(accepted, n_pos + 1))
    np.testing.assert_array_equal(got[1], lengths)
    np.testing.assert_array_equal(got[2], bonus)
