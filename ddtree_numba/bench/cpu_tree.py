"""The CPU path of public DDTree implementations, timed on the host: the yardstick for the GPU build.

Per request, as the official code runs it (spec §1.2): log-softmax top-K over the vocabulary
(K = min(B, V)), then the Python ``heapq`` best-first build (``reference.build_tree``, which is the
official loop), one request after another. Two times are reported per (batch, budget):

- ``heap``: the heapq build alone, summed over the batch (what the GPU tree build replaces);
- ``topk+heap``: a NumPy log-softmax top-K (argpartition) over [L, V] float32 logits plus the heap build (what the
  GPU top-k + tree build replace; the official code runs its top-k on the GPU, then copies, so
  this is an upper bound on its host time).

``bench sweep --kernel tree_build`` adds the device -> host copy of the logits the host top-k needs
(:func:`copy_times`) and times each request separately (:func:`request_times`).

Inputs are drafter-like rows (Gaussian logits at a few scales, so trees vary from wide to deep).
Run it on the machine whose GPU numbers it is compared with.

    python -m ddtree_numba.bench.cpu_tree --batch 1 64 --budgets 32 512 --out cpu_tree.h5
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from reference import build_tree

VOCAB = 163840  # Kimi K2
HORIZON = 16  # L: block 16 -> 15 drafted positions in DFlash; 16 rows as in the GPU benchmarks
SCALES = (1.0, 2.0, 3.0, 4.0)  # logit scales of the rows (wide ... deep trees)


def drafter_logits(rng: np.random.Generator, n_rows: int, scale: float, vocab: int) -> np.ndarray:
    """float32 [n_rows, vocab] Gaussian logits."""
    return (rng.standard_normal((n_rows, vocab), dtype=np.float32) * np.float32(scale))


def numpy_topk_log_probs(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Fast NumPy log-softmax top-k: argpartition, then order the k by (logit desc, id asc).

    The reference's ``topk_log_probs`` sorts the whole row for clarity; this is what a host
    implementation would run. (An exact tie straddling the partition boundary may pick a
    different id than the reference: irrelevant for timing.)
    """
    x = logits.astype(np.float64)  # [L, V]
    top = np.argpartition(-x, k - 1, axis=1)[:, :k]  # [L, k], unordered
    vals = np.take_along_axis(x, top, axis=1)
    order = np.lexsort((top, -vals), axis=1)  # last key first: value desc, then id asc
    top, vals = np.take_along_axis(top, order, axis=1), np.take_along_axis(vals, order, axis=1)
    peak = x.max(axis=1, keepdims=True)
    log_z = peak + np.log(np.exp(x - peak).sum(axis=1, keepdims=True))
    return (vals - log_z).astype(np.float32), top.astype(np.int64)


def time_request(logits: np.ndarray, budget: int) -> tuple[float, float]:
    """Seconds for (top-k, heap build) of one request's [L, V] logits."""
    t0 = time.perf_counter()
    values, ids = numpy_topk_log_probs(logits, min(budget, logits.shape[1]))
    t1 = time.perf_counter()
    build_tree(values, ids, budget)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def request_times(pool: list[np.ndarray], budget: int, reps: int) -> tuple[list[float], list[float]]:
    """Per request of ``pool`` ([L, V] float32 logits each): the median over ``reps`` of its NumPy
    top-k and of its heap build, in microseconds (one request after another, as the official loop)."""
    topk_us, heap_us = [], []
    for logits in pool:
        runs = [time_request(logits, budget) for _ in range(reps)]
        topk_us.append(1e6 * float(np.median([r[0] for r in runs])))
        heap_us.append(1e6 * float(np.median([r[1] for r in runs])))
    return topk_us, heap_us


def copy_times(n_rows: int, vocab: int, reps: int) -> list[float]:
    """Microseconds to copy float32 [n_rows, vocab] drafter logits from the GPU to a fresh host
    array (what ``.cpu()`` does before a host top-k); needs a GPU."""
    from numba import cuda

    device = cuda.device_array((n_rows, vocab), np.float32)
    device.copy_to_host()  # warm-up: first-touch and driver staging buffers
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        device.copy_to_host()  # synchronous, pageable destination
        times.append(1e6 * (time.perf_counter() - t0))
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="batch sizes (default 1 64)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[32, 512], help="budgets B (default 32 512)")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each batch (median taken)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="append the results to this HDF5 file (one group per run)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    # A pool of distinct requests, reused round-robin: generating 64 x [16, 163840] rows per
    # repetition would cost more than the work being timed.
    pool = [drafter_logits(rng, HORIZON, SCALES[i % len(SCALES)], args.vocab) for i in range(8)]

    time_request(pool[0], max(args.budgets))  # warm-up (allocator, caches)
    rows = []
    print(" batch budget |  heap ms (median)  topk+heap ms | per request: heap us")
    for budget in args.budgets:
        for bs in args.batch:
            heap_runs, total_runs = [], []
            for rep in range(args.reps):
                heap = topk = 0.0
                for r in range(bs):
                    t_topk, t_heap = time_request(pool[(rep * bs + r) % len(pool)], budget)
                    heap += t_heap
                    topk += t_topk
                heap_runs.append(heap)
                total_runs.append(heap + topk)
            heap_ms, total_ms = 1e3 * np.median(heap_runs), 1e3 * np.median(total_runs)
            rows.append((bs, budget, heap_ms, total_ms))
            print(f"{bs:6d} {budget:6d} | {heap_ms:16.2f} {total_ms:13.2f} | {1e3 * heap_ms / bs:10.1f}")
    if args.out:
        import xarray as xr

        from ddtree_numba.bench.common import write_run

        ds = xr.Dataset(
            {"heap_ms": ("case", [r[2] for r in rows]), "topk_heap_ms": ("case", [r[3] for r in rows])},
            coords={"batch": ("case", [r[0] for r in rows]), "budget": ("case", [r[1] for r in rows])},
            attrs={"benchmark": "cpu_tree", "vocab": args.vocab, "horizon": HORIZON, "reps": args.reps,
                   "timing": "time.perf_counter on the host, one request after another, median of reps",
                   "units": "ms for the whole batch"},
        )
        print(f"wrote {args.out}:{write_run(args.out, ds)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
