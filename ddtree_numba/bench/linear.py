"""Benchmark: batch-invariant FP32 linear (kernels/linear.py) on the GPU, small-preset shapes.

For each weight shape N x K (lm_head 32768 x 2048, q_b 12288 x 768, o_proj 2048 x 8192, dense
gate|up 11264 x 2048) and each row count M (1, 4, 16 decode; 64, 256, 1056 tree verify): random
inputs, warm-up, then ``--reps`` timed calls with CUDA events, rotating over enough weight copies
that together exceed the L2 (``--l2-mb``, 50 MB by default) so no call finds its weights cached.
Bytes = W + x + out once each (the fewest a product must move); GB/s is compared with the H200
profile's HBM bandwidth (``sim.profiles.H200``: 4.8 TB/s spec, 4.3 TB/s measured copy). Decode
target: >= 70 % of the spec bandwidth at M = 1..16. TFLOP/s (2 M N K) is printed for the
compute-bound large-M rows (FP32 peak 67 TFLOP/s).

    python -m ddtree_numba.bench.linear                       # default sweep (< 60 s)
    python -m ddtree_numba.bench.linear --shape 32768,2048 --rows 1,16 --out data/bench/h200.h5

Not a test: run it on the GPU machine; prints a table, ``--out`` appends an xarray Dataset (dims
case; values n, k, m, mt, median/min/max latency, gbps, pct_hbm, tflops) to an HDF5 file.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from numba import cuda

from ddtree_numba.bench.common import write_run
from ddtree_numba.kernels import linear as lin
from sim.profiles import H200

DEFAULT_SHAPES = ((32768, 2048), (12288, 768), (2048, 8192), (11264, 2048))
DEFAULT_ROWS = (1, 4, 16, 64, 256, 1056)


def bench_shape(n_cols: int, k_dim: int, rows: tuple[int, ...], reps: int, warmup: int,
                l2_mb: float, seed: int) -> list[dict]:
    """Median/min/max latency of linear() per M for one weight shape."""
    rng = np.random.default_rng(seed)
    w_bytes = 4 * n_cols * k_dim
    sets = max(1, int(np.ceil(l2_mb * 1e6 / w_bytes)) + 1)  # rotated copies exceed the L2
    weights = [cuda.to_device(rng.standard_normal((n_cols, k_dim), np.float32)) for _ in range(sets)]
    stream = cuda.stream()
    results = []
    for m_rows in rows:
        xs = [cuda.to_device(rng.standard_normal((m_rows, k_dim), np.float32)) for _ in range(2)]
        out = cuda.device_array((m_rows, n_cols), np.float32)

        def call(i: int) -> None:
            lin.linear(xs[i % 2], weights[i % sets], out, stream=stream)

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
        med = float(np.median(times))
        moved = w_bytes + 4 * m_rows * (k_dim + n_cols)
        gbps = moved / (med * 1e-6) / 1e9
        results.append(dict(
            n=n_cols, k=k_dim, m=m_rows, mt=lin.row_tile(m_rows), median_us=med,
            min_us=float(np.min(times)), max_us=float(np.max(times)), gbps=gbps,
            pct_hbm=100.0 * gbps * 1e9 / H200.hbm_bandwidth_spec,
            tflops=2.0 * m_rows * n_cols * k_dim / (med * 1e-6) / 1e12,
            finite=bool(np.isfinite(out.copy_to_host()).all())))
    return results


def _write(rows: list[dict], path: Path, args: argparse.Namespace) -> None:
    """Append the results as one group linear/<timestamp>_<sha> (temp file, then rename)."""
    import xarray as xr

    keys = ("n", "k", "m", "mt", "median_us", "min_us", "max_us", "gbps", "pct_hbm", "tflops")
    ds = xr.Dataset({key: ("case", np.array([r[key] for r in rows])) for key in keys},
                    attrs=dict(benchmark="linear", config=json.dumps(vars(args), default=str),
                               hbm_bandwidth_spec=H200.hbm_bandwidth_spec))
    group = write_run(path, ds)
    print(f"wrote {path}:{group}")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="N,K (repeatable; default sweep)")
    parser.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)), help="M values, comma-separated")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--l2-mb", type=float, default=50.0, help="weights rotated per shape exceed this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="HDF5 file to append the results to")
    args = parser.parse_args(argv)
    if args.reps < 50:
        parser.error("--reps must be >= 50")
    shapes = [_ints(s) for s in args.shape] if args.shape else DEFAULT_SHAPES
    rows = _ints(args.rows)
    results = []
    print(f"{'N':>6} {'K':>5} {'M':>5} {'MT':>3} {'median us':>10} {'min':>8} {'max':>8} "
          f"{'GB/s':>7} {'% HBM':>6} {'TFLOP/s':>8}")
    for n_cols, k_dim in shapes:
        t0 = time.perf_counter()
        for r in bench_shape(n_cols, k_dim, rows, args.reps, args.warmup, args.l2_mb, args.seed):
            results.append(r)
            print(f"{r['n']:>6} {r['k']:>5} {r['m']:>5} {r['mt']:>3} {r['median_us']:>10.1f} "
                  f"{r['min_us']:>8.1f} {r['max_us']:>8.1f} {r['gbps']:>7.0f} {r['pct_hbm']:>5.1f}% "
                  f"{r['tflops']:>8.2f}{'' if r['finite'] else '  NON-FINITE OUTPUT'}", flush=True)
        print(f"   ({n_cols} x {k_dim}: {time.perf_counter() - t0:.0f} s)", flush=True)
    if args.out:
        _write(results, args.out, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
