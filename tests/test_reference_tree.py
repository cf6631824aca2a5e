"""reference/tree.py against the official loop transcription, the spec's checked vectors, and its contracts."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.tree import (
    DraftTree,
    TreeBatch,
    build_tree,
    build_tree_batch,
    pack_visibility,
    unpack_visibility,
)
from tests.official_ddtree import build_ddtree_tree_official

N_CHUNKS = 4
CASES_PER_CHUNK = 250  # 4 x 250 = 1000 random and 1000 tie-heavy cases


# ----------------------------------------------------------------------------------------------
# Case generators
# ----------------------------------------------------------------------------------------------

def _draw_sizes(rng: np.random.Generator) -> tuple[int, int, int]:
    """(L, K, budget): mostly small, one case in ten up to L=32, K=1024, budget=1024."""
    if rng.random() < 0.1:
        return int(rng.integers(1, 33)), int(rng.integers(1, 1025)), int(rng.integers(0, 1025))
    return int(rng.integers(1, 9)), int(rng.integers(1, 17)), int(rng.integers(0, 65))


def _unique_ids(rng: np.random.Generator, n_positions: int, k: int) -> np.ndarray:
    """int64 [L, K], unique per row, drawn from a vocabulary of K..2K tokens (token 0 included)."""
    vocab = k + int(rng.integers(0, k + 1))
    return np.argsort(rng.random((n_positions, vocab)), axis=1)[:, :k].astype(np.int64)


def _random_log_probs(rng: np.random.Generator, n_positions: int, k: int) -> np.ndarray:
    """[L, K] sorted descending like a top-k row (one case in ten unsorted).

    Half the cases are float32 (what the official code feeds the heap; float64 sums of a few float32
    values are mostly exact), half float64 (where the order of operations changes the rounding).
    """
    lp = -np.abs(rng.normal(0.0, rng.uniform(0.1, 5.0), (n_positions, k)))
    if rng.random() < 0.9:
        lp = -np.sort(-lp, axis=1)
    return lp.astype(np.float32) if rng.random() < 0.5 else lp


def _tie_heavy_log_probs(rng: np.random.Generator, n_positions: int, k: int) -> np.ndarray:
    """float32 [L, K] on a few levels (multiples of 0.5: path sums tie exactly) or equiprobable rows."""
    n_levels = int(rng.integers(1, 4))
    lp = -0.5 * rng.integers(0, n_levels + 1, (n_positions, k)).astype(np.float64)
    lp = -np.sort(-lp, axis=1)
    equiprobable = rng.random(n_positions) < 0.3
    lp[equiprobable] = np.log(1.0 / k)
    return lp.astype(np.float32)


# ----------------------------------------------------------------------------------------------
# Comparison with the transcription
# ----------------------------------------------------------------------------------------------

def _child_maps(tree: DraftTree) -> list[dict[int, int]]:
    """token -> child dict for each node, from the CSR arrays."""
    return [{int(tree.tokens[c]): int(c) for c in tree.children(p)} for p in range(tree.n_nodes)]


def _assert_matches_official(lp: np.ndarray, ids: np.ndarray, budget: int, root: int, label: str) -> None:
    tree = build_tree(lp, ids, budget, root_token=root)
    official = build_ddtree_tree_official(lp, ids, budget)
    n = len(official.node_token_ids)
    assert tree.n_nodes == 1 + n, label
    assert tree.tokens[0] == root, label
    np.testing.assert_array_equal(tree.tokens[1:], official.node_token_ids, err_msg=label)
    np.testing.assert_array_equal(tree.parents, official.parents, err_msg=label)
    np.testing.assert_array_equal(tree.depths[1:], official.node_depths, err_msg=label)
    np.testing.assert_array_equal(tree.ranks[1:], official.node_ranks, err_msg=label)
    np.testing.assert_array_equal(tree.scores[1:], official.node_weights, err_msg=label)  # bit-exact
    np.testing.assert_array_equal(tree.visibility, official.visibility, err_msg=label)
    assert _child_maps(tree) == official.child_maps, label


def _reachable(n_positions: int, k: int) -> int:
    return sum(k**d for d in range(1, n_positions + 1))


@pytest.mark.parametrize("chunk", range(N_CHUNKS))
def test_matches_official_random(chunk: int) -> None:
    rng = np.random.default_rng(1000 + chunk)
    for case in range(CASES_PER_CHUNK):
        n_positions, k, budget = _draw_sizes(rng)
        lp = _random_log_probs(rng, n_positions, k)
        ids = _unique_ids(rng, n_positions, k)
        _assert_matches_official(lp, ids, budget, int(rng.integers(-1, 100)), f"random chunk {chunk} case {case}")


@pytest.mark.parametrize("chunk", range(N_CHUNKS))
def test_matches_official_tie_heavy(chunk: int) -> None:
    rng = np.random.default_rng(2000 + chunk)
    for case in range(CASES_PER_CHUNK):
        n_positions, k, budget = _draw_sizes(rng)
        lp = _tie_heavy_log_probs(rng, n_positions, k)
        ids = _unique_ids(rng, n_positions, k)
        _assert_matches_official(lp, ids, budget, -1, f"tie-heavy chunk {chunk} case {case}")


@pytest.mark.parametrize(
    ("n_positions", "k", "budget"),
    [(32, 1024, 1024), (1, 1024, 1024), (32, 1, 1024), (32, 2, 1024), (2, 1024, 1024), (32, 1024, 0), (1, 1, 1)],
)
def test_matches_official_extremes(n_positions: int, k: int, budget: int) -> None:
    rng = np.random.default_rng(n_positions * 7919 + k * 31 + budget)
    for lp in (_random_log_probs(rng, n_positions, k), _tie_heavy_log_probs(rng, n_positions, k)):
        ids = _unique_ids(rng, n_positions, k)
        _assert_matches_official(lp, ids, budget, 5, f"L={n_positions} K={k} B={budget}")
        assert build_tree(lp, ids, budget).n_nodes == 1 + min(budget, _reachable(n_positions, k))


@settings(max_examples=150, deadline=None)
@given(
    n_positions=st.integers(0, 4),
    k=st.integers(0, 4),
    budget=st.integers(0, 40),
    levels=st.lists(st.sampled_from([0.0, -0.5, -1.0, -2.0, -7.25]), min_size=16, max_size=16),
)
def test_matches_official_edge_shapes(n_positions: int, k: int, budget: int, levels: list[float]) -> None:
    lp = np.resize(np.asarray(levels, dtype=np.float64), (n_positions, k))
    ids = np.tile(np.arange(k, dtype=np.int64), (n_positions, 1))
    _assert_matches_official(lp, ids, budget, 0, f"L={n_positions} K={k} B={budget}")


# ----------------------------------------------------------------------------------------------
# The spec's checked vectors and structural properties
# ----------------------------------------------------------------------------------------------

def _rank_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, tree.n_nodes):
        paths.append(paths[tree.parents[i]] + (int(tree.ranks[i]),))
    return paths[1:]


def test_equiprobable_order() -> None:
    lp = np.full((3, 4), np.log(0.25))
    ids = np.tile(np.arange(4), (3, 1))
    tree = build_tree(lp, ids, 10)
    assert _rank_paths(tree) == [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]


def test_exhaustion_v2() -> None:
    lp = np.full((3, 2), np.log(0.5))
    tree = build_tree(lp, np.tile(np.arange(2), (3, 1)), 20)
    assert tree.n_nodes == 1 + 14
    assert sorted(_rank_paths(tree)) == sorted(
        [(a,) for a in range(2)] + [(a, b) for a in range(2) for b in range(2)]
        + [(a, b, c) for a in range(2) for b in range(2) for c in range(2)]
    )


def test_budget_equal_depth_is_not_a_chain() -> None:
    lp = np.log(np.array([[0.5, 0.4, 0.1], [0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]))
    tree = build_tree(lp, np.tile(np.arange(3), (3, 1)), 3)
    assert _rank_paths(tree) == [(0,), (1,), (0, 0)]
    np.testing.assert_array_equal(tree.depths, [0, 1, 1, 2])


def test_token_zero_keeps_size() -> None:
    """The SGLang token-0 bug (spec §3): size never depends on token values."""
    lp = np.log(np.array([[0.6, 0.3, 0.1], [0.7, 0.2, 0.1]]))
    ids = np.array([[0, 5, 9], [0, 3, 4]])
    tree = build_tree(lp, ids, 4, root_token=0)
    assert tree.n_nodes == 5
    assert np.count_nonzero(tree.tokens == 0) >= 2
    assert tree.child_with_token(0, 0) == 1 and tree.child_with_token(1, 0) == 2


def _ancestors_or_self(parents: np.ndarray, i: int) -> set[int]:
    out = set()
    while i >= 0:
        out.add(i)
        i = int(parents[i])
    return out


def test_structure_properties() -> None:
    rng = np.random.default_rng(7)
    for _ in range(60):
        n_positions, k, budget = _draw_sizes(rng)
        tree = build_tree(_random_log_probs(rng, n_positions, k), _unique_ids(rng, n_positions, k), budget)
        n = tree.n_nodes
        assert tree.parents[0] == -1 and tree.depths[0] == 0 and tree.ranks[0] == 0 and tree.scores[0] == 0.0
        assert np.all(tree.parents[1:] < np.arange(1, n)) and np.all(tree.parents[1:] >= 0)
        np.testing.assert_array_equal(tree.depths[1:], tree.depths[tree.parents[1:]] + 1)
        for i in range(n):
            want = sorted(_ancestors_or_self(tree.parents, i))
            np.testing.assert_array_equal(np.flatnonzero(tree.visibility[i]), want)
        # CSR: every non-root node exactly once, under its parent, ascending.
        assert tree.child_ptr.shape == (n + 1,) and tree.child_index.shape == (n - 1,)
        assert tree.child_ptr[0] == 0 and tree.child_ptr[-1] == n - 1
        for p in range(n):
            kids = tree.children(p)
            np.testing.assert_array_equal(kids, np.flatnonzero(tree.parents == p))
        assert (tree.tokens.dtype, tree.parents.dtype, tree.depths.dtype, tree.ranks.dtype) == (
            np.int64, np.int32, np.int32, np.int32)
        assert tree.scores.dtype == np.float64 and tree.visibility.dtype == bool
        assert tree.child_ptr.dtype == np.int32 and tree.child_index.dtype == np.int32


@pytest.mark.parametrize(("n_positions", "k", "budget"), [(3, 4, 0), (0, 4, 5), (3, 0, 5)])
def test_root_only(n_positions: int, k: int, budget: int) -> None:
    tree = build_tree(np.zeros((n_positions, k)), np.tile(np.arange(k), (n_positions, 1)), budget, root_token=42)
    assert tree.n_nodes == 1
    np.testing.assert_array_equal(tree.visibility, [[True]])
    np.testing.assert_array_equal(tree.child_ptr, [0, 0])
    assert tree.child_index.shape == (0,) and tree.tokens[0] == 42 and tree.child_with_token(0, 42) == -1


def test_depth_one_and_top_one() -> None:
    lp = np.log(np.array([[0.5, 0.3, 0.2]]))
    tree = build_tree(lp, np.array([[7, 8, 9]]), 10)  # L = 1: a star of K nodes
    np.testing.assert_array_equal(tree.tokens[1:], [7, 8, 9])
    np.testing.assert_array_equal(tree.parents, [-1, 0, 0, 0])
    chain = build_tree(np.zeros((5, 1)), np.arange(5)[:, None], 10)  # K = 1: a chain of L nodes
    np.testing.assert_array_equal(chain.parents, [-1, 0, 1, 2, 3, 4])
    np.testing.assert_array_equal(chain.tokens[1:], np.arange(5))


def test_child_with_token() -> None:
    lp = np.log(np.array([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]]))
    tree = build_tree(lp, np.array([[10, 11, 12], [20, 21, 22]]), 6)
    for i in range(1, tree.n_nodes):
        assert tree.child_with_token(int(tree.parents[i]), int(tree.tokens[i])) == i
    assert tree.child_with_token(0, 20) == -1


# ----------------------------------------------------------------------------------------------
# Batches and packed visibility
# ----------------------------------------------------------------------------------------------

def _assert_tree_equal(a: DraftTree, b: DraftTree) -> None:
    for field in ("tokens", "parents", "depths", "ranks", "scores", "visibility", "child_ptr", "child_index"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype, field
        np.testing.assert_array_equal(x, y, err_msg=field)


@pytest.mark.parametrize("capacity", [None, 40])
def test_batch_matches_single_and_padding(capacity: int | None) -> None:
    rng = np.random.default_rng(11)
    bs, n_positions, k = 5, 4, 6
    lp = np.stack([_random_log_probs(rng, n_positions, k) for _ in range(bs)])
    ids = np.stack([_unique_ids(rng, n_positions, k) for _ in range(bs)])
    budgets = np.array([0, 3, 12, 39, 7])
    roots = np.array([4, -1, 0, 9, 2])
    batch = build_tree_batch(lp, ids, budgets, roots, capacity=capacity)
    assert isinstance(batch, TreeBatch) and batch.batch_size == bs
    assert batch.capacity == (capacity if capacity else 40)
    np.testing.assert_array_equal(batch.sizes, 1 + budgets)
    n_cap = batch.capacity
    for b in range(bs):
        single = build_tree(lp[b], ids[b], int(budgets[b]), int(roots[b]))
        _assert_tree_equal(batch.tree(b), single)
        n = single.n_nodes
        assert np.all(batch.tokens[b, n:] == -1) and np.all(batch.parents[b, n:] == -1)
        assert np.all(batch.depths[b, n:] == 0) and np.all(batch.ranks[b, n:] == 0) and np.all(batch.scores[b, n:] == 0)
        np.testing.assert_array_equal(batch.visibility[b, n:], np.eye(n_cap, dtype=bool)[n:])
        assert not batch.visibility[b, :n, n:].any()
        assert np.all(batch.child_ptr[b, n:] == single.child_ptr[-1])
        assert np.all(batch.child_index[b, n - 1:] == -1)


def test_batch_scalar_budget_and_capacity_for_graphs() -> None:
    rng = np.random.default_rng(12)
    lp = np.stack([_tie_heavy_log_probs(rng, 3, 3) for _ in range(3)])
    ids = np.tile(np.arange(3), (3, 3, 1))
    batch = build_tree_batch(lp, ids, 8, capacity=1 + 8)
    np.testing.assert_array_equal(batch.sizes, [9, 9, 9])
    assert batch.capacity == 9 and np.all(batch.tokens[:, 0] == -1)


def test_pack_visibility_layout_and_roundtrip() -> None:
    rng = np.random.default_rng(13)
    for n in (0, 1, 31, 32, 33, 64, 65, 100):
        vis = rng.random((2, 3, n, n)) < 0.5
        packed = pack_visibility(vis)
        assert packed.dtype == np.uint32 and packed.shape == (2, 3, n, -(-n // 32))
        for j in range(n):
            np.testing.assert_array_equal((packed[..., j // 32] >> np.uint32(j % 32)) & 1, vis[..., j])
        np.testing.assert_array_equal(unpack_visibility(packed, n), vis)


def test_pack_visibility_of_tree_rows() -> None:
    """Packed rows obey row_i = row_parent | bit_i (spec §7, Mask)."""
    rng = np.random.default_rng(14)
    tree = build_tree(_random_log_probs(rng, 8, 8), _unique_ids(rng, 8, 8), 90)
    packed = pack_visibility(tree.visibility)
    for i in range(1, tree.n_nodes):
        expect = packed[tree.parents[i]].copy()
        expect[i // 32] |= np.uint32(1 << (i % 32))
        np.testing.assert_array_equal(packed[i], expect)


# ----------------------------------------------------------------------------------------------
# Validation: one test per error, type and argument name
# ----------------------------------------------------------------------------------------------

_LP = np.log(np.full((2, 3), 1.0 / 3.0))
_IDS = np.tile(np.arange(3), (2, 1))

_BUILD_ERRORS = {
    "lp_int": (lambda: build_tree(_IDS, _IDS, 3), TypeError, "top_log_probs"),
    "lp_1d": (lambda: build_tree(_LP[0], _IDS[0], 3), ValueError, "top_log_probs"),
    "lp_nan": (lambda: build_tree(np.where(_IDS == 1, np.nan, _LP), _IDS, 3), ValueError, "top_log_probs"),
    "lp_neg_inf": (lambda: build_tree(np.where(_IDS == 2, -np.inf, _LP), _IDS, 3), ValueError, "top_log_probs"),
    "ids_float": (lambda: build_tree(_LP, _LP, 3), TypeError, "top_ids"),
    "ids_bool": (lambda: build_tree(_LP, _IDS > 0, 3), TypeError, "top_ids"),
    "ids_shape": (lambda: build_tree(_LP, _IDS[:, :2], 3), ValueError, "top_ids"),
    "ids_negative": (lambda: build_tree(_LP, _IDS - 1, 3), ValueError, "top_ids"),
    "ids_duplicate": (lambda: build_tree(_LP, np.array([[0, 1, 0], [0, 1, 2]]), 3), ValueError, "top_ids"),
    "ids_uint64_overflow": (lambda: build_tree(_LP, _IDS.astype(np.uint64) + np.uint64(2**63), 3),
                            ValueError, "top_ids"),
    "budget_negative": (lambda: build_tree(_LP, _IDS, -1), ValueError, "budget"),
    "budget_bool": (lambda: build_tree(_LP, _IDS, True), TypeError, "budget"),
    "budget_float": (lambda: build_tree(_LP, _IDS, 3.0), TypeError, "budget"),
    "root_token_low": (lambda: build_tree(_LP, _IDS, 3, root_token=-2), ValueError, "root_token"),
    "batch_lp_2d": (lambda: build_tree_batch(_LP, _IDS, 3), ValueError, "top_log_probs"),
    "batch_empty": (lambda: build_tree_batch(np.zeros((0, 2, 3)), np.zeros((0, 2, 3), dtype=np.int64), 3),
                    ValueError, "top_log_probs"),
    "batch_ids_shape": (lambda: build_tree_batch(_LP[None], _IDS[None, :1], 3), ValueError, "top_ids"),
    "batch_budgets_shape": (lambda: build_tree_batch(_LP[None], _IDS[None], np.array([1, 2])), ValueError, "budgets"),
    "batch_budgets_float": (lambda: build_tree_batch(_LP[None], _IDS[None], np.array([1.0])), TypeError, "budgets"),
    "batch_budgets_negative": (lambda: build_tree_batch(_LP[None], _IDS[None], np.array([-1])), ValueError, "budgets"),
    "batch_roots_low": (lambda: build_tree_batch(_LP[None], _IDS[None], 3, np.array([-3])), ValueError, "root_tokens"),
    "batch_capacity_small": (lambda: build_tree_batch(_LP[None], _IDS[None], 3, capacity=3), ValueError, "capacity"),
    "batch_capacity_type": (lambda: build_tree_batch(_LP[None], _IDS[None], 3, capacity=4.0), TypeError, "capacity"),
    "batch_request_ids_dup": (lambda: build_tree_batch(_LP[None], np.zeros((1, 2, 3), dtype=np.int64), 3),
                              ValueError, "top_ids"),
    "tree_index": (lambda: build_tree_batch(_LP[None], _IDS[None], 3).tree(1), ValueError, "b"),
    "child_node": (lambda: build_tree(_LP, _IDS, 3).child_with_token(4, 0), ValueError, "node"),
    "child_token_type": (lambda: build_tree(_LP, _IDS, 3).child_with_token(0, 1.0), TypeError, "token"),
    "pack_dtype": (lambda: pack_visibility(np.eye(3)), TypeError, "vis"),
    "pack_shape": (lambda: pack_visibility(np.ones((3, 4), dtype=bool)), ValueError, "vis"),
    "unpack_dtype": (lambda: unpack_visibility(np.zeros((3, 1), dtype=np.int32), 3), TypeError, "packed"),
    "unpack_shape": (lambda: unpack_visibility(np.zeros((3, 2), dtype=np.uint32), 3), ValueError, "packed"),
    "unpack_stray_bits": (lambda: unpack_visibility(np.full((3, 1), 8, dtype=np.uint32), 3), ValueError, "packed"),
    "unpack_n": (lambda: unpack_visibility(np.zeros((3, 1), dtype=np.uint32), -1), ValueError, "n"),
}


@pytest.mark.parametrize("case", sorted(_BUILD_ERRORS))
def test_validation(case: str) -> None:
    call, error, name = _BUILD_ERRORS[case]
    with pytest.raises(error, match=rf"\b{name}\b"):
        call()
