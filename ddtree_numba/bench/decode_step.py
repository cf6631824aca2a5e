"""Benchmark the engine's decode step: AR bandwidth and DDTree speed-up (issue 4's speed targets).

Through the engine's own loops (``engine.decode.generate_ar`` / ``generate_ddtree`` with CUDA
graphs: the first step eager, then one captured graph replayed per step):

1. **AR step** at each batch size (default 1 and 8): the time of every graph-replayed step from
   CUDA events (median over >= 50 steps; the status copy that follows each step is excluded),
   beside the eager step (every kernel launched from Python) for comparison. The bytes a step
   must read (:func:`step_bytes`: every weight of attention, dense FFN, norms and lm_head; per MoE
   layer the gate, the *active* routed experts and the shared experts; one embedding row per
   request; the KV rows attended) at the device profile's HBM bandwidth (``sim.profiles``
   roofline, measured ceiling where known) give the floor; ``fraction`` = floor / step time.
   Target (batch 1): fraction >= 0.5, i.e. the step takes at most twice the weights' read time.
2. **DDTree** at batch 1, budget B = 32, block 16, oracle drafter (fed the AR continuation) at
   accuracy 0.9 and 1.0: tokens/s of the graph-replayed rounds (tokens they committed / their
   summed event time), tau = mean acceptance length (every round), and ``ratio`` = DDTree
   tokens/s / (timed tau x AR tokens/s), where the timed tau is the mean acceptance of the same
   replayed rounds (the first, eager round is not timed, so its acceptance must not weigh on the
   ratio: at accuracy 0.9 the whole run's tau gave 0.520 where the medians' AR step / round was
   0.494, PERFORMANCE run fold timed) and AR tokens/s = batch / median AR replay step. Target:
   ratio >= 0.5.
   Stage times come from the eager run (events between stages; after the graph run, so its JIT
   compiles are not in them: the graph run's first, eager round carries them).

    python -m ddtree_numba.bench.decode_step --preset small [--batch 1 8] [--out data/bench/h200.h5]
    python -m ddtree_numba.bench.decode_step --preset small --batch 1 --accuracy 1.0 --temperature 0.8
    python -m ddtree_numba.bench.decode_step --preset small --batch 1 --pdl   # programmatic launches

``--temperature`` > 0 samples (AR and DDTree with the same seed: the posterior is the Gumbel sample
kernel, the tokens must still agree); the targets are stated for greedy decoding.

The DDTree tokens must equal the AR tokens (greedy, lossless); the exit status is 1 if not.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ddtree_numba.bench.common import add_pdl_release_argument
from ddtree_numba.bench.roofline import routed_experts_read
from ddtree_numba.engine.generate import _positive as positive_arg  # argparse type: an int >= 1
from ddtree_numba.kernels.pdl import set_release_mode

F32 = 4
MIN_STEPS = 50  # replayed steps the AR median is taken over (issue 4: median of >= 50 steps)
RATIO_TARGET = 0.5  # DDTree tokens/s >= 0.5 tau AR tokens/s
FRACTION_TARGET = 0.5  # AR step at >= 50% of HBM bandwidth
FIRST_TOKEN = 3  # prompt ids avoid the low special ids (bos 1, eos 2)


# --- bytes a step must read ------------------------------------------------------------------

def step_bytes(config: Any, batch: int, kv_rows: float, *, experts: int | None = None) -> dict[str, float]:
    """Bytes one AR step of ``batch`` requests must read from DRAM, by component (FP32 weights).

    Args:
        config: a ModelConfig.
        batch: requests (one new row each).
        kv_rows: cached rows each request's attention reads per layer (past length + the new row).
        experts: distinct routed experts read per MoE layer; default min(E, batch * k): k at
            batch 1, an upper bound for larger batches (every routed row a different expert).

    Returns:
        dict with "attention" (q/kv projections, absorbed W_UK / W_UV, o_proj), "norms" (every
        RMSNorm weight), "dense_ffn", "moe" (gate + bias, routed experts read, shared experts),
        "lm_head", "embedding" (one row per request), "kv" (latent + RoPE rows read) and "total".
    """
    c = config
    if batch < 1 or kv_rows < 0:
        raise ValueError(f"batch must be >= 1 and kv_rows >= 0, got {batch}, {kv_rows}")
    experts = routed_experts_read(c, batch, experts)
    h, d = c.n_heads, c.hidden_size
    qk = c.qk_nope_dim + c.qk_rope_dim
    if c.q_lora_rank:
        q_path = c.q_lora_rank * d + h * qk * c.q_lora_rank  # q_a rows of w_a, q_b_proj
    else:
        q_path = h * qk * d  # q_proj
    attention = (q_path + c.kv_cache_dim * d  # kv_a rows of w_a
                 + h * c.kv_lora_rank * c.qk_nope_dim  # W_UK^T [H, C, nope]
                 + h * c.v_head_dim * c.kv_lora_rank  # W_UV [H, v, C]
                 + d * h * c.v_head_dim)  # o_proj
    layer_norms = 2 * d + c.q_lora_rank + c.kv_lora_rank  # input, post-attention, q_a, kv_a norms
    n_moe = sum(c.is_moe_layer(i) for i in range(c.n_layers))
    n_dense = c.n_layers - n_moe
    swiglu = 3 * d  # per intermediate unit: a gate row, an up row, a down column
    moe = (c.n_routed_experts * d + (c.n_routed_experts if c.has_gate_bias else 0)
           + (experts + c.n_shared_experts) * c.moe_intermediate * swiglu)
    out = {
        "attention": float(F32 * c.n_layers * attention),
        "norms": float(F32 * (c.n_layers * layer_norms + d)),  # + final norm
        "dense_ffn": float(F32 * n_dense * c.dense_intermediate * swiglu),
        "moe": float(F32 * n_moe * moe),
        "lm_head": float(F32 * c.vocab_size * d),
        "embedding": float(F32 * batch * d),
        "kv": float(F32 * c.n_layers * batch * kv_rows * c.kv_cache_dim),
    }
    out["total"] = sum(out.values())
    return out


# --- measurements ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ArPoint:
    """One batch size's AR step: graph replay vs eager, against the bandwidth floor."""

    batch: int
    graph_us: float  # median replayed step
    graph_min_us: float
    eager_us: float  # median eager step
    steps: int  # replayed steps in the median
    bytes: float  # mean over the replayed steps
    floor_us: float  # bytes at the profile's bandwidth
    tokens: list[list[int]]

    @property
    def fraction(self) -> float:
        return self.floor_us / self.graph_us if self.graph_us > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.batch / (self.graph_us * 1e-6) if self.graph_us > 0 else 0.0


@dataclass(frozen=True)
class TreePoint:
    """One DDTree run (batch 1): replayed rounds, acceptance, and the ratio to tau x AR."""

    accuracy: float
    round_us: float  # median replayed round
    eager_round_us: float
    tau: float  # mean acceptance length over every round
    timed_tau: float  # mean acceptance length over the replayed (timed) rounds
    tokens_per_s: float  # tokens committed by the replayed rounds / their summed time
    ratio: float  # tokens_per_s / (timed_tau * AR tokens/s)
    rounds: int
    forward_passes: int
    identical: bool
    stage_us: dict[str, float]  # per round of the eager run (kernels compiled by the graph run)


def replay_rate(result: Any) -> tuple[float, int]:
    """(tokens per second of replay time, replayed rounds) of a graph-replayed GenerateResult:
    the tokens the replayed rounds committed (acceptance lengths, summed over the batch) over
    their summed step time."""
    replay = result.replay_s
    if replay.size == 0 or replay.sum() <= 0:
        return 0.0, 0
    return result.timed_tokens_per_s, int(replay.size)


def mean_kv_rows(prompt_len: int, first_step: int, steps: int) -> float:
    """Mean rows attended per layer over AR steps first_step .. first_step + steps - 1 (step r
    after the prefill reads the prompt, r earlier tokens and its own new row)."""
    return prompt_len + 1 + first_step + (steps - 1) / 2.0


def _prompts(rng: np.random.Generator, batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    return [rng.integers(FIRST_TOKEN, vocab, size=prompt_len).tolist() for _ in range(batch)]


def measure_ar(config: Any, model: Any, prompts: list[list[int]], n_new: int, eager_new: int,
               bandwidth: float, *, temperature: float = 0.0, seed: int = 0, pdl: bool = False) -> ArPoint:
    """AR with graphs (n_new tokens) and eager (eager_new tokens) on ``model``; greedy, or sampled
    at ``temperature`` with ``seed`` (the posterior kernel is then the Gumbel sample); ``pdl``:
    programmatic dependent launches (engine.decode)."""
    from ddtree_numba.engine.decode import generate_ar

    sampling = dict(temperature=temperature, seed=seed, pdl=pdl)
    replayed = generate_ar(model, prompts, max_new_tokens=n_new, graphs=True, **sampling)
    eager = generate_ar(model, prompts, max_new_tokens=eager_new, graphs=False, **sampling)
    times = replayed.timed_s  # the replays (the simulator has no graphs: every step)
    first = replayed.stage_rounds if replayed.graphs else 0
    nbytes = step_bytes(config, len(prompts), mean_kv_rows(len(prompts[0]), first, times.size))["total"]
    return ArPoint(batch=len(prompts), graph_us=1e6 * float(np.median(times)), graph_min_us=1e6 * float(times.min()),
                   eager_us=1e6 * float(np.median(eager.step_s)), steps=int(times.size), bytes=nbytes,
                   floor_us=1e6 * nbytes / bandwidth, tokens=replayed.tokens)


def measure_tree(config: Any, model: Any, prompts: list[list[int]], ar: ArPoint, n_new: int, eager_new: int,
                 accuracy: float, *, budget: int, block: int, entropy: float, seed: int,
                 temperature: float = 0.0, pdl: bool = False) -> TreePoint:
    """DDTree with the oracle fed ``ar``'s tokens: graph-replayed run + a short eager run (sampled
    at ``temperature`` with ``seed`` as the AR run was: the same tokens, lossless)."""
    from ddtree_numba.engine.decode import generate_ddtree
    from ddtree_numba.engine.drafters import OracleDrafter

    ref = np.full((len(prompts), n_new), -1, dtype=np.int64)
    for b, tokens in enumerate(ar.tokens):
        ref[b, :len(tokens)] = tokens[:n_new]

    def run(n: int, graphs: bool) -> Any:
        drafter = OracleDrafter(ref, config.vocab_size, block - 1, accuracy=accuracy, entropy=entropy, seed=seed)
        return generate_ddtree(model, drafter, prompts, budget=budget, block_size=block, max_new_tokens=n,
                               graphs=graphs, temperature=temperature, seed=seed, pdl=pdl)

    tree = run(n_new, True)
    eager = run(eager_new, False)
    rate, rounds = replay_rate(tree)
    if not tree.graphs:  # the simulator: every round is eager and timed, the rate over all of them
        rate, rounds = tree.timed_tokens_per_s, tree.rounds
    times = tree.timed_s
    tau = tree.mean_acceptance
    timed_tau = tree.timed_mean_acceptance   # the tau of the rounds the rate times
    ar_rate = ar.tokens_per_s
    staged = eager if eager.rounds else tree   # (the graph run's eager round compiled the kernels)
    return TreePoint(accuracy=accuracy, round_us=1e6 * float(np.median(times)) if times.size else float("nan"),
                     eager_round_us=1e6 * float(np.median(eager.step_s)) if eager.rounds else float("nan"),
                     tau=tau, timed_tau=timed_tau, tokens_per_s=rate,
                     ratio=rate / (timed_tau * ar_rate) if timed_tau > 0 and ar_rate > 0 else 0.0,
                     rounds=rounds, forward_passes=tree.forward_passes,
                     identical=tree.tokens == [t[:n_new] for t in ar.tokens],
                     stage_us={k: 1e6 * v for k, v in staged.stage_per_round_s.items()})


# --- report ----------------------------------------------------------------------------------

def format_table(ar_points: list[ArPoint], trees: list[TreePoint], bandwidth: float, profile: str) -> str:
    """The printed report."""
    lines = [f"AR step (CUDA-graph replay, CUDA events; floor = bytes at {bandwidth / 1e12:.2f} TB/s, {profile})",
             f"{'batch':>5} {'steps':>5} {'graph us':>9} {'min':>8} {'eager us':>9} {'GB read':>8} "
             f"{'floor us':>8} {'fraction':>8} {'tok/s':>8}  target"]
    for p in ar_points:
        target = f">= {FRACTION_TARGET:.2f} {'ok' if p.fraction >= FRACTION_TARGET else 'MISSED'}" if p.batch == 1 \
            else "(experts: upper bound)"
        lines.append(f"{p.batch:>5} {p.steps:>5} {p.graph_us:9.1f} {p.graph_min_us:8.1f} {p.eager_us:9.1f} "
                     f"{p.bytes / 1e9:8.3f} {p.floor_us:8.1f} {p.fraction:8.3f} {p.tokens_per_s:8.1f}  {target}")
    if trees:
        lines.append("DDTree batch 1 (graph replay; stages: eager rounds, events between stages)")
        lines.append(f"{'acc':>5} {'rounds':>6} {'round us':>9} {'eager us':>9} {'tau':>6} {'timed':>6} {'tok/s':>9} "
                     f"{'ratio':>6} {'same':>5}  target  stages us (draft topk build verify accept compact)")
        for t in trees:
            ok = "ok" if t.ratio >= RATIO_TARGET else "MISSED"
            stages = " ".join(f"{v:.0f}" for v in t.stage_us.values())
            lines.append(f"{t.accuracy:5.2f} {t.rounds:>6} {t.round_us:9.1f} {t.eager_round_us:9.1f} {t.tau:6.2f} "
                         f"{t.timed_tau:6.2f} "
                         f"{t.tokens_per_s:9.1f} {t.ratio:6.3f} {'yes' if t.identical else 'NO':>5}  "
                         f">= {RATIO_TARGET} {ok}  {stages}")
    return "\n".join(lines)


def build_dataset(ar_points: list[ArPoint], trees: list[TreePoint], attrs: dict[str, Any]) -> Any:
    """An xarray Dataset: AR variables over ``batch``, DDTree variables over ``accuracy``."""
    import xarray as xr

    data = {
        "ar_graph_us": (("batch",), [p.graph_us for p in ar_points]),
        "ar_graph_min_us": (("batch",), [p.graph_min_us for p in ar_points]),
        "ar_eager_us": (("batch",), [p.eager_us for p in ar_points]),
        "ar_steps": (("batch",), [p.steps for p in ar_points]),
        "ar_bytes": (("batch",), [p.bytes for p in ar_points]),
        "ar_floor_us": (("batch",), [p.floor_us for p in ar_points]),
        "ar_fraction": (("batch",), [p.fraction for p in ar_points]),
        "ar_tokens_per_s": (("batch",), [p.tokens_per_s for p in ar_points]),
    }
    coords: dict[str, Any] = {"batch": [p.batch for p in ar_points]}
    if trees:
        stages = list(trees[0].stage_us)
        data.update({
            "tree_round_us": (("accuracy",), [t.round_us for t in trees]),
            "tree_eager_round_us": (("accuracy",), [t.eager_round_us for t in trees]),
            "tree_tau": (("accuracy",), [t.tau for t in trees]),
            "tree_timed_tau": (("accuracy",), [t.timed_tau for t in trees]),
            "tree_tokens_per_s": (("accuracy",), [t.tokens_per_s for t in trees]),
            "tree_ratio": (("accuracy",), [t.ratio for t in trees]),
            "tree_rounds": (("accuracy",), [t.rounds for t in trees]),
            "tree_forward_passes": (("accuracy",), [t.forward_passes for t in trees]),
            "tree_identical": (("accuracy",), [int(t.identical) for t in trees]),  # 0/1 (stack §9)
            "tree_stage_us": (("accuracy", "stage"), [[t.stage_us[s] for s in stages] for t in trees]),
        })
        coords.update({"accuracy": [t.accuracy for t in trees], "stage": stages})
    return xr.Dataset(data, coords=coords, attrs={"benchmark": "decode_step", "units": "us; bytes; tokens/s",
                                                  **attrs})


# --- command line ----------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ddtree_numba.bench.decode_step",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small", help="model preset (default: %(default)s)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="AR batch sizes (default: 1 8)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128,
                        help=f"tokens per request of the graph runs (AR: new-tokens - 2 replayed steps, "
                             f">= {MIN_STEPS} for the median; default: %(default)s)")
    parser.add_argument("--eager-tokens", type=int, default=12, help="tokens of the eager comparison runs")
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--accuracy", type=float, nargs="*", default=[0.9, 1.0],
                        help="oracle accuracies of the DDTree runs (none: skip DDTree)")
    parser.add_argument("--entropy", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (the targets' runs); > 0: AR and DDTree sample with the same seed "
                             "(Gumbel-max posterior), so the tokens must still agree (default: %(default)s)")
    parser.add_argument("--odd-tiles", choices=("on", "off"),
                        help="11-row tiles for many-row linear and head launches (kernels/linear.py ODD_TILES; "
                             "a B 32 tree's 33 rows in 3 x 11 instead of 5 x 8; default: ODD_TILES, on)")
    parser.add_argument("--row-products", choices=("on", "off"),
                        help="1-row products through kernels/gemv.py where it has a layout (engine.model."
                             "ROW_PRODUCTS; the same bits as linear; default: on)")
    parser.add_argument("--decode-split", choices=("on", "off"),
                        help="an AR step's attention in two wide launches (kernels/verify_attention.py "
                             "DECODE_SPLIT; the same bits as the one launch; default: on)")
    parser.add_argument("--tree-split", choices=("on", "off"),
                        help="a small tree's attention (a round's verify at batch 1) in two launches, scores "
                             "then softmax and P·V (kernels/verify_attention.py TREE_SPLIT; the same bits as "
                             "the one launch; default: off)")
    parser.add_argument("--quads", choices=("on", "off"),
                        help="the linears' staged rows read with 16-byte shared loads and staged in 16-byte "
                             "quads (kernels/linear.py VECTOR_X_LOADS and VECTOR_STAGING, both; the same bits; "
                             "default: on). Set explicitly, so in-process A/B runs can alternate")
    parser.add_argument("--ring", type=int, metavar="SLOTS",
                        help="the linears' async weight ring: SLOTS step slots a warp in shared memory filled "
                             "by cp.async (kernels/linear.py ASYNC_RING_STAGES; 0: off, the register loads; the "
                             "same bits; default: ASYNC_RING_STAGES). Set explicitly, so in-process A/B runs "
                             "can alternate")
    parser.add_argument("--attention-split", type=positive_arg, default=None, metavar="KEYS",
                        help="keys per attention segment (TargetModel's attention_split, numerics; "
                             "default: the engine's, 2048)")
    parser.add_argument("--products", choices=("cuda-core", "tensor-core"), default="cuda-core",
                        help="kernels of the dense matrix products (TargetModel's products, numerics: "
                             "kernels/linear.py or kernels/linear_tc.py; default: cuda-core)")
    parser.add_argument("--pdl", action="store_true",
                        help="programmatic dependent launch of every kernel (engine.decode's pdl; sm_90 on; "
                             "the same tokens; ignored under the simulator)")
    add_pdl_release_argument(parser, "with --pdl")
    parser.add_argument("--out", type=Path, help="append the run to this HDF5 file (bench/common.py write_run)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if min(args.batch) < 1 or args.prompt_len < 1 or args.eager_tokens < 2 or args.new_tokens < 3:
        raise SystemExit("error: --batch and --prompt-len must be >= 1, --eager-tokens >= 2, --new-tokens >= 3")
    if args.budget < 1 or args.block < 2 or any(not 0.0 <= a <= 1.0 for a in args.accuracy):
        raise SystemExit("error: --budget >= 1, --block >= 2, --accuracy in [0, 1]")
    if not args.temperature >= 0.0:
        raise SystemExit(f"error: --temperature must be >= 0, got {args.temperature}")
    from ddtree_numba.config import ModelConfig
    from ddtree_numba.engine.decode import required_kv_capacity
    import ddtree_numba.engine.model as em
    from ddtree_numba.engine.model import TargetModel
    from ddtree_numba.kernels import absorb as ab
    from ddtree_numba.kernels import linear as lin
    from ddtree_numba.kernels import verify_attention as va
    from reference.weights import init_weights
    from sim.install import simulator_active
    from sim.launch import programmatic_launch_count
    from sim.profiles import active_profile, roofline

    if args.ring is not None:
        try:
            lin.check_ring_stages(args.ring, "--ring")
        except ValueError as err:
            raise SystemExit(f"error: {err}") from None
    t_start = time.perf_counter()
    programmatic_before = programmatic_launch_count()
    if args.odd_tiles:
        lin.set_odd_tiles(args.odd_tiles == "on")
    args.odd_tiles = "on" if lin.ODD_TILES else "off"   # (recorded in the config attrs)
    if args.row_products:
        em.ROW_PRODUCTS = args.row_products == "on"
    args.row_products = "on" if em.ROW_PRODUCTS else "off"
    if args.decode_split:
        va.DECODE_SPLIT = args.decode_split == "on"
    # recorded with the batches they apply to: each split runs only up to its batch bound
    # (VerifyPlan.decode_split / tree_split), so "on" alone would claim the larger batches too
    args.decode_split = f"on (batch <= {va.DECODE_SPLIT_MAX_BATCH})" if va.DECODE_SPLIT else "off"
    if args.tree_split:
        va.TREE_SPLIT = args.tree_split == "on"
    args.tree_split = f"on (batch <= {va.TREE_SPLIT_MAX_BATCH})" if va.TREE_SPLIT else "off"
    set_release_mode(args.pdl_release)   # before the first kernel compiles (recorded in the config attrs)
    if args.quads:
        lin.VECTOR_X_LOADS = lin.VECTOR_STAGING = args.quads == "on"
        lin._setup.cache_clear()                          # launch shapes built with the other setting
    quads = (lin.VECTOR_X_LOADS, lin.VECTOR_STAGING)
    if args.ring is not None:
        lin.set_async_ring(args.ring)                     # clears the plans built with the other setting
    args.ring = lin.ASYNC_RING_STAGES
    args.quads = {(True, True): "on", (False, False): "off"}.get(quads, f"x loads {quads[0]}, staging {quads[1]}")
    config = ModelConfig.from_name(args.preset)
    profile = active_profile()
    bandwidth = roofline(profile, 1.0, 0.0).bandwidth
    if args.new_tokens - 2 < MIN_STEPS and not simulator_active():
        print(f"warning: {args.new_tokens - 2} replayed AR steps < {MIN_STEPS}", file=sys.stderr)
    host_weights = init_weights(config, args.seed)
    rng = np.random.default_rng(args.seed)
    n, ne = args.new_tokens, min(args.eager_tokens, args.new_tokens)
    weights: Any = host_weights
    ar_points: list[ArPoint] = []
    trees: list[TreePoint] = []
    for bs in args.batch:
        prompts = _prompts(rng, bs, args.prompt_len, config.vocab_size)
        drafting = bs == 1 and args.accuracy
        capacity = required_kv_capacity([args.prompt_len], n, args.budget if drafting else 0)
        split = {} if args.attention_split is None else {"attention_split": args.attention_split}
        model = TargetModel(config, weights, batch_size=bs, kv_capacity=capacity, max_rows=args.prompt_len,
                            products=args.products, **split)
        args.attention_split = model.attention_split  # recorded in the run's config
        weights = model.weights  # uploaded once, shared by the next models
        # The model's absorb path (numerics: a process keeps one) and its layout knobs as set.
        args.absorbs = (f"segment (split up to {ab.FEW_ROWS} rows, tile {ab.TILE_ROWS} rows a thread)"
                        if model._segment_absorbs else "head_linear")
        args.routing = "expert grid" if model._route_by_expert else "row blocks"   # numerics too
        point = measure_ar(config, model, prompts, n, ne, bandwidth, temperature=args.temperature, seed=args.seed,
                           pdl=args.pdl)
        ar_points.append(point)
        print(f"[{time.perf_counter() - t_start:.0f} s] AR batch {bs}: {point.graph_us:.1f} us/step", file=sys.stderr)
        if drafting:
            for accuracy in args.accuracy:
                trees.append(measure_tree(config, model, prompts, point, n, ne, accuracy, budget=args.budget,
                                          block=args.block, entropy=args.entropy, seed=args.seed,
                                          temperature=args.temperature, pdl=args.pdl))
                print(f"[{time.perf_counter() - t_start:.0f} s] DDTree accuracy {accuracy}", file=sys.stderr)
        del model
    del host_weights
    args.programmatic_launches = programmatic_launch_count() - programmatic_before   # > 0: PDL really on
    args.engine_release_early = em.PDL_RELEASE_EARLY   # whether the engine asked for any early release
    print(f"decode_step: preset {args.preset}, prompt {args.prompt_len}, {n} new tokens, budget {args.budget}, "
          f"block {args.block}, oracle entropy {args.entropy}, temperature {args.temperature}, absorbs {args.absorbs}, "
          f"routing {args.routing}, attention segments of {args.attention_split} keys, products {args.products}"
          + (f", programmatic launches ({args.programmatic_launches} launched eagerly or captured, "
             f"release {args.pdl_release}, engine early release "
             f"{'on' if args.engine_release_early else 'off: every release at the exits'})"
             if args.pdl else "")
          + (" (simulator: no CUDA graphs, wall-clock times)" if simulator_active() else ""))
    print(format_table(ar_points, trees, bandwidth, profile.name))
    if args.out:
        from ddtree_numba.bench.common import write_run

        config_attrs = {k: getattr(args, k) for k in ("preset", "batch", "prompt_len", "new_tokens", "eager_tokens",
                                                      "budget", "block", "accuracy", "entropy", "seed",
                                                      "temperature", "odd_tiles", "row_products", "decode_split", "tree_split", "quads", "ring", "absorbs",
                                                      "routing",
                                                      "attention_split", "products", "pdl",
                                                      "pdl_release", "engine_release_early",
                                                      "programmatic_launches")}
        ds = build_dataset(ar_points, trees, {
            "config": json.dumps(config_attrs), "profile": profile.name, "bandwidth_Bps": bandwidth,
            "targets": json.dumps({"ar_fraction_batch1": FRACTION_TARGET, "ddtree_ratio": RATIO_TARGET}),
            "notes": "AR / DDTree times: CUDA events around each graph replay (status copy excluded); stage "
                     "times: the eager run's rounds (compiled by then); MoE bytes at batch > 1 assume "
                     "min(E, batch * k) experts",
        })
        group = write_run(args.out, ds)
        print(f"wrote {args.out}:{group}")
    print(f"total {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    return 0 if all(t.identical for t in trees) else 1


if __name__ == "__main__":
    raise SystemExit(main())
