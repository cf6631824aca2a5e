"""Per-kernel profile of target forwards: one AR step and one tree verify, under Nsight Compute.

The program runs each forward three times (compile, warm-up) and then once more between
``cuda.profile_start()`` and ``cuda.profile_stop()``, so ``ncu --profile-from-start off`` records
exactly one forward per row count. ``--table`` turns ncu's CSV into a per-kernel table (kernel,
grid, block, calls, total and mean microseconds, and the MB read from DRAM and their rate where the
profile has ``dram__bytes_read.sum``), one per profiled forward, slowest first.

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum \\
        --csv --print-units base python3 -m ddtree_numba.bench.profile_forward --preset small > prof.csv
    python3 -m ddtree_numba.bench.profile_forward --table prof.csv

ncu serialises the kernels and, by default, flushes the caches before each one, so small kernels
whose inputs would sit in L2 during a graph replay read them from DRAM here: the sum of the
kernel times is an upper bound of the replayed step, and the ranking is what it is for. With
``--cache-control none`` ncu leaves the caches alone, as a replay would (serialised still).

``--ddtree N`` profiles a whole DDTree generation instead: batch 1, ``--rows`` - 1 as the budget
(default B = 32), block 16, the oracle drafter at accuracy 1.0 fed an AR run's tokens, N new
tokens, CUDA graphs as in the decode-step bench. Its table has one section per target forward:
a section is a forward (the prefill, then each round's verify) with the kernels that follow it
up to the next forward (accept, compaction, the next round's draft, top-k and build).

``--graph-prefix`` needs no profiler: what each launch adds to a forward as a CUDA graph replays it.
For i = 1 .. L (L the forward's launches) it captures a graph of the forward's first i launches
(numba's kernel launch skips the later ones while the graph is captured), replays it ``--reps``
times and takes the median; launch i's cost is the difference of the medians of i and i - 1
launches: its own time and its gap in the chain, as a replayed step pays them (ncu serialises each
kernel with its own overhead and cannot see the gaps). Launch 0's cost is the whole graph of one
launch, so it holds the graph's own start as well. Printed per launch and per kernel (grid,
block), slowest first; ``--out`` appends the per-launch costs to an HDF5 file.

    python3 -m ddtree_numba.bench.profile_forward --graph-prefix --rows 1 33 --out prefix.h5
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import csv
import sys
from pathlib import Path
from typing import Any

import numpy as np

FIRST_KERNEL = "_prepare_rows_kernel"  # every TargetModel.forward starts with it
PREFIX_REPS = 30                        # --graph-prefix: replays a prefix graph (median)


def _chain_visibility(rows: int) -> tuple[np.ndarray, np.ndarray]:
    """A binary tree of ``rows`` nodes (parent (i - 1) // 2): (depths [rows], bool visibility [rows, rows])."""
    from reference.tree import _ancestor_closure

    vis = _ancestor_closure(np.r_[-1, (np.arange(1, rows) - 1) // 2])
    return vis.sum(axis=1) - 1, vis


def forward_inputs(rows: int, past: int) -> list[Any]:
    """Device inputs of one batch-1 forward of ``rows`` rows over ``past`` cached rows: tokens,
    positions (past + depth), sizes and the packed visibility of :func:`_chain_visibility`'s tree."""
    from numba import cuda

    from reference.tree import pack_visibility

    depths, vis = _chain_visibility(rows)
    host = (np.arange(3, 3 + rows, dtype=np.int32)[None], (past + depths).astype(np.int32)[None],
            np.array([rows], np.int32), pack_visibility(vis[None]))
    return [cuda.to_device(np.ascontiguousarray(a).copy()) for a in host]


def warm_models(preset: str, past: int, row_counts: list[int], seed: int = 0) -> list[tuple[Any, list[Any]]]:
    """(model, forward inputs) per row count: one model each, sharing weights and cache
    (past_len = past), every forward run three times (compiled, loaded, its host checks done)."""
    from numba import cuda

    from ddtree_numba.config import ModelConfig
    from ddtree_numba.engine.model import TargetModel
    from reference.weights import init_weights

    config = ModelConfig.from_name(preset)
    capacity = past + max(row_counts)
    weights: Any = init_weights(config, seed)
    built, cache = [], None
    for rows in row_counts:
        model = TargetModel(config, weights, batch_size=1, kv_capacity=capacity, max_rows=rows, cache=cache)
        weights, cache = model.weights, model.cache
        built.append((model, forward_inputs(rows, past)))
    built[0][0].advance(cuda.to_device(np.array([past], np.int32)))
    for _ in range(3):
        for model, args in built:
            model.forward(*args)
    cuda.synchronize()
    return built


def run_forwards(preset: str, past: int, row_counts: list[int], seed: int = 0) -> None:
    """:func:`warm_models`, then one forward of each between profile_start / profile_stop."""
    from numba import cuda

    built = warm_models(preset, past, row_counts, seed)
    cuda.profile_start()
    for model, args in built:
        model.forward(*args)
    cuda.synchronize()
    cuda.profile_stop()


def run_ddtree(preset: str, budget: int, new_tokens: int, block: int = 16, seed: int = 0) -> None:
    """A batch-1 DDTree generation (oracle drafter at accuracy 1.0 fed an AR run's tokens, CUDA
    graphs) run twice to compile and warm up, then once more between profile_start / profile_stop."""
    from numba import cuda

    from ddtree_numba.bench.decode_step import _prompts
    from ddtree_numba.config import ModelConfig
    from ddtree_numba.engine.decode import generate_ar, generate_ddtree, required_kv_capacity
    from ddtree_numba.engine.drafters import OracleDrafter
    from ddtree_numba.engine.model import TargetModel
    from reference.weights import init_weights

    config = ModelConfig.from_name(preset)
    prompts = _prompts(np.random.default_rng(seed), 1, 64, config.vocab_size)   # the decode-step bench's
    capacity = required_kv_capacity([len(prompts[0])], new_tokens, budget)
    model = TargetModel(config, init_weights(config, seed), batch_size=1, kv_capacity=capacity,
                        max_rows=budget + 1)
    ar = generate_ar(model, prompts, max_new_tokens=new_tokens)
    ref = np.asarray(ar.tokens, dtype=np.int64)                     # [1, new_tokens]

    def run() -> None:
        drafter = OracleDrafter(ref, config.vocab_size, block - 1, accuracy=1.0, entropy=0.5, seed=seed)
        generate_ddtree(model, drafter, prompts, budget=budget, block_size=block, max_new_tokens=new_tokens)

    run()
    run()
    cuda.synchronize()
    cuda.profile_start()
    run()
    cuda.synchronize()
    cuda.profile_stop()


def kernel_label(kernel: Any) -> str:
    """A launched kernel's name as ncu prints it: the factory and the kernel, ``get_kernel::kernel``."""
    func = getattr(kernel, "py_func", None)
    name = getattr(func, "__qualname__", None) or getattr(kernel, "__name__", None) or type(kernel).__name__
    return name.replace(".<locals>.", "::")


@contextlib.contextmanager
def launch_limit(limit: int | None, record: list | None = None):
    """While active, numba's kernel launches past the first ``limit`` of the scope enqueue nothing
    (None: no limit); each launch's (label, grid, block) is appended to ``record``, skipped or not.
    GPU launches only (the simulator's kernels launch another way)."""
    from numba.cuda import dispatcher

    original = dispatcher._Kernel.launch
    count = [0]

    def limited(self, args, griddim, blockdim, stream=0, sharedmem=0):
        count[0] += 1
        if record is not None:
            record.append((kernel_label(self), tuple(griddim), tuple(blockdim)))
        if limit is not None and count[0] > limit:
            return None
        return original(self, args, griddim, blockdim, stream, sharedmem)

    dispatcher._Kernel.launch = limited
    try:
        yield count
    finally:
        dispatcher._Kernel.launch = original


def prefix_costs(forward: Any, reps: int = PREFIX_REPS) -> tuple[list[tuple[str, tuple, tuple]], list[float]]:
    """(launches, prefix medians): ``forward(stream)`` enqueues one forward; launches are its
    (label, grid, block) in order, medians[i] the median us of a graph of its first i + 1 launches
    (``bench.common.graph_replay_times``, ``reps`` replays). The caller has run it eagerly once."""
    from ddtree_numba.bench.common import graph_replay_times

    launches: list = []
    with launch_limit(0, launches):   # count and name them; nothing runs
        forward(0)
    medians = []
    for i in range(1, len(launches) + 1):
        with launch_limit(i):
            times = graph_replay_times(lambda _, builder: forward(builder), 1, reps)
        medians.append(float(np.median(times)))
    return launches, medians


def run_graph_prefix(preset: str, past: int, row_counts: list[int], reps: int = PREFIX_REPS,
                     seed: int = 0) -> list[dict]:
    """Per row count and launch: (rows, index, kernel, grid, block, prefix us, cost us), from
    :func:`warm_models`' models (every launch compiled and checked before any capture)."""
    out = []
    for rows, (model, args) in zip(row_counts, warm_models(preset, past, row_counts, seed)):
        launches, medians = prefix_costs(lambda stream, m=model, a=args: m.forward(*a, stream=stream), reps)
        for i, ((name, grid, block), t) in enumerate(zip(launches, medians)):
            out.append(dict(rows=rows, index=i, kernel=name, grid=str(grid), block=str(block), prefix_us=t,
                            cost_us=t - (medians[i - 1] if i else 0.0)))
    return out


def format_prefix(results: list[dict]) -> str:
    """Per row count: the launches in order (cost and running total), then the kernels (name,
    grid, block) by total cost."""
    lines = []
    for rows in sorted({r["rows"] for r in results}):
        sel = [r for r in results if r["rows"] == rows]
        lines.append(f"forward of {rows} rows: {len(sel)} launches, {sel[-1]['prefix_us']:.1f} us as one graph "
                     f"(launch i: median of the first i + 1 launches' graph minus the first i's)")
        lines.append(f"{'#':>3} {'cost us':>8} {'total':>8}  kernel grid block")
        for r in sel:
            lines.append(f"{r['index']:3d} {r['cost_us']:8.2f} {r['prefix_us']:8.1f}  {r['kernel']} {r['grid']} {r['block']}")
        agg: dict[tuple, list[float]] = collections.defaultdict(list)
        for r in sel:
            agg[(r["kernel"], r["grid"], r["block"])].append(r["cost_us"])
        lines.append(f"{'total us':>9} {'calls':>5} {'mean us':>8}  kernel grid block")
        for (name, grid, block), costs in sorted(agg.items(), key=lambda kv: -sum(kv[1])):
            lines.append(f"{sum(costs):9.1f} {len(costs):5d} {sum(costs) / len(costs):8.2f}  {name} {grid} {block}")
    return "\n".join(lines)


def prefix_dataset(results: list[dict], reps: int) -> Any:
    """The per-launch costs as an xarray Dataset (dim ``launch``)."""
    import xarray as xr

    cols = {k: [r[k] for r in results] for k in ("rows", "index", "kernel", "grid", "block", "prefix_us", "cost_us")}
    ds = xr.Dataset({k: ("launch", np.asarray(v)) for k, v in cols.items()})
    ds.attrs.update(benchmark="graph_prefix", units="us (graph replay medians)", reps=reps)
    return ds


# ncu's unit names (short in current versions, long in older ones; --print-units base writes ns, byte)
_TIME_US = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6, "nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}
_BYTES_MB = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3, "Tbyte": 1e6}
Row = tuple  # (kernel, grid, block, calls, total us, MB read from DRAM or None)


def read_table(path: Path) -> list[list[Row]]:
    """ncu CSV -> per forward, rows (kernel, grid, block, calls, total us, MB read from DRAM),
    slowest first. The MB are the sum of ``dram__bytes_read.sum`` over the calls where the
    profile has that metric for every call (``--metrics gpu__time_duration.sum,dram__bytes_read.sum``),
    else None.

    Raises:
        ValueError naming ``path``: a CSV without ncu's columns, or a unit it does not know.
    """
    with open(path, newline="") as f:
        rows = list(csv.DictReader(line for line in f if line.startswith('"')))
    need = {"ID", "Kernel Name", "Grid Size", "Block Size", "Metric Name", "Metric Value"}
    if rows and not need <= set(rows[0]):
        raise ValueError(f"path: {path} is not an ncu --csv profile (columns {sorted(need - set(rows[0]))} missing)")
    launches: dict[str, dict[str, Any]] = {}   # ncu's launch ID -> its name, grid, block and metrics
    for r in rows:
        metric, unit = r.get("Metric Name"), r.get("Metric Unit") or ""
        if metric not in ("gpu__time_duration.sum", "dram__bytes_read.sum"):
            continue
        units = _TIME_US if metric == "gpu__time_duration.sum" else _BYTES_MB
        if unit not in units:
            raise ValueError(f"path: {path}: {metric} in unit {unit!r}, not one of {sorted(units)}")
        launch = launches.setdefault(r["ID"], {"name": r["Kernel Name"].split("[")[0].split("(")[0],
                                               "grid": r["Grid Size"], "block": r["Block Size"]})
        value = float(r["Metric Value"].replace(",", "")) * units[unit]
        launch["us" if metric == "gpu__time_duration.sum" else "mb"] = value
    kernels = [(k["name"], k["grid"], k["block"], k["us"], k.get("mb"))
               for _, k in sorted(launches.items(), key=lambda item: int(item[0])) if "us" in k]
    starts = [i for i, k in enumerate(kernels) if k[0].endswith(FIRST_KERNEL)] + [len(kernels)]
    forwards = []
    for a, b in zip(starts, starts[1:]):
        agg: dict[tuple[str, str, str], list[tuple[float, float | None]]] = collections.defaultdict(list)
        for name, grid, block, us, mb in kernels[a:b]:
            agg[(name, grid, block)].append((us, mb))
        forwards.append(sorted(((n, g, bl, len(v), sum(us for us, _ in v),
                                 None if any(mb is None for _, mb in v) else sum(mb for _, mb in v))
                                for (n, g, bl), v in agg.items()), key=lambda r: -r[4]))
    return forwards


def format_table(forwards: list[list[Row]]) -> str:
    """One table a forward: total and mean us, share, calls, and where the profile read DRAM
    bytes, the MB read and their rate (GB/s over the kernels' own time)."""
    lines = []
    for i, rows in enumerate(forwards):
        total = sum(r[4] for r in rows)
        has_mb = any(r[5] is not None for r in rows)
        read = sum(r[5] or 0.0 for r in rows)
        every = all(r[5] is not None for r in rows)   # a forward total only where every kernel has its bytes
        lines.append(f"forward {i}: {sum(r[3] for r in rows)} kernels, {total:.1f} us in all (ncu, serialised)"
                     + (f", {read:.1f} MB read from DRAM ({read / total:.2f} TB/s)" if every and has_mb and total else ""))
        lines.append(f"{'total us':>9} {'share':>6} {'calls':>5} {'mean us':>8}" +
                     (f" {'MB read':>8} {'GB/s':>7}" if has_mb else "") + "  kernel (grid, block)")
        for name, grid, block, calls, us, mb in rows:
            extra = ""
            if has_mb:
                extra = f" {mb:8.1f} {mb / us * 1e3:7.0f}" if mb is not None and us > 0 else f" {'':>8} {'':>7}"
            share = us / total if total else 0.0
            lines.append(f"{us:9.1f} {share:6.1%} {calls:5d} {us / calls:8.1f}{extra}  {name} {grid} {block}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddtree_numba.bench.profile_forward",
                                     description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.split("\n")[1:]))
    parser.add_argument("--preset", default="small", help="model preset (default: %(default)s)")
    parser.add_argument("--past", type=int, default=192, help="cached rows before the forward (default: %(default)s)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 33],
                        help="rows per forward, one profiled forward each (default: 1 33: an AR step, a B = 32 tree)")
    parser.add_argument("--ddtree", type=int, metavar="N", default=0,
                        help="profile a DDTree generation of N new tokens (budget: the largest --rows - 1) "
                             "instead of single forwards")
    parser.add_argument("--table", type=Path, help="print the per-kernel table of this ncu CSV instead of running")
    parser.add_argument("--graph-prefix", action="store_true",
                        help="time each launch's cost in a replayed graph of the forward (no profiler; see above)")
    parser.add_argument("--reps", type=int, default=PREFIX_REPS, help="--graph-prefix: replays a prefix (>= 5)")
    parser.add_argument("--out", type=Path, help="--graph-prefix: HDF5 file to append the per-launch costs to")
    args = parser.parse_args(argv)
    if args.table is not None:
        print(format_table(read_table(args.table)))
        return 0
    if args.past < 0 or min(args.rows) < 1 or args.ddtree < 0 or (args.ddtree and max(args.rows) < 2):
        print("error: --past and --ddtree must be >= 0, --rows >= 1 (>= 2 with --ddtree)", file=sys.stderr)
        return 2
    if args.graph_prefix:
        from numba import cuda

        if args.ddtree or args.reps < 5:
            print("error: --graph-prefix takes single forwards (no --ddtree) and --reps >= 5", file=sys.stderr)
            return 2
        if cuda.config.ENABLE_CUDASIM:
            print("error: --graph-prefix needs a CUDA GPU (NUMBA_ENABLE_CUDASIM is set)", file=sys.stderr)
            return 2
        results = run_graph_prefix(args.preset, args.past, args.rows, args.reps)
        print(format_prefix(results))
        if args.out is not None:
            from ddtree_numba.bench.common import write_run

            print(f"wrote {args.out}:{write_run(args.out, prefix_dataset(results, args.reps), command=sys.argv)}")
        return 0
    if args.ddtree:
        run_ddtree(args.preset, max(args.rows) - 1, args.ddtree)
    else:
        run_forwards(args.preset, args.past, args.rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
