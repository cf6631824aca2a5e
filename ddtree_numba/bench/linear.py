"""Benchmark: batch-invariant FP32 linear (kernels/linear.py) on the GPU, small-preset shapes.

For each weight shape N x K (lm_head 32768 x 2048, q_b 12288 x 768, o_proj 2048 x 8192, dense
gate|up 11264 x 2048) and each row count M (1, 4, 16 decode; 64, 256, 1056 tree verify): random
inputs (never zeros), enough rotated weight copies that together they exceed the L2 3x (so no
call finds its weights cached), then ``--reps`` timed calls.

Timing (as ddtree_numba/bench/topk.py): "queue-ahead": a sleeper kernel keeps the stream busy
while Python enqueues the call, so the CUDA events around it time the GPU work only (what a
captured CUDA graph replays). ``host_us`` is the median wall time of one eager call (argument
checks + launch, no sync): the Python cost per call outside a graph.

Bounds come from the active device profile (sim.profiles.active_profile, limits §3): bytes = W +
x + out once each (the fewest a product must move) at the profile's HBM bandwidth (``% HBM``
against the datasheet rate, the decode target: >= 70 % at M = 1), FLOPs = 2 M N K at its FP32
peak (``% FP32``; target >= 10 TFLOP/s from M = 256). ``floor`` is the larger of the two times
(measured bandwidth where the profile has it).

Checks on the first call of each M (output poisoned with NaN first): every element finite, and
row 0 bit for bit the M = 1 row 0 (batch invariance on the real build); ``--check`` also
compares rows 0 and M - 1 with float64 on the host (slow for big shapes).

Model (H200: 132 SMs at 1.98 GHz, 4 FP32 warp-FMAs per SM-clock, 128 B/clk shared/L1 per SM,
HBM 4.3 TB/s measured, L2 read ~5-7 TB/s assumed) and the prediction per change, 32768 x 2048:
  * Per warp-step (128 k) a lane issues C LDG.128 (W), MT LDS.128 (x) and 4 MT C FMAs: shared/L1
    pipe 4 (MT + C) clk vs FMA MT C clk per warp per SM quarter; W bytes per FLOP = 1 / (2 MT).
  * Run 2's 1056-row time (57.8 ms) is neither HBM (132 x 268 MB = 35 GB: 8 ms) nor FMA (2.1 ms):
    staging, one scalar load in flight per thread (64 KB per block, ~20 round trips) and two
    phases per block with one block per SM, dominated.
  1. Queue-ahead timing: M = 1 drops from 286 us (host inside) to the GPU time; host_us ~ 30-60.
  2. Host: cached plans and launch checks, no reshape / NumPy / profile query per call: the
     simulator-measured Python cost fell from ~69 to ~27 us per call (launch stubbed).
  3a. Row tiles fastest in the grid: W from HBM once (268 MB, not 35 GB); the 132 row tiles of a
     column block read it from L2.
  3b. Staging with 8 loads in flight per thread (SU positions x MT rows): a phase's staging from
     ~10 round trips to ~2 (MT 8) and o_proj M = 1 (32 KB of x per block) from 32 to 4.
  3c. One-phase tiles (M <= 4 at K 2048, q_b at any M) loop over column blocks on a grid of one
     block per SM: x staged once per SM, no 7.8-wave tail. Prediction M = 1: 70-85 us GPU (64 KB
     of W loads in flight per SM, 4 round trips per column block per warp) = 3.2-3.8 TB/s,
     67-80 % of the 4.8 TB/s spec; M = 4 about the same.
  3d. 8 x 8 register tile (C 8 at MT 8): shared/L1 pipe 64 clk = FMA 64 clk per warp-step
     (C 4: 48 vs 32, pipe-bound at <= 67 %); 245-251 registers on sm_90. Measured in run
     18774bc; it spills 128-188 B on sm_120, so only sm_90 launches it (linear.columns).
  3e. Transposed butterfly: MT C - 1 shuffles per pass instead of 5 MT C (64 partials: 63 vs
     320 shuffles + adds per 4096 FMAs at K 2048).
     Prediction M = 1056: per block (64 columns, 2 phases) ~2 x (1.5 us staging + 3-4 us FMA at
     60-80 % issue) ~ 10-12 us, 512 blocks per SM: 5-6 ms if L2 keeps up; 512 KB of W per block
     is ~5.6 TB/s of L2 reads at that rate, so 6-9 ms = 16-24 TFLOP/s (target >= 10); M = 256
     the same rate (1.5-2.3 ms); M = 16 (two 8-row tiles, 2 phases): ~100 us.

    python -m ddtree_numba.bench.linear                       # default sweep (< 90 s on an H200)
    python -m ddtree_numba.bench.linear --shape 32768,2048 --rows 1,1056 --out data/bench/h200.h5
    python -m ddtree_numba.bench.linear --shape 1344,2048 --rows 1 --prologue none --prologue rmsnorm

``--prologue`` (repeatable; default none) times each shape with the kernel's input prologue:
``rmsnorm`` (x [M, K] normed by its row's rms and a weight, as w_a and the lm_head run) or
``swiglu`` (x [M, 2K] -> silu(gate) * up, as down_proj runs). An AR step's small linears take 9-37
us for 0.5-21 us of weight bytes (PERFORMANCE "run leaf subsets"); none against rmsnorm at w_a's
shape says what the one-warp rms ahead of the weight loop costs.

Not a test: run it on the GPU machine; prints a table, ``--out`` appends an xarray Dataset (dims
case; values n, k, m, mt, median/min/max GPU latency, host_us, gbps, pct_hbm, tflops, pct_fp32,
x_floor) to an HDF5 file.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
from numba import cuda

from ddtree_numba.bench.common import write_run
from ddtree_numba.bench.topk import queue_ahead_times
from ddtree_numba.kernels import linear as lin
from ddtree_numba.kernels import linear_tc as tc
from sim.profiles import active_profile, roofline

DEFAULT_SHAPES = ((32768, 2048), (12288, 768), (2048, 8192), (11264, 2048))
DEFAULT_ROWS = (1, 4, 16, 64, 256, 1056)
ROTATION_L2_FACTOR = 3   # rotated weights together exceed L2 3x
EPS = 1e-6               # the rmsnorm prologue's epsilon (the presets')
MAX_WEIGHT_SETS = 16
HOST_CALLS = 20          # eager calls timed for host_us
IMPLS = ("cuda-core", "tensor-core", "tensor-core-ring")   # linear.linear, linear_tc.linear_tc (its ring)
KEYS = ("n", "k", "m", "mt", "median_us", "min_us", "max_us", "host_us", "gbps", "pct_hbm",
        "tflops", "pct_fp32", "x_floor")


def _host_us(call, stream) -> float:
    """Median wall time of one eager call (enqueue only), the queue drained in between."""
    times = []
    for rep in range(HOST_CALLS):
        stream.synchronize()
        t0 = time.perf_counter()
        call(rep)
        times.append(1e6 * (time.perf_counter() - t0))
    stream.synchronize()
    return statistics.median(times)


def prologue_input(x: np.ndarray, prologue: str, norm_weight: np.ndarray, eps: float = EPS) -> np.ndarray:
    """What the kernel multiplies by W.T after its prologue, in float64 (reference.model's rms_norm
    and silu): x itself, rms_norm(x) * norm_weight, or silu(x[:, :K]) * x[:, K:]."""
    from reference.model import rms_norm, silu

    x64 = np.asarray(x, np.float64)
    if prologue == "rmsnorm":
        return rms_norm(x64, np.asarray(norm_weight, np.float64), eps)
    if prologue == "swiglu":
        k_dim = x64.shape[1] // 2
        return silu(x64[:, :k_dim]) * x64[:, k_dim:]
    if prologue != "none":
        raise ValueError(f"prologue must be one of {lin.PROLOGUES}, got {prologue!r}")
    return x64


def _check_rows(got: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """Rows 0 and M - 1 against float64 within 1e-5 of |x| @ |w|.T (tests/test_kernel_linear.py);
    x: the input after the prologue (:func:`prologue_input`)."""
    for m in sorted({0, got.shape[0] - 1}):
        ref = w.astype(np.float64) @ x[m].astype(np.float64)
        bound = 1e-5 * (np.abs(w).astype(np.float64) @ np.abs(x[m]).astype(np.float64))
        err = np.abs(got[m] - ref)
        if not np.all(err <= bound):
            raise AssertionError(f"row {m}: max error {err.max():.3g} over the bound")


def bench_shape(n_cols: int, k_dim: int, rows: tuple[int, ...], args: argparse.Namespace,
                prologue: str = "none", impl: str = "cuda-core") -> list[dict]:
    """:func:`_bench_shape` with ``linear_tc.ASYNC_RING`` set for the tensor-core impls (True for
    "tensor-core-ring", False for "tensor-core") while it runs, restored after."""
    if not impl.startswith("tensor-core"):
        return _bench_shape(n_cols, k_dim, rows, args, prologue, impl)
    saved = tc.set_async_ring(impl == "tensor-core-ring")
    try:
        return _bench_shape(n_cols, k_dim, rows, args, prologue, impl)
    finally:
        tc.set_async_ring(saved)


def _bench_shape(n_cols: int, k_dim: int, rows: tuple[int, ...], args: argparse.Namespace,
                 prologue: str, impl: str) -> list[dict]:
    """GPU latency (queue-ahead), host time and checks of linear() (``impl`` "cuda-core") or
    linear_tc() ("tensor-core", its segment workspace allocated once) per M for one weight shape
    and input prologue."""
    profile = active_profile()
    rng = np.random.default_rng(args.seed)
    w_host = rng.standard_normal((n_cols, k_dim), np.float32)
    w_bytes = w_host.nbytes
    sets = int(min(MAX_WEIGHT_SETS, max(2, math.ceil(ROTATION_L2_FACTOR * profile.l2_bytes / w_bytes))))
    weights = [cuda.to_device(np.roll(w_host, 7 * s, axis=1)) for s in range(sets)]
    x_cols = 2 * k_dim if prologue == "swiglu" else k_dim
    x_host = rng.standard_normal((max(rows), x_cols), np.float32)
    x_sets = [cuda.to_device(np.roll(x_host, s, axis=1)) for s in range(2)]
    norm_host = (1.0 + 0.1 * rng.standard_normal(k_dim)).astype(np.float32)
    kwargs = {"swiglu": True} if prologue == "swiglu" else \
        {"norm_weight": cuda.to_device(norm_host), "eps": EPS} if prologue == "rmsnorm" else {}
    stream = cuda.stream()
    results, first_row = [], None
    for m_rows in rows:
        xs = [x[:m_rows] for x in x_sets]
        out = cuda.to_device(np.full((m_rows, n_cols), np.nan, np.float32))
        if impl.startswith("tensor-core"):
            shape = tc.partials_shape(m_rows, n_cols, k_dim)
            product = functools.partial(   # the workspaces allocated once, as an engine would
                tc.linear_tc, partials=cuda.device_array(shape, np.float32) if shape[0] > 1 else None,
                inv_rms=cuda.device_array(m_rows, np.float32))
            mt = tc.mtiles(m_rows)
        else:
            product, mt = lin.linear, lin.plan_linear(m_rows, n_cols, k_dim).mt
        product(xs[0], weights[0], out, stream=stream, **kwargs)
        got = out.copy_to_host(stream=stream)
        stream.synchronize()
        if not np.isfinite(got).all():
            raise AssertionError(f"N {n_cols} K {k_dim} M {m_rows}: non-finite or unwritten output")
        if first_row is None:
            first_row = got[0].copy()
        elif not np.array_equal(got[0], first_row):
            raise AssertionError(f"N {n_cols} K {k_dim} M {m_rows}: row 0 differs from M = 1's")
        if args.check:
            _check_rows(got, prologue_input(x_host[:m_rows], prologue, norm_host), w_host)

        def call(i: int) -> None:
            product(xs[i % 2], weights[i % sets], out, stream=stream, **kwargs)

        times = queue_ahead_times(call, stream, args.reps, args.warmup)
        med = statistics.median(times)
        moved = w_bytes + 4 * m_rows * (x_cols + n_cols)
        flops = 2.0 * m_rows * n_cols * k_dim
        floor = roofline(profile, moved, flops).t_floor_s * 1e6
        gbps = moved / (med * 1e-6) / 1e9
        tflops = flops / (med * 1e-6) / 1e12
        results.append(dict(
            impl=impl, prologue=prologue, n=n_cols, k=k_dim, m=m_rows, mt=mt, median_us=med,
            min_us=min(times), max_us=max(times), host_us=_host_us(call, stream), gbps=gbps,
            pct_hbm=100.0 * gbps * 1e9 / profile.hbm_bandwidth_spec,
            tflops=tflops, pct_fp32=100.0 * tflops * 1e12 / profile.fp32_peak,
            x_floor=med / floor))
    return results


def _write(rows: list[dict], path: Path, args: argparse.Namespace) -> None:
    """Append the results as one group linear/<timestamp>_<sha> (temp file, then rename)."""
    import xarray as xr

    profile = active_profile()
    ds = xr.Dataset({key: ("case", np.array([r[key] for r in rows])) for key in ("impl", "prologue", *KEYS)},
                    attrs=dict(benchmark="linear", config=json.dumps(vars(args), default=str),
                               timing="queue-ahead CUDA events (GPU only); host_us: eager call",
                               profile=profile.name,
                               hbm_bandwidth_spec=profile.hbm_bandwidth_spec,
                               fp32_peak=profile.fp32_peak))
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="rows 0 and M-1 vs float64 too")
    parser.add_argument("--prologue", action="append", choices=lin.PROLOGUES,
                        help="input prologue (repeatable; default none): rmsnorm (x [M, K]) or swiglu (x [M, 2K])")
    parser.add_argument("--impl", action="append", choices=IMPLS,
                        help="product (repeatable; default cuda-core): cuda-core = linear.linear (FP32 fma "
                             "chains), tensor-core = linear_tc.linear_tc (3xTF32 mma.sync; weights through "
                             "registers), tensor-core-ring = the same with the weights through its cp.async ring")
    parser.add_argument("--ring", type=int, metavar="SLOTS",
                        help="the async weight ring's slots a warp (linear.set_async_ring; 0: off; default: "
                             "ASYNC_RING_STAGES); recorded in the run's config")
    parser.add_argument("--out", type=Path, help="HDF5 file to append the results to")
    args = parser.parse_args(argv)
    if args.reps < 20:
        parser.error("--reps must be >= 20")
    if args.ring is not None:
        try:
            lin.set_async_ring(args.ring)
        except ValueError as err:
            parser.error(f"--ring: {err}")
    args.ring = lin.ASYNC_RING_STAGES
    shapes = [_ints(s) for s in args.shape] if args.shape else DEFAULT_SHAPES
    rows = _ints(args.rows)
    print(f"profile {active_profile().describe()}; GPU times queue-ahead (no host time inside)")
    prologues = tuple(dict.fromkeys(args.prologue or ["none"]))
    impls = tuple(dict.fromkeys(args.impl or ["cuda-core"]))
    header = (f"{'impl':>16} {'prologue':>8} {'N':>6} {'K':>5} {'M':>5} {'MT':>3} {'GPU us':>9} {'min':>8} {'max':>8} "
              f"{'host us':>8} {'GB/s':>6} {'% HBM':>6} {'TFLOP/s':>8} {'% FP32':>6} {'x floor':>7}")
    print(header)
    results = []
    for (n_cols, k_dim), prologue, impl in itertools.product(shapes, prologues, impls):
        t0 = time.perf_counter()
        for r in bench_shape(n_cols, k_dim, rows, args, prologue, impl):
            results.append(r)
            print(f"{r['impl']:>16} {r['prologue']:>8} {r['n']:>6} {r['k']:>5} {r['m']:>5} {r['mt']:>3} {r['median_us']:>9.1f} "
                  f"{r['min_us']:>8.1f} {r['max_us']:>8.1f} {r['host_us']:>8.1f} {r['gbps']:>6.0f} "
                  f"{r['pct_hbm']:>5.1f}% {r['tflops']:>8.2f} {r['pct_fp32']:>5.1f}% "
                  f"{r['x_floor']:>7.2f}", flush=True)
        print(f"   ({n_cols} x {k_dim}, {prologue}, {impl}: {time.perf_counter() - t0:.0f} s)", flush=True)
    if args.out:
        _write(results, args.out, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
