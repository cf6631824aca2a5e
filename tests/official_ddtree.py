"""A literal transcription of the official tree build loop (spec §1.2, `build_ddtree_tree`).

Used only by the tests, as an independent oracle for reference/tree.py (which it must not import):
a heapq of tuples (-w, ranks, parent, depth, rank), a child-map dict per node, Python floats (float64)
for the weights, and the O(n^2) visibility loop. Written in the structure of the official code, not
for speed.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass
class OfficialTree:
    """What the official loop produces (plus the ranks and weights it carries)."""

    node_token_ids: list[int]  # drafted nodes only, in pop order (node k is index k + 1)
    node_depths: list[int]
    node_ranks: list[int]
    node_weights: list[float]
    parents: list[int]  # parents[0] = -1 for the root
    child_maps: list[dict[int, int]]  # child_maps[p][token] = child index
    visibility: np.ndarray  # bool [1 + n, 1 + n]


def build_ddtree_tree_official(top_log_probs: np.ndarray, top_token_ids: np.ndarray, budget: int) -> OfficialTree:
    """The official best-first loop over [L, K] top-k log-probs and ids."""
    depth_limit = top_log_probs.shape[0]
    topk = top_log_probs.shape[1] if depth_limit > 0 else 0
    node_token_ids: list[int] = []
    node_depths: list[int] = []
    node_ranks: list[int] = []
    node_weights: list[float] = []
    parents = [-1]
    child_maps: list[dict[int, int]] = [dict()]

    if budget > 0 and depth_limit > 0 and topk > 0:
        first_logw = float(top_log_probs[0, 0])
        heap = [(-first_logw, (0,), 0, 1, 0)]
        n = 0
        while heap and n < budget:
            neg_logw, ranks, parent_index, depth, rank = heapq.heappop(heap)
            logw = -neg_logw
            token_id = int(top_token_ids[depth - 1, rank])
            current_index = n + 1
            node_token_ids.append(token_id)
            node_depths.append(depth)
            node_ranks.append(rank)
            node_weights.append(logw)
            parents.append(parent_index)
            child_maps.append(dict())
            child_maps[parent_index][token_id] = current_index
            n += 1

            if rank + 1 < topk:
                sibling_ranks = ranks[:-1] + (rank + 1,)
                sibling_logw = logw - float(top_log_probs[depth - 1, rank]) + float(top_log_probs[depth - 1, rank + 1])
                heapq.heappush(heap, (-sibling_logw, sibling_ranks, parent_index, depth, rank + 1))

            if depth < depth_limit:
                child_ranks = ranks + (0,)
                child_logw = logw + float(top_log_probs[depth, 0])
                heapq.heappush(heap, (-child_logw, child_ranks, current_index, depth + 1, 0))

    current_length = 1 + len(node_token_ids)
    visibility = np.zeros((current_length, current_length), dtype=bool)
    visibility[0, 0] = True
    for index in range(1, current_length):
        parent_index = parents[index]
        visibility[index, :index] = visibility[parent_index, :index]
        visibility[index, index] = True
    return OfficialTree(node_token_ids, node_depths, node_ranks, node_weights, parents, child_maps, visibility)
