"""Benchmark: what one launch costs beyond its bytes on this GPU (GPU; not a test).

Why. The AR-step target asks an AR step of ``small`` to read its weights at >= 50 % of HBM
bandwidth. A step is 78 launches in one CUDA graph (43 of them read weights), and queue-ahead
timing of single launches fitted its products as t = intercept + bytes / bandwidth with an
intercept of ~7-10 us a launch (PERFORMANCE, run row products). This bench measures that law for
launches that do nothing but read, as a replayed graph runs them: if a pure streaming read of B
cold bytes costs a + B / bw in a chain of graph launches, then ``L x a + bytes / bw`` is the floor
of any forward that keeps L launches, whatever its kernels do, and the ``gemv`` variant tells how
far the engine's own product kernel sits above it in such a chain (run "floor": ~2.5 us + bytes at
~3.2 TB/s for both on the H100, an empty launch 1.1 us).

Variants, each a chain of launches captured in one CUDA graph (``bench.common
.graph_replay_times``: the GPU's time a launch, as a replayed decode step sees it), launch i
reading slice i of a pool sized past the L2 (every launch reads bytes no recent launch read):

- ``empty``: a kernel that writes one value a block over the stream kernel's grid: the chain's
  cost of a launch with no bytes (size 0).
- ``stream``: every thread sums ``--unroll`` 16-byte loads at a time (``ld.global.nc.v4``, all in
  flight before their adds), grid-stride over its slice; one wave of ``--blocks-per-sm`` blocks
  of 256 threads an SM. Its sums (of one slice a size) are checked against NumPy (float64,
  relative 1e-4).
- ``gemv``: the engine's 1-row product (``kernels.gemv``, prologue none, no residual) of one row
  with a weight [N, 2048] of the same bytes (N = size / 8 KiB), the layout the engine picks.

Printed: us a launch (median of the replays), the GB/s that makes, and per variant the fit
``a + bytes / bw`` over the sizes of at least ``FIT_MIN_BYTES`` (least squares); with
``--forward LAUNCHES,MB`` also that fit's floor for a forward of that many launches and bytes.

    python3 -m ddtree_numba.bench.stream_floor
    python3 -m ddtree_numba.bench.stream_floor --cols 128,1344,8192 --forward 78,1463 --out data/bench/h100.h5

``--out`` appends an xarray Dataset (dims ``variant`` x ``cols``) with provenance to an HDF5 file.
"""
from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
from numba import cuda, float32   # module globals: the simulator swaps the kernels' ``cuda``

from ddtree_numba.bench.common import graph_replay_times, positive_int_list, summarize, write_run

K_DIM = 2048                     # the gemv variant's weight width (small's hidden size)
COLS = (128, 256, 512, 1024, 1344, 2048, 4096, 8192, 16384, 32768)   # N of [N, 2048]: 1 MB .. 268 MB
THREADS = 256                    # the stream and empty kernels' block
UNROLL = 8                       # 16-byte loads a thread has in flight (default)
BLOCKS_PER_SM = 4                # stream blocks an SM (one wave; default)
L2_PASSES = 3                    # a graph reads at least this many L2s of bytes (cold slices)
MIN_LAUNCHES = 40                # launches a graph, at least
MAX_LAUNCHES = 400
FIT_MIN_BYTES = 4e6              # sizes the fit uses
VARIANTS = ("empty", "stream", "gemv")
CHECK_RTOL = 1e-4


@functools.cache
def get_stream_kernel(unroll: int) -> Any:
    """``kernel(buf, n_vec, out)``: thread t of the grid sums the float4s t, t + G, ... (G the
    grid's threads) of ``buf``'s first ``n_vec`` float4s, ``unroll`` loads issued before their
    adds, and writes its sum to ``out[t]``."""
    from ddtree_numba.kernels.linear import load_f32x4

    U = int(unroll)

    @cuda.jit
    def kernel(buf, n_vec, out):
        t = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        stride = cuda.gridDim.x * cuda.blockDim.x
        acc = float32(0.0)
        i = t
        while i + (U - 1) * stride < n_vec:   # whole rounds: U loads in flight
            part = float32(0.0)
            for u in range(U):
                v = load_f32x4(buf, 4 * (i + u * stride))
                part += (v[0] + v[1]) + (v[2] + v[3])
            acc += part
            i += U * stride
        while i < n_vec:                      # the last partial round
            v = load_f32x4(buf, 4 * i)
            acc += (v[0] + v[1]) + (v[2] + v[3])
            i += stride
        if t < out.shape[0]:
            out[t] = acc

    return kernel


@functools.cache
def get_empty_kernel() -> Any:
    """``kernel(out)``: thread 0 of each block writes 0 to ``out[block]``."""
    @cuda.jit
    def kernel(out):
        if cuda.threadIdx.x == 0 and cuda.blockIdx.x < out.shape[0]:
            out[cuda.blockIdx.x] = float32(0.0)

    return kernel


def stream_grid(sm_count: int, blocks_per_sm: int) -> int:
    """Blocks of the stream and empty kernels: one wave."""
    return sm_count * blocks_per_sm


def launches_for(size_bytes: int, l2_bytes: int) -> int:
    """Launches a graph holds for one size: enough to read L2_PASSES L2s, within the bounds."""
    return int(min(MAX_LAUNCHES, max(MIN_LAUNCHES, math.ceil(L2_PASSES * l2_bytes / size_bytes))))


def pool_floats(cols: list[int], l2_bytes: int) -> int:
    """The pool's floats: at least L2_PASSES L2s and two slices of the largest size (so no launch
    reads the slice the launch before it read)."""
    largest = 4 * K_DIM * max(cols)
    return int(max(L2_PASSES * l2_bytes, 2 * largest) // 4 // (4 * K_DIM) * (4 * K_DIM))


def fit_line(sizes_bytes, times_us) -> tuple[float, float]:
    """Least-squares ``t = a + bytes / bw`` over the given points: (a in us, bw in GB/s); NaN
    with fewer than two distinct sizes."""
    x = np.asarray(sizes_bytes, np.float64)
    y = np.asarray(times_us, np.float64)
    if x.size < 2 or np.unique(x).size < 2:
        return float("nan"), float("nan")
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(1e-3 / slope) if slope > 0 else float("inf")   # bytes/us -> GB/s


def bench_size(variant: str, n_cols: int, pool: Any, host_pool: np.ndarray, args: argparse.Namespace,
               sm_count: int, l2_bytes: int) -> dict:
    """One variant at one size: us a launch (median, min over the replays), its bits checked on
    one slice (the empty kernel: ``n_cols``'s launch count, no bytes)."""
    floats = K_DIM * n_cols
    size = 4 * floats if variant != "empty" else 0
    slices = pool.shape[0] // floats
    launches = launches_for(4 * floats, l2_bytes)
    blocks = stream_grid(sm_count, args.blocks_per_sm)
    checked_slice = 1 % slices                  # the slice whose result is checked against NumPy
    host_slice = host_pool[checked_slice * floats:(checked_slice + 1) * floats]
    if variant == "empty":
        kernel = get_empty_kernel()
        out = cuda.device_array(blocks, np.float32)

        def enqueue(i: int, stream: Any) -> None:
            kernel[blocks, THREADS, stream](out)
        checked = True
    elif variant == "stream":
        kernel = get_stream_kernel(args.unroll)
        out = cuda.device_array(blocks * THREADS, np.float32)
        views = [pool[s * floats:(s + 1) * floats] for s in range(slices)]
        n_vec = np.int64(floats // 4)

        def enqueue(i: int, stream: Any) -> None:
            kernel[blocks, THREADS, stream](views[i % slices], n_vec, out)
        enqueue(checked_slice, 0)
        got = float(out.copy_to_host().astype(np.float64).sum())
        want = float(host_slice.astype(np.float64).sum())
        scale = float(np.abs(host_slice).astype(np.float64).sum())
        checked = abs(got - want) <= CHECK_RTOL * scale
    else:
        from ddtree_numba.kernels.gemv import gemv

        rng = np.random.default_rng(args.seed)
        x_host = rng.standard_normal((1, K_DIM)).astype(np.float32)
        x = cuda.to_device(x_host)
        out = cuda.device_array((1, n_cols), np.float32)
        views = [pool[s * floats:(s + 1) * floats].reshape(n_cols, K_DIM) for s in range(slices)]

        def enqueue(i: int, stream: Any) -> None:
            gemv(x, views[i % slices], out, stream=stream)
        enqueue(checked_slice, 0)
        w = host_slice.reshape(n_cols, K_DIM).astype(np.float64)
        want = w @ x_host[0].astype(np.float64)
        scale = np.abs(w) @ np.abs(x_host[0].astype(np.float64))
        checked = bool(np.all(np.abs(out.copy_to_host()[0] - want) <= CHECK_RTOL * scale))
    cuda.synchronize()
    stats = summarize(graph_replay_times(enqueue, launches, args.reps))
    return dict(variant=variant, cols=n_cols, bytes=size, launches=launches, **stats,
                gbps=size / stats["median_us"] / 1e3 if size else 0.0, checked=bool(checked))


def to_dataset(results: list[dict], fits: dict[str, tuple[float, float]], args: argparse.Namespace) -> Any:
    """The results as an xarray Dataset over (variant, cols), the fits per variant."""
    import json

    import xarray as xr

    variants = [v for v in VARIANTS if any(r["variant"] == v for r in results)]
    cols = sorted({r["cols"] for r in results})
    shape = (len(variants), len(cols))
    fields = {"median_us": np.nan, "min_us": np.nan, "max_us": np.nan, "gbps": np.nan,
              "bytes": -1, "launches": -1, "checked": False}
    data = {name: np.full(shape, fill, dtype=type(fill) if not isinstance(fill, float) else np.float64)
            for name, fill in fields.items()}
    for r in results:
        at = (variants.index(r["variant"]), cols.index(r["cols"]))
        for name in fields:
            data[name][at] = r[name]
    ds = xr.Dataset({name: (("variant", "cols"), values) for name, values in data.items()},
                    coords={"variant": variants, "cols": cols})
    ds["fit_intercept_us"] = ("variant", [fits.get(v, (np.nan, np.nan))[0] for v in variants])
    ds["fit_gbps"] = ("variant", [fits.get(v, (np.nan, np.nan))[1] for v in variants])
    ds.attrs.update(benchmark="stream_floor", units="us a launch (graph replay)", k_dim=K_DIM,
                    config=json.dumps(dict(unroll=args.unroll, blocks_per_sm=args.blocks_per_sm, reps=args.reps,
                                           variants=list(args.variants), forward=args.forward)))
    return ds


def _variant_list(text: str) -> list[str]:
    values = text.split(",")
    bad = [v for v in values if v not in VARIANTS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"variants must be among {', '.join(VARIANTS)}, got {text!r}")
    return values


def _forward(text: str) -> tuple[int, float]:
    try:
        launches, mb = text.split(",")
        out = int(launches), float(mb)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LAUNCHES,MB (e.g. 78,1463), got {text!r}") from None
    if out[0] < 1 or not (out[1] > 0 and math.isfinite(out[1])):
        raise argparse.ArgumentTypeError(f"expected a positive launch count and megabytes, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cols", type=positive_int_list, default=list(COLS),
                        help=f"sizes as N of an [N, {K_DIM}] float32 weight (default: 1 MB to 268 MB)")
    parser.add_argument("--variants", type=_variant_list, default=list(VARIANTS),
                        help="comma-separated among empty, stream, gemv (default: all)")
    parser.add_argument("--unroll", type=int, default=UNROLL, help="stream: loads in flight a thread (1-16)")
    parser.add_argument("--blocks-per-sm", type=int, default=BLOCKS_PER_SM, help="stream: blocks an SM (1-8)")
    parser.add_argument("--reps", type=int, default=20, help="graph replays (>= 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--forward", type=_forward, help="LAUNCHES,MB: print the fit's floor of such a forward")
    parser.add_argument("--out", type=Path, help="HDF5 file to append the results to")
    args = parser.parse_args(argv)
    if not 1 <= args.unroll <= 16:
        parser.error("--unroll must be in 1..16")
    if not 1 <= args.blocks_per_sm <= 8:
        parser.error("--blocks-per-sm must be in 1..8")
    if args.reps < 5:
        parser.error("--reps must be >= 5")
    if cuda.config.ENABLE_CUDASIM:
        parser.error("needs a CUDA GPU (NUMBA_ENABLE_CUDASIM is set)")
    from sim.profiles import active_profile

    profile = active_profile()
    sm_count, l2_bytes = profile.sm_count, profile.l2_bytes
    rng = np.random.default_rng(args.seed)
    host_pool = rng.standard_normal(pool_floats(args.cols, l2_bytes)).astype(np.float32)
    pool = cuda.to_device(host_pool)
    print(f"pool {host_pool.nbytes / 1e6:.0f} MB, {sm_count} SMs, L2 {l2_bytes / 2**20:.0f} MiB; "
          f"stream: {args.blocks_per_sm} blocks an SM x {THREADS} threads, {args.unroll} loads in flight")
    print(f"{'variant':>7} {'N':>6} {'MB':>7} {'launches':>8} {'median us':>10} {'min':>8} {'GB/s':>7}  checked")
    results = []
    for variant in args.variants:
        for n_cols in ([args.cols[0]] if variant == "empty" else args.cols):   # empty: one size (no bytes)
            r = bench_size(variant, n_cols, pool, host_pool, args, sm_count, l2_bytes)
            print(f"{r['variant']:>7} {r['cols']:>6} {r['bytes'] / 1e6:>7.2f} {r['launches']:>8} "
                  f"{r['median_us']:>10.2f} {r['min_us']:>8.2f} {r['gbps']:>7.0f}  {'yes' if r['checked'] else 'NO'}",
                  flush=True)
            results.append(r)
    fits = {}
    for variant in ("stream", "gemv"):
        pts = [(r["bytes"], r["median_us"]) for r in results if r["variant"] == variant and r["bytes"] >= FIT_MIN_BYTES]
        if len(pts) >= 2:
            fits[variant] = fit_line(*zip(*pts))
            a, bw = fits[variant]
            line = f"fit {variant:>6}: {a:.2f} us + bytes at {bw:.0f} GB/s (sizes >= {FIT_MIN_BYTES / 1e6:.0f} MB)"
            if args.forward:
                launches, mb = args.forward
                line += f"; a forward of {launches} launches, {mb:.0f} MB: {launches * a + mb * 1e3 / bw:.1f} us"
            print(line)
    if args.out is not None:
        group = write_run(args.out, to_dataset(results, fits, args), command=sys.argv)
        print(f"wrote {args.out}:{group}")
    return 0 if all(r["checked"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
