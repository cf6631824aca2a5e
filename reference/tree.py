"""DDTree draft-tree construction: the official best-first heap (spec §1.2), exactly.

Node 0 is the root (the bonus token of the previous round); nodes 1..n are the drafted nodes in heap
pop order, so every parent precedes its children (docs/ARCHITECTURE.md, "Node order").
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from reference._checks import as_int64, require_array, require_finite, require_int, require_shape

_WORD_BITS = 32  # packed visibility: bit j % 32 of word j // 32


@dataclass(frozen=True, eq=False)
class DraftTree:
    """One request's draft tree; n_nodes = 1 + drafted nodes.

    Attributes:
        tokens: int64 [n_nodes]; tokens[0] is the root token (-1 if unknown).
        parents: int32 [n_nodes]; parents[0] = -1, 0 <= parents[i] < i.
        depths: int32 [n_nodes]; root 0.
        ranks: int32 [n_nodes]; rank of the node's token in its depth's top-k row; root 0.
        scores: float64 [n_nodes]; path log-probability as the heap computed it; root 0.0.
        visibility: bool [n_nodes, n_nodes]; vis[i, j] iff j is i or an ancestor of i.
        child_ptr: int32 [n_nodes + 1]; CSR offsets into child_index.
        child_index: int32 [n_nodes - 1]; children of p are child_index[child_ptr[p]:child_ptr[p + 1]],
            in ascending node index.
    """

    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    ranks: np.ndarray
    scores: np.ndarray
    visibility: np.ndarray
    child_ptr: np.ndarray
    child_index: np.ndarray

    @property
    def n_nodes(self) -> int:
        """Number of nodes, root included."""
        return int(self.tokens.shape[0])

    def children(self, node: int) -> np.ndarray:
        """int32 node indices of ``node``'s children, ascending."""
        node = require_int(node, "node", minimum=0, maximum=self.n_nodes - 1)
        return self.child_index[self.child_ptr[node]:self.child_ptr[node + 1]]

    def child_with_token(self, node: int, token: int) -> int:
        """Index of the child of ``node`` whose token is ``token``, or -1 if there is none."""
        token = require_int(token, "token")
        for child in self.children(node):
            if self.tokens[child] == token:
                return int(child)
        return -1


def _validate_build_inputs(top_log_probs, top_ids, budget: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Checked float64 [L, K] log-probs, int64 [L, K] ids and int budget."""
    lp = require_array(top_log_probs, "top_log_probs", "float", ndim=2)
    ids = require_array(top_ids, "top_ids", "int", ndim=2)
    budget = require_int(budget, "budget", minimum=0)
    require_shape(ids, "top_ids", lp.shape)
    require_finite(lp, "top_log_probs")  # -inf would turn the sibling recurrence into NaN (spec §1.2 a)
    ids = as_int64(ids, "top_ids")
    if np.any(ids < 0):
        raise ValueError("top_ids must be >= 0")
    if ids.size and np.any(np.diff(np.sort(ids, axis=1), axis=1) == 0):
        raise ValueError("top_ids must be unique within each row (siblings would collide in the child map)")
    return lp.astype(np.float64), ids, budget


def _csr_children(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR child lookup from int32 [n] parents -> (child_ptr int32 [n + 1], child_index int32 [n - 1])."""
    n = parents.shape[0]
    child_nodes = np.arange(1, n, dtype=np.int32)  # every node but the root is someone's child
    order = np.argsort(parents[1:], kind="stable")  # grouped by parent, ascending index within a group
    child_index = child_nodes[order]
    counts = np.bincount(parents[1:], minlength=n)  # [n]
    child_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return child_ptr, child_index.astype(np.int32)


def _ancestor_closure(parents: np.ndarray) -> np.ndarray:
    """bool [n, n] ancestor-or-self matrix; valid because parents[i] < i (spec §1.2, Visibility)."""
    n = parents.shape[0]
    vis = np.zeros((n, n), dtype=bool)
    for i in range(n):
        if parents[i] >= 0:
            vis[i] = vis[parents[i]]
        vis[i, i] = True
    return vis


def build_tree(top_log_probs: np.ndarray, top_ids: np.ndarray, budget: int, root_token: int = -1) -> DraftTree:
    """Build the draft tree with the official best-first heap (spec §1.2).

    Heap entries are keyed ``(-w, rank_path)`` with Python tuple order (rank paths are unique, so a
    score tie goes to the lexicographically smaller path, prefix first). The seed is rank path (0,)
    at depth 1 with ``w = lp[0, 0]``; while the heap is non-empty and fewer than ``budget`` nodes are
    drafted, pop a node (depth d, rank r), record it, then push its next sibling
    ``w' = (w - lp[d-1, r]) + lp[d-1, r+1]`` if ``r + 1 < K`` and its first child ``w' = w + lp[d, 0]``
    if ``d < L``, in float64 with that order of operations.

    Args:
        top_log_probs: [L, K] floating, finite; row d-1 holds the depth-d candidates' log-probs.
        top_ids: [L, K] integer, >= 0, unique within each row; the matching token ids.
        budget: int >= 0, the maximum number of drafted nodes.
        root_token: the root's token (the previous bonus), -1 if unknown.

    Returns:
        DraftTree with 1 + min(budget, sum_{d=1..L} K^d) nodes; root only if budget, L or K is 0.
    """
    lp, ids, budget = _validate_build_inputs(top_log_probs, top_ids, budget)
    root_token = require_int(root_token, "root_token", minimum=-1)
    n_positions, k = lp.shape

    tokens, parents, depths, ranks, scores = [root_token], [-1], [0], [0], [0.0]
    heap: list[tuple[float, tuple[int, ...], int, int, int]] = []
    if budget > 0 and n_positions > 0 and k > 0:
        heap.append((-lp[0, 0], (0,), 0, 1, 0))  # (-w, rank path, parent, depth, rank)
    while heap and len(tokens) - 1 < budget:
        neg_w, path, parent, depth, rank = heapq.heappop(heap)
        w = -neg_w  # negation is exact, so w is the pushed score bit for bit
        node = len(tokens)
        tokens.append(int(ids[depth - 1, rank]))
        parents.append(parent)
        depths.append(depth)
        ranks.append(rank)
        scores.append(w)
        if rank + 1 < k:
            w_sibling = (w - lp[depth - 1, rank]) + lp[depth - 1, rank + 1]
            heapq.heappush(heap, (-w_sibling, path[:-1] + (rank + 1,), parent, depth, rank + 1))
        if depth < n_positions:
            w_child = w + lp[depth, 0]
            heapq.heappush(heap, (-w_child, path + (0,), node, depth + 1, 0))

    parents_arr = np.asarray(parents, dtype=np.int32)
    child_ptr, child_index = _csr_children(parents_arr)
    return DraftTree(
        tokens=np.asarray(tokens, dtype=np.int64),
        parents=parents_arr,
        depths=np.asarray(depths, dtype=np.int32),
        ranks=np.asarray(ranks, dtype=np.int32),
        scores=np.asarray(scores, dtype=np.float64),
        visibility=_ancestor_closure(parents_arr),
        child_ptr=child_ptr,
        child_index=child_index,
    )


@dataclass(frozen=True, eq=False)
class TreeBatch:
    """A batch of draft trees padded to a common capacity N (docs/ARCHITECTURE.md, "Padding").

    Attributes:
        sizes: int32 [bs]; n_nodes of each request's tree.
        tokens: int64 [bs, N]; padding -1.
        parents: int32 [bs, N]; padding -1.
        depths: int32 [bs, N]; padding 0.
        ranks: int32 [bs, N]; padding 0.
        scores: float64 [bs, N]; padding 0.0.
        visibility: bool [bs, N, N]; a padding node sees only itself and nothing sees it.
        child_ptr: int32 [bs, N + 1]; padding nodes have no children (ptr = child_ptr[b, size]).
        child_index: int32 [bs, N]; padding -1.
    """

    sizes: np.ndarray
    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    ranks: np.ndarray
    scores: np.ndarray
    visibility: np.ndarray
    child_ptr: np.ndarray
    child_index: np.ndarray

    @property
    def batch_size(self) -> int:
        """Number of requests."""
        return int(self.sizes.shape[0])

    @property
    def capacity(self) -> int:
        """Padded node count N."""
        return int(self.tokens.shape[1])

    def tree(self, b: int) -> DraftTree:
        """Request ``b``'s tree, unpadded (copies)."""
        b = require_int(b, "b", minimum=0, maximum=self.batch_size - 1)
        n = int(self.sizes[b])
        return DraftTree(
            tokens=self.tokens[b, :n].copy(),
            parents=self.parents[b, :n].copy(),
            depths=self.depths[b, :n].copy(),
            ranks=self.ranks[b, :n].copy(),
            scores=self.scores[b, :n].copy(),
            visibility=self.visibility[b, :n, :n].copy(),
            child_ptr=self.child_ptr[b, :n + 1].copy(),
            child_index=self.child_index[b, :n - 1].copy(),
        )


def _per_request(value, name: str, bs: int, minimum: int, default: int) -> np.ndarray:
    """An int or int array [bs] (None -> default) as int64 [bs], each >= minimum."""
    if value is None:
        return np.full(bs, default, dtype=np.int64)
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return np.full(bs, require_int(value, name, minimum=minimum), dtype=np.int64)
    arr = require_array(value, name, "int", ndim=1)
    require_shape(arr, name, (bs,))
    arr = as_int64(arr, name)
    if np.any(arr < minimum):
        raise ValueError(f"{name} must be >= {minimum}")
    return arr


def build_tree_batch(
    top_log_probs: np.ndarray,
    top_ids: np.ndarray,
    budgets,
    root_tokens=None,
    capacity: int | None = None,
) -> TreeBatch:
    """Build one tree per request with ``build_tree`` and pad them to a common capacity.

    Args:
        top_log_probs: [bs, L, K] floating, finite, bs >= 1.
        top_ids: [bs, L, K] integer, >= 0, unique within each (request, position) row.
        budgets: int or int array [bs], >= 0.
        root_tokens: None (all -1), an int, or int array [bs], >= -1.
        capacity: padded node count N; default the largest tree size. CUDA-graph users pass
            1 + max budget. Must be >= every tree size.

    Returns:
        TreeBatch with arrays padded to N nodes.
    """
    lp = require_array(top_log_probs, "top_log_probs", "float", ndim=3)
    ids = require_array(top_ids, "top_ids", "int", ndim=3)
    require_shape(ids, "top_ids", lp.shape)
    bs = lp.shape[0]
    if bs == 0:
        raise ValueError("top_log_probs must hold at least one request (bs >= 1)")
    budgets = _per_request(budgets, "budgets", bs, minimum=0, default=0)
    roots = _per_request(root_tokens, "root_tokens", bs, minimum=-1, default=-1)
    if capacity is not None:
        capacity = require_int(capacity, "capacity", minimum=1)
    for b in range(bs):  # validate every request before building any
        _validate_build_inputs(lp[b], ids[b], int(budgets[b]))

    trees = [build_tree(lp[b], ids[b], int(budgets[b]), int(roots[b])) for b in range(bs)]
    sizes = np.array([t.n_nodes for t in trees], dtype=np.int32)
    if capacity is None:
        capacity = int(sizes.max())
    elif capacity < int(sizes.max()):
        raise ValueError(f"capacity must be >= every tree size (largest is {int(sizes.max())}), got {capacity}")
    return _pad_trees(trees, sizes, capacity)


def _pad_trees(trees: list[DraftTree], sizes: np.ndarray, n_cap: int) -> TreeBatch:
    """Pad unpadded trees into a TreeBatch of capacity ``n_cap``."""
    bs = len(trees)
    tokens = np.full((bs, n_cap), -1, dtype=np.int64)
    parents = np.full((bs, n_cap), -1, dtype=np.int32)
    depths = np.zeros((bs, n_cap), dtype=np.int32)
    ranks = np.zeros((bs, n_cap), dtype=np.int32)
    scores = np.zeros((bs, n_cap), dtype=np.float64)
    visibility = np.broadcast_to(np.eye(n_cap, dtype=bool), (bs, n_cap, n_cap)).copy()  # padding sees itself
    child_ptr = np.zeros((bs, n_cap + 1), dtype=np.int32)
    child_index = np.full((bs, n_cap), -1, dtype=np.int32)
    for b, (t, n) in enumerate(zip(trees, sizes)):
        tokens[b, :n] = t.tokens
        parents[b, :n] = t.parents
        depths[b, :n] = t.depths
        ranks[b, :n] = t.ranks
        scores[b, :n] = t.scores
        visibility[b, :n, :n] = t.visibility
        child_ptr[b, :n + 1] = t.child_ptr
        child_ptr[b, n + 1:] = t.child_ptr[n]  # padding nodes: empty child ranges
        child_index[b, :n - 1] = t.child_index
    return TreeBatch(sizes, tokens, parents, depths, ranks, scores, visibility, child_ptr, child_index)


def pack_visibility(vis: np.ndarray) -> np.ndarray:
    """Pack ancestor rows into 32-bit words: bit j % 32 of word j // 32 (spec §7, Mask).

    Args:
        vis: bool [..., n, n].

    Returns:
        uint32 [..., n, ceil(n / 32)].
    """
    vis = require_array(vis, "vis", "bool")
    if vis.ndim < 2 or vis.shape[-1] != vis.shape[-2]:
        raise ValueError(f"vis must have shape [..., n, n], got {vis.shape}")
    n = vis.shape[-1]
    n_words = -(-n // _WORD_BITS)
    padded = np.zeros(vis.shape[:-1] + (n_words * _WORD_BITS,), dtype=np.uint64)
    padded[..., :n] = vis
    bits = padded.reshape(vis.shape[:-1] + (n_words, _WORD_BITS))  # [..., n, W, 32]
    weights = np.uint64(1) << np.arange(_WORD_BITS, dtype=np.uint64)  # [32]
    return (bits * weights).sum(axis=-1).astype(np.uint32)


def unpack_visibility(packed: np.ndarray, n: int) -> np.ndarray:
    """Inverse of ``pack_visibility``.

    Args:
        packed: uint32 [..., n, ceil(n / 32)]; bits past column n must be zero.
        n: node count.

    Returns:
        bool [..., n, n].
    """
    n = require_int(n, "n", minimum=0)
    packed = np.asarray(packed)
    if packed.dtype != np.uint32:
        raise TypeError(f"packed must have dtype uint32, got {packed.dtype}")
    n_words = -(-n // _WORD_BITS)
    if packed.ndim < 2 or packed.shape[-2:] != (n, n_words):
        raise ValueError(f"packed must have shape [..., {n}, {n_words}], got {packed.shape}")
    shifts = np.arange(_WORD_BITS, dtype=np.uint32)  # [32]
    bits = ((packed[..., None] >> shifts) & np.uint32(1)).astype(bool)  # [..., n, W, 32]
    bits = bits.reshape(packed.shape[:-1] + (n_words * _WORD_BITS,))
    if np.any(bits[..., n:]):
        raise ValueError(f"packed has bits set past column {n}")
    return bits[..., :n]
