"""Benchmark: launch shapes of two engine kernels at a preset's shapes (GPU), bits checked.

Not a test, and not a sweep of the kernels' numerics: every variant computes the same bits (the
grid and block size are layout), which each case checks against its first variant before its
time is kept. Each time is the median (and minimum) over ``--reps`` replays of one CUDA graph of
``GRAPH_LAUNCHES`` launches (``bench.common.graph_replay_times``: the GPU's time, as a captured
decode step sees it).

``--expert``: ``linear.expert_linear`` at the preset's routed experts (gate | up: N 2 I, K D;
down: N D, K I with the SwiGLU prologue) for ``--rows`` token rows, each row routed to
``n_activated_experts`` distinct experts drawn at random (``--seeds`` routings a row count), the
weights rotated over enough copies to pass the L2 three times, each variant's output poisoned with
NaN first (the routed experts only: the engine's launches also hold the shared expert, engine.model
.FOLD_SHARED_EXPERT). Variants: ``plan`` (what ``expert_linear`` launches: its column blocks chosen for
``linear.expert_busy_tiles``), ``loose`` (the plan's kernel on the grid of the slot bound before run
"lane squares", ceil(J / MT) + min(E, J) slots, its column blocks chosen for all of them) and grids of ``G``
warps a block (8, 4, 2) by ``Y`` column blocks on the tight slot count
(``linear.expert_slots``). What run "lane squares" (PERFORMANCE.md) took from it: the tight slot
bound; no grid beat the plan at 33 rows.

``--posterior``: ``accept.posterior_argmax`` and ``accept.posterior_sample`` (temperature 0.8)
over ``--rows`` rows of the preset's vocabulary, at 256 / 512 / 1024 threads a block (the sample
kernel up to ``accept.MAX_SAMPLE_THREADS``).

    python3 -m ddtree_numba.bench.launch_shapes --expert --posterior
    python3 -m ddtree_numba.bench.launch_shapes --expert --rows 1,33 --seeds 2 --out data/bench/h200.h5

Prints a table; ``--out`` appends an xarray Dataset (dim ``case``) with provenance to an HDF5 file.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ddtree_numba.bench.common import positive_int_list

GRAPH_LAUNCHES = 40        # launches captured in one graph
EXPERT_GROUPS = (8, 4, 2)  # warps (column groups) a block in the grid variants
L2_BYTES = 50e6            # H200's L2 (about): weight copies are rotated past 3 x this
SAMPLE_TEMPERATURE = 0.8
POSTERIOR_THREADS = (256, 512, 1024)


def routing(rows: int, experts: int, top_k: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A CSR routing of ``rows`` rows, each to ``top_k`` distinct random experts, in expert order
    (rows ascending within an expert, as ``moe_csr`` orders them): (row_offsets int32 [E + 1],
    row_index int32 [J], counts [E])."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(rows)]).reshape(-1)
    order = np.argsort(ids, kind="stable")
    counts = np.bincount(ids, minlength=experts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return offsets, (order // top_k).astype(np.int32), counts


def expert_variants(rows: int, n_cols: int, k_dim: int, entries: int, experts: int) -> list[tuple[str, tuple, int]]:
    """(name, grid, threads) of the plan, the loose slot bound and the grid variants."""
    from ddtree_numba.kernels import linear as lin

    mt = lin.row_tile(rows, k_dim, "expert")
    plan = lin._plan("expert", mt, n_cols, k_dim, True)   # as expert_linear plans it (rows = MT)
    tight = lin.expert_slots(entries, experts, mt)
    loose = -(-entries // mt) + min(experts, entries)
    out = [("plan", (tight, lin._grid_cols(plan, lin.expert_wave_tiles(entries, experts, mt)), 1), plan.threads),
           ("loose", (loose, lin._grid_cols(plan, loose), 1), plan.threads)]
    for groups in EXPERT_GROUPS:
        col_blocks = -(-(-(-n_cols // plan.columns)) // groups)
        for y in sorted({max(1, col_blocks >> s) for s in range(4)}):
            out.append((f"g{groups}y{y}", (tight, y, 1), groups * plan.k_split * 32))
    return out


def bench_expert(config: Any, rows: int, seed: int, which: str, reps: int) -> list[dict]:
    """Every expert variant of one (rows, routing, projection) case."""
    from numba import cuda

    from ddtree_numba.bench.common import graph_replay_times
    from ddtree_numba.kernels import linear as lin

    experts, top_k = config.n_routed_experts, config.n_activated_experts
    d, inter = config.hidden_size, config.moe_intermediate
    offsets, row_index, counts = routing(rows, experts, top_k, seed)
    entries = rows * top_k
    rng = np.random.default_rng(seed + 1)
    if which == "gate_up":
        n_cols, k_dim, prologue, x_rows = 2 * inter, d, "none", rows
        index = row_index
    else:
        n_cols, k_dim, prologue, x_rows = d, inter, "swiglu", entries
        index = np.arange(entries, dtype=np.int32)
    x = cuda.to_device(rng.uniform(-1, 1, (x_rows, k_dim * (2 if prologue == "swiglu" else 1))).astype(np.float32))
    copies = max(2, int(np.ceil(3 * L2_BYTES / (4.0 * experts * n_cols * k_dim))))
    weights = [cuda.to_device(rng.uniform(-0.05, 0.05, (experts, n_cols, k_dim)).astype(np.float32))
               for _ in range(copies)]
    offsets_d, index_d = cuda.to_device(offsets), cuda.to_device(index)
    tile_rows = min(rows, x_rows, entries)   # as the engine's max_rows: an expert holds at most `rows` entries
    mt = lin.row_tile(tile_rows, k_dim, "expert")
    tiles = int(np.sum(-(-counts // mt)))
    # the plan as _setup makes it for the slots the routing needs (the async ring's slots sized
    # for the plan's block: the variants launch at most its threads)
    plan = lin._launch_plan("expert", mt, n_cols, k_dim, True, lin.expert_slots(entries, experts, mt), 1, 0,
                            lin.expert_wave_tiles(entries, experts, mt))[0]
    kernel = lin.get_kernel("expert", prologue, False, mt, columns=plan.columns, pipelined=lin.ring_for(mt),
                            vector_x=lin.VECTOR_X_LOADS, vector_stage=lin.VECTOR_STAGING,
                            ring_stages=plan.ring_stages)   # as _setup
    geometry = plan.geometry(n_cols, k_dim)
    results, first = [], None
    for name, grid, threads in expert_variants(tile_rows, n_cols, k_dim, entries, experts):
        out = cuda.to_device(np.full((entries, n_cols), np.nan, np.float32))   # poisoned: unwritten rows differ

        def enqueue(i: int, stream: Any, grid: tuple = grid, threads: int = threads, out: Any = out) -> None:
            lin._configured(kernel, grid, threads, stream, plan.shared_bytes)(
                x, lin._kernel_weight(weights[i % copies]), out, offsets_d, index_d, *geometry)

        enqueue(0, 0)
        cuda.synchronize()
        times = graph_replay_times(enqueue, GRAPH_LAUNCHES, reps)
        got = out.copy_to_host()
        first = got if first is None else first
        results.append(dict(kernel=f"expert_{which}", rows=rows, seed=seed, variant=name, grid_x=grid[0],
                            grid_y=grid[1], threads=threads, tiles=tiles, median_us=float(np.median(times)),
                            min_us=float(np.min(times)), same_bits=bool(np.array_equal(got.view(np.uint32),
                                                                                        first.view(np.uint32)))))
    return results


def bench_posterior(config: Any, rows: int, reps: int, seed: int) -> list[dict]:
    """posterior_argmax and posterior_sample over ``rows`` rows at each block size."""
    from numba import cuda

    from ddtree_numba.bench.common import graph_replay_times
    from ddtree_numba.kernels.accept import MAX_SAMPLE_THREADS, posterior_argmax, posterior_sample

    rng = np.random.default_rng(seed)
    vocab = config.vocab_size
    logits = [cuda.to_device(rng.standard_normal((1, rows, vocab)).astype(np.float32)) for _ in range(2)]
    sizes = cuda.to_device(np.array([rows], np.int32))
    temperatures = cuda.to_device(np.array([SAMPLE_TEMPERATURE]))
    seeds = cuda.to_device(np.array([seed], np.uint64))
    positions = cuda.to_device(np.arange(rows, dtype=np.int32).reshape(1, rows))
    out = cuda.device_array((1, rows), np.int32)
    results = []
    for kind in ("argmax", "sample"):
        first = None
        for threads in (t for t in POSTERIOR_THREADS if kind == "argmax" or t <= MAX_SAMPLE_THREADS):
            def enqueue(i: int, stream: Any, kind: str = kind, threads: int = threads) -> None:
                if kind == "argmax":
                    posterior_argmax(logits[i % 2], sizes, out, stream=stream, threads=threads)
                else:
                    posterior_sample(logits[i % 2], sizes, temperatures, seeds, positions, out, stream=stream,
                                     threads=threads)

            out.copy_to_device(np.full((1, rows), -2, np.int32))   # poisoned: an unwritten row differs
            enqueue(0, 0)
            cuda.synchronize()
            times = graph_replay_times(enqueue, GRAPH_LAUNCHES, reps)
            got = out.copy_to_host()
            first = got if first is None else first
            results.append(dict(kernel=f"posterior_{kind}", rows=rows, seed=seed, variant=f"t{threads}", grid_x=rows,
                                grid_y=1, threads=threads, tiles=rows, median_us=float(np.median(times)),
                                min_us=float(np.min(times)), same_bits=bool(np.array_equal(got, first))))
    return results


def to_dataset(results: list[dict], args: argparse.Namespace) -> Any:
    import xarray as xr

    from sim.profiles import active_profile

    data = {key: ("case", np.array([r[key] for r in results])) for key in results[0]}
    return xr.Dataset(data, attrs=dict(benchmark="launch_shapes", units="us",
                                       config=json.dumps(vars(args), default=str), profile=active_profile().name,
                                       graph_launches=GRAPH_LAUNCHES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="model preset (default: %(default)s)")
    parser.add_argument("--expert", action="store_true", help="time expert_linear's grids")
    parser.add_argument("--posterior", action="store_true", help="time the posterior kernels' block sizes")
    parser.add_argument("--rows", type=positive_int_list, default=[1, 33], help="token rows (default 1,33)")
    parser.add_argument("--seeds", type=int, default=2, help="routings per row count past one row (default 2)")
    parser.add_argument("--reps", type=int, default=30, help="graph replays (>= 20)")
    parser.add_argument("--out", type=Path, help="HDF5 file to append the results to")
    args = parser.parse_args(argv)
    if not (args.expert or args.posterior):
        parser.error("give --expert, --posterior or both")
    if args.reps < 20:
        parser.error("--reps must be >= 20")
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    from ddtree_numba.config import ModelConfig

    try:
        config = ModelConfig.from_name(args.preset)
    except (ValueError, FileNotFoundError) as err:
        parser.error(f"--preset: {err}")
    from numba import cuda

    if cuda.config.ENABLE_CUDASIM:
        parser.error("needs a CUDA GPU (NUMBA_ENABLE_CUDASIM is set)")
    if args.expert and config.n_routed_experts == 0:
        parser.error(f"--expert: preset {args.preset} has no routed experts")
    results = []
    print(f"{'kernel':>18} {'rows':>4} {'seed':>4} {'variant':>8} {'grid':>10} {'thr':>5} {'tiles':>5} "
          f"{'median us':>10} {'min':>8}  same")
    cases = []
    if args.expert:
        cases += [("expert", rows, seed, which) for rows in args.rows for seed in range(1 if rows == 1 else args.seeds)
                  for which in ("gate_up", "down")]
    if args.posterior:
        cases += [("posterior", rows, 0, "") for rows in args.rows]
    for family, rows, seed, which in cases:
        batch = (bench_expert(config, rows, seed, which, args.reps) if family == "expert"
                 else bench_posterior(config, rows, args.reps, seed))
        for r in batch:
            print(f"{r['kernel']:>18} {r['rows']:>4} {r['seed']:>4} {r['variant']:>8} "
                  f"{str((r['grid_x'], r['grid_y'])):>10} {r['threads']:>5} {r['tiles']:>5} "
                  f"{r['median_us']:>10.2f} {r['min_us']:>8.2f}  {'yes' if r['same_bits'] else 'NO'}", flush=True)
        results += batch
    if args.out is not None:
        from ddtree_numba.bench.common import write_run

        group = write_run(args.out, to_dataset(results, args), command=sys.argv)
        print(f"wrote {args.out}:{group}")
    return 0 if all(r["same_bits"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
