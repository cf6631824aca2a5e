"""GPU tree build (ddtree_numba.kernels.tree_build) against reference.build_tree_batch.

Simulator tests use tiny trees (L <= 4, K <= 4, budgets <= 48, 1-3 requests, one or two warps);
every integer output and the float64 scores must be bit-exact. The ``gpu`` tests sweep real
shapes on the H200 (skipped under the simulator).
"""
from __future__ import annotations

import multiprocessing
import os
from fractions import Fraction
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from ddtree_numba.golden import read_all
from ddtree_numba.kernels import tree_build as tb
from reference import build_tree_batch, pack_visibility, topk_log_probs

GOLDEN_TREE = Path(__file__).resolve().parent.parent / "data" / "golden" / "tree.h5"
SIM_THREADS = 32  # one warp: the cheapest simulated block
INT_FIELDS = ("tokens", "parents", "depths", "ranks", "child_ptr", "child_index")


# --- helpers ---------------------------------------------------------------------------------

def _random_rows(rng: np.random.Generator, bs: int, n_pos: int, k: int, vocab: int = 100
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Sorted float32 log-probs [bs, L, K] and unique int32 ids [bs, L, K]."""
    lp = -np.sort(rng.exponential(2.0, size=(bs, n_pos, k)), axis=-1).astype(np.float32)
    ids = np.argsort(rng.random((bs, n_pos, vocab)), axis=-1)[..., :k].astype(np.int32)
    return lp, ids


def _tie_rows(rng: np.random.Generator, bs: int, n_pos: int, k: int, levels: int = 3
              ) -> tuple[np.ndarray, np.ndarray]:
    """Log-probs quantised to a few levels (exact score ties everywhere), unique ids."""
    lp, ids = _random_rows(rng, bs, n_pos, k)
    quantised = -np.sort(rng.integers(0, levels, size=lp.shape), axis=-1) * np.float32(0.5)
    return quantised.astype(np.float32), ids


def _near_tie_rows(rng: np.random.Generator, bs: int, n_pos: int, k: int, levels: int = 3
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Tie rows moved down by 0-2 float32 ulps: exact ties next to ulp-level near ties (float64
    scores a rounding step apart, where the sibling recurrence's rounding decides the order)."""
    lp, ids = _tie_rows(rng, bs, n_pos, k, levels)
    steps = rng.integers(0, 3, size=lp.shape).astype(np.float32)
    near = lp - steps * np.spacing(np.abs(lp)).astype(np.float32)
    return -np.sort(-near, axis=-1), ids


def _flat_rows(rng: np.random.Generator, bs: int, n_pos: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Nearly flat rows (log-prob gaps ~1e-3 between ranks): long runs of sibling pops."""
    lp, ids = _random_rows(rng, bs, n_pos, k)
    gaps = rng.uniform(1e-4, 2e-3, size=lp.shape)
    return (np.float32(-1.5) - np.cumsum(gaps, axis=-1)).astype(np.float32), ids


def _build(lp, ids, budgets, *, past_lens=None, roots=None, capacity=None, threads=SIM_THREADS,
           on_device=False) -> dict[str, np.ndarray]:
    """Run the kernel on host or device inputs and return every output on the host."""
    bs, n_pos, k = lp.shape
    budgets = np.asarray(budgets, dtype=np.int32)
    past_lens = np.arange(bs, dtype=np.int32) * 7 + 3 if past_lens is None else past_lens
    roots = np.arange(bs, dtype=np.int32) + 40 if roots is None else roots
    capacity = int(budgets.max()) + 1 if capacity is None else capacity
    plan = tb.plan(bs, n_pos, k, capacity, threads=threads)
    out = tb.allocate_outputs(plan)
    args = (lp, ids, budgets, past_lens, roots)
    if on_device:
        args = tuple(cuda.to_device(a) for a in args)
    tb.run(plan, *args, out)
    return out.to_host() | {"past_lens": past_lens, "roots": roots, "capacity": capacity}


def _assert_matches_reference(got: dict[str, np.ndarray], lp, ids, budgets) -> None:
    """Every output equals reference.build_tree_batch (clamped budgets), bit for bit."""
    budgets = np.minimum(np.asarray(budgets, dtype=np.int64), got["capacity"] - 1)
    ref = build_tree_batch(lp, ids, budgets, got["roots"].astype(np.int64), capacity=got["capacity"])
    np.testing.assert_array_equal(got["sizes"], ref.sizes)
    for name in INT_FIELDS:
        np.testing.assert_array_equal(got[name], getattr(ref, name), err_msg=name)
    np.testing.assert_array_equal(got["scores"].view(np.int64), ref.scores.view(np.int64), err_msg="scores")
    np.testing.assert_array_equal(got["positions"], got["past_lens"][:, None] + ref.depths)
    np.testing.assert_array_equal(got["visibility"], pack_visibility(ref.visibility))


def _rank_paths(got: dict[str, np.ndarray], b: int) -> list[tuple[int, ...]]:
    """Rank path of every drafted node of request b, in node order."""
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, int(got["sizes"][b])):
        paths.append(paths[got["parents"][b, i]] + (int(got["ranks"][b, i]),))
    return paths[1:]


# --- simulator: agreement with the reference -------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_random_small_trees(seed):
    rng = np.random.default_rng(seed)
    n_pos, k = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    lp, ids = _random_rows(rng, 2, n_pos, k)
    budgets = rng.integers(0, 17, size=2)
    _assert_matches_reference(_build(lp, ids, budgets), lp, ids, budgets)


@pytest.mark.parametrize("seed", range(3))
def test_tie_heavy_trees(seed):
    rng = np.random.default_rng(100 + seed)
    lp, ids = _tie_rows(rng, 2, 3 + seed % 2, 4)
    budgets = rng.integers(8, 17, size=2)
    _assert_matches_reference(_build(lp, ids, budgets), lp, ids, budgets)


@pytest.mark.parametrize("seed", range(3))
def test_near_tie_trees(seed):
    """Ulp-level near ties: a sibling run must stop at every score it cannot strictly beat."""
    rng = np.random.default_rng(200 + seed)
    lp, ids = _near_tie_rows(rng, 2, 3, 4 + seed)
    budgets = rng.integers(10, 25, size=2)
    _assert_matches_reference(_build(lp, ids, budgets), lp, ids, budgets)


def test_long_sibling_runs_on_flat_rows():
    """Flat rows: depth-1 siblings pop in runs longer than RUN_MAX, runs stop at the budget and
    at K (no sibling left), children take over (the second request's depth 2 is sharp)."""
    rng = np.random.default_rng(13)
    lp, ids = _flat_rows(rng, 2, 2, 3 * tb.RUN_MAX // 2)
    lp[1, 1] = np.float32(-0.001) - np.float32(1.0) * np.arange(lp.shape[2], dtype=np.float32)
    budgets = np.array([2 * tb.RUN_MAX + 5, 3 * tb.RUN_MAX])
    _assert_matches_reference(_build(lp, ids, budgets), lp, ids, budgets)


def test_peaked_rows_pop_chains_and_the_runner_up():
    """Peaked rows (top-1 near 0, the rest far below): deep chains of first children, runner-up
    pops; the counting variant reports fewer rounds than nodes, and the same tree."""
    rng = np.random.default_rng(17)
    lp, ids = _random_rows(rng, 2, 4, 3)
    lp[:, :, 0] = -rng.uniform(1e-3, 0.2, size=(2, 4)).astype(np.float32)
    budgets = np.array([30, 23])
    plan = tb.plan(2, 4, 3, 31, threads=SIM_THREADS)
    out = tb.allocate_outputs(plan)
    rounds = cuda.to_device(np.zeros((2, 2), np.int32))
    past, roots = np.array([3, 10], np.int32), np.array([40, 41], np.int32)
    tb.run(plan, lp, ids, budgets.astype(np.int32), past, roots, out, rounds=rounds)
    got = out.to_host() | {"past_lens": past, "roots": roots, "capacity": 31}
    _assert_matches_reference(got, lp, ids, budgets)
    n_rounds, placed = rounds.copy_to_host().T
    assert (n_rounds >= 1).all() and (n_rounds < budgets // 2).all(), n_rounds
    assert (placed == 0).all()  # budgets below BAND_MIN_BUDGET: the heap pops every node


def test_round_counter_on_flat_rows_and_ties():
    """Rounds: at most one per node, fewer on flat rows (runs), and the tree is unchanged."""
    rng = np.random.default_rng(19)
    lp, ids = _flat_rows(rng, 2, 2, 8)
    lp[1], _ = _tie_rows(rng, 1, 2, 8, levels=2)
    budgets = np.array([20, 20], np.int32)
    plan = tb.plan(2, 2, 8, 21, threads=SIM_THREADS)
    out = tb.allocate_outputs(plan)
    rounds = np.zeros((2, 2), np.int32)
    past, roots = np.array([0, 0], np.int32), np.array([1, 2], np.int32)
    tb.run(plan, lp, ids, budgets, past, roots, out, rounds=rounds)
    _assert_matches_reference(out.to_host() | {"past_lens": past, "roots": roots, "capacity": 21},
                              lp, ids, budgets)
    assert 1 <= rounds[0, 0] <= 10 and 1 <= rounds[1, 0] <= 20, rounds


def test_many_slots_per_lane_with_ties():
    """48 pops: lanes own two slots each, equal scores inside a lane and across lanes."""
    rng = np.random.default_rng(7)
    lp, ids = _tie_rows(rng, 1, 4, 4, levels=2)
    _assert_matches_reference(_build(lp, ids, [48]), lp, ids, [48])


def test_two_warps_and_device_inputs():
    """64 threads (warp 1 only writes outputs); inputs already on the device."""
    rng = np.random.default_rng(11)
    lp, ids = _random_rows(rng, 2, 3, 3)
    budgets = np.array([12, 5])
    got = _build(lp, ids, budgets, threads=64, on_device=True)
    _assert_matches_reference(got, lp, ids, budgets)


def test_equiprobable_order_matches_spec():
    """Spec §1.2: 4 equiprobable tokens per depth, L = 3, B = 10."""
    lp = np.full((1, 3, 4), np.log(0.25), dtype=np.float32)
    ids = (np.arange(3)[:, None] * 10 + np.arange(4)[None, :] + 10).astype(np.int32)[None]
    got = _build(lp, ids, [10])
    assert _rank_paths(got, 0) == [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    _assert_matches_reference(got, lp, ids, [10])


def test_tied_signed_zeros_keep_the_winners_bits():
    """A tie of +0.0 (sibling (1,): (-0.0 - -0.0) + -0.0) and -0.0 (first child (0, 0): -0.0 + -0.0):
    the heap pops (0, 0) first and records its own -0.0, not the other tied candidate's +0.0."""
    lp = np.array([[[-0.0, -0.0], [-0.0, -1.0]]], dtype=np.float32)
    ids = np.array([[[5, 6], [7, 8]]], dtype=np.int32)
    got = _build(lp, ids, [4])
    assert _rank_paths(got, 0)[:3] == [(0,), (0, 0), (1,)]
    assert np.signbit(got["scores"][0, 1:4]).tolist() == [True, True, False]
    _assert_matches_reference(got, lp, ids, [4])


def test_exhaustion_v2():
    """Spec §1.2: V = 2, L = 3, B = 20 drafts all 2 + 4 + 8 = 14 nodes; the rest is padding."""
    rng = np.random.default_rng(3)
    lp, ids = topk_log_probs(rng.normal(size=(3, 2)), 2)
    lp, ids = lp[None], ids.astype(np.int32)[None]
    got = _build(lp, ids, [20])
    assert got["sizes"][0] == 15
    assert (got["child_index"][0, 14:] == -1).all() and (got["tokens"][0, 15:] == -1).all()
    _assert_matches_reference(got, lp, ids, [20])


@pytest.mark.parametrize("n_pos,k,budget", [(3, 3, 0), (3, 3, 1), (1, 4, 6), (4, 1, 7), (0, 3, 5), (2, 0, 5)])
def test_edge_shapes(n_pos, k, budget):
    """Budget 0 / 1, L = 1, K = 1 (a chain of length L), and L = 0 or K = 0 (root only)."""
    rng = np.random.default_rng(n_pos * 10 + k)
    lp, ids = _random_rows(rng, 1, n_pos, k)
    got = _build(lp, ids, [budget], capacity=8)
    if n_pos == 0 or k == 0 or budget == 0:
        assert got["sizes"][0] == 1
    if k == 1:
        np.testing.assert_array_equal(got["depths"][0, :got["sizes"][0]], np.arange(got["sizes"][0]))
    _assert_matches_reference(got, lp, ids, [budget])


def test_budget_equal_to_horizon_is_not_a_chain():
    """Spec §1.2 (b): depth-1 probs [0.5, 0.4, 0.1], later top-1 0.5, B = L = 3."""
    probs = np.array([[0.5, 0.4, 0.1], [0.5, 0.3, 0.2], [0.5, 0.3, 0.2]])
    lp = np.log(probs).astype(np.float32)[None]
    ids = np.array([[[7, 3, 5], [1, 2, 9], [4, 8, 6]]], dtype=np.int32)
    got = _build(lp, ids, [3])
    assert _rank_paths(got, 0) == [(0,), (1,), (0, 0)]
    _assert_matches_reference(got, lp, ids, [3])


def test_budget_fills_a_slot_class():
    """Budget 64 = 32 lanes x 2 slots: the last node (64) gets no slot."""
    rng = np.random.default_rng(8)
    lp, ids = _random_rows(rng, 1, 3, 4)
    assert tb.plan(1, 3, 4, 65).slots_per_lane == 2
    _assert_matches_reference(_build(lp, ids, [64]), lp, ids, [64])


def test_ranks_past_the_lp_cache_come_from_global_memory(monkeypatch):
    """A kernel whose lp cache holds 2 ranks per depth (L = 3): deeper ranks read global memory."""
    monkeypatch.setitem(tb.tree_build_kernels, 2, tb._make_kernel(2, lp_words=6))
    rng = np.random.default_rng(12)
    lp, ids = _random_rows(rng, 2, 3, 5)
    lp[1] = np.float32(-0.25) * np.arange(5, dtype=np.float32)  # flat rows: high ranks pop early
    budgets = np.array([20, 14])
    _assert_matches_reference(_build(lp, ids, budgets), lp, ids, budgets)


def test_device_budgets_are_clamped_to_capacity():
    """Device inputs are not value-checked; a budget past the capacity builds capacity - 1 nodes."""
    rng = np.random.default_rng(5)
    lp, ids = _random_rows(rng, 2, 3, 3)
    got = _build(lp, ids, [100, -4], capacity=6, on_device=True)
    np.testing.assert_array_equal(got["sizes"], [6, 1])
    _assert_matches_reference(got, lp, ids, [5, 0])


def test_outputs_into_caller_numpy_buffers_and_token_zero():
    """Caller-owned NumPy buffers are filled in place; token id 0 is an ordinary token."""
    lp = np.log(np.array([[[0.6, 0.3, 0.1], [0.7, 0.2, 0.1]]])).astype(np.float32)
    ids = np.array([[[0, 4, 2], [0, 3, 1]]], dtype=np.int32)
    plan = tb.plan(1, 2, 3, 5, threads=SIM_THREADS)
    out = tb.TreeBuildOutputs(**{name: np.full(shape, 99, dtype) for name, (shape, dtype)
                                 in plan.output_shapes().items()})
    tb.run(plan, lp, ids, np.array([4], np.int32), np.array([9], np.int32), np.array([0], np.int32), out)
    # nodes (0,), (0,0), (1,), (1,0): tokens 0, 0, 4, 0 under root 0
    np.testing.assert_array_equal(out.tokens[0], [0, 0, 0, 4, 0])
    got = out.to_host() | {"past_lens": np.array([9], np.int32), "roots": np.array([0], np.int32), "capacity": 5}
    _assert_matches_reference(got, lp, ids, [4])


# --- simulator: the threshold phase (kernels built with it on at tiny budgets) ---------------

@pytest.fixture
def bands_on(monkeypatch):
    """Variant S = 2 (capacity <= 65) with the threshold phase from budget 1, leaving <= 2 pops
    (or ``left``) to the heap; the plain and the round-counting kernel."""
    def install(left: int = 2) -> None:
        monkeypatch.setitem(tb.tree_build_kernels, 2, tb._make_kernel(2, band_min_budget=1, band_left=left))
        monkeypatch.setitem(tb._counting_kernels, 2,
                            tb._make_kernel(2, count_rounds=True, band_min_budget=1, band_left=left))
    install()
    return install


def _build_counted(lp, ids, budgets) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Outputs (as _build) and the counting variant's int32 [bs, 2] (heap rounds, nodes placed)."""
    bs, n_pos, k = lp.shape
    budgets = np.asarray(budgets, dtype=np.int32)
    past, roots = np.arange(bs, dtype=np.int32) * 5, np.arange(bs, dtype=np.int32) + 7
    capacity = int(budgets.max()) + 1
    plan = tb.plan(bs, n_pos, k, capacity, threads=SIM_THREADS)
    out = tb.allocate_outputs(plan)
    rounds = np.zeros((bs, 2), np.int32)
    tb.run(plan, lp, ids, budgets, past, roots, out, rounds=rounds)
    return out.to_host() | {"past_lens": past, "roots": roots, "capacity": capacity}, rounds


@pytest.mark.parametrize("rows", [_random_rows, _flat_rows])
def test_threshold_phase_places_nodes_exactly(bands_on, rows):
    """Random and flat rows (long sibling runs): the phase places all but <= 2 nodes, the heap the
    rest, and the tree is the reference's."""
    rng = np.random.default_rng(31)
    lp, ids = rows(rng, 2, 4, 4)
    budgets = np.array([40, 23])
    got, rounds = _build_counted(lp, ids, budgets)
    _assert_matches_reference(got, lp, ids, budgets)
    placed = rounds[:, 1]
    assert (placed >= budgets - 2).all() and (placed <= budgets).all(), rounds


def test_threshold_phase_sorts_exact_ties_by_rank_path(bands_on):
    """Tie-heavy rows: equal scores among the placed nodes are ordered by rank path in the
    phase's sort. (A threshold takes all of a tie or none, so an attempt may overflow and leave
    more to the heap.)"""
    rng = np.random.default_rng(31)
    lp, ids = _tie_rows(rng, 1, 4, 4)
    budgets = np.array([40])
    got, rounds = _build_counted(lp, ids, budgets)
    _assert_matches_reference(got, lp, ids, budgets)
    placed = int(rounds[0, 1])
    assert placed > 0 and np.unique(got["scores"][0, 1:placed + 1]).size < placed, rounds


def test_threshold_phase_on_near_ties_places_or_gives_way(bands_on):
    """ulp-level near ties: a run whose float64 sums round is not the recurrence's, so the phase
    gives way (0 placed) or places what it proved; the tree is the reference's either way."""
    rng = np.random.default_rng(32)
    lp, ids = _near_tie_rows(rng, 2, 4, 4)
    budgets = np.array([40, 30])
    got, rounds = _build_counted(lp, ids, budgets)
    _assert_matches_reference(got, lp, ids, budgets)
    assert (rounds[:, 1] == 0).any() and (rounds[:, 1] <= budgets).all(), rounds


def test_threshold_phase_keeps_signed_zeros_and_writes_long_runs_by_warp(bands_on):
    """Log-probs of exactly +0.0 / -0.0 (certain tokens): scores are bit-exact, signed zeros
    included (a run base of -0.0 gives way to the heap); and tied rows longer than LONG_RUN,
    whose runs the warp writes together."""
    lp = np.full((2, 2, 10), -0.5, np.float32)
    lp[0, :, :3] = np.array([[-0.0, 0.0, -0.0], [-0.0, 0.0, -0.0]], np.float32)
    lp[1] = np.float32(-0.25) * (np.arange(10) // 9 + 1)  # 9 equal log-probs, then a lower one
    ids = np.broadcast_to(np.arange(10, dtype=np.int32) * 3, (2, 2, 10)).copy()
    budgets = np.array([30, 30])
    got, rounds = _build_counted(lp, ids, budgets)
    _assert_matches_reference(got, lp, ids, budgets)
    assert rounds[1, 1] > tb.LONG_RUN, rounds


def test_threshold_phase_fills_a_whole_slot_class(bands_on):
    """Budget 64 = 32 x 2 slots with nothing left to the heap: node 64 is placed without a slot."""
    bands_on(left=0)
    rng = np.random.default_rng(33)
    lp, ids = _random_rows(rng, 1, 3, 4)
    got, rounds = _build_counted(lp, ids, [64])
    _assert_matches_reference(got, lp, ids, [64])
    assert rounds[0, 1] >= 62, rounds


def test_threshold_phase_gives_way_to_rising_scores_and_unsorted_rows(bands_on):
    """A positive log-prob (a first child above its parent) and an unsorted row break the order
    the phase relies on: it places nothing and the heap builds the reference's tree."""
    rng = np.random.default_rng(34)
    lp, ids = _random_rows(rng, 2, 3, 4)
    lp[0, 1, 0] = np.float32(0.25)  # depth-2 first children score above their parents
    lp[1, 0] = lp[1, 0, [0, 2, 1, 3]]  # depth 1 out of order
    budgets = np.array([30, 30])
    got, rounds = _build_counted(lp, ids, budgets)
    _assert_matches_reference(got, lp, ids, budgets)
    np.testing.assert_array_equal(rounds[:, 1], [0, 0])


def test_threshold_phase_is_off_below_its_budget():
    """The registered kernels leave budgets below BAND_MIN_BUDGET to the heap alone."""
    rng = np.random.default_rng(35)
    lp, ids = _random_rows(rng, 1, 3, 4)
    budget = min(48, tb.BAND_MIN_BUDGET - 1)
    got, rounds = _build_counted(lp, ids, [budget])
    _assert_matches_reference(got, lp, ids, [budget])
    assert rounds[0, 1] == 0 and rounds[0, 0] >= 1


# --- device functions as plain Python (py_func: the same code on a GPU host) ----------------

def _random_forest(rng: np.random.Generator, n: int) -> tuple[np.ndarray, ...]:
    """A random rooted tree: int16 parents, ranks (order among siblings), depths; and rank paths."""
    parents, ranks, depths = np.full(n, -1, np.int16), np.zeros(n, np.int16), np.zeros(n, np.int16)
    n_children = np.zeros(n, np.int64)
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, n):
        p = int(rng.integers(0, i))
        parents[i], ranks[i], depths[i] = p, n_children[p], depths[p] + 1
        n_children[p] += 1
        paths.append(paths[p] + (int(ranks[i]),))
    return parents, ranks, depths, paths


def test_path_less_is_python_tuple_order():
    """Candidate (child r of node q) order == Python order of the rank tuples, prefixes first."""
    path_less = tb._path_less.py_func
    rng = np.random.default_rng(21)
    parents, ranks, depths, paths = _random_forest(rng, 60)
    for _ in range(600):
        qa, qb = (int(x) for x in rng.integers(0, 60, size=2))
        ra, rb = (int(x) for x in rng.integers(0, 3, size=2))
        if (qa, ra) == (qb, rb):
            continue
        expected = paths[qa] + (ra,) < paths[qb] + (rb,)
        assert bool(path_less(qa, ra, qb, rb, parents, ranks, depths)) == expected
    # a node's own candidate path is a proper prefix of its descendants' candidates
    child = int(np.nonzero(parents == 0)[0][0])
    assert path_less(0, int(ranks[child]), child, 0, parents, ranks, depths)


def test_score_key_orders_like_the_float64_scores(monkeypatch):
    """(high signed, low unsigned) keys compare like the floats: equal keys iff equal scores."""
    # On a GPU _f64_bits is a numba intrinsic that Python cannot call: run the key's Python
    # body with the simulator's NumPy bit cast (same bits).
    monkeypatch.setattr(tb, "_f64_bits", getattr(tb._f64_bits_sim, "py_func", tb._f64_bits_sim))
    score_key = tb._score_key.py_func
    rng = np.random.default_rng(40)
    base = -rng.exponential(8.0, size=40)
    values = np.concatenate([
        base, np.nextafter(base, 0.0), np.nextafter(base, -np.inf), base[:8],  # ulp steps, ties
        [0.0, -0.0, -np.inf, -5e-324, 5e-324, -np.finfo(np.float64).max, -1.0, -2.0, 3.5],
    ])
    keys = [tuple(int(h) for h in score_key(float(v))) for v in values]
    for a, ka in zip(values, keys):
        for b, kb in zip(values, keys):
            assert (ka < kb) == (a < b) and (ka == kb) == (a == b), (a, b)


def test_score_from_key_inverts_score_key(monkeypatch):
    """key -> score -> key is the identity; the score is the original one (+0.0 for -0.0)."""
    for name in ("_f64_bits", "_f64_from_bits"):  # NumPy bit casts, as under the simulator
        sim = getattr(tb, f"{name}_sim")
        monkeypatch.setattr(tb, name, getattr(sim, "py_func", sim))
    rng = np.random.default_rng(41)
    base = -rng.exponential(8.0, size=30)
    values = np.concatenate([base, np.nextafter(base, 0.0), [0.0, -0.0, -np.inf, -5e-324, 5e-324, 2.5]])
    for v in values:
        back = tb._score_from_key.py_func(*tb._score_key.py_func(float(v)))
        assert back == v and (v != 0.0 or not np.signbit(back)), v


def test_above_high_is_the_first_score_past_a_high_key_word(monkeypatch):
    """x >= _above_high(h) iff the high key word of x is > h (the run's frontier bound)."""
    for name in ("_f64_bits", "_f64_from_bits"):  # NumPy bit casts, as under the simulator
        sim = getattr(tb, f"{name}_sim")
        monkeypatch.setattr(tb, name, getattr(sim, "py_func", sim))
    score_key, above_high = tb._score_key.py_func, tb._above_high.py_func
    rng = np.random.default_rng(43)
    base = -rng.exponential(8.0, size=40)
    values = np.concatenate([base, np.nextafter(base, 0.0), [0.0, -0.0, -np.inf, -5e-324, -1.0, -2.0]])
    for v in values:
        thr = above_high(int(score_key(float(v))[0]))
        assert thr > v and score_key(thr)[0] == score_key(float(v))[0] + 1, v
        assert score_key(float(np.nextafter(thr, -np.inf)))[0] <= score_key(float(v))[0], v


def test_top2_of_three_keeps_the_two_best():
    """The local run's candidate merge: best, second (with their fields) and the third score."""
    top2 = tb._top2_of_three.py_func
    rng = np.random.default_rng(44)
    for _ in range(200):
        scores = -rng.integers(0, 3, size=3) * 0.5  # many exact ties
        scores[rng.random(3) < 0.2] = -np.inf
        cands = [(float(s), j, 10 + j, float(s) - 1, float(s) - 2) for j, s in enumerate(scores)]
        out = top2(*cands[0], *cands[1], *cands[2])
        first, second, third = out[:5], out[5:10], out[10]
        assert first in cands and second in cands and first[1] != second[1]
        assert sorted([first[0], second[0], third], reverse=True) == sorted(scores.tolist(), reverse=True)
        assert first[0] >= second[0] >= third


@pytest.mark.parametrize("n_slots", tb.SLOT_CLASSES)
def test_rescan_finds_the_best_of_a_lane_slice(n_slots):
    """_rescan over every slot count the kernels use: empty, tie-heavy and distinct scores."""
    rescan = tb._rescan.py_func
    rng = np.random.default_rng(30 + n_slots)
    for trial in range(20):
        slot_score = np.full(3 * n_slots, 7.0)  # neighbours' slices must not be read
        own = -rng.integers(0, 3 if trial % 2 else 1000, size=n_slots) * 0.5
        own[rng.random(n_slots) < 0.3] = -np.inf
        if trial == 0:
            own[:] = -np.inf
        slot_score[n_slots:2 * n_slots] = own
        best, j = rescan(slot_score, n_slots, n_slots)
        assert best == own.max() and own[j] == best and 0 <= j < n_slots


def test_successors_follow_the_heap_recurrences():
    """Sibling (w - lp[d-1,r]) + lp[d-1,r+1] and child w + lp[d,0], bit for bit, cache or not."""
    successors = tb._successors.py_func
    rng = np.random.default_rng(4)
    n_depth, k = 3, 5
    lp = -np.sort(rng.exponential(2.0, size=(2, n_depth, k)), axis=-1).astype(np.float32)
    for kc in (k, 2):  # every rank cached / ranks >= 2 read from global memory
        cache = lp[1, :, :kc].ravel().copy()
        for depth in range(1, n_depth + 1):
            for rank in range(k + 1):  # rank K: an exhausted slot (its sibling is -inf)
                w = float(rng.normal(-5.0, 2.0))
                info = rank | (depth << tb.DEPTH_SHIFT)
                sibling, child = successors(lp, cache, kc, 1, n_depth, k, w, info)
                row = lp[1, depth - 1].astype(np.float64)
                expected_sibling = (w - row[rank]) + row[rank + 1] if rank + 1 < k else -np.inf
                expected_child = w + np.float64(lp[1, depth, 0]) if depth < n_depth else -np.inf
                assert sibling == expected_sibling and child == expected_child


def test_child_count_reads_the_slot_rank_except_for_the_last_node():
    child_count = tb._child_count.py_func
    n_slots = 2
    slot_info = np.arange(32 * n_slots, dtype=np.int32) | (5 << tb.DEPTH_SHIFT)
    for q in range(64):
        expected = (q & 31) * n_slots + (q >> 5) if q < 40 else 0
        assert child_count(q, 41, n_slots, slot_info) == expected
    assert child_count(64, 65, n_slots, slot_info) == 0  # node 64 has no slot in this class


def test_exact_sum_flags_rounding():
    exact_sum = tb._exact_sum.py_func
    assert exact_sum(-3.5, -0.25) == (-3.75, True)
    assert exact_sum(1.0, 2.0 ** -60) == (1.0, False)  # the small term is lost
    rng = np.random.default_rng(37)
    for a, b in zip(rng.normal(0.0, 30.0, 200), rng.normal(0.0, 1.0, 200) * 10.0 ** rng.integers(-12, 3, 200)):
        s, exact = exact_sum(float(a), float(b))
        assert s == float(a) + float(b) and exact == (Fraction(s) == Fraction(float(a)) + Fraction(float(b)))


def test_run_start_counts_the_run_the_recurrence_walks():
    """n (capped) and base: the children the heap's serial sibling recurrence finds >= tau, and
    base + lp[r] equals the recurrence's score of every child of the run, cache or not."""
    run_start = tb._run_start.py_func
    rng = np.random.default_rng(36)
    n_depth, k = 2, 9
    lp = -np.sort(rng.exponential(1.0, size=(1, n_depth, k)), axis=-1).astype(np.float32)
    for kc in (k, 3):
        cache = lp[0, :, :kc].ravel().copy()
        for rank in range(k):
            score = float(rng.normal(-4.0, 1.0))
            walk = [score]  # the recurrence from child `rank` on
            for r in range(rank, k - 1):
                walk.append((walk[-1] - float(lp[0, 1, r])) + float(lp[0, 1, r + 1]))
            for tau in (score, score - 0.5, score - 3.0, -np.inf):
                for cap in (1, 2, k):
                    n, base, exact = run_start(lp, cache, kc, 0, k, score, rank, 2, tau, cap)
                    expected = 0
                    while expected < min(len(walk), cap) and walk[expected] >= tau:
                        expected += 1
                    assert exact and n == expected
                    for j in range(len(walk)):
                        assert base + float(lp[0, 1, rank + j]) == walk[j]


def test_next_threshold_secant_bisection_and_cap():
    nxt = tb._next_threshold.py_func
    inf = np.inf
    # no overflow yet, two kept points: the secant of log(nodes) aims at the target
    t = nxt(-2.0, -1.5, -inf, -2.0, -1.0, 10, 40, True, 160)
    assert t == pytest.approx(-2.0 - (np.log(160) - np.log(40)) / ((np.log(40) - np.log(10)) / 1.0))
    assert nxt(-2.0, -1.5, -inf, -2.0, -2.0, 0, 5, True, 160) == -2.0 - tb.BAND_STEP  # one point
    assert nxt(-2.0, -1.5, -4.0, -2.0, -1.0, 10, 40, True, 160) == -3.0  # bisection below a kept tau
    assert nxt(-2.0, -3.5, -4.0, -2.0, -1.0, 10, 40, True, 160) == -3.5  # never above the best pending
    assert nxt(-4.0, -1.5, -inf, -2.0, -1.0, 10, 40, False, 160) == -3.0  # after an overflow


# --- simulator: golden files -----------------------------------------------------------------

def _golden_cases() -> dict:
    return read_all(GOLDEN_TREE)


def test_golden_single_trees():
    """Every single-tree case of data/golden/tree.h5 (run as a batch of one)."""
    for name, ds in _golden_cases().items():
        if "in_budget" not in ds:
            continue
        lp = ds["in_top_log_probs"].values[None].astype(np.float32)
        ids = ds["in_top_ids"].values[None].astype(np.int32)
        budget = int(ds["in_budget"])
        n = ds["out_tokens"].shape[0]
        n_words = ds["out_visibility_packed"].shape[1]
        got = _build(lp, ids, [budget], roots=np.array([int(ds["in_root_token"])], np.int32),
                     capacity=budget + 1)  # capacity 1 + budget, as a CUDA graph would have it
        assert got["sizes"][0] == n, name
        for field in ("tokens", "parents", "depths", "ranks", "scores"):
            np.testing.assert_array_equal(got[field][0, :n], ds[f"out_{field}"].values, err_msg=f"{name}.{field}")
        np.testing.assert_array_equal(got["child_ptr"][0, :n + 1], ds["out_child_ptr"].values, err_msg=name)
        np.testing.assert_array_equal(got["child_index"][0, :n - 1], ds["out_child_index"].values, err_msg=name)
        np.testing.assert_array_equal(got["visibility"][0, :n, :n_words], ds["out_visibility_packed"].values,
                                      err_msg=name)
        assert (got["visibility"][0, :n, n_words:] == 0).all(), name


def test_golden_ragged_batch():
    ds = _golden_cases()["batch_ragged"]
    lp = ds["in_top_log_probs"].values.astype(np.float32)
    ids = ds["in_top_ids"].values.astype(np.int32)
    got = _build(lp, ids, ds["in_budgets"].values, roots=ds["in_root_tokens"].values.astype(np.int32),
                 capacity=int(ds["in_capacity"]))
    for field in ("sizes", "tokens", "parents", "depths", "ranks", "scores", "child_ptr", "child_index"):
        np.testing.assert_array_equal(got[field], ds[f"out_{field}"].values, err_msg=field)
    np.testing.assert_array_equal(got["visibility"], ds["out_visibility_packed"].values)


# --- simulator: validation (nothing launched, nothing written) -------------------------------

def _valid_args(bs=2, n_pos=2, k=3, capacity=5):
    rng = np.random.default_rng(0)
    lp, ids = _random_rows(rng, bs, n_pos, k)
    plan = tb.plan(bs, n_pos, k, capacity, threads=SIM_THREADS)
    out = tb.TreeBuildOutputs(**{name: np.full(shape, 7, dtype) for name, (shape, dtype)
                                 in plan.output_shapes().items()})
    inputs = {"top_log_probs": lp, "top_ids": ids, "budgets": np.full(bs, 4, np.int32),
              "past_lens": np.zeros(bs, np.int32), "root_tokens": np.zeros(bs, np.int32)}
    return plan, inputs, out


def _bad(name, value):
    plan, inputs, out = _valid_args()
    inputs[name] = value(inputs[name]) if callable(value) else value
    return plan, inputs, out


@pytest.mark.parametrize("name,value,error", [
    ("top_log_probs", lambda a: a.astype(np.float64), TypeError),
    ("top_log_probs", lambda a: a[:, :1], ValueError),
    ("top_log_probs", lambda a: np.where(a == a.min(), -np.inf, a).astype(np.float32), ValueError),
    ("top_log_probs", lambda a: np.asfortranarray(a), ValueError),
    ("top_log_probs", [[0.0]], TypeError),
    ("top_ids", lambda a: a.astype(np.int64), TypeError),
    ("top_ids", lambda a: -a - 1, ValueError),
    ("top_ids", lambda a: np.zeros_like(a), ValueError),
    ("budgets", lambda a: a.astype(np.int64), TypeError),
    ("budgets", lambda a: a + 10, ValueError),
    ("budgets", lambda a: a - 10, ValueError),
    ("budgets", lambda a: a[:1], ValueError),
    ("past_lens", lambda a: a - 1, ValueError),
    ("past_lens", lambda a: a.astype(np.float32), TypeError),
    ("root_tokens", lambda a: a - 2, ValueError),
])
def test_bad_inputs_raise_naming_the_argument(name, value, error):
    plan, inputs, out = _bad(name, value)
    with pytest.raises(error, match=name):
        tb.run(plan, *inputs.values(), out)
    assert (out.sizes == 7).all() and (out.visibility == 7).all()  # nothing written


@pytest.mark.parametrize("field,value,error", [
    ("visibility", lambda a: a[..., :0], ValueError),
    ("scores", lambda a: a.astype(np.float32), TypeError),
    ("child_ptr", lambda a: a[:, :-1], ValueError),
    ("tokens", lambda a: a.astype(np.int64), TypeError),
])
def test_bad_output_buffers(field, value, error):
    plan, inputs, out = _valid_args()
    out = tb.TreeBuildOutputs(**{**out.__dict__, field: value(getattr(out, field))})
    with pytest.raises(error, match=f"out.{field}"):
        tb.run(plan, *inputs.values(), out)
    assert (out.sizes == 7).all()


@pytest.mark.parametrize("kwargs,error,name", [
    ({"batch_size": 0}, ValueError, "batch_size"),
    ({"horizon": -1}, ValueError, "horizon"),
    ({"horizon": tb.MAX_HORIZON + 1}, ValueError, "horizon"),
    ({"top_k": 2.0}, TypeError, "top_k"),
    ({"capacity": tb.MAX_NODES + 1}, ValueError, "capacity"),
    ({"capacity": True}, TypeError, "capacity"),
    ({"threads": 48}, ValueError, "threads"),
    ({"threads": 1024}, ValueError, "threads"),
])
def test_plan_validation(kwargs, error, name):
    args = {"batch_size": 1, "horizon": 2, "top_k": 2, "capacity": 4} | kwargs
    threads = args.pop("threads", tb.DEFAULT_THREADS)
    with pytest.raises(error, match=name):
        tb.plan(**args, threads=threads)


def test_run_rejects_wrong_plan_and_out_types():
    plan, inputs, out = _valid_args()
    with pytest.raises(TypeError, match="tree_plan"):
        tb.run((2, 2, 3, 5), *inputs.values(), out)
    with pytest.raises(TypeError, match="out"):
        tb.run(plan, *inputs.values(), out.__dict__)


def test_plan_shapes():
    plan = tb.plan(3, 16, 1024, 1025)
    assert plan.n_words == 33 and plan.slots_per_lane == 32
    assert plan.cached_ranks == tb._lp_cache_words(32) // 16 < 1024
    assert [tb.plan(1, 4, 8, n).slots_per_lane for n in (1, 65, 66, 129, 513, 514)] == [2, 2, 4, 4, 16, 32]
    shapes = plan.output_shapes()
    assert shapes["visibility"] == ((3, 1025, 33), np.dtype(np.uint32))
    assert shapes["child_ptr"][0] == (3, 1026)


# --- GPU: randomized sweep at real shapes ----------------------------------------------------

def _sweep_case(seed: int):
    """Worker: one random batch of 64 and its reference outputs (pickled back to the test).

    L <= 32, K <= 1024, budgets <= 1024 (a quarter of the batches big, the rest <= 128, which
    keeps the CPU reference cheap), half tie-heavy (logits rounded to 0.5: equal log-probs), and
    half of those also ulp-level near ties (log-probs 0-2 float32 ulps down).
    """
    rng = np.random.default_rng(seed)
    bs = 64
    n_pos = int(rng.integers(1, 33))
    max_budget = int(rng.integers(1, 1025)) if rng.random() < 0.25 else int(rng.integers(1, 129))
    k = int(rng.integers(1, min(1024, 2 * max_budget) + 1))
    vocab = max(2 * k, 64)
    logits = rng.normal(0.0, rng.choice([1.0, 2.5, 6.0]), size=(bs * n_pos, vocab))
    kind = rng.random()
    if kind < 1 / 2:  # tie-heavy (equal log-probs); half of them near ties too
        logits = np.round(logits * 2) / 2
    lp, ids = topk_log_probs(logits, k)
    lp, ids = lp.reshape(bs, n_pos, k), ids.reshape(bs, n_pos, k).astype(np.int32)
    if kind < 1 / 4:  # ulp-level near ties: move log-probs down by 0-2 float32 ulps, keep rows sorted
        steps = rng.integers(0, 3, size=lp.shape).astype(np.float32)
        lp = -np.sort(-(lp - steps * np.spacing(np.abs(lp)).astype(np.float32)), axis=-1)
    budgets = rng.integers(0, max_budget + 1, size=bs).astype(np.int32)
    roots = rng.integers(-1, vocab, size=bs).astype(np.int32)
    ref = build_tree_batch(lp, ids, budgets.astype(np.int64), roots.astype(np.int64), capacity=max_budget + 1)
    expected = {"sizes": ref.sizes, **{f: getattr(ref, f) for f in INT_FIELDS}, "scores": ref.scores,
                "visibility": pack_visibility(ref.visibility), "depths": ref.depths}
    return (lp, ids, budgets, roots, max_budget + 1), expected


@pytest.mark.gpu
def test_gpu_random_sweep_10000_trees():
    """160 batches of 64 = 10,240 trees against the reference (CPU side on every core)."""
    past = np.arange(64, dtype=np.int32) * 3
    # spawn, not fork: the parent holds a CUDA context, which a forked child must not inherit
    with ProcessPoolExecutor(max_workers=os.cpu_count(), mp_context=multiprocessing.get_context("spawn")) as pool:
        for (lp, ids, budgets, roots, capacity), ref in pool.map(_sweep_case, range(160), chunksize=2):
            plan = tb.plan(64, lp.shape[1], lp.shape[2], capacity)
            out = tb.allocate_outputs(plan)
            args = [cuda.to_device(a) for a in (lp, ids, budgets, past, roots)]
            got = tb.run(plan, *args, out).to_host()
            for name in ("sizes", "visibility", *INT_FIELDS):
                np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
            np.testing.assert_array_equal(got["scores"].view(np.int64), ref["scores"].view(np.int64))
            np.testing.assert_array_equal(got["positions"], past[:, None] + ref["depths"])


@pytest.mark.gpu
def test_gpu_full_budget_batch():
    """bs 64, L 16, K = B = 1024 (Kimi K2 shapes after top-k): one launch, exact."""
    rng = np.random.default_rng(9)
    bs, n_pos, budget = 64, 16, 1024
    lp, ids = topk_log_probs(rng.normal(0, 3.0, size=(bs * n_pos, 163840 // 16)), budget)
    lp, ids = lp.reshape(bs, n_pos, budget), ids.reshape(bs, n_pos, budget).astype(np.int32)
    budgets = np.full(bs, budget, np.int32)
    got = _build(lp, ids, budgets, threads=tb.DEFAULT_THREADS, on_device=True)
    assert (got["sizes"] == budget + 1).all()
    _assert_matches_reference(got, lp, ids, budgets)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["wide", "peaked", "grid"])
def test_gpu_threshold_phase_at_b512(kind):
    """bs 64, L 16, K = B = 512, the registered kernel (threshold phase on): wide and peaked
    drafter rows, and log-probs on a 0.5 grid (exact ties, long tied runs, rank 0 exactly -0.0
    or +0.0). Exact; on drafter rows the phase places all but <= BAND_LEFT nodes of most trees."""
    rng = np.random.default_rng({"wide": 40, "peaked": 41, "grid": 42}[kind])
    bs, n_pos, budget = 64, 16, 512
    scale = {"wide": 1.5, "peaked": 7.0, "grid": 2.0}[kind]
    lp, ids = topk_log_probs(rng.normal(0, scale, size=(bs * n_pos, 16384)), budget)
    lp, ids = lp.reshape(bs, n_pos, budget), ids.reshape(bs, n_pos, budget).astype(np.int32)
    if kind == "grid":
        lp = np.round(lp / 4) * np.float32(0.5)  # a few levels: long tied runs
        # rank 0 certain (-0.0 or +0.0 at random): chains of zero-scored first children
        lp[:, :, 0] = np.where(rng.random((bs, n_pos)) < 0.5, np.float32(-0.0), np.float32(0.0))
        lp = -np.sort(-lp, axis=-1)
    budgets = np.full(bs, budget, np.int32)
    past, roots = np.zeros(bs, np.int32), np.arange(bs, dtype=np.int32)
    plan = tb.plan(bs, n_pos, budget, budget + 1)
    out = tb.allocate_outputs(plan)
    rounds = cuda.to_device(np.zeros((bs, 2), np.int32))
    tb.run(plan, *[cuda.to_device(a) for a in (lp, ids, budgets, past, roots)], out, rounds=rounds)
    _assert_matches_reference(out.to_host() | {"past_lens": past, "roots": roots, "capacity": budget + 1},
                              lp, ids, budgets)
    placed = rounds.copy_to_host()[:, 1]
    assert (placed <= budget).all()
    if kind != "grid":
        assert (placed >= budget - tb.BAND_LEFT).mean() > 0.9, placed
