"""The golden cases: inputs and expected outputs of every reference function, from fixed seeds.

One file per kernel family (:data:`GOLDEN_FILES`), one group per case (``ddtree_numba.golden``).
Each case is an ``xr.Dataset`` with named dims and

- ``in_*`` variables: the reference call's arguments (scalars as 0-d variables);
- ``out_*`` variables: what the reference returned;
- attrs ``config`` (JSON of the generation parameters), ``seed``, ``case`` (description) and
  ``function`` (qualified name of the reference function that produced the outputs).

Dims: position (drafter horizon L), vocab, rank (top-k), node / node_key (tree nodes as rows /
visibility columns), node_ptr (n + 1 CSR offsets), child (n - 1 CSR entries), word (packed
visibility), request (batch), head, latent, rope, key (N + T cache rows), row, accepted; model
cases add row / row_key (new tokens), layer, entry (hidden-state entries), hidden and vocab.

Building is pure: :func:`build_cases` returns identical datasets on every call, so :func:`check`
can rebuild and compare them with the committed files (bit for bit on the machine that wrote them;
float variables within CHECK_RTOL / CHECK_ATOL elsewhere).
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr
from tqdm import tqdm

from ddtree_numba.config import ModelConfig
from ddtree_numba.golden import datasets_diff, read_all, write_cases
from reference.accept import accept, accept_batch
from reference.attention import verify_attention, verify_attention_batch
from reference.compact import compact, compact_batch
from reference.model import LayerCache, causal_visibility
from reference.model import forward as model_forward
from reference.sampling import gumbel_noise, philox4x32, sample_posterior
from reference.topk import bf16_to_float32, float32_to_bf16, topk_log_probs
from reference.tree import DraftTree, TreeBatch, build_tree, build_tree_batch, pack_visibility
from reference.weights import init_weights

GOLDEN_FILES: dict[str, str] = {
    "topk": "topk.h5",
    "tree": "tree.h5",
    "attention": "attention.h5",
    "accept": "accept.h5",
    "sampling": "sampling.h5",
    "compact": "compact.h5",
    "model": "model.h5",
}
GENERATOR = "reference.golden_cases"
# check() tolerance for float variables: NumPy's exp / log / einsum take different SIMD paths on
# different CPUs (AVX-512 vs AVX2) and differ in the last bit of float64 results (seen: 2.2e-16
# on attention outputs and Gumbel noise). Everything else (ints, bools, tree structure) is exact.
CHECK_RTOL = 1e-12
CHECK_ATOL = 1e-14

# Kimi K2 (256K releases) softmax scale: 192^-1/2 * (0.1 * ln(64) + 1)^2 (spec §6, derived).
KIMI_SCALE = 192.0**-0.5 * (0.1 * math.log(64.0) + 1.0) ** 2
TINY_SCALE = 0.25  # tiny test dims: keeps scores O(1) so softmax weights are spread


# --------------------------------------------------------------------------- helpers


def _qualname(function: Callable) -> str:
    """``module.function``, recorded in each case's ``function`` attribute."""
    return f"{function.__module__}.{function.__qualname__}"


def _case(function: Callable, seed: int, description: str, config: dict[str, Any], variables: dict) -> xr.Dataset:
    """One golden case: variables name -> (dims, values), with the standard attrs."""
    return xr.Dataset(
        variables,
        attrs={
            "config": json.dumps(config, sort_keys=True),
            "seed": seed,
            "case": description,
            "function": _qualname(function),
        },
    )


def _logits(rng: np.random.Generator, n_rows: int, vocab: int, std: float = 3.0) -> np.ndarray:
    """float32 [n_rows, vocab] Gaussian logits (peaked enough for realistic acceptance)."""
    return (rng.standard_normal((n_rows, vocab)) * std).astype(np.float32)


def _bf16_logits(rng: np.random.Generator, n_rows: int, vocab: int, std: float = 2.5) -> tuple[np.ndarray, np.ndarray]:
    """Tie-heavy drafter logits as the drafter emits them: (uint16 bf16 bits, float32 widening)."""
    bits = float32_to_bf16(_logits(rng, n_rows, vocab, std))  # [n_rows, vocab] uint16
    return bits, bf16_to_float32(bits)


def _tree_vars(tree: DraftTree, prefix: str) -> dict[str, tuple]:
    """Every DraftTree field (plus packed visibility) as variables named ``prefix + field``."""
    return {
        f"{prefix}tokens": (("node",), tree.tokens),
        f"{prefix}parents": (("node",), tree.parents),
        f"{prefix}depths": (("node",), tree.depths),
        f"{prefix}ranks": (("node",), tree.ranks),
        f"{prefix}scores": (("node",), tree.scores),
        f"{prefix}visibility": (("node", "node_key"), tree.visibility),
        f"{prefix}visibility_packed": (("node", "word"), pack_visibility(tree.visibility)),
        f"{prefix}child_ptr": (("node_ptr",), tree.child_ptr),
        f"{prefix}child_index": (("child",), tree.child_index),
    }


def _batch_vars(batch: TreeBatch, prefix: str) -> dict[str, tuple]:
    """Every TreeBatch field (plus packed visibility) as variables with a leading request dim."""
    return {
        f"{prefix}sizes": (("request",), batch.sizes),
        f"{prefix}tokens": (("request", "node"), batch.tokens),
        f"{prefix}parents": (("request", "node"), batch.parents),
        f"{prefix}depths": (("request", "node"), batch.depths),
        f"{prefix}ranks": (("request", "node"), batch.ranks),
        f"{prefix}scores": (("request", "node"), batch.scores),
        f"{prefix}visibility": (("request", "node", "node_key"), batch.visibility),
        f"{prefix}visibility_packed": (("request", "node", "word"), pack_visibility(batch.visibility)),
        f"{prefix}child_ptr": (("request", "node_ptr"), batch.child_ptr),
        f"{prefix}child_index": (("request", "node"), batch.child_index),
    }


def tree_from_vars(ds: xr.Dataset, prefix: str) -> DraftTree:
    """The DraftTree stored by ``_tree_vars`` (e.g. ``prefix="in_tree_"`` in accept cases)."""
    fields = ("tokens", "parents", "depths", "ranks", "scores", "visibility", "child_ptr", "child_index")
    return DraftTree(**{f: ds[prefix + f].values for f in fields})


def batch_from_vars(ds: xr.Dataset, prefix: str) -> TreeBatch:
    """The TreeBatch stored by ``_batch_vars``."""
    fields = ("sizes", "tokens", "parents", "depths", "ranks", "scores", "visibility", "child_ptr", "child_index")
    return TreeBatch(**{f: ds[prefix + f].values for f in fields})


def _random_tree(rng: np.random.Generator, horizon: int, vocab: int, budget: int, root_token: int) -> DraftTree:
    """A tree grown the official way: random logits -> top-min(B, V) -> heap."""
    values, ids = topk_log_probs(_logits(rng, horizon, vocab), min(budget, vocab))
    return build_tree(values, ids, budget, root_token)


# --------------------------------------------------------------------------- topk


def _topk_case(seed: int, description: str, logits: np.ndarray, k: int, config: dict,
               extra: dict | None = None) -> xr.Dataset:
    values, ids = topk_log_probs(logits, k)
    variables = {
        "in_logits": (("position", "vocab"), logits),
        "in_k": ((), np.int64(k)),
        "out_values": (("position", "rank"), values),
        "out_ids": (("position", "rank"), ids),
        **(extra or {}),
    }
    return _case(topk_log_probs, seed, description, config, variables)


def _topk_cases() -> dict[str, xr.Dataset]:
    cases = {}
    for name, seed, n_pos, vocab, k, what in [
        ("fp32_random", 101, 6, 96, 12, "fp32 Gaussian logits"),
        ("k_gt_v", 103, 3, 5, 9, "k > V: clamped to V"),
        ("k0", 104, 3, 7, 0, "k = 0: empty rank dim"),
        ("l1", 105, 1, 40, 6, "L = 1"),
    ]:
        logits = _logits(np.random.default_rng(seed), n_pos, vocab)
        cases[name] = _topk_case(seed, what, logits, k, {"L": n_pos, "V": vocab, "k": k, "std": 3.0})

    seed = 102
    bits, logits = _bf16_logits(np.random.default_rng(seed), 5, 512)
    cases["bf16_ties"] = _topk_case(
        seed,
        "bf16-quantized N(0, 2.5^2) logits: many equal values, ordered by lower id (in_logits_bf16 = raw bits)",
        logits,
        32,
        {"L": 5, "V": 512, "k": 32, "std": 2.5, "dtype": "bf16"},
        {"in_logits_bf16": (("position", "vocab"), bits)},
    )

    seed = 106
    rng = np.random.default_rng(seed)
    special = np.array(
        [0.0, -0.0, 1.0, 1.00390625, 1.01171875, 1.0 + 2.0**-8 + 2.0**-20, np.inf, -np.inf, np.nan, 3.4e38, 1e-40],
        dtype=np.float32,
    )  # exact, a tie to even (down), a tie to even (up), just above a tie, specials, overflow, subnormal
    x = np.concatenate([special, (rng.standard_normal(53) * 10.0).astype(np.float32)])
    bits = float32_to_bf16(x)
    cases["bf16_round"] = _case(
        float32_to_bf16,
        seed,
        "float32 -> bf16 round to nearest even (out_bits), widened back with bf16_to_float32 (out_widened)",
        {"n": int(x.size), "std": 10.0},
        {
            "in_x": (("element",), x),
            "out_bits": (("element",), bits),
            "out_widened": (("element",), bf16_to_float32(bits)),
        },
    )
    return cases


# --------------------------------------------------------------------------- tree


def _tree_case(seed: int, description: str, lp: np.ndarray, ids: np.ndarray, budget: int, root: int,
               config: dict) -> xr.Dataset:
    tree = build_tree(lp, ids, budget, root)
    variables = {
        "in_top_log_probs": (("position", "rank"), lp),
        "in_top_ids": (("position", "rank"), ids),
        "in_budget": ((), np.int64(budget)),
        "in_root_token": ((), np.int64(root)),
        **_tree_vars(tree, "out_"),
    }
    description += "; out_visibility_packed = pack_visibility(out_visibility)"
    return _case(build_tree, seed, description, config, variables)


def _tree_from_logits_case(seed: int, description: str, n_pos: int, vocab: int, budget: int, root: int,
                           k: int | None = None, bf16: bool = False) -> xr.Dataset:
    """Official pipeline: logits -> topk_log_probs(logits, K = min(B, V) unless given) -> build_tree."""
    rng = np.random.default_rng(seed)
    logits = _bf16_logits(rng, n_pos, vocab)[1] if bf16 else _logits(rng, n_pos, vocab)
    k = min(budget, vocab) if k is None else k
    lp, ids = topk_log_probs(logits, k)
    config = {"L": n_pos, "V": vocab, "K": k, "budget": budget, "root_token": root,
              "logits": "bf16" if bf16 else "fp32"}
    return _tree_case(seed, description, lp, ids, budget, root, config)


def _tree_cases() -> dict[str, xr.Dataset]:
    cases = {
        "random": _tree_from_logits_case(201, "random fp32 logits, K = min(B, V)", 6, 50, 40, 17),
        "random_multiword": _tree_from_logits_case(202, "81 nodes: 3 packed visibility words", 8, 128, 80, 3),
        "tie_heavy": _tree_from_logits_case(203, "bf16 logits: top-k ties broken by lower id", 5, 64, 24, 9, bf16=True),
        "budget0": _tree_from_logits_case(204, "budget 0: root only (K = 0)", 4, 16, 0, 5),
        "budget1": _tree_from_logits_case(205, "budget 1: root + the top-1 depth-1 node", 4, 16, 1, 5),
        "l1": _tree_from_logits_case(206, "L = 1: every node at depth 1", 1, 20, 8, 2),
        "k1": _tree_from_logits_case(207, "K = 1 with B > L: the top-1 chain of length L", 5, 30, 8, 4, k=1),
    }

    # Spec §1.2: 4 equiprobable tokens per depth, L = 3, B = 10.
    lp = np.full((3, 4), np.log(0.25), dtype=np.float32)
    ids = np.array([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]], dtype=np.int64)
    cases["equiprobable"] = _tree_case(
        0, "spec 1.2: 4 equiprobable tokens/depth, L=3, B=10: rank paths (0,),(1,),(2,),(3,),(0,0)..(0,3),(1,0),(1,1)",
        lp, ids, 10, 1, {"L": 3, "K": 4, "budget": 10, "p": 0.25})

    # Spec §1.2: V = 2, L = 3, B = 20 exhausts all 2 + 4 + 8 = 14 nodes.
    lp, ids = topk_log_probs(_logits(np.random.default_rng(208), 3, 2), 2)
    cases["v2_exhaustion"] = _tree_case(208, "V = 2, L = 3, B = 20: exhausted at 14 drafted nodes", lp, ids, 20, 0,
                                        {"L": 3, "V": 2, "K": 2, "budget": 20})

    # Spec §1.2 (b): B = L is not a chain.
    probs = np.array([[0.5, 0.4, 0.1], [0.5, 0.3, 0.2], [0.5, 0.3, 0.2]])
    ids = np.array([[7, 3, 5], [1, 2, 9], [4, 8, 6]], dtype=np.int64)
    cases["budget_eq_l"] = _tree_case(
        0, "spec 1.2 (b): B = L = 3, depth-1 probs [0.5, 0.4, ..]: rank paths (0,),(1,),(0,0), not a chain",
        np.log(probs).astype(np.float32), ids, 3, 6, {"L": 3, "K": 3, "budget": 3, "probs": probs.tolist()})

    # Spec §3 token-0 bug: token 0 is an ordinary token (root and drafted); 4 drafted nodes, 5 in all.
    seed = 209
    logits = _logits(np.random.default_rng(seed), 2, 6)
    logits[:, 0] = logits.max(axis=1) + 1.0  # token 0 is every position's top-1
    lp, ids = topk_log_probs(logits, 4)
    cases["token0"] = _tree_case(seed, "token id 0 at root and in the tree (size 5, spec 3)", lp, ids, 4, 0,
                                 {"L": 2, "V": 6, "K": 4, "budget": 4})

    # Ragged batch padded to a CUDA-graph capacity: budgets differ, one request drafts nothing.
    seed = 210
    budgets = np.array([12, 0, 30], dtype=np.int64)
    roots = np.array([5, 7, 0], dtype=np.int64)
    capacity = 40
    rng = np.random.default_rng(seed)
    lp, ids = topk_log_probs(_logits(rng, 3 * 5, 40), int(budgets.max()))  # [3 * L, K]
    lp, ids = lp.reshape(3, 5, -1), ids.reshape(3, 5, -1)  # [bs, L, K]
    batch = build_tree_batch(lp, ids, budgets, roots, capacity)
    cases["batch_ragged"] = _case(
        build_tree_batch, seed,
        "bs=3, budgets [12, 0, 30], capacity 40 > largest tree: padding nodes see only themselves",
        {"bs": 3, "L": 5, "V": 40, "K": int(budgets.max()), "budgets": budgets.tolist(), "capacity": capacity},
        {
            "in_top_log_probs": (("request", "position", "rank"), lp),
            "in_top_ids": (("request", "position", "rank"), ids),
            "in_budgets": (("request",), budgets),
            "in_root_tokens": (("request",), roots),
            "in_capacity": ((), np.int64(capacity)),
            **_batch_vars(batch, "out_"),
        },
    )
    return cases


# --------------------------------------------------------------------------- attention


def _attention_case(seed: int, description: str, n_past: int, budget: int, heads: int, d_latent: int, d_rope: int,
                    scale: float) -> xr.Dataset:
    """Single request: a random tree of 1 + drafted nodes over n_past cached rows."""
    rng = np.random.default_rng(seed)
    vis = _random_tree(rng, 5, 24, budget, 0).visibility  # [T, T]
    t = vis.shape[0]
    q_latent = (rng.standard_normal((t, heads, d_latent)) * 0.5).astype(np.float32)  # [T, H, Dl]
    q_rope = (rng.standard_normal((t, heads, d_rope)) * 0.5).astype(np.float32)  # [T, H, Dr]
    kv_latent = rng.standard_normal((n_past + t, d_latent)).astype(np.float32)  # [N + T, Dl]
    k_rope = rng.standard_normal((n_past + t, d_rope)).astype(np.float32)  # [N + T, Dr]
    out, lse = verify_attention(q_latent, q_rope, kv_latent, k_rope, vis, scale)
    config = {"N": n_past, "T": t, "H": heads, "Dl": d_latent, "Dr": d_rope, "scale": scale, "budget": budget}
    return _case(verify_attention, seed, description, config, {
        "in_q_latent": (("node", "head", "latent"), q_latent),
        "in_q_rope": (("node", "head", "rope"), q_rope),
        "in_kv_latent": (("key", "latent"), kv_latent),
        "in_k_rope": (("key", "rope"), k_rope),
        "in_visibility": (("node", "node_key"), vis),
        "in_scale": ((), np.float64(scale)),
        "out_out": (("node", "head", "latent"), out),
        "out_lse": (("node", "head"), lse),
    })


def _attention_cases() -> dict[str, xr.Dataset]:
    cases = {
        "n0": _attention_case(301, "N = 0: the tree attends only to itself", 0, 6, 2, 16, 8, TINY_SCALE),
        "small_n": _attention_case(302, "small N = 5, T = 9", 5, 8, 2, 16, 8, TINY_SCALE),
        "t1": _attention_case(303, "T = 1: root only (budget 0)", 7, 0, 2, 16, 8, TINY_SCALE),
        "kimi_dims": _attention_case(304, "Kimi K2 latent/rope dims 512/64, H = 2, N = 40, T = 9", 40, 8, 2, 512, 64,
                                     KIMI_SCALE),
    }

    # Ragged batch: trees of 8, 3 and 1 nodes over 0, 5 and 3 cached rows; request 3 is an idle slot.
    seed = 305
    rng = np.random.default_rng(seed)
    bs, tc, heads, d_latent, d_rope, s = 4, 8, 2, 16, 8, 16
    budgets = np.array([7, 2, 0, 3], dtype=np.int64)
    lp, ids = topk_log_probs(_logits(rng, bs * 4, 24), int(budgets.max()))
    vis = build_tree_batch(lp.reshape(bs, 4, -1), ids.reshape(bs, 4, -1), budgets, capacity=tc).visibility
    past_lens = np.array([0, 5, 3, 6], dtype=np.int64)
    tree_sizes = np.array([8, 3, 1, 0], dtype=np.int64)  # request 3 idle: its 4-node tree is not verified
    q_latent = (rng.standard_normal((bs, tc, heads, d_latent)) * 0.5).astype(np.float32)
    q_rope = (rng.standard_normal((bs, tc, heads, d_rope)) * 0.5).astype(np.float32)
    kv_latent = rng.standard_normal((bs, s, d_latent)).astype(np.float32)
    k_rope = rng.standard_normal((bs, s, d_rope)).astype(np.float32)
    out, lse = verify_attention_batch(q_latent, q_rope, kv_latent, k_rope, past_lens, tree_sizes, vis, TINY_SCALE)
    cases["batch_ragged"] = _case(
        verify_attention_batch, seed,
        "ragged bs=4: tree sizes [8, 3, 1, 0 (idle)], past lens [0, 5, 3, 6], S = 16; padding rows are zeros",
        {"bs": bs, "Tc": tc, "H": heads, "Dl": d_latent, "Dr": d_rope, "S": s, "scale": TINY_SCALE,
         "past_lens": past_lens.tolist(), "tree_sizes": tree_sizes.tolist()},
        {
            "in_q_latent": (("request", "node", "head", "latent"), q_latent),
            "in_q_rope": (("request", "node", "head", "rope"), q_rope),
            "in_kv_latent": (("request", "key", "latent"), kv_latent),
            "in_k_rope": (("request", "key", "rope"), k_rope),
            "in_past_lens": (("request",), past_lens),
            "in_tree_sizes": (("request",), tree_sizes),
            "in_visibility": (("request", "node", "node_key"), vis),
            "in_scale": ((), np.float64(TINY_SCALE)),
            "out_out": (("request", "node", "head", "latent"), out),
            "out_lse": (("request", "node", "head"), lse),
        },
    )
    return cases


# --------------------------------------------------------------------------- accept


def _deepest_path(tree: DraftTree) -> list[int]:
    """Node indices root -> the first deepest node."""
    node = int(np.argmax(tree.depths))
    path = [node]
    while tree.parents[path[-1]] >= 0:
        path.append(int(tree.parents[path[-1]]))
    return path[::-1]


def _posterior(rng: np.random.Generator, tree: DraftTree, vocab: int, follow: float) -> np.ndarray:
    """int64 [n] posterior: with probability ``follow`` a node's posterior is its first child's token
    (the target agrees with the drafter's best guess), otherwise a random token (which may still
    match another child)."""
    post = rng.integers(0, vocab, tree.n_nodes)
    for node in range(tree.n_nodes):
        kids = tree.children(node)
        if kids.size and rng.random() < follow:
            post[node] = tree.tokens[kids[0]]
    return post.astype(np.int64)


def _accept_case(seed: int, description: str, tree: DraftTree, post: np.ndarray, config: dict) -> xr.Dataset:
    result = accept(post, tree)
    return _case(accept, seed, description, config, {
        **_tree_vars(tree, "in_tree_"),
        "in_posterior_tokens": (("node",), post),
        "out_accepted": (("accepted",), result.accepted),
        "out_length": ((), np.int32(result.length)),
        "out_bonus": ((), np.int64(result.bonus)),
    })


def _accept_cases() -> dict[str, xr.Dataset]:
    cases = {}
    vocab = 32
    for name, seed, budget, follow in [("random_a", 401, 30, 0.7), ("random_b", 402, 60, 0.85),
                                       ("random_c", 403, 12, 0.5)]:
        rng = np.random.default_rng(seed)
        tree = _random_tree(rng, 6, vocab, budget, int(rng.integers(vocab)))
        config = {"L": 6, "V": vocab, "budget": budget, "follow": follow}
        cases[name] = _accept_case(seed, f"random tree (B = {budget}), posterior follows a child w.p. {follow}",
                                   tree, _posterior(rng, tree, vocab, follow), config)

    seed = 404
    rng = np.random.default_rng(seed)
    tree = _random_tree(rng, 5, vocab, 25, 1)
    post = _posterior(rng, tree, vocab, 0.0)
    path = _deepest_path(tree)
    post[path[:-1]] = tree.tokens[path[1:]]  # each path node's posterior is the next path node's token
    cases["full_depth"] = _accept_case(seed, "posterior follows a deepest path: length = 1 + max depth", tree, post,
                                       {"L": 5, "V": vocab, "budget": 25})

    seed = 405
    rng = np.random.default_rng(seed)
    tree = _random_tree(rng, 5, vocab, 25, 1)
    post = _posterior(rng, tree, vocab, 0.9)
    root_tokens = set(tree.tokens[tree.children(0)].tolist())
    post[0] = min(set(range(vocab)) - root_tokens)  # no root child matches: only the root is accepted
    cases["root_only"] = _accept_case(seed, "root's posterior matches no child: length 1", tree, post,
                                      {"L": 5, "V": vocab, "budget": 25})

    seed = 406
    rng = np.random.default_rng(seed)
    budgets = np.array([20, 0, 9], dtype=np.int64)
    lp, ids = topk_log_probs(_logits(rng, 3 * 5, vocab), int(budgets.max()))
    batch = build_tree_batch(lp.reshape(3, 5, -1), ids.reshape(3, 5, -1), budgets, [3, 4, 0], capacity=24)
    post = np.full((3, batch.capacity), -1, dtype=np.int64)  # padding entries -1: must be ignored
    for b in range(3):
        post[b, :batch.sizes[b]] = _posterior(rng, batch.tree(b), vocab, 0.8)
    accepted, lengths, bonus = accept_batch(post, batch)
    cases["batch"] = _case(
        accept_batch, seed, "bs=3, budgets [20, 0, 9], capacity 24; padding posteriors are -1 and ignored",
        {"bs": 3, "L": 5, "V": vocab, "budgets": budgets.tolist(), "capacity": 24, "follow": 0.8},
        {
            **_batch_vars(batch, "in_tree_"),
            "in_posterior_tokens": (("request", "node"), post),
            "out_accepted": (("request", "accepted"), accepted),
            "out_lengths": (("request",), lengths),
            "out_bonus": (("request",), bonus),
        },
    )
    return cases


# --------------------------------------------------------------------------- sampling


def _sampling_case(seed: int, description: str, logits: np.ndarray, temperature: float, sample_seed: int,
                   positions: np.ndarray, config: dict) -> xr.Dataset:
    tokens = sample_posterior(logits, temperature, sample_seed, positions)
    return _case(sample_posterior, seed, description, config, {
        "in_logits": (("row", "vocab"), logits),
        "in_temperature": ((), np.float64(temperature)),
        "in_seed": ((), np.uint64(sample_seed)),
        "in_positions": (("row",), positions),
        "out_tokens": (("row",), tokens),
    })


def _sampling_cases() -> dict[str, xr.Dataset]:
    cases = {}
    seed = 501
    rng = np.random.default_rng(seed)
    logits = _bf16_logits(rng, 12, 64, std=1.0)[1]  # [12, 64]
    for row in range(0, 12, 2):  # tie each even row's maximum at a second id: argmax takes the lower
        logits[row, rng.integers(64)] = logits[row].max()
    cases["greedy"] = _sampling_case(
        seed, "temperature 0: argmax, ties to the lowest id (bf16 logits, tied maxima in even rows)", logits, 0.0,
        0, np.arange(12, dtype=np.int64), {"T": 12, "V": 64, "temperature": 0.0})

    seed = 502
    rng = np.random.default_rng(seed)
    depths = _random_tree(rng, 5, 24, 16, 0).depths
    positions = (1000 + depths).astype(np.int64)  # tree nodes: past_len + depth (siblings share noise)
    cases["t0_7"] = _sampling_case(seed, "temperature 0.7, tree positions past_len + depth (past_len 1000)",
                                   _logits(rng, depths.size, 300, std=2.0), 0.7, 12345, positions,
                                   {"T": int(depths.size), "V": 300, "temperature": 0.7, "past_len": 1000})

    seed = 503
    rng = np.random.default_rng(seed)
    positions = (2**32 - 3 + np.arange(7)).astype(np.int64)  # crosses 2^32: both counter words matter
    big_seed = 0xDEADBEEF_12345678  # both key words matter
    cases["t1_3"] = _sampling_case(seed, "temperature 1.3, 64-bit seed, positions crossing 2^32",
                                   _logits(rng, 7, 257, std=2.0), 1.3, big_seed, positions,
                                   {"T": 7, "V": 257, "temperature": 1.3})

    seed = 504
    positions = np.array([0, 1, 1, 2, 2**33 + 5], dtype=np.int64)
    noise = gumbel_noise(77, positions, 37)
    cases["gumbel"] = _case(
        gumbel_noise, seed, "Gumbel noise keyed by (seed, position, token); V = 37 not a multiple of 4",
        {"seed": 77, "V": 37}, {
            "in_seed": ((), np.uint64(77)),
            "in_positions": (("row",), positions),
            "in_vocab_size": ((), np.int64(37)),
            "out_noise": (("row", "vocab"), noise),
        })

    # Random123 kat_vectors (philox4x32_10) first, then random counters / keys.
    seed = 505
    rng = np.random.default_rng(seed)
    counter = np.concatenate([
        np.array([[0, 0, 0, 0], [0xFFFFFFFF] * 4, [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]], dtype=np.uint32),
        rng.integers(0, 2**32, (5, 4), dtype=np.uint32),
    ])
    key = np.concatenate([
        np.array([[0, 0], [0xFFFFFFFF] * 2, [0xA4093822, 0x299F31D0]], dtype=np.uint32),
        rng.integers(0, 2**32, (5, 2), dtype=np.uint32),
    ])
    cases["philox"] = _case(philox4x32, seed, "Philox4x32-10: Random123 known-answer vectors 0-2, then random",
                            {"rounds": 10, "n": 8}, {
                                "in_counter": (("vector", "counter_word"), counter),
                                "in_key": (("vector", "key_word"), key),
                                "out_bits": (("vector", "counter_word"), philox4x32(counter, key)),
                            })
    return cases


# --------------------------------------------------------------------------- compact


def _compact_case(seed: int, description: str, rows: int, width: int, past_len: int, accepted: list[int]) -> xr.Dataset:
    cache = np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)  # [S, D]
    acc = np.asarray(accepted, dtype=np.int32)
    return _case(compact, seed, description, {"S": rows, "D": width, "past_len": past_len, "accepted": accepted}, {
        "in_cache": (("row", "latent"), cache),
        "in_past_len": ((), np.int64(past_len)),
        "in_accepted": (("accepted",), acc),
        "out_cache": (("row", "latent"), compact(cache, past_len, acc)),
    })


def _compact_batch_case(seed: int, description: str, dtype: str) -> xr.Dataset:
    rng = np.random.default_rng(seed)
    bs, rows, width = 3, 24, 20
    past_lens = np.array([4, 0, 10], dtype=np.int64)
    accepted = np.array([[0, 2, 3, 7, 11], [0, -1, -1, -1, -1], [0, 1, 2, 4, -1]], dtype=np.int32)  # padded -1
    lengths = np.array([5, 1, 4], dtype=np.int32)
    values = rng.standard_normal((bs, rows, width)).astype(np.float32)  # [bs, S, D]
    cache = float32_to_bf16(values) if dtype == "bf16" else values
    return _case(compact_batch, seed, description,
                 {"bs": bs, "S": rows, "D": width, "dtype": dtype, "past_lens": past_lens.tolist(),
                  "lengths": lengths.tolist()}, {
                     "in_cache": (("request", "row", "latent"), cache),
                     "in_past_lens": (("request",), past_lens),
                     "in_accepted": (("request", "accepted"), accepted),
                     "in_lengths": (("request",), lengths),
                     "out_cache": (("request", "row", "latent"), compact_batch(cache, past_lens, accepted, lengths)),
                 })


def _compact_cases() -> dict[str, xr.Dataset]:
    return {
        "single": _compact_case(601, "one request: rows past_len + [0, 3, 6, 10] gathered", 24, 16, 5, [0, 3, 6, 10]),
        "overlapping": _compact_case(602, "destinations overlap later sources (row 3 -> 2 after 2 -> 1)", 16, 8, 3,
                                     [0, 2, 3, 5, 6]),
        "noop_all": _compact_case(603, "every tree node accepted (a chain): no row moves", 12, 8, 4, [0, 1, 2, 3, 4]),
        "noop_root": _compact_case(604, "root only: no row moves", 12, 8, 4, [0]),
        "batch": _compact_batch_case(605, "bs=3 fp32, accepted padded with -1", "fp32"),
        "batch_bf16": _compact_batch_case(606, "bs=3 raw bf16 bits (uint16), accepted padded with -1", "bf16"),
    }


# --------------------------------------------------------------------------- model

MODEL_PRESET = "tiny"
MODEL_WEIGHTS_SEED = 0
MODEL_PROMPT_LENS = (5, 9)  # the two requests of the engine tests (a ragged batch)
MODEL_TREE = {"horizon": 3, "budget": 3}  # draft tree of the verify cases


def _pad_stack(arrays: list[np.ndarray], fill: Any) -> np.ndarray:
    """Stack arrays whose first dims differ (rows or keys) along a new leading request dim, padded with fill."""
    n = max(a.shape[0] for a in arrays)
    out = np.full((len(arrays), n) + arrays[0].shape[1:], fill, dtype=arrays[0].dtype)
    for i, a in enumerate(arrays):
        out[i, :a.shape[0]] = a
    return out


def _model_step(seed: int, description: str, config: dict, weights: dict, model_config: ModelConfig,
                calls: list[tuple[np.ndarray, np.ndarray, list[LayerCache] | None, np.ndarray]]
                ) -> tuple[xr.Dataset, list[Any]]:
    """One step of a ragged batch: one float64 forward per request, stored padded along ``request``.

    calls: per request (tokens [T_b], positions [T_b], cache (None: empty) or per layer rows, visibility [T_b, T_b]).
    Padding: tokens -1, positions 0, padding rows see only themselves, cache rows 0, outputs NaN; in_sizes and
    in_past_lens give the real extents. No in_cache_* when every cache is empty (prefill).
    """
    outs = [model_forward(weights, model_config, *call) for call in calls]
    t_max = max(len(call[0]) for call in calls)
    vis = np.broadcast_to(np.eye(t_max, dtype=bool), (len(calls), t_max, t_max)).copy()
    for i, call in enumerate(calls):
        vis[i, :len(call[0]), :len(call[0])] = call[3]
    variables = {
        "in_sizes": (("request",), np.array([len(call[0]) for call in calls], dtype=np.int32)),
        "in_tokens": (("request", "row"), _pad_stack([call[0] for call in calls], -1)),
        "in_positions": (("request", "row"), _pad_stack([call[1] for call in calls], 0)),
        "in_visibility": (("request", "row", "row_key"), vis),
        "out_logits": (("request", "row", "vocab"), _pad_stack([o.logits for o in outs], np.nan)),
        "out_hidden": (("request", "row", "entry", "hidden"),
                       _pad_stack([o.hidden.transpose(1, 0, 2) for o in outs], np.nan)),
    }
    caches = [call[2] for call in calls]
    if any(c is not None for c in caches):
        variables["in_past_lens"] = (("request",), np.array([c[0].latent.shape[0] for c in caches], dtype=np.int32))
        variables["in_cache_latent"] = (("request", "key", "layer", "latent"),
                                        _pad_stack([np.stack([r.latent for r in c], axis=1) for c in caches], 0.0))
        variables["in_cache_k_rope"] = (("request", "key", "layer", "rope"),
                                        _pad_stack([np.stack([r.k_rope for r in c], axis=1) for c in caches], 0.0))
    return _case(model_forward, seed, description, config, variables), outs


def _model_cases() -> dict[str, xr.Dataset]:
    """A ragged batch of two requests (prompts of MODEL_PROMPT_LENS tokens, weights init_weights(tiny, 0))
    through one DDTree round's target work: prefill; the verify of a draft tree per request rooted at the
    prefill's greedy token (positions past_len + depth); and the AR decode step of that root token, the
    first step of an AR replay of the tree (same prefix). Each step is one case; prompts and draft trees
    come from one random stream (the cases' seed)."""
    model_config = ModelConfig.from_name(MODEL_PRESET)
    weights = init_weights(model_config, MODEL_WEIGHTS_SEED)
    seed = 700
    rng = np.random.default_rng(seed)
    config = {"preset": MODEL_PRESET, "weights_seed": MODEL_WEIGHTS_SEED, "prompt_lens": list(MODEL_PROMPT_LENS)}
    prompts = [rng.integers(0, model_config.vocab_size, n).astype(np.int32) for n in MODEL_PROMPT_LENS]
    cases = {}
    cases["prefill"], outs = _model_step(
        seed, "prefill of two prompts (ragged batch)", {**config, "step": "prefill"}, weights, model_config,
        [(p, np.arange(len(p), dtype=np.int32), None, causal_visibility(len(p))) for p in prompts])
    caches = [o.new_cache for o in outs]
    roots = [int(np.argmax(o.logits[-1])) for o in outs]
    trees = [_random_tree(rng, MODEL_TREE["horizon"], model_config.vocab_size, MODEL_TREE["budget"], root)
             for root in roots]
    cases["tree"], _ = _model_step(
        seed, "verify of a draft tree per request, rooted at the greedy token (positions past_len + depth)",
        {**config, "step": "tree", **MODEL_TREE}, weights, model_config,
        [(t.tokens.astype(np.int32), (len(p) + t.depths).astype(np.int32), c, t.visibility)
         for t, p, c in zip(trees, prompts, caches)])
    cases["decode"], _ = _model_step(
        seed, "one AR decode step of each request's greedy token (the tree roots)", {**config, "step": "decode"},
        weights, model_config, [(np.array([r], dtype=np.int32), np.array([len(p)], dtype=np.int32), c,
                                 causal_visibility(1)) for r, p, c in zip(roots, prompts, caches)])
    return cases


# --------------------------------------------------------------------------- entry points

_BUILDERS: dict[str, Callable[[], dict[str, xr.Dataset]]] = {
    "topk": _topk_cases,
    "tree": _tree_cases,
    "attention": _attention_cases,
    "accept": _accept_cases,
    "sampling": _sampling_cases,
    "compact": _compact_cases,
    "model": _model_cases,
}


def _check_names(names: Iterable[str] | None) -> list[str]:
    """Family names (default all), validated against GOLDEN_FILES."""
    if names is None:
        return list(GOLDEN_FILES)
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise TypeError(f"names: expected a list of family names, got {type(names).__name__}")
    names = list(names)
    unknown = [n for n in names if n not in GOLDEN_FILES]
    if unknown:
        raise ValueError(f"names: unknown golden families {unknown}; known: {list(GOLDEN_FILES)}")
    return names


def build_cases(name: str) -> dict[str, xr.Dataset]:
    """All cases of one family (a key of GOLDEN_FILES), rebuilt from the reference; pure."""
    if not isinstance(name, str):
        raise TypeError(f"name: expected str, got {type(name).__name__}")
    if name not in _BUILDERS:
        raise ValueError(f"name: unknown golden family {name!r}; known: {list(GOLDEN_FILES)}")
    return _BUILDERS[name]()


def regenerate(out_dir: str | Path, names: Iterable[str] | None = None, progress: bool = True) -> list[Path]:
    """Rebuild and (atomically) write the golden files of ``names`` (default all) into ``out_dir``.

    Returns:
        The written paths, in GOLDEN_FILES order of ``names``.
    """
    names = _check_names(names)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in tqdm(names, desc="golden regen", unit="file", disable=not progress):
        written.append(write_cases(out_dir / GOLDEN_FILES[name], build_cases(name), attrs={"generator": GENERATOR}))
    return written


def check(golden_dir: str | Path, names: Iterable[str] | None = None) -> list[str]:
    """Rebuild every case and compare it with the files in ``golden_dir``: exactly, except float
    variables within CHECK_RTOL / CHECK_ATOL (last-bit differences between CPUs).

    Returns:
        One human-readable line per difference (``file:case: what``); empty if all equal.

    Raises:
        GoldenFileError: a file is missing, corrupt or of another schema.
    """
    names = _check_names(names)
    problems = []
    for name in names:
        file_name = GOLDEN_FILES[name]
        stored = read_all(Path(golden_dir) / file_name)
        built = build_cases(name)
        problems += [f"{file_name}:{case}: missing from the file" for case in built if case not in stored]
        problems += [f"{file_name}:{case}: in the file but no longer built" for case in stored if case not in built]
        for case in sorted(built.keys() & stored.keys()):
            diff = datasets_diff(built[case], stored[case], rtol=CHECK_RTOL, atol=CHECK_ATOL)
            problems += [f"{file_name}:{case}: {line}" for line in diff]
    return problems
