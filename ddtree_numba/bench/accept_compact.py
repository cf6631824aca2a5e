"""Benchmark: posterior (argmax / sampled / merged lm_head parts), acceptance walk and KV
compaction on the GPU, and the lm_head with and without its fused argmax.

GPU time per step by CUDA events, measured "queue-ahead": before each repetition a sleeper
kernel keeps the stream busy while Python enqueues the step's launches, so the events time the
kernels back to back (as a CUDA graph replays them) and not Python's 20-30 us per launch
(limits §8). Warm-up runs first (compilation), then >= 20 repetitions; inputs rotate over
several sets (trees, posteriors, accepted rows) so no repetition reuses the last one's L2 state.

Kimi K2 shapes (spec §6): V = 163840, horizon L = 16 (accepted width 17), cache rows of
61 layers x 576 bf16 values (latent 512 + rope 64), per-layer [bs, S, 576] buffers or one
[bs, S, 61 * 576] buffer. Trees come from the NumPy reference (tree vocab 4096: token ids do
not change the timing); posteriors follow a child with probability 0.9 (long acceptances).

    ddtree-numba bench accept-compact                      # bs 1/8/64 x B 32/512
    ddtree-numba bench accept-compact --batch 64 --budget 512 --reps 50 --out data/bench/h200.h5
    ddtree-numba bench accept-compact --batch 64 --budget 512 --max-logits-gb 0   # no fp32 logits
    ddtree-numba bench accept-compact --lm-head-rows 64,513 --no-round           # lm_head only

The speed target (issue 3): posterior argmax + accept + compaction at bs 64, B 512 <= 30 us.
With full fp32 logits the argmax alone reads 21.5 GB (5 ms), so the engine fuses it into the
lm_head (``linear.linear_argmax``: per row and column block one (max, lowest id), part of the
target forward) and the posterior is only the merge of those parts. Merging every node's parts
(``accept.posterior_argmax_parts``, 25 MB at bs 64, B 512) before the walk: steps
"posterior_parts_merge" and "parts_merge+walk+compact". Merging only the nodes the walk visits,
inside it (``accept.accept_walk_parts``, one launch, <= L + 1 rows a request): steps
"parts_walk" and "parts_walk+compact", the issue's quantity. The parts of each input set encode
its posterior (the winning part holds the posterior token), so the walks accept the same long
paths; both ways are checked against the set before timing.

``--lm-head-rows``: linear (logits stored) vs linear_argmax (parts only) at the Kimi K2 lm_head
shape (V 163840 x D 7168, fp32, rmsnorm prologue), each alone and followed by its posterior
(posterior_argmax over the logits / the parts merge), for M rows (one request's tree of B + 1
nodes is M = B + 1; bs 64 x 513 would be a 7168 x 163840 x 32832 FP32 GEMM, ~1.5 s). Reported
per call and per row; rows are "batch" in the table and the dataset (budget 0).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int64, uint64

from ddtree_numba.bench.common import write_run
from ddtree_numba.kernels import accept as ka
from ddtree_numba.kernels import compact as kc
from ddtree_numba.kernels import linear as lin
from reference import accept_batch, build_tree_batch, topk_log_probs
from sim.profiles import active_profile, roofline

KIMI_VOCAB = 163840
HORIZON = 16  # L: drafted positions; accepted width L + 1
LAYERS = 61
ROW_VALUES = 576  # latent 512 + rope 64 per layer
TREE_VOCAB = 4096  # token ids of the synthetic trees (the timing does not depend on them)
FOLLOW = 0.9  # probability that a node's posterior is one of its children's tokens
PAST_MAX = 64  # past lengths drawn from [0, PAST_MAX)
INPUT_SETS = 4  # rotated input sets
SLEEP_NS_PER_CALL = 1000  # nanosleep argument of the sleeper kernel
FILL_THREADS = 256
FILL_BLOCKS = 4096
MIX1 = np.uint64(0x9E3779B97F4A7C15)  # splitmix64 constants: a cheap on-device logit filler
MIX2 = np.uint64(0xBF58476D1CE4E5B9)
SHIFT_MIX = np.uint64(31)
SHIFT_MANTISSA = np.uint64(40)  # top 24 bits -> float32 in [0, 1)
KIMI_HIDDEN = 7168  # lm_head input width D
PART_WINNER = 9.0  # a part value above the filler's [-8, 8): the part holding the posterior token


@cuda.jit
def sleep_kernel(calls):
    """Keep the stream busy for about calls x SLEEP_NS_PER_CALL ns (one thread)."""
    for _ in range(calls):
        cuda.nanosleep(SLEEP_NS_PER_CALL)


@cuda.jit
def fill_logits_kernel(flat, seed):
    """flat float32 [n] <- pseudo-random values in [-8, 8) from a hash of (index, seed)."""
    i = int64(cuda.grid(1))  # > 2**31 elements at bs 64, B 512
    while i < flat.shape[0]:
        h = (uint64(i) + seed) * MIX1
        h = (h ^ (h >> SHIFT_MIX)) * MIX2
        h = h ^ (h >> SHIFT_MIX)
        flat[i] = float32(h >> SHIFT_MANTISSA) * float32(2.0**-24) * float32(16.0) - float32(8.0)
        i += cuda.gridsize(1)


@dataclass
class Timing:
    """Per-repetition GPU times of one step, in microseconds."""

    name: str
    batch: int
    budget: int
    times_us: list[float]
    bytes_moved: int  # DRAM bytes the step must move (0: latency-bound, no floor reported)

    @property
    def median(self) -> float:
        return statistics.median(self.times_us)


def time_step(step: Callable[[int, object], None], stream, reps: int, warmup: int) -> list[float]:
    """GPU microseconds of ``step(rep, stream)`` per repetition, queue-ahead (module doc)."""
    for rep in range(warmup):
        step(rep, stream)
    stream.synchronize()
    t0 = time.perf_counter()
    step(0, stream)
    enqueue_s = time.perf_counter() - t0
    stream.synchronize()
    sleep_calls = int(3 * enqueue_s * 1e9 / SLEEP_NS_PER_CALL) + 500  # 3x the enqueue time + 0.5 ms
    events = []
    for rep in range(reps):
        sleep_kernel[1, 1, stream](sleep_calls)
        start, end = cuda.event(timing=True), cuda.event(timing=True)
        start.record(stream)
        step(rep, stream)
        end.record(stream)
        events.append((start, end))
    stream.synchronize()
    return [1000.0 * cuda.event_elapsed_time(start, end) for start, end in events]


def random_posterior(rng: np.random.Generator, trees, vocab: int, follow: float) -> np.ndarray:
    """int32 [bs, N]: w.p. ``follow`` a node's posterior is one of its children's tokens, else a
    random token of ``vocab`` (so walks accept long paths). Also the kernel tests' input."""
    post = rng.integers(0, vocab, (trees.batch_size, trees.capacity)).astype(np.int32)
    for b in range(trees.batch_size):
        for node in range(int(trees.sizes[b])):
            kids = trees.child_index[b, trees.child_ptr[b, node]:trees.child_ptr[b, node + 1]]
            if kids.size and rng.random() < follow:
                post[b, node] = trees.tokens[b, rng.choice(kids)]
    return post


def posterior_parts(rng: np.random.Generator, post: np.ndarray, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """linear_argmax-shaped parts [bs * N, P] whose merge is ``post`` [bs, N]: random candidates
    in [-8, 8) at random ids of each part, and PART_WINNER at the posterior token's part."""
    width, n_parts = lin.argmax_part_cols(vocab), lin.argmax_parts(vocab)
    tokens = post.reshape(-1).astype(np.int64)
    rows = tokens.size
    val = rng.uniform(-8.0, 8.0, (rows, n_parts)).astype(np.float32)
    idx = np.minimum(np.arange(n_parts) * width + rng.integers(0, width, (rows, n_parts)), vocab - 1)
    val[np.arange(rows), tokens // width] = PART_WINNER
    idx[np.arange(rows), tokens // width] = tokens
    return val, idx.astype(np.int32)


def make_round_inputs(rng: np.random.Generator, bs: int, budget: int, vocab: int) -> dict[str, object]:
    """One rotated input set on the device: tree CSR, posterior (and lm_head parts that merge
    into it), past lengths, and the walk's expected outputs (accepted / lengths, used by the
    compaction-only steps)."""
    k = min(budget, TREE_VOCAB)
    lp, ids = topk_log_probs(rng.standard_normal((bs * HORIZON, TREE_VOCAB)) * 2.0, k)
    trees = build_tree_batch(lp.reshape(bs, HORIZON, k), ids.reshape(bs, HORIZON, k), budget,
                             rng.integers(0, TREE_VOCAB, bs), capacity=budget + 1)
    post = random_posterior(rng, trees, TREE_VOCAB, FOLLOW)
    part_val, part_idx = posterior_parts(rng, post, vocab)
    accepted, lengths, _ = accept_batch(post, trees)
    width = HORIZON + 1
    acc = np.full((bs, width), -1, np.int32)
    acc[:, :accepted.shape[1]] = accepted
    host = {
        "posterior": post, "child_ptr": trees.child_ptr, "child_index": trees.child_index,
        "tokens": trees.tokens.astype(np.int32), "accepted": acc, "lengths": lengths.astype(np.int32),
        "past_lens": rng.integers(0, PAST_MAX, bs).astype(np.int32),
        "sizes": trees.sizes.astype(np.int32),
        "positions": (rng.integers(0, PAST_MAX, (bs, 1)) + trees.depths).astype(np.int64),
        "part_val": part_val, "part_idx": part_idx,
    }
    return {name: cuda.to_device(np.ascontiguousarray(a)) for name, a in host.items()} | {
        "mean_length": float(lengths.mean())}


def check_merge(sets: list[dict[str, object]], out_post, stream) -> None:
    """The parts of every input set merge into its posterior on its real rows (else the timed
    walks would not be the benchmarked ones)."""
    for d in sets:
        ka.posterior_argmax_parts(d["part_val"], d["part_idx"], d["sizes"], out_post, stream=stream)
        got, want = out_post.copy_to_host(stream=stream), d["posterior"].copy_to_host(stream=stream)
        stream.synchronize()
        real = np.arange(got.shape[1])[None, :] < d["sizes"].copy_to_host()[:, None]
        if not np.array_equal(got[real], want[real]) or np.any(got[~real] != -1):
            raise RuntimeError("posterior_argmax_parts did not reproduce the posterior of its parts")


def check_parts_walk(sets: list[dict[str, object]], out_acc, out_len, out_bonus, stream) -> None:
    """The fused walk over every input set's parts accepts the set's nodes (accepted, lengths
    from reference.accept_batch on its posterior)."""
    for d in sets:
        ka.accept_walk_parts(d["part_val"], d["part_idx"], d["child_ptr"], d["child_index"], d["tokens"],
                             out_acc, out_len, out_bonus, stream=stream)
        got = out_acc.copy_to_host(stream=stream), out_len.copy_to_host(stream=stream)
        want = d["accepted"].copy_to_host(stream=stream), d["lengths"].copy_to_host(stream=stream)
        stream.synchronize()
        if not all(np.array_equal(g, w) for g, w in zip(got, want)):
            raise RuntimeError("accept_walk_parts did not accept the nodes of its input set")


def run_case(bs: int, budget: int, args: argparse.Namespace, stream) -> list[Timing]:
    """Every step at one (batch, budget)."""
    rng = np.random.default_rng(1000 * bs + budget)
    n_cap = budget + 1
    n_rows = PAST_MAX + n_cap
    sets = [make_round_inputs(rng, bs, budget, args.vocab) for _ in range(INPUT_SETS)]
    out_post = cuda.device_array((bs, n_cap), np.int32)
    out_acc = cuda.device_array((bs, HORIZON + 1), np.int32)
    out_len = cuda.device_array(bs, np.int32)
    out_bonus = cuda.device_array(bs, np.int32)
    temperatures = cuda.to_device(np.ones(bs))
    seeds = cuda.to_device(rng.integers(0, 2**63, bs).astype(np.uint64))
    big = cuda.device_array((bs, n_rows, LAYERS * ROW_VALUES), np.uint16)  # bf16 bits, uninitialised
    per_layer = [cuda.device_array((bs, n_rows, ROW_VALUES), np.uint16) for _ in range(LAYERS)]
    plan_big = kc.plan_compaction(big)
    plan_layers = kc.plan_compaction(per_layer)
    row_bytes = LAYERS * ROW_VALUES * 2
    mean_len = statistics.mean(s["mean_length"] for s in sets)
    moved = int(2 * bs * max(mean_len - 1.0, 0.0) * row_bytes)  # read + write, root never moves

    def walk(rep, s):
        d = sets[rep % INPUT_SETS]
        ka.accept_walk(d["posterior"], d["child_ptr"], d["child_index"], d["tokens"], out_acc, out_len,
                       out_bonus, stream=s)

    def compact(plan):
        def step(rep, s):
            d = sets[rep % INPUT_SETS]
            kc.run_compaction(plan, d["past_lens"], d["accepted"], d["lengths"], stream=s)
        return step

    def walk_compact(rep, s):
        walk(rep, s)
        d = sets[rep % INPUT_SETS]
        kc.run_compaction(plan_big, d["past_lens"], out_acc, out_len, stream=s)

    def merge(rep, s):
        d = sets[rep % INPUT_SETS]
        ka.posterior_argmax_parts(d["part_val"], d["part_idx"], d["sizes"], out_post, stream=s)

    def merge_walk_compact(rep, s):
        merge(rep, s)
        d = sets[rep % INPUT_SETS]
        ka.accept_walk(out_post, d["child_ptr"], d["child_index"], d["tokens"], out_acc, out_len,
                       out_bonus, stream=s)
        kc.run_compaction(plan_big, d["past_lens"], out_acc, out_len, stream=s)

    def parts_walk(rep, s):
        d = sets[rep % INPUT_SETS]
        ka.accept_walk_parts(d["part_val"], d["part_idx"], d["child_ptr"], d["child_index"], d["tokens"],
                             out_acc, out_len, out_bonus, stream=s)

    def parts_walk_compact(rep, s):
        parts_walk(rep, s)
        kc.run_compaction(plan_big, sets[rep % INPUT_SETS]["past_lens"], out_acc, out_len, stream=s)

    check_merge(sets, out_post, stream)
    check_parts_walk(sets, out_acc, out_len, out_bonus, stream)
    n_parts = lin.argmax_parts(args.vocab)
    parts_read = int(8 * n_parts * statistics.mean(int(s["sizes"].copy_to_host().sum()) for s in sets))
    steps: list[tuple[str, Callable, int]] = [
        ("accept_walk", walk, 0),
        ("compact_61x576_one_buffer", compact(plan_big), moved),
        ("compact_61_layer_buffers", compact(plan_layers), moved),
        ("walk+compact", walk_compact, moved),
        ("posterior_parts_merge", merge, parts_read),
        ("parts_merge+walk+compact", merge_walk_compact, parts_read + moved),
        ("parts_walk", parts_walk, 0),
        ("parts_walk+compact", parts_walk_compact, moved),
    ]
    logits_bytes = 4 * bs * n_cap * args.vocab
    if logits_bytes <= args.max_logits_gb * 1e9:
        logits = cuda.device_array((bs, n_cap, args.vocab), np.float32)
        fill_logits_kernel[FILL_BLOCKS, FILL_THREADS, stream](logits.reshape(logits.size), np.uint64(bs))
        read = int(4 * args.vocab * sum(int(s["sizes"].copy_to_host().sum()) for s in sets) / INPUT_SETS)

        def argmax(rep, s):
            ka.posterior_argmax(logits, sets[rep % INPUT_SETS]["sizes"], out_post, stream=s)

        def sample(rep, s):
            d = sets[rep % INPUT_SETS]
            ka.posterior_sample(logits, d["sizes"], temperatures, seeds, d["positions"], out_post, stream=s)

        def full_round(rep, s):
            argmax(rep, s)
            walk_compact(rep, s)

        steps += [("posterior_argmax", argmax, read), ("argmax+walk+compact", full_round, read + moved)]
        if not args.no_sample:
            steps.append(("posterior_sample_T1", sample, read))
    else:
        print(f"  (bs {bs}, B {budget}: logits {logits_bytes / 1e9:.1f} GB > --max-logits-gb; "
              "posterior over the logits skipped)")
    results = []
    for name, step, nbytes in steps:
        results.append(Timing(name, bs, budget, time_step(step, stream, args.reps, args.warmup), nbytes))
        print(f"  {name:28s} bs {bs:3d} B {budget:5d}: median {results[-1].median:10.1f} us", flush=True)
    return results


def run_lm_head(rows: list[int], args: argparse.Namespace, stream) -> list[Timing]:
    """linear vs linear_argmax at the Kimi K2 lm_head shape (module doc), each alone and with
    its posterior, for each row count M (batch = M, budget 0 in the results)."""
    n_cols, k_dim = args.vocab, KIMI_HIDDEN
    w = cuda.device_array((n_cols, k_dim), np.float32)
    fill_logits_kernel[FILL_BLOCKS, FILL_THREADS, stream](w.reshape(w.size), np.uint64(7))
    norm = cuda.to_device(np.ones(k_dim, np.float32))
    n_parts = lin.argmax_parts(n_cols)
    w_bytes = 4 * n_cols * k_dim
    results = []
    for m_rows in rows:
        xs = [cuda.device_array((m_rows, k_dim), np.float32) for _ in range(2)]
        for i, x in enumerate(xs):
            fill_logits_kernel[FILL_BLOCKS, FILL_THREADS, stream](x.reshape(x.size), np.uint64(100 + i))
        logits = cuda.device_array((m_rows, n_cols), np.float32)
        part_val = cuda.device_array((m_rows, n_parts), np.float32)
        part_idx = cuda.device_array((m_rows, n_parts), np.int32)
        sizes = cuda.to_device(np.array([m_rows], np.int32))
        post = cuda.device_array((1, m_rows), np.int32)
        post_fused = cuda.device_array((1, m_rows), np.int32)

        def lm_linear(rep, s):
            lin.linear(xs[rep % 2], w, logits, norm_weight=norm, stream=s)

        def lm_argmax(rep, s):
            lin.linear_argmax(xs[rep % 2], w, part_val, part_idx, norm_weight=norm, stream=s)

        def lm_linear_post(rep, s):
            lm_linear(rep, s)
            ka.posterior_argmax(logits.reshape(1, m_rows, n_cols), sizes, post, stream=s)

        def lm_argmax_post(rep, s):
            lm_argmax(rep, s)
            ka.posterior_argmax_parts(part_val, part_idx, sizes, post_fused, stream=s)

        lm_linear_post(0, stream)
        lm_argmax_post(0, stream)
        stream.synchronize()
        if not np.array_equal(post.copy_to_host(), post_fused.copy_to_host()):
            raise RuntimeError(f"lm_head M {m_rows}: fused posterior != posterior_argmax(linear)")
        base = w_bytes + 4 * m_rows * k_dim
        for name, step, nbytes in (
                ("lm_head_linear", lm_linear, base + 4 * m_rows * n_cols),
                ("lm_head_linear_argmax", lm_argmax, base + 8 * m_rows * n_parts),
                ("lm_head_linear+posterior_argmax", lm_linear_post, base + 8 * m_rows * n_cols),
                ("lm_head_linear_argmax+merge", lm_argmax_post, base + 16 * m_rows * n_parts)):
            results.append(Timing(name, m_rows, 0, time_step(step, stream, args.reps, args.warmup), nbytes))
            med = results[-1].median
            print(f"  {name:34s} M {m_rows:5d}: median {med:10.1f} us, {med / m_rows:8.2f} us/row, "
                  f"{2e-6 * m_rows * n_cols * k_dim / med:6.1f} TFLOP/s", flush=True)
    return results


def format_table(results: list[Timing], vocab: int = KIMI_VOCAB) -> str:
    profile = active_profile()
    header = (f"{'step':28s} {'bs':>4s} {'B':>5s} {'median us':>10s} {'min':>9s} {'max':>9s} {'MB':>9s} "
              f"{'floor us':>9s} {'% roof':>7s}")
    lines = [header, "-" * len(header)]
    for r in results:
        if r.name.startswith("lm_head"):
            continue
        floor = roofline(profile, r.bytes_moved, 0.0).t_floor_s * 1e6 if r.bytes_moved else math.nan
        pct = 100.0 * floor / r.median if r.bytes_moved else math.nan
        lines.append(f"{r.name:28s} {r.batch:4d} {r.budget:5d} {r.median:10.1f} {min(r.times_us):9.1f} "
                     f"{max(r.times_us):9.1f} {r.bytes_moved / 1e6:9.1f} {floor:9.1f} {pct:7.1f}")
    lm_head = [r for r in results if r.name.startswith("lm_head")]
    if lm_head:
        title = f"lm_head step (V {vocab}, D {KIMI_HIDDEN})"
        header = f"{title:34s} {'M':>5s} {'median us':>10s} {'us/row':>8s} {'TFLOP/s':>8s}"
        lines += ["", header, "-" * len(header)]
        for r in lm_head:
            lines.append(f"{r.name:34s} {r.batch:5d} {r.median:10.1f} {r.median / r.batch:8.2f} "
                         f"{2e-6 * r.batch * vocab * KIMI_HIDDEN / r.median:8.1f}")
    return "\n".join(lines)


def write_dataset(path: str, results: list[Timing], args: argparse.Namespace) -> None:
    """An xarray Dataset over (case,) written as HDF5 (h5netcdf), atomically (temp file, rename)."""
    import xarray as xr

    ds = xr.Dataset(
        {
            "median_us": (("case",), [r.median for r in results]),
            "min_us": (("case",), [min(r.times_us) for r in results]),
            "max_us": (("case",), [max(r.times_us) for r in results]),
            "times_us": (("case", "rep"), [r.times_us for r in results]),
            "bytes_moved": (("case",), np.array([r.bytes_moved for r in results], np.int64)),
        },
        coords={
            "step": (("case",), [r.name for r in results]),
            "batch": (("case",), np.array([r.batch for r in results], np.int64)),
            "budget": (("case",), np.array([r.budget for r in results], np.int64)),
        },
        attrs={
            "benchmark": "accept_compact",
            "config": json.dumps({"vocab": args.vocab, "horizon": HORIZON, "layers": LAYERS,
                                  "argmax_parts": lin.argmax_parts(args.vocab), "lm_head_hidden": KIMI_HIDDEN,
                                  "row_values": ROW_VALUES, "reps": args.reps, "warmup": args.warmup,
                                  "input_sets": INPUT_SETS, "follow": FOLLOW, "past_max": PAST_MAX}),
            "timing": "CUDA events, queue-ahead behind a sleeper kernel (GPU time, no launch gaps)",
        },
    )
    group = write_run(path, ds)
    print(f"wrote {path}:{group}")


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of positive ints, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=_int_list, default=[1, 8, 64], help="batch sizes (default 1,8,64)")
    parser.add_argument("--budget", type=_int_list, default=[32, 512], help="tree budgets B (default 32,512)")
    parser.add_argument("--vocab", type=int, default=KIMI_VOCAB, help="vocabulary of the target logits")
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions (>= 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-logits-gb", type=float, default=30.0,
                        help="skip the posterior steps when the float32 logits exceed this (default 30)")
    parser.add_argument("--no-sample", action="store_true", help="skip the sampled posterior (slow at B 512)")
    parser.add_argument("--lm-head-rows", type=_int_list, default=[],
                        help="also time linear vs linear_argmax at the Kimi lm_head shape for these "
                             "row counts (e.g. 64,513)")
    parser.add_argument("--no-round", action="store_true",
                        help="skip the posterior / walk / compaction cases (with --lm-head-rows)")
    parser.add_argument("--out", help="also write the results as an HDF5 xarray Dataset")
    args = parser.parse_args(argv)
    if args.reps < 20:
        parser.error("--reps must be >= 20")
    if args.vocab < TREE_VOCAB:
        parser.error(f"--vocab must be >= {TREE_VOCAB} (the synthetic trees' token ids)")
    if cuda.config.ENABLE_CUDASIM:
        parser.error("needs a CUDA GPU (NUMBA_ENABLE_CUDASIM is set)")
    if args.out:
        import h5netcdf  # noqa: F401  (fail now, not after the run)
    if args.no_round and not args.lm_head_rows:
        parser.error("--no-round leaves nothing to time without --lm-head-rows")
    stream = cuda.stream()
    results = []
    if not args.no_round:
        for bs in args.batch:
            for budget in args.budget:
                results += run_case(bs, budget, args, stream)
    if args.lm_head_rows:
        results += run_lm_head(args.lm_head_rows, args, stream)
    print()
    print(format_table(results, args.vocab))
    for step, what in (("argmax+walk+compact", "argmax over fp32 logits"),
                       ("parts_merge+walk+compact", "merge of the fused lm_head's parts"),
                       ("parts_walk+compact", "the visited nodes' parts merged in the walk")):
        target = [r for r in results if r.name == step and r.batch == 64 and r.budget == 512]
        if target:
            print(f"\ntarget (issue 3): posterior argmax + accept + compaction, bs 64, B 512 <= 30 us, "
                  f"posterior = {what}: measured {target[0].median:.1f} us")
    if args.out:
        write_dataset(args.out, results, args)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
