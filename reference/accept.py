"""The acceptance walk (spec §1.4, official ``follow_verified_tree``).

Starting at the root, follow the child whose token equals the target's posterior token at the
current node; the first posterior token with no matching child becomes the next bonus token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from reference._checks import as_int64, require_array, require_shape
from reference.tree import DraftTree, TreeBatch


@dataclass(frozen=True, eq=False)
class AcceptResult:
    """Outcome of one walk.

    Attributes:
        accepted: int32 [m]; accepted node indices, root first, strictly increasing.
        length: m, with 1 <= m <= 1 + max depth (the root always counts).
        bonus: the next round's root token (posterior token of the last accepted node).
    """

    accepted: np.ndarray
    length: int
    bonus: int


def _walk(posterior: np.ndarray, tree: DraftTree) -> AcceptResult:
    """The official walk over a checked int64 [n_nodes] posterior."""
    accepted = [0]
    token = int(posterior[0])
    child = tree.child_with_token(0, token)
    while child >= 0:
        accepted.append(child)
        token = int(posterior[child])
        child = tree.child_with_token(child, token)
    return AcceptResult(np.asarray(accepted, dtype=np.int32), len(accepted), token)


def _check_posterior(posterior_tokens, shape: tuple[int, ...]) -> np.ndarray:
    """Integer posterior tokens of the given shape, as int64."""
    posterior = require_array(posterior_tokens, "posterior_tokens", "int", ndim=len(shape))
    require_shape(posterior, "posterior_tokens", shape)
    return as_int64(posterior, "posterior_tokens")


def accept(posterior_tokens: np.ndarray, tree: DraftTree) -> AcceptResult:
    """Walk ``tree`` along the posterior tokens (spec §1.4).

    Args:
        posterior_tokens: int [n_nodes], >= 0; the target's token at each node (greedy or sampled,
            see ``reference.sampling.sample_posterior``).
        tree: the verified DraftTree.

    Returns:
        AcceptResult.
    """
    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
    posterior = _check_posterior(posterior_tokens, (tree.n_nodes,))
    if np.any(posterior < 0):
        raise ValueError("posterior_tokens must be >= 0")
    return _walk(posterior, tree)


def accept_batch(posterior_tokens: np.ndarray, trees: TreeBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``accept`` for every request of a padded batch.

    Args:
        posterior_tokens: int [bs, N] with N = trees.capacity; entries of padding nodes are ignored,
            the others must be >= 0.
        trees: the verified TreeBatch.

    Returns:
        accepted: int32 [bs, W], padded with -1, where W = max over requests of (max depth + 1).
        lengths: int32 [bs].
        bonus: int64 [bs].
    """
    if not isinstance(trees, TreeBatch):
        raise TypeError(f"trees must be a TreeBatch, got {type(trees).__name__}")
    bs, n_cap = trees.batch_size, trees.capacity
    posterior = _check_posterior(posterior_tokens, (bs, n_cap))
    real = np.arange(n_cap)[None, :] < trees.sizes[:, None]  # [bs, N]
    if np.any(posterior[real] < 0):
        raise ValueError("posterior_tokens must be >= 0 on real (non-padding) nodes")

    width = int(max(trees.depths[b, :trees.sizes[b]].max() for b in range(bs))) + 1
    accepted = np.full((bs, width), -1, dtype=np.int32)
    lengths = np.zeros(bs, dtype=np.int32)
    bonus = np.zeros(bs, dtype=np.int64)
    for b in range(bs):
        n = int(trees.sizes[b])
        result = _walk(posterior[b, :n], trees.tree(b))
        accepted[b, :result.length] = result.accepted
        lengths[b] = result.length
        bonus[b] = result.bonus
    return accepted, lengths, bonus
