"""Benchmark the GPU best-first tree build (ddtree_numba.kernels.tree_build); needs a GPU.

For each batch size and budget B: K = min(B, V) top-k candidates per position (V = 163840),
L = 16 positions, every request drafting B nodes. Input sets (drafter-like top-k log-probs:
Gaussian logits of a few scales over a sampled vocabulary) are rotated between launches.

Two timings, each a median / min / max over --reps:
- ``launch``: CUDA events around one ``run()`` call: GPU time plus any host launch overhead
  the GPU waits for (tens of µs from Python, limits §4);
- ``graph``: --graph-launches builds captured in one CUDA graph (cuda.core GraphBuilder, or
  torch.cuda.graph if that fails), replayed between two events, divided by the launch count:
  the kernel's time as the engine's graph-captured round sees it.

Diagnostics (the kernel's round-counting variant, untimed): nodes the warp-0 heap popped per
round, over all requests and for the request with the most rounds (the batch waits for it), and
nodes the threshold phase placed before the heap (mean and fewest over the requests).

Targets (issue 3, H200, bs 64): <= 20 µs at B = 32 and <= 150 µs at B = 512.

    ddtree-numba bench tree-build [--batch 1 8 64] [--budgets 8 16 32 ...] [--out data/bench/h200.h5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from numba import cuda

from ddtree_numba.bench.common import graph_replay_times, write_run
from ddtree_numba.kernels import tree_build as tb

VOCAB = 163840  # Kimi K2; K = min(B, V)
SAMPLED_VOCAB = 16384  # logits drawn per row to make a realistic top-1024 (not the full V)
TARGETS_US = {(64, 32): 20.0, (64, 512): 150.0}


def top_k_pool(rng: np.random.Generator, n_rows: int, k: int, scales: list[float]
               ) -> tuple[np.ndarray, np.ndarray]:
    """Sorted float32 log-probs [n_rows, k] and int32 ids [n_rows, k] (value desc, id asc).

    Logit scales pick the tree shape: 1-4 gives wide, shallow trees (depth-1 ranks up to B);
    6-8 gives peaked rows and deep, narrow trees (more frontier rescans per pop).
    """
    scale = rng.choice(scales, size=(n_rows, 1))
    logits = rng.standard_normal((n_rows, SAMPLED_VOCAB)) * scale  # [R, Vs] float64
    top = np.argpartition(-logits, k - 1, axis=1)[:, :k]  # [R, k], unordered
    values = np.take_along_axis(logits, top, axis=1)
    order = np.lexsort((top, -values), axis=1)  # value descending, then id ascending
    top = np.take_along_axis(top, order, axis=1)
    values = np.take_along_axis(values, order, axis=1)
    peak = logits.max(axis=1, keepdims=True)
    log_z = peak + np.log(np.exp(logits - peak).sum(axis=1, keepdims=True))
    return (values - log_z).astype(np.float32), top.astype(np.int32)


def device_input_sets(pool: tuple[np.ndarray, np.ndarray], n_sets: int, bs: int, horizon: int, k: int,
                      budget: int, rng: np.random.Generator) -> list[tuple]:
    """``n_sets`` rotated device inputs (lp, ids, budgets, past_lens, roots) for one config."""
    lp_pool, id_pool = pool
    rows = bs * horizon
    sets = []
    for s in range(n_sets):
        pick = rng.choice(lp_pool.shape[0], size=rows, replace=False)
        lp = np.ascontiguousarray(lp_pool[pick, :k]).reshape(bs, horizon, k)
        ids = np.ascontiguousarray(id_pool[pick, :k]).reshape(bs, horizon, k)
        budgets = np.full(bs, budget, np.int32)
        past = rng.integers(0, 131072, size=bs).astype(np.int32)
        roots = rng.integers(0, VOCAB, size=bs).astype(np.int32)
        sets.append(tuple(cuda.to_device(a) for a in (lp, ids, budgets, past, roots)))
    return sets


def summary(values_us: list[float]) -> tuple[float, float, float]:
    return statistics.median(values_us), min(values_us), max(values_us)


def time_launches(plan, sets, out, reps: int, warmup: int) -> list[float]:
    """µs per launch, CUDA events around each launch, inputs rotated."""
    stream = cuda.stream()
    start, end = cuda.event(), cuda.event()
    for r in range(warmup):
        tb.run(plan, *sets[r % len(sets)], out, stream=stream)
    stream.synchronize()
    times = []
    for r in range(reps):
        start.record(stream)
        tb.run(plan, *sets[r % len(sets)], out, stream=stream)
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)  # ms -> µs
    return times


def time_graph(plan, sets, out, reps: int, launches: int) -> list[float]:
    """µs per launch from replays of one CUDA graph holding ``launches`` rotated builds."""
    return graph_replay_times(lambda r, stream: tb.run(plan, *sets[r % len(sets)], out, stream=stream),
                              launches, reps)


def time_graph_torch(plan, sets, out, reps: int, launches: int) -> list[float]:
    """As :func:`time_graph`, captured with torch.cuda.graph (measured to work, limits §4)."""
    import torch

    stream = torch.cuda.Stream()
    numba_stream = cuda.external_stream(stream.cuda_stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for r in range(launches):
            tb.run(plan, *sets[r % len(sets)], out, stream=numba_stream)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    with torch.cuda.stream(stream):
        graph.replay()  # warm-up replay
        for _ in range(reps):
            start.record(stream)
            graph.replay()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / launches)
    return times


GRAPH_TIMERS = {"cuda.core": time_graph, "torch": time_graph_torch}


def round_stats(plan, sets, out, budget: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """From the kernel's round-counting variant on the first input set (diagnostic; not timed):
    nodes the heap popped per round (over all requests, and of the request with the most
    rounds; NaN where the heap had nothing to pop) and nodes the threshold phase placed (mean,
    fewest)."""
    rounds = cuda.device_array((plan.batch_size, 2), np.int32)
    tb.run(plan, *sets[0], out, rounds=rounds)
    counts = rounds.copy_to_host().astype(np.float64)  # [bs, (heap rounds, placed)]
    heap_pops = budget - counts[:, 1]
    slowest = int(np.argmax(counts[:, 0]))
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = heap_pops.sum() / counts[:, 0].sum() if counts[:, 0].sum() else np.nan
        worst = heap_pops[slowest] / counts[slowest, 0] if counts[slowest, 0] else np.nan
    return (float(mean), float(worst)), (float(counts[:, 1].mean()), float(counts[:, 1].min()))


def check_sizes(out, bs: int, budget: int) -> None:
    """Every request drafted its whole budget (B <= sum K^d always holds here)."""
    sizes = out.sizes.copy_to_host()
    if not (sizes == budget + 1).all():
        raise AssertionError(f"bs={bs} B={budget}: sizes {np.unique(sizes)} != {budget + 1}")


def write_dataset(path: Path, results: dict, args: argparse.Namespace) -> None:
    """Results as an xarray Dataset (dims batch, budget, stat) in HDF5, written atomically."""
    import xarray as xr

    batches, budgets = args.batch, args.budgets
    stats = ["median", "min", "max"]
    data = {}
    pops = np.full((len(batches), len(budgets), 2), np.nan)
    placed = np.full((len(batches), len(budgets), 2), np.nan)
    for (bs, budget), res in results.items():
        pops[batches.index(bs), budgets.index(budget)] = res["pops_per_round"]
        placed[batches.index(bs), budgets.index(budget)] = res["threshold_nodes"]
    data["pops_per_round"] = (("batch", "budget", "requests"), pops, {
        "long_name": "nodes the heap popped per round: all requests, the request with the most rounds"})
    data["threshold_nodes"] = (("batch", "budget", "placed"), placed, {
        "long_name": "nodes the threshold phase placed before the heap: mean, fewest"})
    for mode in ("launch", "graph"):
        arr = np.full((len(batches), len(budgets), 3), np.nan)
        for (bs, budget), res in results.items():
            if res.get(mode) is not None:
                arr[batches.index(bs), budgets.index(budget)] = res[mode]
        data[f"{mode}_us"] = (("batch", "budget", "stat"), arr)
    ds = xr.Dataset(data, coords={"batch": batches, "budget": budgets, "stat": stats,
                                  "requests": ["mean", "slowest"], "placed": ["mean", "fewest"]}, attrs={
        "benchmark": "tree_build",
        "units": "us for the whole batch",
        "config": json.dumps({"horizon": args.horizon, "vocab": VOCAB, "threads": args.threads,
                              "scales": args.scales,
                              "reps": args.reps, "rotate": args.rotate,
                              "graph_launches": args.graph_launches}),
    })
    group = write_run(path, ds)
    print(f"wrote {path}:{group}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--horizon", type=int, default=16)
    parser.add_argument("--threads", type=int, default=tb.DEFAULT_THREADS)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rotate", type=int, default=4, help="input sets rotated between launches")
    parser.add_argument("--graph-launches", type=int, default=8)
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timing")
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 2.0, 3.0, 4.0],
                        help="logit scales of the input rows (6 8: peaked rows, deep trees)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write an HDF5 xarray Dataset here")
    args = parser.parse_args(argv)
    if args.reps < 20:
        parser.error("--reps must be >= 20")

    rng = np.random.default_rng(args.seed)
    k_max = min(max(args.budgets), VOCAB)
    pool = top_k_pool(rng, max(args.batch) * args.horizon * 2, k_max, args.scales)
    results: dict = {}
    graph_timers = {} if args.no_graph else dict(GRAPH_TIMERS)  # first that works is kept
    print(f"tree_build: L={args.horizon}, K=min(B, {VOCAB}), logit scales {args.scales}, "
          f"{args.threads} threads/block, {args.reps} reps, {args.rotate} input sets")
    print(f"{'bs':>4} {'B':>5} {'K':>5} | {'launch med':>10} {'min':>8} {'max':>8} | "
          f"{'graph med':>10} {'min':>8} {'max':>8} | {'ns/node':>7} | {'pops/round':>10} {'slowest':>7} | "
          f"{'placed':>6} {'fewest':>6} | target")
    for bs in args.batch:
        for budget in args.budgets:
            k = min(budget, VOCAB)
            plan = tb.plan(bs, args.horizon, k, budget + 1, threads=args.threads)
            out = tb.allocate_outputs(plan)
            sets = device_input_sets(pool, args.rotate, bs, args.horizon, k, budget, rng)
            launch_us = summary(time_launches(plan, sets, out, args.reps, args.warmup))
            check_sizes(out, bs, budget)
            graph_us = None
            while graph_us is None and graph_timers:
                name, timer = next(iter(graph_timers.items()))
                try:
                    graph_us = summary(timer(plan, sets, out, args.reps, args.graph_launches))
                except Exception as exc:  # capture through cuda.core is unverified (stack §9)
                    print(f"graph timing via {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                    del graph_timers[name]
            pops, placed = round_stats(plan, sets, out, budget)
            results[(bs, budget)] = {"launch": launch_us, "graph": graph_us, "pops_per_round": pops,
                                     "threshold_nodes": placed}
            g = "{:10.1f} {:8.1f} {:8.1f}".format(*graph_us) if graph_us else f"{'-':>10} {'-':>8} {'-':>8}"
            per_node = 1e3 * (graph_us or launch_us)[0] / budget  # serial pops dominate: ns per drafted node
            target = TARGETS_US.get((bs, budget))
            print(f"{bs:>4} {budget:>5} {k:>5} | {launch_us[0]:10.1f} {launch_us[1]:8.1f} {launch_us[2]:8.1f} | "
                  f"{g} | {per_node:7.0f} | {pops[0]:10.2f} {pops[1]:7.2f} | {placed[0]:6.1f} {placed[1]:6.0f} | "
                  f"{f'<= {target:.0f} us' if target else ''}")
    if graph_timers:
        print(f"graph timings captured with {next(iter(graph_timers))}")
    if args.out:
        write_dataset(args.out, results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
