"""The official DDTree build loop, transcribed from its description in ddtree-spec.md §1.2.

Used only by the tests, as an independent oracle for reference/tree.py (which it must not
import). It follows the loop step for step as the spec states it: a heapq of tuples
(-w, rank path, parent, depth, rank), one token -> child dict per node, Python floats (float64)
for the weights, and the O(n^2) visibility fill. Written to mirror that description, not for
speed or style; reference/tree.py is the readable version.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass
class OfficialTree:
    """What the loop produces (plus the ranks and weights it carries)."""

    node_token_ids: list[int]  # drafted nodes only, in pop order (drafted node k is tree index k + 1)
    node_depths: list[int]
    node_ranks: list[int]
    node_weights: list[float]
    parents: list[int]  # parents[0] = -1 for the root
    child_maps: list[dict[int, int]]  # child_maps[p][token] = child index
    visibility: np.ndarray  # bool [1 + n, 1 + n]


def build_ddtree_tree_official(lp: np.ndarray, ids: np.ndarray, budget: int) -> OfficialTree:
    """Spec §1.2 over [L, K] top-k log-probs ``lp`` and token ids ``ids``."""
    horizon = lp.shape[0]
    k = lp.shape[1] if horizon > 0 else 0
    out = OfficialTree([], [], [], [], [-1], [{}], np.zeros((0, 0), dtype=bool))

    # Early exit (B <= 0, L == 0; K == 0 guarded as the vLLM review asks, spec §3): root only.
    if budget > 0 and horizon > 0 and k > 0:
        # Seed: rank path (0,), parent 0 (the root), depth 1, rank 0, w = lp[0, 0].
        frontier = [(-float(lp[0, 0]), (0,), 0, 1, 0)]
        drafted = 0
        while frontier and drafted < budget:
            neg_w, path, parent, depth, rank = heapq.heappop(frontier)
            w = -neg_w
            token = int(ids[depth - 1, rank])
            index = drafted + 1  # the new node's index in the tree
            out.node_token_ids.append(token)
            out.node_depths.append(depth)
            out.node_ranks.append(rank)
            out.node_weights.append(w)
            out.parents.append(parent)
            out.child_maps.append({})
            out.child_maps[parent][token] = index
            drafted += 1
            # Next sibling: same parent and depth, last rank replaced; w - lp[d-1, r] + lp[d-1, r+1]
            # evaluated left to right.
            if rank + 1 < k:
                w_next = w - float(lp[depth - 1, rank]) + float(lp[depth - 1, rank + 1])
                heapq.heappush(frontier, (-w_next, path[:-1] + (rank + 1,), parent, depth, rank + 1))
            # First child: parent = the new node, depth + 1, rank 0, w + lp[d, 0].
            if depth < horizon:
                w_child = w + float(lp[depth, 0])
                heapq.heappush(frontier, (-w_child, path + (0,), index, depth + 1, 0))

    # Visibility: root sees itself; row i = row parents[i] on columns < i, plus the diagonal.
    size = 1 + len(out.node_token_ids)
    vis = np.zeros((size, size), dtype=bool)
    vis[0, 0] = True
    for i in range(1, size):
        vis[i, :i] = vis[out.parents[i], :i]
        vis[i, i] = True
    out.visibility = vis
    return out
