"""Bytes, FLOPs and roofline bounds of each kernel, for the sweeps (limits §3).

Every count is the DRAM traffic / arithmetic a kernel cannot avoid at its shape: inputs read once,
outputs written once. The bound is the slower of moving those bytes at the profile's bandwidth and
doing those FLOPs at its peak (``sim.profiles.roofline``; measured ceilings where the profile has
them). A latency-bound kernel (the tree build's serial pops) is far from this bound by design: the
achieved fraction then says how much of the time is not bandwidth or arithmetic.
"""
from __future__ import annotations

import math

import numpy as np

from sim.profiles import DeviceProfile, roofline

F32 = 4
I32 = 4
F64 = 8
LATENT = 512  # MLA latent (kv_lora_rank) of Kimi K2 / DeepSeek-V3
ROPE = 64
QK_DIM = LATENT + ROPE
# Per (query, head, key): 576 multiply-adds for the score, 512 for the value sum (limits §3).
FLOPS_PER_SCORE = 2 * (QK_DIM + LATENT)
LOGIT_ITEMSIZE = {"fp32": 4, "bf16": 2}
TOPK_FLOPS_PER_LOGIT = 3  # subtract the max, exp (counted as one), add to the sum


def topk_cost(rows: int, vocab: int, k: int, dtype: str) -> tuple[float, float]:
    """(bytes, FLOPs) of the fused log-softmax top-k: one read of [rows, V] logits, [rows, k] out."""
    if dtype not in LOGIT_ITEMSIZE:
        raise ValueError(f"dtype must be one of {sorted(LOGIT_ITEMSIZE)}, got {dtype!r}")
    k_out = min(k, vocab)
    return (float(rows * vocab * LOGIT_ITEMSIZE[dtype] + rows * k_out * (F32 + I32)),
            float(TOPK_FLOPS_PER_LOGIT * rows * vocab))


def tree_build_cost(batch: int, horizon: int, k: int, budget: int) -> tuple[float, float]:
    """(bytes, FLOPs) of the tree build: top-k [bs, L, K] log-probs + ids read, the tree written.

    Outputs per request of N = B + 1 nodes (kernels/tree_build.py output_shapes): tokens, parents,
    depths, ranks, positions, child_index (int32 [N]), scores (float64 [N]), child_ptr
    (int32 [N + 1]), packed visibility (uint32 [N, ceil(N / 32)]). The arithmetic is a few score
    additions per node: 0 FLOPs is counted, the bound is memory (and far below the serial pops).
    """
    n = budget + 1
    out = 6 * I32 * n + F64 * n + I32 * (n + 1) + I32 * n * math.ceil(n / 32) + I32
    return float(batch * (horizon * k * (F32 + I32) + out)), 0.0


def verify_attention_cost(batch: int, tree: int, n_cached: int, heads: int = 64) -> tuple[float, float]:
    """(bytes, FLOPs) of tree-verify MLA attention: 2 T H (N + T) 1088 FLOPs per request.

    Bytes: the [N + T, 576] fp32 key rows read once, the queries [T, H, 576] read, out [T, H, 512]
    and lse [T, H] written, the packed visibility read.
    """
    keys = n_cached + tree
    nbytes = F32 * (keys * QK_DIM + tree * heads * QK_DIM + tree * heads * (LATENT + 1)) \
        + I32 * tree * math.ceil(tree / 32)
    return float(batch * nbytes), float(batch * FLOPS_PER_SCORE * tree * heads * keys)


def ceilings(profile: DeviceProfile, unit: str = "fp32") -> tuple[float, float]:
    """(bandwidth B/s, peak FLOP/s) the profile's roofline uses (measured where known)."""
    r = roofline(profile, 1.0, 1.0, unit=unit)
    return r.bandwidth, r.peak


def bound_arrays(profile: DeviceProfile, nbytes, flops, median_us, unit: str = "fp32"
                 ) -> dict[str, np.ndarray]:
    """Element-wise bounds: memory_bound_us, compute_bound_us, bound_us, fraction_of_bound.

    ``fraction_of_bound`` = bound / median (1.0 = at the roof); NaN where nothing was measured
    or nothing is moved or computed.
    """
    bandwidth, peak = ceilings(profile, unit)
    nbytes = np.asarray(nbytes, np.float64)
    flops = np.asarray(flops, np.float64)
    median = np.asarray(median_us, np.float64)
    memory_us = 1e6 * nbytes / bandwidth
    compute_us = 1e6 * flops / peak
    bound = np.maximum(memory_us, compute_us)
    bound = np.where(bound > 0, bound, np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        fraction = bound / median
    return {"memory_bound_us": memory_us, "compute_bound_us": compute_us, "bound_us": bound,
            "fraction_of_bound": fraction}
