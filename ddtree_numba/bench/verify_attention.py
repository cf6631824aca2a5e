"""Benchmark: tree-verify MLA attention kernel (FP32) on the GPU, Kimi K2 shapes.

For each (batch, tree size T, cached length N): random inputs (every request a random tree of T
nodes, N cached rows), ``plan`` once, warm-up, then ``--reps`` timed ``run`` calls with CUDA
events, rotating over ``--sets`` input sets so that no call finds the previous call's KV in L2.
Effective TFLOP/s counts 2·T·H·(N+T)·1088 per request (limits §3; dense over the tree block) and
is compared with the H200's 67 TFLOP/s FP32 peak (target: >= 30 %, about 20 TFLOP/s, at H = 64,
T = 33, N = 32k, bs 8).

    ddtree-numba bench verify-attention                      # default sweep
    ddtree-numba bench verify-attention --shape 8,33,32768 --tile h32 --out data/bench/h200.h5

Not a test: run it on the GPU machine; prints a table, ``--out`` appends an xarray Dataset
(dims case, values latency_us median/min/max, tflops, pct_fp32_peak) to an HDF5 file.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from numba import cuda

from ddtree_numba.bench.common import write_run
from ddtree_numba.kernels import verify_attention as va

H200_FP32_PEAK = 67e12
HEADS = 64
SCALE = 0.14467962580268923   # Kimi K2, YaRN factor 64 (limits §2)
DEFAULT_SHAPES = ((8, 33, 32768), (1, 33, 32768), (1, 9, 4096), (64, 9, 4096), (8, 65, 32768))
TILES = {
    "default": va.KIMI_K2_CONFIG,                  # 64 heads per tile, 256 threads
    "h32": va.default_config(512, 64, 32),         # 32 heads per tile (KV read twice per node)
}


def _tree_visibility(rng: np.random.Generator, bs: int, t: int) -> np.ndarray:
    """Packed uint32 [bs, T, W] ancestor-or-self rows of random trees (parents[i] < i)."""
    vis = np.zeros((bs, t, t), bool)
    for b in range(bs):
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
        for i in range(t):
            vis[b, i] = vis[b, parents[i]] if i else vis[b, i]
            vis[b, i, i] = True
    words = -(-t // 32)
    packed = np.zeros((bs, t, words), np.uint32)
    for j in range(t):
        packed[:, :, j // 32] |= vis[:, :, j].astype(np.uint32) << np.uint32(j % 32)
    return packed


def _input_set(rng: np.random.Generator, bs: int, t: int, n: int) -> dict:
    """Device arrays for one call: N cached rows then T tree rows per request."""
    s = n + t
    host = dict(
        q_latent=rng.standard_normal((bs, t, HEADS, 512), np.float32),
        q_rope=rng.standard_normal((bs, t, HEADS, 64), np.float32),
        kv_latent=rng.standard_normal((bs, s, 512), np.float32),
        k_rope=rng.standard_normal((bs, s, 64), np.float32),
        past_lens=np.full(bs, n, np.int32),
        tree_sizes=np.full(bs, t, np.int32),
        visibility=_tree_visibility(rng, bs, t),
    )
    return {k: cuda.to_device(v) for k, v in host.items()}


def bench_case(bs: int, t: int, n: int, tile: str, split: int, reps: int, warmup: int,
               sets: int, seed: int) -> dict:
    """Median/min/max latency (µs) of one run() call, and effective TFLOP/s."""
    rng = np.random.default_rng(seed)
    p = va.plan(bs, t, HEADS, n + t, split_size=split, config=TILES[tile])
    inputs = [_input_set(rng, bs, t, n) for _ in range(sets)]
    out = cuda.device_array((bs, t, HEADS, 512), np.float32)
    lse = cuda.device_array((bs, t, HEADS), np.float32)
    workspace = p.allocate_workspace()
    stream = cuda.stream()

    def call(i: int) -> None:
        x = inputs[i % sets]
        va.run(p, x["q_latent"], x["q_rope"], x["kv_latent"], x["k_rope"], x["past_lens"],
               x["tree_sizes"], x["visibility"], SCALE, out, lse, workspace, stream)

    for i in range(warmup):
        call(i)
    stream.synchronize()
    times = []
    for i in range(reps):
        start, end = cuda.event(timing=True), cuda.event(timing=True)
        start.record(stream)
        call(i)
        end.record(stream)
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end) * 1e3)
    flops = 2.0 * t * HEADS * (n + t) * 1088 * bs
    med = float(np.median(times))
    return dict(batch=bs, tree=t, past=n, tile=tile, split=split, median_us=med,
                min_us=float(np.min(times)), max_us=float(np.max(times)),
                tflops=flops / (med * 1e-6) / 1e12,
                pct_fp32_peak=100.0 * flops / (med * 1e-6) / H200_FP32_PEAK,
                finite=bool(np.isfinite(out.copy_to_host()).all()))


def _write(rows: list[dict], path: Path, args: argparse.Namespace) -> None:
    """Append the results as one group /runs/<timestamp>_<sha> (write to a temp file, then rename)."""
    import xarray as xr

    ds = xr.Dataset(
        {key: ("case", np.array([r[key] for r in rows])) for key in
         ("batch", "tree", "past", "split", "median_us", "min_us", "max_us", "tflops",
          "pct_fp32_peak")} | {"tile": ("case", np.array([r["tile"] for r in rows]))},
        attrs=dict(benchmark="verify_attention", config=json.dumps(vars(args), default=str)),
    )
    group = write_run(path, ds)
    print(f"wrote {path}:{group}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="bs,T,N (repeatable; default sweep)")
    parser.add_argument("--tile", choices=sorted(TILES), action="append",
                        help="tile config (repeatable; default: default)")
    parser.add_argument("--split", type=int, default=va.DEFAULT_SPLIT_SIZE)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sets", type=int, default=2, help="input sets rotated between calls")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="HDF5 file to append the results to")
    args = parser.parse_args(argv)
    if args.reps < 20:
        parser.error("--reps must be >= 20")
    shapes = ([tuple(int(v) for v in s.split(",")) for s in args.shape] if args.shape
              else DEFAULT_SHAPES)
    rows = []
    print(f"{'bs':>3} {'T':>4} {'N':>7} {'tile':>8} {'median us':>11} {'min':>9} {'max':>9} "
          f"{'TFLOP/s':>8} {'% FP32':>7}")
    for tile in args.tile or ["default"]:
        for bs, t, n in shapes:
            t0 = time.perf_counter()
            r = bench_case(bs, t, n, tile, args.split, args.reps, args.warmup, args.sets,
                           args.seed)
            rows.append(r)
            print(f"{bs:>3} {t:>4} {n:>7} {tile:>8} {r['median_us']:>11.1f} {r['min_us']:>9.1f} "
                  f"{r['max_us']:>9.1f} {r['tflops']:>8.2f} {r['pct_fp32_peak']:>6.1f}%"
                  f"{'' if r['finite'] else '  NON-FINITE OUTPUT'}  ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    if args.out:
        _write(rows, args.out, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
