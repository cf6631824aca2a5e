"""Benchmark: the MLA absorbs (kernels/absorb.py) on the GPU at a preset's shapes, per layout.

A model's two absorbs per layer: the query absorb ``q_nope @ W_UK`` (K = qk_nope_dim, N =
kv_lora_rank) and the value absorb ``o_latent @ W_UVᵀ`` (K = kv_lora_rank, N = v_head_dim), over
n_heads heads; ``small``: 64 heads, (K 128, N 512) and (K 512, N 128), 16.8 MB of weights each.
For each row count and layout: random inputs, rotated weight copies (up to 16) that together
exceed the L2 3x where that many fit (small: 12 copies; tiny's weights stay cached), then
``--reps`` timed calls, queue-ahead
(CUDA events around GPU work only, as bench/linear.py: what a captured graph replays).

Layouts (``--layout``, repeatable): ``auto`` (plan_absorb's choice), ``split`` (the split kernel at
any row count), ``tile`` (the tile plan), ``tile:MT,CQ,RW,SL[,BPS[,P]]`` (a forced tile block: MT rows a
thread, CQ column quads, RW row groups, SL segment lanes, optionally BPS blocks an SM in the launch
bounds and P = 1 for the 2 x 2 lane squares of ``get_tile_kernel``'s ``pairs``; the grid follows). Every layout gives the
same bits (checked on the first call of each case against the split kernel, output poisoned with
NaN first), so the table is a choice of layout, not of numerics.

``floor`` is the larger of the weight stream at the profile's HBM bandwidth (measured where the
profile has it) and the FMAs at its FP32 peak; ``x floor`` the median over it; ``% HBM`` is
against the datasheet rate, as bench/linear.py. x is a contiguous [M, H, K] array (the engine
passes a view of wider rows: the same kernel, other strides).

    python -m ddtree_numba.bench.absorb --preset small --rows 1,33
    python -m ddtree_numba.bench.absorb --rows 33 --layout auto --layout tile:4,8,9,1 --out data/bench/h200.h5

Not a test: run it on the GPU machine; ``--out`` appends an xarray Dataset (dims case; values
absorb, layout, m, k, n, heads, the plan's kind / mt / lanes / col_quads / row_groups / threads /
blocks, median / min / max GPU us, % HBM, % FP32, x floor) to an HDF5 file.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import numpy as np

DEFAULT_ROWS = (1, 9, 33, 64)
ROTATION_L2_FACTOR = 3
MAX_WEIGHT_SETS = 16
KEYS = ("m", "k", "n", "heads", "mt", "lanes", "col_quads", "row_groups", "blocks_per_sm", "pairs", "threads", "blocks",
        "median_us", "min_us", "max_us", "pct_hbm", "pct_fp32", "x_floor")


def parse_layout(text: str) -> tuple[str, tuple[int, ...]]:
    """``auto`` / ``split`` / ``tile`` / ``tile:MT,CQ,RW,SL[,BPS[,P]]`` -> (name, forced tile block or ())."""
    if text in ("auto", "split", "tile"):
        return text, ()
    name, _, spec = text.partition(":")
    try:
        block = tuple(int(v) for v in spec.split(","))
    except ValueError:
        block = ()
    if name != "tile" or len(block) not in (4, 5, 6) or block[5:6] not in ((), (0,), (1,)):
        raise ValueError(f"layout must be auto, split, tile or tile:MT,CQ,RW,SL[,BPS[,P]], got {text!r}")
    return name, block


def layout_plan(layout: str, m_rows: int, heads: int, n_cols: int, k_dim: int, sm_count: int):
    """The AbsorbPlan a layout names for these shapes (ValueError: a forced block that no kernel takes)."""
    from ddtree_numba.kernels import absorb as ab

    name, block = parse_layout(layout)
    if name == "auto":
        return ab.plan_absorb(m_rows, heads, n_cols, k_dim)
    if name == "split":
        return ab._split_plan(m_rows, heads, n_cols, k_dim)
    if not block:
        return ab._tile_plan(m_rows, heads, n_cols, k_dim, sm_count)
    try:
        return ab.tile_block_plan(*block[:4], m_rows, heads, n_cols, *block[4:5], *(bool(p) for p in block[5:6]))
    except ValueError as err:
        raise ValueError(f"layout {layout!r}: {err}") from None


def bench_case(name: str, heads: int, k_dim: int, n_cols: int, m_rows: int, layouts: list[str],
               args: argparse.Namespace) -> list[dict]:
    """Queue-ahead GPU times of one absorb shape and row count, per layout."""
    from numba import cuda

    from ddtree_numba.bench.topk import queue_ahead_times
    from ddtree_numba.kernels import absorb as ab
    from sim.profiles import active_profile, roofline

    profile = active_profile()
    rng = np.random.default_rng(args.seed)
    w_host = rng.standard_normal((heads, k_dim, n_cols), np.float32)
    sets = int(min(MAX_WEIGHT_SETS, max(2, math.ceil(ROTATION_L2_FACTOR * profile.l2_bytes / w_host.nbytes))))
    weights = [cuda.to_device(np.roll(w_host, 3 * s, axis=2)) for s in range(sets)]
    xs = [cuda.to_device(rng.standard_normal((m_rows, heads, k_dim), np.float32)) for _ in range(2)]
    out = cuda.device_array((m_rows, heads, n_cols), np.float32)
    stream = cuda.stream()
    want = cuda.to_device(np.full(out.shape, np.nan, np.float32))
    ab.absorb(xs[0], weights[0], want, stream=stream, plan=ab._split_plan(m_rows, heads, n_cols, k_dim))
    want_host = want.copy_to_host(stream=stream)
    moved = w_host.nbytes + 4 * m_rows * heads * (k_dim + n_cols)
    flops = 2.0 * m_rows * heads * n_cols * k_dim
    floor_us = roofline(profile, moved, flops).t_floor_s * 1e6
    rows = []
    for layout in layouts:
        plan = layout_plan(layout, m_rows, heads, n_cols, k_dim, profile.sm_count)
        out.copy_to_device(np.full(out.shape, np.nan, np.float32), stream=stream)
        ab.absorb(xs[0], weights[0], out, stream=stream, plan=plan)
        got = out.copy_to_host(stream=stream)
        stream.synchronize()
        if not np.array_equal(got.view(np.int32), want_host.view(np.int32)):
            raise AssertionError(f"{name} M {m_rows} layout {layout}: not the split kernel's bits")

        def call(i: int, plan=plan) -> None:
            ab.absorb(xs[i % 2], weights[i % sets], out, stream=stream, plan=plan)

        times = queue_ahead_times(call, stream, args.reps, args.warmup)
        med = statistics.median(times)
        rows.append(dict(absorb=name, layout=layout, kind=plan.kind, m=m_rows, k=k_dim, n=n_cols, heads=heads,
                         mt=plan.mt, lanes=plan.lanes, col_quads=plan.col_quads, row_groups=plan.row_groups,
                         blocks_per_sm=plan.blocks_per_sm, pairs=int(plan.pairs),
                         threads=plan.threads, blocks=int(np.prod(plan.grid)), median_us=med, min_us=min(times),
                         max_us=max(times), pct_hbm=100.0 * moved / (med * 1e-6) / profile.hbm_bandwidth_spec,
                         pct_fp32=100.0 * flops / (med * 1e-6) / profile.fp32_peak, x_floor=med / floor_us))
    return rows


def _write(rows: list[dict], path: Path, args: argparse.Namespace) -> None:
    """Append the results as one group absorb/<timestamp>_<sha> (temp file, then rename)."""
    import xarray as xr

    from ddtree_numba.bench.common import write_run
    from sim.profiles import active_profile

    profile = active_profile()
    ds = xr.Dataset({key: ("case", np.array([r[key] for r in rows])) for key in ("absorb", "layout", "kind", *KEYS)},
                    attrs=dict(benchmark="absorb", config=json.dumps(vars(args), default=str),
                               timing="queue-ahead CUDA events (GPU only)", profile=profile.name,
                               hbm_bandwidth_spec=profile.hbm_bandwidth_spec, fp32_peak=profile.fp32_peak))
    print(f"wrote {path}:{write_run(path, ds)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--preset", default="small", help="model preset whose absorb shapes are timed")
    parser.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)), help="row counts, comma-separated")
    parser.add_argument("--layout", action="append",
                        help="auto, split, tile or tile:MT,CQ,RW,SL[,BPS[,P]] (repeatable; default auto)")
    parser.add_argument("--absorb", choices=("q", "value"), action="append", help="which absorb (default both)")
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="HDF5 file to append the results to")
    args = parser.parse_args(argv)
    if args.reps < 20:
        parser.error("--reps must be >= 20")
    layouts = args.layout or ["auto"]
    try:
        for layout in layouts:
            parse_layout(layout)
        rows = tuple(int(v) for v in args.rows.split(","))
    except ValueError as err:
        parser.error(str(err))
    if any(m < 1 for m in rows):
        parser.error("--rows must be positive")
    from ddtree_numba.config import ModelConfig
    from sim.profiles import active_profile

    cfg = ModelConfig.from_name(args.preset)
    shapes = {"q": (cfg.qk_nope_dim, cfg.kv_lora_rank), "value": (cfg.kv_lora_rank, cfg.v_head_dim)}
    absorbs = args.absorb or ["q", "value"]
    profile = active_profile()
    for name in absorbs:   # every layout's plan before any timing
        k_dim, n_cols = shapes[name]
        for m_rows in rows:
            for layout in layouts:
                try:
                    layout_plan(layout, m_rows, cfg.n_heads, n_cols, k_dim, profile.sm_count)
                except ValueError as err:
                    parser.error(str(err))
    print(f"profile {profile.describe()}; {args.preset}: {cfg.n_heads} heads; GPU times queue-ahead")
    print(f"{'absorb':>6} {'M':>4} {'layout':>18} {'kind':>5} {'MT':>2} {'SL':>2} {'CQ':>3} {'RW':>3} {'thr':>4} "
          f"{'blocks':>6} {'GPU us':>8} {'min':>7} {'% HBM':>6} {'% FP32':>6} {'x floor':>7}")
    results = []
    for name in absorbs:
        k_dim, n_cols = shapes[name]
        for m_rows in rows:
            for r in bench_case(name, cfg.n_heads, k_dim, n_cols, m_rows, layouts, args):
                results.append(r)
                print(f"{r['absorb']:>6} {r['m']:>4} {r['layout']:>18} {r['kind']:>5} {r['mt']:>2} {r['lanes']:>2} "
                      f"{r['col_quads']:>3} {r['row_groups']:>3} {r['threads']:>4} {r['blocks']:>6} "
                      f"{r['median_us']:>8.1f} {r['min_us']:>7.1f} {r['pct_hbm']:>5.1f}% {r['pct_fp32']:>5.1f}% "
                      f"{r['x_floor']:>7.2f}", flush=True)
    if args.out:
        _write(results, args.out, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
