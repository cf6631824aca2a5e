"""Sweeps: each kernel over the issue's grid, one xarray Dataset per sweep, one HDF5 group each.

    ddtree-numba bench sweep --kernel all --out data/bench/sweeps-h200.h5      # every kernel sweep
    ddtree-numba bench sweep --kernel topk --quick --out /tmp/sweeps.h5        # a smaller grid
    ddtree-numba bench sweep --kernel e2e --out data/bench/sweeps-h200.h5      # AR vs DDTree, `small`

Grids (``--quick`` for smaller ones; ``--batch/--budget/...`` override a dimension):
batch (1, 8, 64), budget B (8 ... 1024), block (8, 16: L = block - 1 drafted positions per
request), cached length N (1k ... 128k, verify attention), drafter-logit dtype (fp32, bf16, top-k).
Every sweep is timed with the benchmark modules' own timers (CUDA events, warm-up, >= 20 reps,
inputs rotated) and carries, per case, the bytes and FLOPs it must move and do, the roofline
bound of the active ``sim.profiles`` device profile and the fraction of it reached, and its
peers measured in the same run on the same machine:

- topk: NumPy log-softmax top-k on the host (one request timed, x batch) and, when PyTorch
  imports, torch.topk + torch.logsumexp on the GPU;
- tree_build: the CPU path of the official code (device -> host copy of the logits, NumPy top-k,
  the reference's heapq build, per request) against GPU top-k + GPU tree build;
- verify_attention: PyTorch eager absorbed MLA with an additive mask (fp32, bf16; time) and the
  float64 reference (error, where cheap);
- accept_compact: none (the bound only).

Groups are ``sweep_<kernel>/<UTC timestamp>_<git sha>`` with provenance (bench/common.py
write_run); ``ddtree-numba plot`` turns them into figures. The default grids take about a minute
each on an H200.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ddtree_numba.bench import roofline as rf
from sim.profiles import DeviceProfile, active_profile

VOCAB = 163840  # Kimi K2
POW2_BUDGETS = (8, 16, 32, 64, 128, 256, 512, 1024)
KERNELS = ("topk", "tree_build", "verify_attention", "accept_compact")
CHOICES = KERNELS + ("e2e", "all")
DTYPES = ("fp32", "bf16")
VERIFY_PREDICTED_FRACTION = 0.3  # verify cases are predicted at 30 % of the FP32 peak (measured: 29-34 %)
ACCEPT_STEPS = ("accept_walk", "compact_61x576_one_buffer", "compact_61_layer_buffers", "walk+compact",
                "posterior_parts_merge", "parts_merge+walk+compact", "parts_walk", "parts_walk+compact",
                "posterior_argmax", "argmax+walk+compact", "posterior_sample_T1")


def check_positive_ints(grid: Any, names: Sequence[str]) -> None:
    """Each field ``names`` of ``grid`` a non-empty tuple of positive ints (ValueError naming it)."""
    for name in names:
        values = getattr(grid, name)
        if not values or any(not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"{name} must be a non-empty tuple of positive ints, got {values!r}")


@dataclass(frozen=True)
class Grid:
    """One sweep's grid and repetition counts (dimensions a kernel does not use are ignored)."""

    batch: tuple[int, ...] = (1, 8, 64)
    budget: tuple[int, ...] = POW2_BUDGETS
    block: tuple[int, ...] = (8, 16)
    n_cached: tuple[int, ...] = (1024, 4096, 16384, 65536, 131072)
    dtype: tuple[str, ...] = DTYPES
    reps: int = 30
    warmup: int = 3
    cpu_requests: int = 4  # distinct requests the host paths time (the batch time is batch x their mean)
    cpu_reps: int = 3
    max_call_ms: float = 60.0  # verify attention: cases predicted slower than this per call are skipped

    def __post_init__(self) -> None:
        check_positive_ints(self, ("batch", "budget", "block", "n_cached"))
        if min(self.block) < 2:
            raise ValueError(f"block must be >= 2 (L = block - 1 drafted positions), got {self.block}")
        if max(self.budget) > 1024:
            raise ValueError(f"budget must be <= 1024 (MAX_NODES - 1), got {max(self.budget)}")
        if not self.dtype or set(self.dtype) - set(DTYPES):
            raise ValueError(f"dtype must be a non-empty subset of {DTYPES}, got {self.dtype!r}")
        if self.reps < 20:
            raise ValueError(f"reps must be >= 20, got {self.reps}")
        if self.warmup < 1 or self.cpu_requests < 1 or self.cpu_reps < 1:
            raise ValueError("warmup, cpu_requests and cpu_reps must be >= 1")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


GRIDS: dict[str, dict[str, Grid]] = {
    "topk": {"default": Grid(),
             "quick": Grid(batch=(1, 64), budget=(8, 32, 256, 1024), block=(16,), reps=20)},
    "tree_build": {"default": Grid(),
                   "quick": Grid(batch=(1, 64), budget=(8, 32, 128, 512, 1024), block=(16,), reps=20,
                                 cpu_requests=2, cpu_reps=2)},
    "verify_attention": {"default": Grid(budget=(8, 32, 128, 512, 1024), reps=20),
                         "quick": Grid(batch=(1, 8), budget=(8, 32, 128), n_cached=(1024, 8192, 32768),
                                       reps=20)},
    "accept_compact": {"default": Grid(budget=(8, 32, 128, 512, 1024)),
                       "quick": Grid(batch=(1, 64), budget=(32, 512), reps=20)},
}


@dataclass(frozen=True)
class Backend:
    """Where the numbers come from (GPU and host timers by default; tests pass fakes).

    All times in microseconds, one entry per repetition.
    - ``topk(rows, dtype, budgets, grid)`` -> {budget: {"gpu": [...], "torch": [...] or []}}
    - ``numpy_topk(horizon, dtype, budgets, grid)`` -> {budget: [per-request us, ...]}
    - ``tree_build(batch, horizon, budgets, grid)`` -> {budget: {"graph": [...], "launch": [...]}}
    - ``cpu_copy(rows, grid)`` -> [...] (device -> host copy of float32 [rows, V] logits)
    - ``cpu_requests(horizon, budgets, grid)`` -> {budget: ([top-k us per request], [heap us per request])}
    - ``verify(batch, tree, n_cached, grid)`` -> {"gpu", "torch_fp32", "torch_bf16": [...],
      "out_err", "lse_err": float}
    - ``accept_compact(batch, budget, grid)`` -> {step: ([...], bytes moved)}
    """

    topk: Callable
    numpy_topk: Callable
    tree_build: Callable
    cpu_copy: Callable
    cpu_requests: Callable
    verify: Callable
    accept_compact: Callable
    profile: DeviceProfile = field(default_factory=active_profile)


# --- the GPU and host timers (the benchmark modules' own functions) ---------------------------------

def _gpu_topk(rows: int, dtype: str, budgets: Sequence[int], grid: Grid) -> dict:
    from numba import cuda

    from ddtree_numba.bench import topk as bt
    from ddtree_numba.bench.verify_attention import torch_available
    from ddtree_numba.kernels.topk import plan_topk, run_topk

    stream = cuda.stream()
    sets, _ = bt.make_inputs(rows, {"fp32": "f32", "bf16": "bf16"}[dtype], np.random.default_rng(rows), stream)
    peer = torch_available()
    out = {}
    for budget in budgets:
        plan = plan_topk(rows, VOCAB, min(budget, VOCAB), np.uint16 if dtype == "bf16" else np.float32)
        values = cuda.device_array((rows, plan.k_out), np.float32, stream=stream)
        ids = cuda.device_array((rows, plan.k_out), np.int32, stream=stream)
        run_topk(plan, sets[0], values, ids, stream, check=True)  # once with the non-finite check

        def call(rep: int, plan=plan, values=values, ids=ids) -> None:
            run_topk(plan, sets[rep % len(sets)], values, ids, stream, check=False)

        gpu = bt.queue_ahead_times(call, stream, grid.reps, grid.warmup)
        torch_us: list[float] = []
        if peer:
            try:
                torch_us = bt.torch_times(sets, {"fp32": "f32", "bf16": "bf16"}[dtype], plan.k_out,
                                          grid.reps, grid.warmup)
            except Exception as exc:  # the peer is optional: report and go on
                print(f"torch top-k peer failed: {type(exc).__name__}: {exc}", flush=True)
        out[budget] = {"gpu": gpu, "torch": torch_us}
    return out


def _host_logits(horizon: int, dtype: str, n: int, seed: int) -> list[np.ndarray]:
    """``n`` requests' [L, V] drafter logits: float32, or bf16 bit patterns for "bf16"."""
    from ddtree_numba.bench.cpu_tree import SCALES, drafter_logits
    from reference.topk import float32_to_bf16

    rng = np.random.default_rng(seed)
    pool = [drafter_logits(rng, horizon, SCALES[i % len(SCALES)], VOCAB) for i in range(n)]
    return [float32_to_bf16(x) for x in pool] if dtype == "bf16" else pool


def _numpy_topk(horizon: int, dtype: str, budgets: Sequence[int], grid: Grid) -> dict:
    from ddtree_numba.bench.cpu_tree import numpy_topk_log_probs
    from reference.topk import bf16_to_float32

    (logits,) = _host_logits(horizon, dtype, 1, horizon)
    out = {}
    for budget in budgets:
        times = []
        for _ in range(grid.cpu_reps):
            t0 = time.perf_counter()
            numpy_topk_log_probs(bf16_to_float32(logits) if dtype == "bf16" else logits, min(budget, VOCAB))
            times.append(1e6 * (time.perf_counter() - t0))
        out[budget] = [float(np.median(times))]
    return out


_GRAPH_TIMERS: dict[str, Callable] = {}  # graph timers that have not failed in this process


def _gpu_tree_build(batch: int, horizon: int, budgets: Sequence[int], grid: Grid) -> dict:
    from ddtree_numba.bench import tree_build as btb
    from ddtree_numba.kernels import tree_build as tb

    if not _GRAPH_TIMERS:
        _GRAPH_TIMERS.update(btb.GRAPH_TIMERS)
    rng = np.random.default_rng(1000 * batch + horizon)
    pool = btb.top_k_pool(rng, 2 * batch * horizon, min(max(budgets), VOCAB), [1.0, 2.0, 3.0, 4.0])
    out = {}
    for budget in budgets:
        k = min(budget, VOCAB)
        plan = tb.plan(batch, horizon, k, budget + 1)
        buffers = tb.allocate_outputs(plan)
        sets = btb.device_input_sets(pool, 4, batch, horizon, k, budget, rng)
        launch = btb.time_launches(plan, sets, buffers, grid.reps, grid.warmup)
        btb.check_sizes(buffers, batch, budget)
        graph: list[float] = []
        while not graph and _GRAPH_TIMERS:
            name, timer = next(iter(_GRAPH_TIMERS.items()))
            try:
                graph = timer(plan, sets, buffers, grid.reps, 8)
            except Exception as exc:  # capture through cuda.core is unverified (stack §9)
                print(f"graph timing via {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                del _GRAPH_TIMERS[name]
        out[budget] = {"graph": graph, "launch": launch}
    return out


def _cpu_copy(rows: int, grid: Grid) -> list[float]:
    from ddtree_numba.bench.cpu_tree import copy_times

    return copy_times(rows, VOCAB, grid.cpu_reps)


def _cpu_requests(horizon: int, budgets: Sequence[int], grid: Grid) -> dict:
    from ddtree_numba.bench.cpu_tree import request_times, time_request

    pool = _host_logits(horizon, "fp32", grid.cpu_requests, 7 * horizon)
    time_request(pool[0], max(budgets))  # warm-up (allocator, caches)
    return {budget: request_times(pool, budget, grid.cpu_reps) for budget in budgets}


def _gpu_verify(batch: int, tree: int, n_cached: int, grid: Grid) -> dict:
    from ddtree_numba.bench import verify_attention as bva

    return bva.measure(batch, tree, n_cached, reps=grid.reps, warmup=grid.warmup, peers=True, check=True)


def _gpu_accept_compact(batch: int, budget: int, grid: Grid) -> dict:
    from numba import cuda

    from ddtree_numba.bench import accept_compact as bac

    args = argparse.Namespace(vocab=VOCAB, reps=grid.reps, warmup=grid.warmup, max_logits_gb=30.0,
                              no_sample=False)
    return {t.name: (t.times_us, t.bytes_moved) for t in bac.run_case(batch, budget, args, cuda.stream())}


def gpu_backend() -> Backend:
    """The real timers: needs a CUDA GPU."""
    return Backend(topk=_gpu_topk, numpy_topk=_numpy_topk, tree_build=_gpu_tree_build, cpu_copy=_cpu_copy,
                   cpu_requests=_cpu_requests, verify=_gpu_verify, accept_compact=_gpu_accept_compact)


# --- Dataset builders ---------------------------------------------------------------------------------

def _var(dims: tuple[str, ...], data: Any, units: str, long_name: str) -> tuple:
    return dims, np.asarray(data), {"units": units, "long_name": long_name}


def _put(times: np.ndarray, index: tuple, values: Sequence[float]) -> None:
    """times[index, :len(values)] = values (the rep axis is last; missing reps stay NaN)."""
    values = list(values)[:times.shape[-1]]
    times[index + (slice(0, len(values)),)] = values


def _stats(times: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NaN-aware median / min / max over the last (rep) axis; all-NaN -> NaN."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(times, -1), np.nanmin(times, -1), np.nanmax(times, -1)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(a, np.float64) / np.asarray(b, np.float64)


def _timing_vars(dims: tuple[str, ...], times: np.ndarray, what: str) -> dict:
    median, low, high = _stats(times)
    return {
        "median_us": _var(dims, median, "us", f"median GPU time of {what}"),
        "min_us": _var(dims, low, "us", f"minimum GPU time of {what}"),
        "max_us": _var(dims, high, "us", f"maximum GPU time of {what}"),
        "times_us": _var(dims + ("rep",), times, "us", f"GPU time of {what} per repetition"),
    }


def _bound_vars(dims: tuple[str, ...], profile: DeviceProfile, nbytes: np.ndarray, flops: np.ndarray,
                median: np.ndarray) -> dict:
    b = rf.bound_arrays(profile, nbytes, flops, median)
    return {
        "bytes": _var(dims, nbytes, "B", "DRAM bytes the kernel must move (inputs read, outputs written once)"),
        "flops": _var(dims, flops, "FLOP", "floating-point operations the kernel must do"),
        "memory_bound_us": _var(dims, b["memory_bound_us"], "us", "bytes at the profile's bandwidth"),
        "compute_bound_us": _var(dims, b["compute_bound_us"], "us", "FLOPs at the profile's FP32 peak"),
        "bound_us": _var(dims, b["bound_us"], "us", "roofline bound: max(memory, compute)"),
        "fraction_of_bound": _var(dims, b["fraction_of_bound"], "1", "bound / median (1 = at the roof)"),
    }


def _attrs(kernel: str, grid: Grid, profile: DeviceProfile, timing: str) -> dict:
    bandwidth, peak = rf.ceilings(profile)
    return {"benchmark": f"sweep_{kernel}", "grid": grid.to_json(), "profile": profile.name,
            "bandwidth_Bps": bandwidth, "fp32_peak_flops": peak, "vocab": VOCAB, "timing": timing}


QUEUE_AHEAD = "CUDA events, queue-ahead behind a sleeper kernel (GPU time, no launch gaps)"


def sweep_topk(grid: Grid, backend: Backend) -> Any:
    """Fused top-k over batch x block x budget (k = min(B, V)) x dtype, with its NumPy and torch peers."""
    import xarray as xr

    dims = ("batch", "block", "budget", "dtype")
    shape = tuple(len(getattr(grid, d)) for d in dims)
    gpu = np.full(shape + (grid.reps,), np.nan)
    torch_t = np.full(shape + (grid.reps,), np.nan)
    numpy_req = np.full(shape[1:], np.nan)  # per request: [block, budget, dtype]
    nbytes, flops = np.zeros(shape), np.zeros(shape)
    for bi, batch in enumerate(grid.batch):
        for li, block in enumerate(grid.block):
            rows = batch * (block - 1)
            for di, dtype in enumerate(grid.dtype):
                res = backend.topk(rows, dtype, grid.budget, grid)
                for ki, budget in enumerate(grid.budget):
                    _put(gpu, (bi, li, ki, di), res[budget]["gpu"])
                    _put(torch_t, (bi, li, ki, di), res[budget]["torch"])
                    nbytes[bi, li, ki, di], flops[bi, li, ki, di] = rf.topk_cost(rows, VOCAB, budget, dtype)
    for li, block in enumerate(grid.block):
        for di, dtype in enumerate(grid.dtype):
            res = backend.numpy_topk(block - 1, dtype, grid.budget, grid)
            for ki, budget in enumerate(grid.budget):
                numpy_req[li, ki, di] = float(np.median(res[budget]))
    data = _timing_vars(dims, gpu, "one top-k call (whole batch)")
    median = data["median_us"][1]
    data |= _bound_vars(dims, backend.profile, nbytes, flops, median)
    torch_median = _stats(torch_t)[0]
    numpy_us = np.asarray(grid.batch, np.float64)[:, None, None, None] * numpy_req[None]
    data |= {
        "torch_median_us": _var(dims, torch_median, "us", "torch.topk + torch.logsumexp, float32-upcast (GPU)"),
        "speedup_vs_torch": _var(dims, _ratio(torch_median, median), "1", "torch median / median"),
        "numpy_us": _var(dims, numpy_us, "us",
                         "NumPy log-softmax top-k on the host: one request's median x batch"),
        "speedup_vs_numpy": _var(dims, _ratio(numpy_us, median), "1", "NumPy time / median"),
    }
    batch, block = np.meshgrid(grid.batch, grid.block, indexing="ij")
    coords = {"batch": list(grid.batch), "block": list(grid.block), "budget": list(grid.budget),
              "dtype": list(grid.dtype), "rep": np.arange(grid.reps),
              "k": ("budget", [min(b, VOCAB) for b in grid.budget]),
              "horizon": ("block", [b - 1 for b in grid.block]),
              "rows": (("batch", "block"), batch * (block - 1))}
    return xr.Dataset(data, coords=coords, attrs=_attrs("topk", grid, backend.profile, QUEUE_AHEAD))


def sweep_tree_build(grid: Grid, backend: Backend, topk: Any | None = None) -> Any:
    """GPU tree build over batch x block x budget against the CPU path of the official code.

    ``topk``: a :func:`sweep_topk` Dataset of the same run with fp32 rows; its medians give the GPU
    path's top-k time (NaN where it has no such case).
    """
    import xarray as xr

    dims = ("batch", "block", "budget")
    shape = tuple(len(getattr(grid, d)) for d in dims)
    graph = np.full(shape + (grid.reps,), np.nan)
    launch = np.full(shape + (grid.reps,), np.nan)
    copy_us = np.full(shape[:2], np.nan)
    req_topk = np.full(shape[1:], np.nan)  # mean per request: [block, budget]
    req_heap = np.full(shape[1:], np.nan)
    nbytes, flops = np.zeros(shape), np.zeros(shape)
    for bi, batch in enumerate(grid.batch):
        for li, block in enumerate(grid.block):
            res = backend.tree_build(batch, block - 1, grid.budget, grid)
            copy_us[bi, li] = float(np.median(backend.cpu_copy(batch * (block - 1), grid)))
            for ki, budget in enumerate(grid.budget):
                _put(graph, (bi, li, ki), res[budget]["graph"])
                _put(launch, (bi, li, ki), res[budget]["launch"])
                nbytes[bi, li, ki], flops[bi, li, ki] = rf.tree_build_cost(batch, block - 1, min(budget, VOCAB),
                                                                           budget)
    for li, block in enumerate(grid.block):
        res = backend.cpu_requests(block - 1, grid.budget, grid)
        for ki, budget in enumerate(grid.budget):
            topk_us, heap_us = res[budget]
            req_topk[li, ki], req_heap[li, ki] = float(np.mean(topk_us)), float(np.mean(heap_us))
    data = _timing_vars(dims, graph, "one tree build (whole batch, CUDA-graph replay)")
    median = data["median_us"][1]
    data |= _bound_vars(dims, backend.profile, nbytes, flops, median)
    batch = np.asarray(grid.batch, np.float64)[:, None, None]
    cpu_topk, cpu_heap = batch * req_topk[None], batch * req_heap[None]
    cpu_path = copy_us[:, :, None] + cpu_topk + cpu_heap
    gpu_topk = _topk_medians(topk, grid)
    gpu_path = gpu_topk + median
    data |= {
        "launch_median_us": _var(dims, _stats(launch)[0], "us",
                                 "median of one eager launch from Python (CUDA events around it)"),
        "cpu_copy_us": _var(dims[:2], copy_us, "us", "device -> host copy of float32 [bs x L, V] drafter logits"),
        "cpu_topk_us": _var(dims, cpu_topk, "us", "NumPy log-softmax top-k, one request after another (batch x mean)"),
        "cpu_heap_us": _var(dims, cpu_heap, "us", "reference heapq build (the official loop), batch x mean"),
        "cpu_path_us": _var(dims, cpu_path, "us", "CPU path: copy + top-k + heap build"),
        "gpu_topk_us": _var(dims, gpu_topk, "us", "GPU fused top-k, fp32 logits (sweep_topk of the same run)"),
        "gpu_path_us": _var(dims, gpu_path, "us", "GPU path: fused top-k + tree build"),
        "speedup_build": _var(dims, _ratio(cpu_heap, median), "1", "CPU heap build / GPU tree build"),
        "speedup_path": _var(dims, _ratio(cpu_path, gpu_path), "1", "CPU path / GPU path"),
    }
    coords = {"batch": list(grid.batch), "block": list(grid.block), "budget": list(grid.budget),
              "rep": np.arange(grid.reps), "k": ("budget", [min(b, VOCAB) for b in grid.budget]),
              "horizon": ("block", [b - 1 for b in grid.block])}
    attrs = _attrs("tree_build", grid, backend.profile,
                   "GPU: CUDA events around a replayed CUDA graph of 8 builds, divided by 8; host: "
                   f"time.perf_counter, {grid.cpu_requests} distinct requests timed {grid.cpu_reps} times "
                   "(median), a batch costs batch x their mean (requests run one after another)")
    return xr.Dataset(data, coords=coords, attrs=attrs)


def _topk_medians(topk: Any | None, grid: Grid) -> np.ndarray:
    """fp32 top-k medians [batch, block, budget] from a sweep_topk Dataset (NaN where absent)."""
    out = np.full((len(grid.batch), len(grid.block), len(grid.budget)), np.nan)
    if topk is None or "fp32" not in list(topk["dtype"].values):
        return out
    med = topk["median_us"].sel(dtype="fp32")
    for bi, batch in enumerate(grid.batch):
        for li, block in enumerate(grid.block):
            for ki, budget in enumerate(grid.budget):
                try:
                    out[bi, li, ki] = float(med.sel(batch=batch, block=block, budget=budget))
                except KeyError:
                    continue
    return out


def predicted_verify_ms(profile: DeviceProfile, batch: int, tree: int, n_cached: int) -> float:
    """Predicted ms per verify call at VERIFY_PREDICTED_FRACTION of the FP32 roofline bound."""
    nbytes, flops = rf.verify_attention_cost(batch, tree, n_cached)
    bound_us = rf.bound_arrays(profile, nbytes, flops, 1.0)["bound_us"]
    return float(bound_us) / VERIFY_PREDICTED_FRACTION / 1e3


def sweep_verify_attention(grid: Grid, backend: Backend) -> Any:
    """Verify attention over batch x budget (T = B + 1) x N, with torch peers and the reference error."""
    import xarray as xr

    dims = ("batch", "budget", "n_cached")
    shape = tuple(len(getattr(grid, d)) for d in dims)
    gpu = np.full(shape + (grid.reps,), np.nan)
    peers = {name: np.full(shape + (grid.reps,), np.nan) for name in ("torch_fp32", "torch_bf16")}
    errs = {name: np.full(shape, np.nan) for name in ("out_err", "lse_err")}
    measured = np.zeros(shape, np.int8)
    nbytes, flops = np.zeros(shape), np.zeros(shape)
    for idx in np.ndindex(*shape):
        batch, budget, n = (getattr(grid, d)[i] for d, i in zip(dims, idx))
        nbytes[idx], flops[idx] = rf.verify_attention_cost(batch, budget + 1, n)
        if predicted_verify_ms(backend.profile, batch, budget + 1, n) > grid.max_call_ms:
            continue
        res = backend.verify(batch, budget + 1, n, grid)
        measured[idx] = 1
        _put(gpu, idx, res["gpu"])
        for name, arr in peers.items():
            _put(arr, idx, res[name])
        for name, arr in errs.items():
            arr[idx] = res[name]
    data = _timing_vars(dims, gpu, "one verify-attention call (whole batch)")
    median = data["median_us"][1]
    data |= _bound_vars(dims, backend.profile, nbytes, flops, median)
    data |= {
        "measured": _var(dims, measured, "1", f"1 = timed; 0 = predicted > max_call_ms ({grid.max_call_ms} ms)"),
        "tflops": _var(dims, _ratio(flops, median) / 1e6, "TFLOP/s", "effective FP32 TFLOP/s"),
        "out_err": _var(dims, errs["out_err"], "1", "max |out - float64 reference|, request 0"),
        "lse_err": _var(dims, errs["lse_err"], "1", "max |lse - ref| / max(1, |ref|), request 0"),
    }
    for name, arr in peers.items():
        med = _stats(arr)[0]
        precision = name.split("_")[1]
        data[f"{name}_median_us"] = _var(dims, med, "us", f"PyTorch eager absorbed MLA, additive mask, {precision}")
        data[f"speedup_vs_{name}"] = _var(dims, _ratio(med, median), "1", f"{name} median / median")
    coords = {"batch": list(grid.batch), "budget": list(grid.budget), "n_cached": list(grid.n_cached),
              "rep": np.arange(grid.reps), "tree": ("budget", [b + 1 for b in grid.budget])}
    attrs = _attrs("verify_attention", grid, backend.profile,
                   "CUDA events around each call, 2 input sets rotated; H 64, latent 512 + rope 64, fp32")
    return xr.Dataset(data, coords=coords, attrs=attrs)


def sweep_accept_compact(grid: Grid, backend: Backend) -> Any:
    """Posterior, accept walk and KV compaction steps over batch x budget (bs x 61 x 576 bf16 cache)."""
    import xarray as xr

    results = {(b, B): backend.accept_compact(b, B, grid) for b in grid.batch for B in grid.budget}
    steps = [s for s in ACCEPT_STEPS if any(s in r for r in results.values())]
    steps += sorted({s for r in results.values() for s in r} - set(steps))
    dims = ("step", "batch", "budget")
    shape = (len(steps), len(grid.batch), len(grid.budget))
    times = np.full(shape + (grid.reps,), np.nan)
    nbytes = np.zeros(shape)
    for (bi, batch), (ki, budget) in ((x, y) for x in enumerate(grid.batch) for y in enumerate(grid.budget)):
        for si, step in enumerate(steps):
            if step in results[batch, budget]:
                step_times, moved = results[batch, budget][step]
                _put(times, (si, bi, ki), step_times)
                nbytes[si, bi, ki] = moved
    data = _timing_vars(dims, times, "one step (whole batch)")
    data |= _bound_vars(dims, backend.profile, nbytes, np.zeros(shape), data["median_us"][1])
    coords = {"step": steps, "batch": list(grid.batch), "budget": list(grid.budget), "rep": np.arange(grid.reps)}
    attrs = _attrs("accept_compact", grid, backend.profile, QUEUE_AHEAD) | {
        "note": "bytes 0 (accept_walk, parts_walk): latency-bound, no roofline bound; posterior steps absent "
                "(NaN) where the fp32 logits [bs, B + 1, V] exceed 30 GB"}
    return xr.Dataset(data, coords=coords, attrs=attrs)


def run_sweeps(kernels: Sequence[str], grids: dict[str, Grid], backend: Backend, out: Path | None,
               command: list[str] | None = None, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the kernel sweeps in order (top-k before the tree build that uses it); write each as a group.

    A tree-build sweep without a top-k sweep first runs an fp32-only top-k sweep on its grid (its
    times go into the tree-build Dataset only).
    Returns {kernel: Dataset}.
    """
    from ddtree_numba.bench.common import write_run

    done: dict[str, Any] = {}

    def finish(kernel: str, ds: Any) -> None:
        done[kernel] = ds
        echo(summary(ds))
        if out is not None:
            echo(f"wrote {out}:{write_run(out, ds, command=command)}")

    for kernel in KERNELS:
        if kernel not in kernels:
            continue
        t0 = time.perf_counter()
        if kernel == "tree_build" and "topk" not in done:
            # fp32 top-k times for the GPU path only: kept in the tree-build Dataset (gpu_topk_us),
            # not written as a sweep_topk group of its own (plot reads the latest sweep_topk)
            tb = grids["tree_build"]
            done["topk"] = sweep_topk(dataclasses.replace(tb, dtype=("fp32",)), backend)
        if kernel == "topk":
            finish(kernel, sweep_topk(grids[kernel], backend))
        elif kernel == "tree_build":
            finish(kernel, sweep_tree_build(grids[kernel], backend, done.get("topk")))
        elif kernel == "verify_attention":
            finish(kernel, sweep_verify_attention(grids[kernel], backend))
        else:
            finish(kernel, sweep_accept_compact(grids[kernel], backend))
        echo(f"{kernel}: {time.perf_counter() - t0:.0f} s")
    return done


SUMMARY_VARS = ("median_us", "bound_us", "fraction_of_bound", "speedup_vs_torch", "speedup_vs_numpy",
                "speedup_path", "tflops", "speedup_vs_torch_fp32", "speedup_vs_torch_bf16")


def summary(ds: Any) -> str:
    """A text table of a sweep Dataset's headline variables, one line per case."""
    names = [v for v in SUMMARY_VARS if v in ds]
    frame = ds[names].to_dataframe()
    frame = frame[[c for c in names if c in frame.columns]].dropna(how="all")
    return f"{ds.attrs['benchmark']}\n{frame.to_string(float_format=lambda x: f'{x:.4g}')}"


def comma_separated(convert: Callable[[str], Any], what: str) -> Callable[[str], tuple]:
    """An argparse type: comma-separated values, each through ``convert`` (``what`` names them in errors)."""
    def parse(text: str) -> tuple:
        try:
            values = tuple(convert(v) for v in text.split(",") if v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
        return values

    return parse


_ints = comma_separated(int, "ints")


def _dtypes(text: str) -> tuple[str, ...]:
    values = tuple(v for v in text.split(",") if v)
    if not values or set(values) - set(DTYPES):
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(DTYPES)}, got {text!r}")
    return values


OVERRIDES = ("batch", "budget", "block", "n_cached", "dtype", "reps", "cpu_requests", "cpu_reps", "max_call_ms")


def build_parser() -> argparse.ArgumentParser:
    from ddtree_numba.bench import e2e

    parser = argparse.ArgumentParser(prog="ddtree-numba bench sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=CHOICES, default="all",
                        help="which sweep ('all': the four kernel sweeps, not e2e; default all)")
    parser.add_argument("--quick", action="store_true", help="smaller grids")
    parser.add_argument("--out", type=Path, help="HDF5 file to append one group per sweep to")
    parser.add_argument("--batch", type=_ints, help="override the batch sizes (comma-separated)")
    parser.add_argument("--budget", type=_ints, help="override the budgets B")
    parser.add_argument("--block", type=_ints, help="override the block sizes (L = block - 1)")
    parser.add_argument("--n-cached", type=_ints, help="override the cached lengths N (verify attention)")
    parser.add_argument("--dtype", type=_dtypes, help="override the drafter-logit dtypes (fp32,bf16)")
    parser.add_argument("--reps", type=int, help="timed repetitions (>= 20)")
    parser.add_argument("--cpu-requests", type=int, help="requests the host paths time")
    parser.add_argument("--cpu-reps", type=int, help="repetitions of each host timing")
    parser.add_argument("--max-call-ms", type=float, help="verify attention: skip cases predicted slower")
    e2e.add_arguments(parser.add_argument_group("e2e (--kernel e2e)"))
    return parser


def grids_from_args(args: argparse.Namespace) -> dict[str, Grid]:
    """The default or quick grid of each kernel with the command line's overrides applied."""
    changes = {name: getattr(args, name) for name in OVERRIDES if getattr(args, name, None) is not None}
    size = "quick" if args.quick else "default"
    return {kernel: dataclasses.replace(g[size], **changes) for kernel, g in GRIDS.items()}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    command = ["ddtree-numba", "bench", "sweep", *argv]
    if args.out:
        import h5netcdf  # noqa: F401  (fail now, not after the run)
    if args.kernel == "e2e":
        from ddtree_numba.bench import e2e

        return e2e.main(args, command=command)
    from numba import cuda

    if cuda.config.ENABLE_CUDASIM:
        parser.error("kernel sweeps need a CUDA GPU (NUMBA_ENABLE_CUDASIM is set)")
    try:
        grids = grids_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    kernels = KERNELS if args.kernel == "all" else (args.kernel,)
    t0 = time.perf_counter()
    run_sweeps(kernels, grids, gpu_backend(), args.out, command)
    print(f"all sweeps: {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
