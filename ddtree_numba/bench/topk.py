"""Benchmark the fused log-softmax top-k (ddtree_numba.kernels.topk) at Kimi K2 shapes; needs a GPU.

For each rows x dtype x k: logits [rows, V = 163840] (N(0, 2.5^2), bf16-rounded for bf16),
enough rotated input copies that they do not fit in L2 together, one plan, outputs on device.

Timing: CUDA events around each ``run_topk(check=False)`` call, "queue-ahead": a sleeper kernel
keeps the stream busy while Python enqueues the call, so the events time the GPU work only (as in
a CUDA graph; ddtree_numba/bench/accept_compact.py does the same). ``host_us`` is the Python wall time of
one eager call (validation + launches) for reference. The floor is one read of the logits at the
active device profile's (measured) HBM bandwidth, sim.profiles.roofline (limits §3, §6);
``x floor`` = median / floor. Target (issue 3): bf16, rows 1024 (bs 64 x L 16), k 32: <= 1.5 x floor
(about 117 µs on the H200). ``--buffers warp,block`` times the per-warp candidate-buffer kernel and
the block-buffer one side by side (``plan_topk(warp_buffers=...)``; warp: bf16 with k' <= WARP_MAX_K).
``--torch`` adds torch.topk + torch.logsumexp on the float32-upcast logits (the official path).
``--check`` compares the first call of every config with the reference semantics.

    ddtree-numba bench topk [--rows 16,128,1024] [--k 8,32,256,1024] [--dtype bf16,f32]
                            [--buffers auto,warp,block] [--reps 30] [--torch] [--check]
                            [--out data/bench/h200.h5]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
from numba import cuda

from ddtree_numba.bench.common import write_run
from ddtree_numba.kernels.topk import VALUE_ATOL, VALUE_RTOL, WARP_MAX_K, plan_topk, run_topk
from reference.topk import bf16_to_float32, float32_to_bf16, topk_log_probs
from sim.profiles import active_profile, roofline

VOCAB = 163840  # Kimi K2
STD = 2.5  # logit scale: bf16-rounded, most adjacent top ranks tie (spec §1.2)
ROTATION_L2_FACTOR = 3  # rotated inputs together exceed L2 3x
MAX_INPUT_SETS = 32
SLEEP_NS_PER_CALL = 1000


@cuda.jit
def sleep_kernel(calls):
    """Keep the stream busy for about calls x SLEEP_NS_PER_CALL ns (one thread)."""
    for _ in range(calls):
        cuda.nanosleep(SLEEP_NS_PER_CALL)


@dataclass
class Result:
    """Per-repetition GPU times of one config, in microseconds."""

    rows: int
    dtype: str
    k: int
    buffers: str  # "warp", "block" or "seg" (segment mode): the kernel the plan chose
    n_chunks: int
    threads: int
    times_us: list[float]
    host_us: float
    torch_us: list[float]
    max_value_err: float  # NaN unless --check
    id_mismatches: int  # -1 unless --check

    @property
    def nbytes(self) -> int:
        return self.rows * VOCAB * (2 if self.dtype == "bf16" else 4)

    @property
    def floor_us(self) -> float:
        return roofline(active_profile(), self.nbytes, 0.0).t_memory_s * 1e6


def queue_ahead_times(call, stream, reps: int, warmup: int) -> list[float]:
    """GPU microseconds of ``call(rep)`` per repetition, each enqueued behind a sleeper kernel."""
    for rep in range(warmup):
        call(rep)
    stream.synchronize()
    t0 = time.perf_counter()
    call(0)
    enqueue_s = time.perf_counter() - t0
    stream.synchronize()
    sleep_calls = int(3 * enqueue_s * 1e9 / SLEEP_NS_PER_CALL) + 200
    events = []
    for rep in range(reps):
        sleep_kernel[1, 1, stream](sleep_calls)
        start, end = cuda.event(timing=True), cuda.event(timing=True)
        start.record(stream)
        call(rep)
        end.record(stream)
        events.append((start, end))
    stream.synchronize()
    return [1000.0 * cuda.event_elapsed_time(start, end) for start, end in events]


def make_inputs(rows: int, dtype: str, rng: np.random.Generator, stream) -> tuple[list, np.ndarray]:
    """Rotated device copies of one logit array (columns rolled per copy) and its float32 values."""
    x = (rng.standard_normal((rows, VOCAB), dtype=np.float32) * np.float32(STD))
    host = float32_to_bf16(x) if dtype == "bf16" else x
    rotation_bytes = ROTATION_L2_FACTOR * active_profile().l2_bytes
    n_sets = int(min(MAX_INPUT_SETS, max(2, math.ceil(rotation_bytes / host.nbytes))))
    sets = [cuda.to_device(np.roll(host, 977 * s, axis=1), stream=stream) for s in range(n_sets)]
    return sets, (bf16_to_float32(host) if dtype == "bf16" else host)


def torch_times(sets, dtype: str, k: int, reps: int, warmup: int) -> list[float]:
    """torch.topk + torch.logsumexp on float32-upcast logits, queue-ahead with torch.cuda._sleep."""
    import torch

    tensors = [torch.as_tensor(d, device="cuda") for d in sets]
    if dtype == "bf16":
        tensors = [t.view(torch.bfloat16) for t in tensors]

    def call(rep: int) -> None:
        x = tensors[rep % len(tensors)].float()
        values, ids = torch.topk(x, k, dim=-1)
        values -= torch.logsumexp(x, dim=-1, keepdim=True)

    for rep in range(warmup):
        call(rep)
    torch.cuda.synchronize()
    times = []
    for rep in range(reps):
        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU cycles: the enqueue hides behind it
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call(rep)
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return [1000.0 * s.elapsed_time(e) for s, e in times]


def run_config(rows: int, dtype: str, ks: list[int], args: argparse.Namespace, stream) -> list[Result]:
    rng = np.random.default_rng(rows)
    sets, as_float = make_inputs(rows, dtype, rng, stream)
    results = []
    modes = [(k, mode) for k in ks for mode in args.buffers
             if not (mode == "warp" and (min(k, VOCAB) > WARP_MAX_K or dtype != "bf16"))]  # warp: bf16, small k
    for k, mode in modes:
        plan = plan_topk(rows, VOCAB, k, np.uint16 if dtype == "bf16" else np.float32,
                         threads=args.threads, n_chunks=args.n_chunks, warp_buffers=_WARP_BUFFERS[mode])
        values = cuda.device_array((rows, plan.k_out), np.float32, stream=stream)
        ids = cuda.device_array((rows, plan.k_out), np.int32, stream=stream)

        def call(rep: int) -> None:
            run_topk(plan, sets[rep % len(sets)], values, ids, stream, check=False)

        err, mismatches = math.nan, -1
        if args.check:
            run_topk(plan, sets[0], values, ids, stream, check=True)
            ref_values, ref_ids = topk_log_probs(as_float, plan.k_out)
            got_values, got_ids = values.copy_to_host(stream=stream), ids.copy_to_host(stream=stream)
            stream.synchronize()
            mismatches = int(np.sum(got_ids != ref_ids))
            err = float(np.max(np.abs(got_values - ref_values)))
        times = queue_ahead_times(call, stream, args.reps, args.warmup)
        t0 = time.perf_counter()
        for rep in range(args.warmup):
            call(rep)
        host_us = 1e6 * (time.perf_counter() - t0) / max(args.warmup, 1)
        stream.synchronize()
        torch_us = []
        if args.torch:
            try:
                torch_us = torch_times(sets, dtype, plan.k_out, args.reps, args.warmup)
            except Exception as exc:  # the baseline is optional: report and go on
                print(f"torch baseline failed: {type(exc).__name__}: {exc}", flush=True)
        buffers = "warp" if plan.warp_buffers else "seg" if plan.segments else "block"
        results.append(Result(rows, dtype, plan.k_out, buffers, plan.n_chunks, plan.threads, times, host_us, torch_us, err, mismatches))
        print(format_row(results[-1]), flush=True)
    return results


HEADER = (f"{'rows':>5} {'dtype':>5} {'k':>5} {'buf':>5} {'chunks':>6} {'threads':>7} {'median us':>10} {'min':>8} {'max':>8} "
          f"{'floor us':>9} {'x floor':>8} {'GB/s':>7} {'host us':>8} {'torch us':>9} {'check':>14}")


def format_row(r: Result) -> str:
    med = statistics.median(r.times_us)
    torch_med = f"{statistics.median(r.torch_us):9.1f}" if r.torch_us else f"{'-':>9}"
    check = "-" if r.id_mismatches < 0 else f"{r.id_mismatches} ids, {r.max_value_err:.1e}"
    return (f"{r.rows:5d} {r.dtype:>5} {r.k:5d} {r.buffers:>5} {r.n_chunks:6d} {r.threads:7d} {med:10.1f} {min(r.times_us):8.1f} "
            f"{max(r.times_us):8.1f} {r.floor_us:9.1f} {med / r.floor_us:8.2f} {r.nbytes / med / 1e3:7.0f} "
            f"{r.host_us:8.1f} {torch_med} {check:>14}")


def write_dataset(path: str, results: list[Result], args: argparse.Namespace) -> None:
    """An xarray Dataset over (case,) written as HDF5 (h5netcdf), atomically (temp file, rename)."""
    import xarray as xr

    nan_reps = [math.nan] * args.reps
    ds = xr.Dataset(
        {
            "median_us": (("case",), [statistics.median(r.times_us) for r in results]),
            "min_us": (("case",), [min(r.times_us) for r in results]),
            "max_us": (("case",), [max(r.times_us) for r in results]),
            "times_us": (("case", "rep"), [r.times_us for r in results]),
            "floor_us": (("case",), [r.floor_us for r in results]),
            "host_us": (("case",), [r.host_us for r in results]),
            "torch_times_us": (("case", "rep"), [r.torch_us or nan_reps for r in results]),
            "max_value_err": (("case",), [r.max_value_err for r in results]),
            "id_mismatches": (("case",), np.array([r.id_mismatches for r in results], np.int64)),
        },
        coords={
            "rows": (("case",), np.array([r.rows for r in results], np.int64)),
            "dtype": (("case",), [r.dtype for r in results]),
            "k": (("case",), np.array([r.k for r in results], np.int64)),
            "buffers": (("case",), [r.buffers for r in results]),
            "n_chunks": (("case",), np.array([r.n_chunks for r in results], np.int64)),
            "threads": (("case",), np.array([r.threads for r in results], np.int64)),
        },
        attrs={
            "benchmark": "topk",
            "config": json.dumps({"vocab": VOCAB, "std": STD, "reps": args.reps, "warmup": args.warmup,
                                  "threads": args.threads, "n_chunks": args.n_chunks, "buffers": args.buffers,
                                  "value_atol": VALUE_ATOL, "value_rtol": VALUE_RTOL}),
            "timing": "CUDA events, queue-ahead behind a sleeper kernel (GPU time, no launch gaps)",
        },
    )
    group = write_run(path, ds)
    print(f"wrote {path}:{group}")


_WARP_BUFFERS = {"auto": None, "warp": True, "block": False}  # --buffers -> plan_topk(warp_buffers=...)


def _list(kind):
    def parse(text: str) -> list:
        values = [kind(v) for v in text.split(",") if v]
        if not values:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return values
    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=_list(int), default=[16, 128, 1024], help="rows = bs x L (default 16,128,1024)")
    parser.add_argument("--k", type=_list(int), default=[8, 32, 256, 1024], help="k (default 8,32,256,1024)")
    parser.add_argument("--dtype", type=_list(str), default=["bf16", "f32"], help="bf16 and/or f32")
    parser.add_argument("--buffers", type=_list(str), default=["auto"],
                        help="candidate buffers: auto (the plan's choice), warp and/or block (default auto)")
    parser.add_argument("--threads", type=int, default=None,
                        help="block size (plan_topk threads; default: the plan's choice, 256 or 128 for many rows)")
    parser.add_argument("--n-chunks", type=int, default=None, help="blocks per row (default: the plan's choice)")
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions (>= 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--torch", action="store_true", help="also time torch.topk + torch.logsumexp")
    parser.add_argument("--check", action="store_true", help="compare each config's output with the reference")
    parser.add_argument("--out", help="also write the results as an HDF5 xarray Dataset")
    args = parser.parse_args(argv)
    if args.reps < 20:
        parser.error("--reps must be >= 20")
    if set(args.dtype) - {"bf16", "f32"}:
        parser.error("--dtype takes bf16 and/or f32")
    if set(args.buffers) - set(_WARP_BUFFERS):
        parser.error("--buffers takes auto, warp and/or block")
    if cuda.config.ENABLE_CUDASIM:
        parser.error("needs a CUDA GPU (NUMBA_ENABLE_CUDASIM is set)")
    if args.out:
        import h5netcdf  # noqa: F401  (fail now, not after the run)
    stream = cuda.stream()
    print(HEADER, flush=True)
    results = []
    for rows in args.rows:
        for dtype in args.dtype:
            results += run_config(rows, dtype, args.k, args, stream)
    if args.out:
        write_dataset(args.out, results, args)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
