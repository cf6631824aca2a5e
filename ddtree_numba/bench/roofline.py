"""Bytes, FLOPs and roofline bounds of each kernel, for the sweeps (limits §3), and of a whole
target forward, for issue 4's two speed targets (:func:`forward_cost`, ``python -m
ddtree_numba.bench.roofline``).

Every count is the DRAM traffic / arithmetic a kernel cannot avoid at its shape: inputs read once,
outputs written once. The bound is the slower of moving those bytes at the profile's bandwidth and
doing those FLOPs at its peak (``sim.profiles.roofline``; measured ceilings where the profile has
them). A latency-bound kernel (the tree build's serial pops) is far from this bound by design: the
achieved fraction then says how much of the time is not bandwidth or arithmetic.
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import Any

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


# --- a whole target forward (issue 4) ----------------------------------------------------------

FORWARD_PARTS = ("w_a", "w_q", "q_absorb", "attention", "v_absorb", "wo", "dense_ffn", "moe_gate",
                 "routed_experts", "shared_experts", "lm_head")


def routed_experts_read(config: Any, rows: int, experts: int | None = None) -> int:
    """Distinct routed experts a MoE layer reads for ``rows`` routed rows: ``experts`` (checked),
    default min(E, rows x k) (every routed row a different expert: exact at one row, an upper
    bound above)."""
    k = config.n_activated_experts
    experts = min(config.n_routed_experts, rows * k) if experts is None else experts
    if not 0 <= experts <= config.n_routed_experts:
        raise ValueError(f"experts must lie in [0, {config.n_routed_experts}], got {experts}")
    return experts


def forward_cost(config: Any, rows: int, past: int, *, experts: int | None = None,
                 tree_keys: float | None = None) -> dict[str, tuple[float, float]]:
    """(bytes, FLOPs) by component of one batch-1 target forward of ``rows`` rows over ``past``
    cached rows (an AR step: 1 row; the verify of a B-node tree: B + 1), FP32 weights.

    Bytes are the weights each component must read once (the routed experts: ``experts`` distinct
    ones a MoE layer, :func:`routed_experts_read`) and the attention's key rows (cached and new,
    latent + RoPE: read once). Activations between launches are left out, as L2-resident at these
    sizes (counted, they would add ~0.3 % at one row and ~7 % at 33 rows of ``small``), and so are
    the norms' weights and the embedding row (< 0.01 %). FLOPs are 2 per multiply-add: ``rows`` x
    the weights a row uses (k routed + the shared experts; the weight-absorbed MLA's W_UK and W_UV
    per head), and the attention of each row over the ``past`` cached keys and its ``tree_keys``
    visible new ones (the keys the verify kernel stages for a node: its ancestors and itself;
    default (rows + 1) / 2, a chain's mean), latent + RoPE dims for the scores and latent dims for
    the values.

    Raises:
        ValueError: rows < 1, past < 0, experts outside [0, n_routed_experts], tree_keys outside
            [1, rows].
    """
    c = config
    if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 1:
        raise ValueError(f"rows must be an int >= 1, got {rows!r}")
    if isinstance(past, bool) or not isinstance(past, (int, np.integer)) or past < 0:
        raise ValueError(f"past must be an int >= 0, got {past!r}")
    tree_keys = (rows + 1) / 2 if tree_keys is None else tree_keys
    if isinstance(tree_keys, bool) or not isinstance(tree_keys, (int, float, np.integer, np.floating)) or \
            not 1 <= tree_keys <= rows:
        raise ValueError(f"tree_keys must be a number in [1, rows = {rows}], got {tree_keys!r}")
    k = c.n_activated_experts
    experts = routed_experts_read(c, rows, experts)
    h, d = c.n_heads, c.hidden_size
    n_moe = sum(c.is_moe_layer(i) for i in range(c.n_layers))
    n_dense = c.n_layers - n_moe

    def product(n_layers: int, n_out: int, k_in: int) -> tuple[float, float]:
        """n_layers x an [n_out, k_in] weight, read once, used once by every row."""
        return float(F32 * n_layers * n_out * k_in), float(2 * n_layers * rows * n_out * k_in)

    q_in = c.q_lora_rank or d
    a_cols = (c.q_lora_rank if c.q_lora_rank else 0) + c.kv_cache_dim
    key_bytes = F32 * c.n_layers * (past + rows) * c.kv_cache_dim
    attn_flops = 2.0 * c.n_layers * rows * h * (past + tree_keys) * (c.kv_cache_dim + c.kv_lora_rank)
    expert = 3 * d * c.moe_intermediate    # gate, up and down: one expert's multiply-adds a row
    gate_bias = c.n_routed_experts if c.has_gate_bias else 0
    # without a q low rank, w_a holds the kv rows only and w_q is the full d -> H * qk product
    cost = {
        "w_a": product(c.n_layers, a_cols, d),
        "w_q": product(c.n_layers, h * c.qk_head_dim, q_in),
        "q_absorb": product(c.n_layers, h * c.kv_lora_rank, c.qk_nope_dim),
        "attention": (float(key_bytes), attn_flops),
        "v_absorb": product(c.n_layers, h * c.v_head_dim, c.kv_lora_rank),
        "wo": product(c.n_layers, d, h * c.v_head_dim),
        "dense_ffn": product(n_dense, 3 * c.dense_intermediate, d),
        "moe_gate": (float(F32 * n_moe * (c.n_routed_experts * d + gate_bias)),
                     float(2 * n_moe * rows * c.n_routed_experts * d)),
        "routed_experts": (float(F32 * n_moe * experts * expert), float(2 * n_moe * rows * k * expert)),
        "shared_experts": (float(F32 * n_moe * c.n_shared_experts * expert),
                           float(2 * n_moe * rows * c.n_shared_experts * expert)),
        "lm_head": product(1, c.vocab_size, d),
    }
    assert tuple(cost) == FORWARD_PARTS
    return cost


def component_bounds(profile: DeviceProfile, cost: dict[str, tuple[float, float]],
                     unit: str = "fp32") -> dict[str, np.ndarray]:
    """:func:`bound_arrays` of a :func:`forward_cost`'s components, in its order (nothing measured)."""
    return bound_arrays(profile, [v[0] for v in cost.values()], [v[1] for v in cost.values()],
                        np.ones(len(cost)), unit)


def forward_floor_us(profile: DeviceProfile, cost: dict[str, tuple[float, float]], unit: str = "fp32") -> float:
    """The forward's roofline floor in us: every component at its own bound (bytes at the
    bandwidth or FLOPs at the peak, whichever is slower), one after another."""
    return float(np.nansum(component_bounds(profile, cost, unit)["bound_us"]))


def parity(f_ar: float, f_verify: float) -> float:
    """The ratio target as a parity of efficiencies: a round of time R meets R <= 2 x the AR
    step's time A exactly where (F_v / R) >= (F_v / (2 F_ar)) x (F_ar / A), F_v the verify
    forward's floor and F_ar the AR step's. Returns F_v / (2 F_ar)."""
    return f_verify / (2.0 * f_ar)


def target_table(config: Any, profile: DeviceProfile, past: int, budget: int, *,
                 ar_us: float | None = None, round_us: float | None = None) -> str:
    """Issue 4's two speed targets against the floors of an AR step (1 row) and of a verify
    forward (``budget`` + 1 rows, a chain's visible keys): the component table, then what the
    targets ask of each path (and, given measured times, where each path stands). A round's floor
    is taken as its verify forward's (the oracle drafter's, top-k's, build's, accept's and
    compaction's floors are ~1-2 us at small's sizes; a DFlash drafter's forward would add its own)."""
    rows_v = budget + 1
    one, tree = forward_cost(config, 1, past), forward_cost(config, rows_v, past)
    b1, bv = component_bounds(profile, one), component_bounds(profile, tree)
    bw, peak = ceilings(profile)
    lines = [f"floors on {profile.describe()}: {bw / 1e12:.2f} TB/s, {peak / 1e12:.1f} TFLOP/s FP32 (CUDA cores); "
             f"past {past} rows, verify of B {budget} = {rows_v} rows",
             f"{'component':<15} {'1 row MB':>9} {'GFLOP':>7} {'floor us':>9} | "
             f"{rows_v:>2} rows MB {'GFLOP':>7} {'floor us':>9} {'bound':>8}"]
    for i, name in enumerate(FORWARD_PARTS):
        bound = "compute" if bv["compute_bound_us"][i] >= bv["memory_bound_us"][i] else "memory"
        lines.append(f"{name:<15} {one[name][0] / 1e6:9.1f} {one[name][1] / 1e9:7.3f} {b1['bound_us'][i]:9.1f} | "
                     f"{tree[name][0] / 1e6:10.1f} {tree[name][1] / 1e9:7.2f} {bv['bound_us'][i]:9.1f} {bound:>8}")
    f1, fv = float(np.nansum(b1["bound_us"])), float(np.nansum(bv["bound_us"]))
    lines.append(f"{'total':<15} {sum(v[0] for v in one.values()) / 1e6:9.1f} "
                 f"{sum(v[1] for v in one.values()) / 1e9:7.3f} {f1:9.1f} | "
                 f"{sum(v[0] for v in tree.values()) / 1e6:10.1f} {sum(v[1] for v in tree.values()) / 1e9:7.2f} "
                 f"{fv:9.1f}")
    threshold = parity(f1, fv)
    lines.append(f"AR step at 2 x its floor: {2 * f1:.1f} us (bench.decode_step's target counts the bytes "
                 f"it reads at 50 % of the bandwidth)")
    lines.append(f"floors' ratio (AR step / verify forward): {f1 / fv:.3f}; the ratio target (round <= 2 x AR "
                 f"step) holds exactly where verify floor / round >= {threshold:.3f} x (AR floor / AR step)")
    if ar_us is not None:
        lines.append(f"measured AR step {ar_us:.1f} us: AR floor / AR step = {f1 / ar_us:.3f}; a round must take "
                     f"<= {2 * ar_us:.1f} us (verify floor / round >= {fv / (2 * ar_us):.3f})")
    if round_us is not None:
        lines.append(f"measured round {round_us:.1f} us: verify floor / round = {fv / round_us:.3f}")
        if ar_us is not None:
            lines.append(f"ratio AR step / round: {ar_us / round_us:.3f} (target >= 0.5); the round at "
                         f"{(fv / round_us) / (f1 / ar_us):.3f} x the AR step's fraction (target >= {threshold:.3f})")
    return "\n".join(lines)


MAX_BUDGET = 1024      # issue 4's budgets


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ddtree_numba.bench.roofline",
        description="Roofline floors of a target forward by component: an AR step (1 row) and the verify "
                    "of a B-node tree (B + 1 rows), against issue 4's two speed targets.",
        epilog="Bytes are the weights read once (the routed experts each row may route to) and the key "
               "rows; FLOPs 2 per multiply-add; a component's floor is the slower of its bytes at the measured "
               "bandwidth and its FLOPs at the FP32 CUDA-core peak (sim.profiles). Example, run priming's "
               "decode step on the H200: --preset small --ar-us 882.4 --round-us 2105.7")
    p.add_argument("--preset", default="small", help="model preset (default: small)")
    p.add_argument("--profile", default="h200", help="device profile (sim.profiles; default: h200)")
    p.add_argument("--past", type=int, default=128,
                   help="cached rows before the forward (default: 128, about the mean of bench.decode_step's "
                        "steps: a 64-token prompt and 128 new tokens)")
    p.add_argument("--budget", type=int, default=32, help="tree budget B: the verify has B + 1 rows (default: 32)")
    p.add_argument("--ar-us", type=float, help="a measured AR step (us), to place it against its floor")
    p.add_argument("--round-us", type=float,
                   help="a measured DDTree round (us): the mean round (bench.decode_step's ratio: timed tau / "
                        "(ratio x AR tokens/s)), not the median")
    return p


def main(argv: list[str] | None = None) -> int:
    from ddtree_numba.config import ModelConfig
    from sim.profiles import get_profile

    parser = _parser()
    args = parser.parse_args(argv)
    if args.past < 0:
        parser.error(f"--past must be >= 0, got {args.past}")
    if not 1 <= args.budget <= MAX_BUDGET:
        parser.error(f"--budget must lie in [1, {MAX_BUDGET}], got {args.budget}")
    for name in ("ar_us", "round_us"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"--{name.replace('_', '-')} must be a time > 0 (us), got {value}")
    try:
        config = ModelConfig.from_name(args.preset)
    except (TypeError, ValueError) as exc:
        parser.error(f"--preset: {exc}")
    try:
        profile = get_profile(args.profile)
    except (TypeError, ValueError) as exc:
        parser.error(f"--profile: {exc}")
    print(target_table(config, profile, args.past, args.budget, ar_us=args.ar_us, round_us=args.round_us))
    return 0


if __name__ == "__main__":
    sys.exit(main())
