"""reference/accept.py and reference/compact.py against direct list walks and in-place row copies."""
from __future__ import annotations

import numpy as np
import pytest

from reference.accept import AcceptResult, accept, accept_batch
from reference.compact import compact, compact_batch
from reference.tree import DraftTree, build_tree, build_tree_batch


def _random_tree(rng: np.random.Generator, budget: int | None = None) -> DraftTree:
    n_positions, k = int(rng.integers(1, 8)), int(rng.integers(1, 6))
    vocab = k + int(rng.integers(0, 4))
    lp = np.log(rng.dirichlet(np.ones(vocab) * 0.5, size=n_positions))[:, :k]
    lp = -np.sort(-lp, axis=1)
    ids = np.argsort(rng.random((n_positions, vocab)), axis=1)[:, :k]
    return build_tree(lp, ids, int(rng.integers(0, 40)) if budget is None else budget, int(rng.integers(0, vocab)))


def _direct_walk(post: np.ndarray, tree: DraftTree) -> tuple[list[int], int]:
    """Independent oracle: scan all nodes for a child of the current node holding the posterior token."""
    path, token = [0], int(post[0])
    while True:
        matches = [i for i in range(tree.n_nodes) if tree.parents[i] == path[-1] and tree.tokens[i] == token]
        assert len(matches) <= 1  # siblings never share a token
        if not matches:
            return path, token
        path.append(matches[0])
        token = int(post[matches[0]])


def _path_following_posterior(rng: np.random.Generator, tree: DraftTree, vocab: int) -> np.ndarray:
    """Posterior that follows the root-to-node path of a random (preferably deep) node."""
    post = rng.integers(0, vocab, tree.n_nodes)
    target = int(np.argmax(tree.depths + rng.random(tree.n_nodes)))  # a deepest node, random among ties
    node = target
    while node > 0:
        post[tree.parents[node]] = tree.tokens[node]
        node = int(tree.parents[node])
    return post


def test_accept_matches_direct_walk() -> None:
    rng = np.random.default_rng(0)
    for case in range(300):
        tree = _random_tree(rng)
        vocab = int(tree.tokens[1:].max(initial=0)) + 2
        if case % 2:
            post = _path_following_posterior(rng, tree, vocab)
        else:
            post = rng.integers(0, vocab, tree.n_nodes)
        result = accept(post, tree)
        path, bonus = _direct_walk(post, tree)
        assert isinstance(result, AcceptResult) and result.accepted.dtype == np.int32
        assert result.accepted.tolist() == path and result.length == len(path) and result.bonus == bonus
        assert 1 <= result.length <= 1 + int(tree.depths.max())
        assert np.all(np.diff(result.accepted) > 0)
        if case % 2:
            assert result.length == 1 + int(tree.depths.max())  # the full deep path is accepted


def test_accept_exact_path_and_bonus() -> None:
    lp = np.log(np.array([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.9, 0.05, 0.05]]))
    ids = np.array([[0, 4, 7], [2, 0, 5], [1, 3, 0]])
    tree = build_tree(lp, ids, 12, root_token=9)
    leaf = int(np.argmax(tree.depths))
    chain = [leaf]
    while chain[-1] > 0:
        chain.append(int(tree.parents[chain[-1]]))
    chain.reverse()
    post = np.full(tree.n_nodes, 8, dtype=np.int64)  # token 8 is no child anywhere
    for parent, child in zip(chain[:-1], chain[1:]):
        post[parent] = tree.tokens[child]
    result = accept(post, tree)
    assert result.accepted.tolist() == chain and result.bonus == 8
    post[0] = 8
    assert accept(post, tree).accepted.tolist() == [0] and accept(post, tree).bonus == 8


def test_accept_batch_matches_single() -> None:
    rng = np.random.default_rng(1)
    bs, n_positions, k, vocab = 6, 5, 3, 6
    lp = -np.sort(-np.log(rng.dirichlet(np.ones(vocab), size=(bs, n_positions))[..., :k]), axis=-1)
    ids = np.argsort(rng.random((bs, n_positions, vocab)), axis=-1)[..., :k]
    batch = build_tree_batch(lp, ids, np.array([0, 2, 9, 30, 5, 17]), capacity=40)
    post = np.full((bs, batch.capacity), -7, dtype=np.int64)  # padding entries are ignored
    for b in range(bs):
        tree = batch.tree(b)
        post[b, :tree.n_nodes] = _path_following_posterior(rng, tree, vocab) if b % 2 else rng.integers(
            0, vocab, tree.n_nodes)
    accepted, lengths, bonus = accept_batch(post, batch)
    width = max(int(batch.depths[b, :batch.sizes[b]].max()) for b in range(bs)) + 1
    assert accepted.shape == (bs, width) and accepted.dtype == np.int32
    assert lengths.dtype == np.int32 and bonus.dtype == np.int64
    for b in range(bs):
        single = accept(post[b, :batch.sizes[b]], batch.tree(b))
        assert accepted[b, :lengths[b]].tolist() == single.accepted.tolist()
        assert lengths[b] == single.length and bonus[b] == single.bonus
        assert np.all(accepted[b, lengths[b]:] == -1)


def _inplace_compact(cache: np.ndarray, past_len: int, accepted: np.ndarray) -> np.ndarray:
    """Oracle: the official in-place forward copy, one row at a time (safe since accepted[j] >= j)."""
    out = cache.copy()
    for j, a in enumerate(accepted):
        out[past_len + j] = out[past_len + a]
    return out


def test_compact_matches_inplace_copy() -> None:
    rng = np.random.default_rng(2)
    for _ in range(200):
        tree = _random_tree(rng)
        post = _path_following_posterior(rng, tree, int(tree.tokens.max()) + 2)
        acc = accept(post, tree).accepted
        past_len = int(rng.integers(0, 10))
        cache = rng.normal(size=(past_len + tree.n_nodes + int(rng.integers(0, 4)), 3))
        out = compact(cache, past_len, acc)
        np.testing.assert_array_equal(out, _inplace_compact(cache, past_len, acc))
        np.testing.assert_array_equal(out[past_len:past_len + len(acc)], cache[past_len + acc])
        np.testing.assert_array_equal(out[:past_len], cache[:past_len])
        np.testing.assert_array_equal(out[past_len + len(acc):], cache[past_len + len(acc):])  # stale rows kept


def test_compact_overlapping_rows_and_copy() -> None:
    cache = np.arange(10 * 2).reshape(10, 2)
    before = cache.copy()
    out = compact(cache, 2, np.array([0, 1, 3, 4, 7]))  # destinations overlap later sources
    np.testing.assert_array_equal(out[2:7], before[[2, 3, 5, 6, 9]])
    np.testing.assert_array_equal(cache, before)  # input untouched
    np.testing.assert_array_equal(compact(cache, 0, np.array([0])), cache)  # root only: no-op


def test_compact_batch_matches_single_any_trailing_shape() -> None:
    rng = np.random.default_rng(3)
    bs, s = 4, 24
    cache = rng.normal(size=(bs, s, 2, 3)).astype(np.float32)
    past_lens = np.array([0, 5, 11, 2])
    accepted = np.full((bs, 6), -1)
    lengths = np.array([1, 4, 6, 3])
    for b in range(bs):
        rows = np.sort(rng.choice(np.arange(1, 12), size=lengths[b] - 1, replace=False))
        accepted[b, :lengths[b]] = np.concatenate([[0], rows])
    out = compact_batch(cache, past_lens, accepted, lengths)
    assert out.dtype == cache.dtype and out.shape == cache.shape
    for b in range(bs):
        np.testing.assert_array_equal(out[b], compact(cache[b], int(past_lens[b]), accepted[b, :lengths[b]]))


def _tree():
    return build_tree(np.log(np.array([[0.6, 0.4], [0.7, 0.3]])), np.array([[3, 4], [5, 6]]), 4, root_token=1)


def _batch():
    return build_tree_batch(np.zeros((1, 2, 2)), np.array([[[0, 1], [0, 1]]]), 4)


_CACHE = np.zeros((8, 2))
_ERRORS = {
    "accept_tree_type": (lambda: accept(np.zeros(5, dtype=np.int64), "tree"), TypeError, "tree"),
    "accept_post_dtype": (lambda: accept(np.zeros(5), _tree()), TypeError, "posterior_tokens"),
    "accept_post_shape": (lambda: accept(np.zeros(4, dtype=np.int64), _tree()), ValueError, "posterior_tokens"),
    "accept_post_negative": (lambda: accept(np.full(5, -1), _tree()), ValueError, "posterior_tokens"),
    "batch_trees_type": (lambda: accept_batch(np.zeros((1, 5), dtype=np.int64), _tree()), TypeError, "trees"),
    "batch_post_shape": (lambda: accept_batch(np.zeros((1, 4), dtype=np.int64), _batch()), ValueError,
                         "posterior_tokens"),
    "batch_post_negative": (lambda: accept_batch(np.full((1, 5), -1), _batch()), ValueError, "posterior_tokens"),
    "compact_cache_type": (lambda: compact([[0.0]] * 4, 0, np.array([0])), TypeError, "cache"),
    "compact_cache_0d": (lambda: compact(np.ones(()), 0, np.array([0])), ValueError, "cache"),
    "compact_past_len_negative": (lambda: compact(_CACHE, -1, np.array([0])), ValueError, "past_len"),
    "compact_past_len_type": (lambda: compact(_CACHE, 1.0, np.array([0])), TypeError, "past_len"),
    "compact_accepted_dtype": (lambda: compact(_CACHE, 0, np.array([0.0])), TypeError, "accepted"),
    "compact_accepted_empty": (lambda: compact(_CACHE, 0, np.array([], dtype=np.int64)), ValueError, "accepted"),
    "compact_accepted_root": (lambda: compact(_CACHE, 0, np.array([1, 2])), ValueError, "accepted"),
    "compact_accepted_order": (lambda: compact(_CACHE, 0, np.array([0, 3, 3])), ValueError, "accepted"),
    "compact_accepted_range": (lambda: compact(_CACHE, 4, np.array([0, 4])), ValueError, "accepted"),
    "cbatch_cache_1d": (lambda: compact_batch(np.zeros(4), np.array([0]), np.array([[0]]), np.array([1])),
                        ValueError, "cache"),
    "cbatch_past_lens_shape": (lambda: compact_batch(_CACHE[None], np.array([0, 0]), np.array([[0]]), np.array([1])),
                               ValueError, "past_lens"),
    "cbatch_past_lens_negative": (lambda: compact_batch(_CACHE[None], np.array([-1]), np.array([[0]]), np.array([1])),
                                  ValueError, "past_lens"),
    "cbatch_accepted_rows": (lambda: compact_batch(_CACHE[None], np.array([0]), np.array([[0], [0]]), np.array([1])),
                             ValueError, "accepted"),
    "cbatch_accepted_bad": (lambda: compact_batch(_CACHE[None], np.array([0]), np.array([[0, 0]]), np.array([2])),
                            ValueError, "accepted"),
    "cbatch_lengths_zero": (lambda: compact_batch(_CACHE[None], np.array([0]), np.array([[0]]), np.array([0])),
                            ValueError, "lengths"),
    "cbatch_lengths_dtype": (lambda: compact_batch(_CACHE[None], np.array([0]), np.array([[0]]), np.array([1.0])),
                             TypeError, "lengths"),
}


@pytest.mark.parametrize("case", sorted(_ERRORS))
def test_validation(case: str) -> None:
    call, error, name = _ERRORS[case]
    with pytest.raises(error, match=rf"\b{name}\b"):
        call()
