"""Benchmark: tree-verify MLA attention kernel (FP32) on the GPU, Kimi K2 shapes.

For each (batch, tree size T, cached length N): random inputs filled on the device (every request
a random tree of T nodes, N cached rows), ``plan`` once, warm-up, then ``--reps`` timed ``run``
calls with CUDA events, rotating over ``--sets`` input sets so that no call finds the previous
call's KV in L2. Effective TFLOP/s counts 2·T·H·(N+T)·1088 per request (limits §3; dense over the
tree block) and is compared with the FP32 peak of the active device profile (``sim.profiles``;
H200: 67 TFLOP/s; target >= 30 % at H = 64, T = 33, N = 32k, bs 8).

Timing: by default CUDA events bracket each ``run`` call, so a call's median includes the host's
part of it (``run`` validates every argument and launches one or two kernels (the ``launches``
column): about 0.5 ms a call on the H200 host, which dominates at small shapes; PERFORMANCE.md run "in-bounds loads"). ``--graph``
captures ``GRAPH_LAUNCHES`` rotated calls into one CUDA graph (``cuda.core``, as the engine replays
a step) and reports a replay's time divided by the launches: the GPU's time, as a decode step sees it
(``--warmup`` is then one eager call; the ``--torch`` peer keeps its event timing).

Peers (same inputs, same run): ``--torch`` times PyTorch eager absorbed-MLA attention with an
additive mask in fp32 and bf16 (when torch imports); ``--check`` measures the error of request 0
against the float64 reference (``reference.verify_attention``) where that is cheap enough.

    ddtree-numba bench verify-attention                      # default shapes
    ddtree-numba bench verify-attention --shape 8,33,32768 --tile h32 --torch --out data/bench/h200.h5
    python3 -m ddtree_numba.bench.verify_attention --shape 1,33,160 --shape 1,1,160 --graph \
        --tile sf8x128r4 --tile sf8x128r4-skip --tile sf2x128 --tile sf2x128-skip
    python3 -m ddtree_numba.bench.verify_attention --shape 1,1,160 --graph --tile sf2x256-skip --tile sf1x256-skip

``--tile`` takes the named tiles of ``TILES`` or any score-first tile ``sfHxK[rR][-skip]``.
``--tree-split on --tree-split off`` times each case with a small tree's attention in two launches
(``verify_attention.TREE_SPLIT``: the scores as one GEMM, then softmax and P·V) and in the tile's
one launch, in one process; the ``launches`` column says what each plan ran (``tree-split``,
``decode-split``, ``one`` or ``one+merge``), since the split applies only to the plans it fits, and
``tree_split`` what was asked (``on``, ``off``, or ``module``: the setting left alone). The time is
both launches' together; Nsight Compute gives each kernel's share:

    python3 -m ddtree_numba.bench.verify_attention --shape 1,33,192 --tile sf8x128r4-skip --graph \
        --tree-split off --tree-split on --tree-split off --tree-split on

Not a test: run it on the GPU machine; prints a table, ``--out`` appends an xarray Dataset
(dim case; variables batch, tree, past, split, tile, tree_split, launches, median_us / min_us /
max_us, tflops, pct_fp32_peak, the peers' medians and the reference errors) to an HDF5 file.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from numba import cuda, float32, int64, uint64

from ddtree_numba.bench.common import graph_replay_times, write_run
from ddtree_numba.kernels import verify_attention as va
from reference import pack_visibility
from reference import verify_attention as reference_attention
from sim.profiles import active_profile

HEADS = 64
LATENT = 512
ROPE = 64
SCALE = 0.14467962580268923   # Kimi K2, YaRN factor 64 (limits §2)
DEFAULT_SHAPES = ((8, 33, 32768), (1, 33, 32768), (1, 9, 4096), (64, 9, 4096), (8, 65, 32768))
TILES = {
    "default": va.KIMI_K2_CONFIG,                  # 64 heads per tile, 256 threads
    "h32": va.default_config(512, 64, 32),         # 32 heads per tile (KV read twice per node)
    "h8": va.KIMI_K2_DECODE_CONFIG,                # 8 heads per tile: the chunk layout's decode tiles
    "h8-prefetch": dataclasses.replace(va.KIMI_K2_DECODE_CONFIG, prefetch_l2=True),  # + key rows to L2 a chunk ahead
    # + the whole segment's key rows to L2 at the start (prefetch_chunks = split_size / chunk)
    "h8-prefetch-seg": dataclasses.replace(va.KIMI_K2_DECODE_CONFIG, prefetch_l2=True,
                                           prefetch_chunks=va.SEGMENT_PREFETCH_CHUNKS),
    "h16": va.KIMI_K2_SMALL_TREE_CONFIG,           # 16 heads per tile: the engine's small trees
    "h16-prefetch-seg": dataclasses.replace(va.KIMI_K2_SMALL_TREE_CONFIG, prefetch_l2=True,
                                            prefetch_chunks=va.SEGMENT_PREFETCH_CHUNKS),
    "sf2x128": va.KIMI_K2_SCORE_FIRST_CONFIG,      # score-first, 2 heads: the AR steps' tile before run "lane squares"
    # 2 heads, 256 keys a pass: the engine's AR steps without the skip
    "sf2x256": dataclasses.replace(va.KIMI_K2_SCORE_FIRST_DECODE_SKIP_CONFIG, skip_dead_keys=False),
    "sf4x128": va.default_config(512, 64, 64, tile_heads=4, score_keys=128),  # the small trees' tile before
    "sf8x128r4": va.KIMI_K2_SCORE_FIRST_TREE_CONFIG,  # score-first, 8 heads, 4 x 4 score tiles: the small trees without the skip
    # the same two score-first tiles skipping the score FMAs past a pass's last key (TileConfig.skip_dead_keys):
    # the engine's tiles (engine.model.ATTENTION_SKIP_DEAD_KEYS)
    "sf2x128-skip": va.KIMI_K2_SCORE_FIRST_SKIP_CONFIG,
    "sf8x128r4-skip": va.KIMI_K2_SCORE_FIRST_TREE_SKIP_CONFIG,
    "sf2x256-skip": va.KIMI_K2_SCORE_FIRST_DECODE_SKIP_CONFIG,
}
SCORE_FIRST_NAME = re.compile(r"sf(\d+)x(\d+)(?:r(\d+))?(-skip)?")   # sfHxK[rR][-skip]


def tile_config(name: str) -> va.TileConfig:
    """A named tile: one of TILES, or any score-first tile ``sfHxK[rR][-skip]`` (H heads, K keys a
    pass, R heads a score thread, the dead-key skip), as ``va.default_config`` builds it (layout,
    not numerics: every one gives the same bits)."""
    if name in TILES:
        return TILES[name]
    match = SCORE_FIRST_NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"tile must be one of {sorted(TILES)} or sfHxK[rR][-skip], got {name!r}")
    heads, keys, rows, skip = match.groups()
    config = va.default_config(LATENT, ROPE, HEADS, tile_heads=int(heads), score_keys=int(keys),
                               score_rows=int(rows or 1))
    return dataclasses.replace(config, skip_dead_keys=bool(skip))


def _tile_name(text: str) -> str:
    try:
        tile_config(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


AMPLITUDE = 1.0  # inputs uniform in [-1, 1): scores have std ~1.2 after the scale
FILL_THREADS = 256
FILL_BLOCKS = 4096
MIX1 = np.uint64(0x9E3779B97F4A7C15)  # splitmix64 constants (as bench/accept_compact.py)
MIX2 = np.uint64(0xBF58476D1CE4E5B9)
SHIFT_MIX = np.uint64(31)
SHIFT_MANTISSA = np.uint64(40)  # top 24 bits -> float32 in [0, 1)
GRAPH_LAUNCHES = 20  # run() calls captured in one graph by --graph (the sets rotated)
CHECK_MAX_SCORES = 400_000  # float64 reference only where T x (N + T) <= this (~1 s of NumPy)
TORCH_MAX_BYTES = 24e9  # skip the torch peer when its [bs, T, H, S] scores would exceed this (x3 live)


@cuda.jit
def fill_uniform_kernel(flat, seed, amplitude):
    """flat float32 [n] <- values uniform in [-amplitude, amplitude) from a hash of (index, seed)."""
    i = int64(cuda.grid(1))  # > 2**31 elements at bs 64, N 128k
    while i < flat.shape[0]:
        h = (uint64(i) + seed) * MIX1
        h = (h ^ (h >> SHIFT_MIX)) * MIX2
        h = h ^ (h >> SHIFT_MIX)
        flat[i] = (float32(h >> SHIFT_MANTISSA) * float32(2.0**-23) - float32(1.0)) * amplitude
        i += cuda.gridsize(1)


def random_visibility(rng: np.random.Generator, bs: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """bool [bs, T, T] ancestor-or-self rows of random trees (parents[i] < i) and their packed
    uint32 [bs, T, ceil(T / 32)] form (ARCHITECTURE.md)."""
    vis = np.zeros((bs, t, t), bool)
    for b in range(bs):
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
        for i in range(t):
            if i:
                vis[b, i] = vis[b, parents[i]]  # the parent's row is complete: parents[i] < i
            vis[b, i, i] = True
    return vis, np.stack([pack_visibility(v) for v in vis])


def make_input_set(rng: np.random.Generator, bs: int, t: int, n: int, seed: int, stream) -> dict:
    """Device arrays for one call (N cached rows then T tree rows per request), filled on the device;
    ``host_visibility`` keeps the bool [bs, T, T] mask for the peers."""
    s = n + t
    shapes = dict(q_latent=(bs, t, HEADS, LATENT), q_rope=(bs, t, HEADS, ROPE),
                  kv_latent=(bs, s, LATENT), k_rope=(bs, s, ROPE))
    arrays = {}
    for i, (name, shape) in enumerate(shapes.items()):
        arr = cuda.device_array(shape, np.float32, stream=stream)
        fill_uniform_kernel[FILL_BLOCKS, FILL_THREADS, stream](
            arr.reshape(arr.size), np.uint64(1_000_003 * seed + 7919 * i), np.float32(AMPLITUDE))
        arrays[name] = arr
    vis, packed = random_visibility(rng, bs, t)
    arrays.update(past_lens=cuda.to_device(np.full(bs, n, np.int32), stream=stream),
                  tree_sizes=cuda.to_device(np.full(bs, t, np.int32), stream=stream),
                  visibility=cuda.to_device(packed, stream=stream))
    arrays["host_visibility"] = vis
    return arrays


def event_times(call: Callable[[int], None], reps: int, warmup: int, stream) -> list[float]:
    """Microseconds of ``call(i)`` per repetition, CUDA events on ``stream``, after warm-up."""
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
    return times


def flops(bs: int, t: int, n: int) -> float:
    """Effective FLOPs of one call: 2·T·H·(N+T)·1088 per request (limits §3)."""
    return 2.0 * t * HEADS * (n + t) * 1088 * bs


def torch_scores_bytes(bs: int, t: int, n: int) -> float:
    """fp32 bytes of the peer's [bs, T, H, N + T] scores (three such tensors are live)."""
    return 4.0 * bs * t * HEADS * (n + t)


def torch_mla_times(sets: list[dict], dtype: str, reps: int, warmup: int) -> list[float]:
    """PyTorch eager absorbed MLA attention with an additive mask (DeepSeek-V3 attn_impl="absorb"):
    scores = (q_latent·kv + q_rope·k_rope) · scale + mask, softmax in fp32, out = P · kv.
    ``dtype`` "fp32" or "bf16" for the inputs and products; inputs cast before timing."""
    import torch

    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    prepared = []
    for x in sets:
        ql, qr, kv, kr = (torch.as_tensor(x[name], device="cuda").to(tdtype)
                          for name in ("q_latent", "q_rope", "kv_latent", "k_rope"))
        bs, t = ql.shape[:2]
        n = kv.shape[1] - t
        mask = torch.zeros((bs, t, 1, n + t), dtype=torch.float32, device="cuda")  # [bs, T, 1, S]
        hidden = torch.as_tensor(~x["host_visibility"], device="cuda")  # [bs, T, T]
        mask[:, :, 0, n:].masked_fill_(hidden, float("-inf"))
        prepared.append((ql, qr, kv, kr, mask))

    def call(i: int) -> None:
        ql, qr, kv, kr, mask = prepared[i % len(prepared)]
        scores = (torch.einsum("bthc,bsc->bths", ql, kv) + torch.einsum("bthr,bsr->bths", qr, kr)) * SCALE
        probs = torch.softmax(scores.float() + mask, dim=-1).to(tdtype)  # [bs, T, H, S]
        torch.einsum("bths,bsc->bthc", probs, kv)

    for i in range(warmup):
        call(i)
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def torch_available() -> bool:
    """PyTorch imports and sees a CUDA device (an optional peer, never a dependency)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def reference_error(x: dict, out, lse) -> tuple[float, float]:
    """(max |out - ref|, max |lse - ref| / max(1, |ref lse|)) of request 0 against the float64 reference."""
    t = x["host_visibility"].shape[1]
    n = int(x["past_lens"].copy_to_host()[0])
    host = {name: x[name][0].copy_to_host() for name in ("q_latent", "q_rope", "kv_latent", "k_rope")}
    ref_out, ref_lse = reference_attention(host["q_latent"], host["q_rope"], host["kv_latent"][:n + t],
                                           host["k_rope"][:n + t], x["host_visibility"][0], SCALE)
    got_out, got_lse = out[0].copy_to_host(), lse[0].copy_to_host()
    out_err = float(np.max(np.abs(got_out - ref_out)))
    lse_err = float(np.max(np.abs(got_lse - ref_lse) / np.maximum(1.0, np.abs(ref_lse))))
    return out_err, lse_err


@contextlib.contextmanager
def tree_split_setting(on: bool | None):
    """``va.TREE_SPLIT`` set to ``on`` inside the block and restored after it (``None``: left as it
    is). :func:`va.run` reads the setting at each call, so it must hold while the calls run."""
    saved = va.TREE_SPLIT
    if on is not None:
        va.TREE_SPLIT = on
    try:
        yield
    finally:
        va.TREE_SPLIT = saved


def measure(bs: int, t: int, n: int, *, tile: str = "default", split: int = va.DEFAULT_SPLIT_SIZE,
            reps: int = 20, warmup: int = 3, sets: int = 2, seed: int = 0, peers: bool = False,
            check: bool = False, graph: bool = False, tree_split: bool | None = None) -> dict:
    """Per-repetition times (µs) of one ``run`` call and of the peers, and the reference error.

    ``tree_split``: ``va.TREE_SPLIT`` for this measurement (``None``: the module's setting).
    Returns a dict: ``gpu`` (list), ``torch_fp32`` / ``torch_bf16`` (lists; empty when not run),
    ``out_err`` / ``lse_err`` (NaN when not checked), ``finite`` (bool), ``launches``
    (``VerifyPlan.launches``: what the calls ran, the bench's arrays being 16-byte aligned).
    """
    with tree_split_setting(tree_split):   # va.run reads TREE_SPLIT at each call
        rng = np.random.default_rng(seed)
        stream = cuda.stream()
        p = va.plan(bs, t, HEADS, n + t, split_size=split, config=tile_config(tile))
        inputs = [make_input_set(rng, bs, t, n, seed + s, stream) for s in range(sets)]
        out = cuda.device_array((bs, t, HEADS, LATENT), np.float32)
        lse = cuda.device_array((bs, t, HEADS), np.float32)
        workspace = p.allocate_workspace()

        def call(i: int, on: object = stream) -> None:
            x = inputs[i % sets]
            va.run(p, x["q_latent"], x["q_rope"], x["kv_latent"], x["k_rope"], x["past_lens"],
                   x["tree_sizes"], x["visibility"], SCALE, out, lse, workspace, on)

        stream.synchronize()   # the inputs are filled on `stream`; a graph replays on its own stream
        if graph:
            call(0)   # compile and load before the capture
            stream.synchronize()
            times = graph_replay_times(call, GRAPH_LAUNCHES, reps)
        else:
            times = event_times(call, reps, warmup, stream)
        result = {"gpu": times, "torch_fp32": [], "torch_bf16": [],
                  "out_err": float("nan"), "lse_err": float("nan"), "launches": p.launches()}
        stream.synchronize()
        result["finite"] = bool(np.isfinite(out.copy_to_host()).all())
        if check and t * (n + t) <= CHECK_MAX_SCORES:
            call(0)
            stream.synchronize()
            result["out_err"], result["lse_err"] = reference_error(inputs[0], out, lse)
        if peers and torch_available() and torch_scores_bytes(bs, t, n) <= TORCH_MAX_BYTES / 3:
            for dtype in ("fp32", "bf16"):
                try:
                    result[f"torch_{dtype}"] = torch_mla_times(inputs, dtype, reps, warmup)
                except Exception as exc:  # the peer is optional: report and go on
                    print(f"torch {dtype} peer failed: {type(exc).__name__}: {exc}", flush=True)
        return result


def bench_case(bs: int, t: int, n: int, tile: str, split: int, reps: int, warmup: int,
               sets: int, seed: int, peers: bool = False, check: bool = False, graph: bool = False,
               tree_split: bool | None = None) -> dict:
    """Median/min/max latency (µs) of one run() call, effective TFLOP/s and % of the FP32 peak."""
    m = measure(bs, t, n, tile=tile, split=split, reps=reps, warmup=warmup, sets=sets, seed=seed,
                peers=peers, check=check, graph=graph, tree_split=tree_split)
    times = m["gpu"]
    med = float(np.median(times))
    tflops = flops(bs, t, n) / (med * 1e-6) / 1e12
    torch_med = {k: float(np.median(m[k])) if m[k] else float("nan") for k in ("torch_fp32", "torch_bf16")}
    asked = "module" if tree_split is None else ("on" if tree_split else "off")
    return dict(batch=bs, tree=t, past=n, tile=tile, split=split, tree_split=asked, launches=m["launches"],
                median_us=med,
                min_us=float(np.min(times)), max_us=float(np.max(times)), tflops=tflops,
                pct_fp32_peak=100.0 * tflops * 1e12 / active_profile().fp32_peak,
                torch_fp32_us=torch_med["torch_fp32"], torch_bf16_us=torch_med["torch_bf16"],
                out_err=m["out_err"], lse_err=m["lse_err"], finite=m["finite"])


def _write(rows: list[dict], path: Path, args: argparse.Namespace) -> None:
    """Append the results as one group /verify_attention/<timestamp>_<sha> (temp file, then rename)."""
    import xarray as xr

    keys = ("batch", "tree", "past", "split", "median_us", "min_us", "max_us", "tflops", "pct_fp32_peak",
            "torch_fp32_us", "torch_bf16_us", "out_err", "lse_err")
    ds = xr.Dataset(
        {key: ("case", np.array([r[key] for r in rows])) for key in keys}
        | {name: ("case", np.array([r[name] for r in rows])) for name in ("tile", "tree_split", "launches")},
        attrs=dict(benchmark="verify_attention", config=json.dumps(vars(args), default=str),
                   profile=active_profile().name),
    )
    group = write_run(path, ds)
    print(f"wrote {path}:{group}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="bs,T,N (repeatable; default sweep)")
    parser.add_argument("--tile", type=_tile_name, action="append",
                        help=f"tile config: one of {', '.join(sorted(TILES))}, or any score-first "
                             "sfHxK[rR][-skip] (H heads, K keys a pass, R heads a score thread; repeatable; "
                             "default: default)")
    parser.add_argument("--split", type=int, action="append",
                        help=f"keys per segment (repeatable: each tile and shape at each split; part of the "
                             f"numerics, the engine's is {va.DEFAULT_SPLIT_SIZE}; default: that)")
    parser.add_argument("--tree-split", choices=("on", "off"), action="append",
                        help="a small tree's attention in two launches (on) or the tile's one launch (off), "
                             "verify_attention.TREE_SPLIT; repeatable: each case at each setting, in the given "
                             f"order (the split applies to 2-{va.TREE_SPLIT_MAX_NODES} tree rows, batch <= "
                             f"{va.TREE_SPLIT_MAX_BATCH}, merge-free plans; the launches column says what ran); "
                             f"default: the module's setting ({'on' if va.TREE_SPLIT else 'off'})")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sets", type=int, default=2, help="input sets rotated between calls")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch", action="store_true", help="also time PyTorch eager MLA (fp32, bf16)")
    parser.add_argument("--check", action="store_true", help="error of request 0 vs the float64 reference")
    parser.add_argument("--graph", action="store_true",
                        help=f"time CUDA-graph replays of {GRAPH_LAUNCHES} calls (the GPU's time; default: events "
                             "around each call, the host's launch included)")
    parser.add_argument("--out", type=Path, help="HDF5 file to append the results to")
    args = parser.parse_args(argv)
    if args.reps < 20:
        parser.error("--reps must be >= 20")
    splits = args.split or [va.DEFAULT_SPLIT_SIZE]
    for split in splits:
        if split <= 0:
            parser.error(f"--split must be positive, got {split}")
    if cuda.config.ENABLE_CUDASIM:
        parser.error("needs a CUDA GPU (NUMBA_ENABLE_CUDASIM is set)")
    shapes = ([tuple(int(v) for v in s.split(",")) for s in args.shape] if args.shape
              else DEFAULT_SHAPES)
    tree_splits = [s == "on" for s in args.tree_split] if args.tree_split else [None]
    rows = []
    print(f"{'bs':>3} {'T':>4} {'N':>7} {'tile':>14} {'split':>6} {'launches':>12} {'median us':>11} {'min':>9} "
          f"{'max':>9} {'TFLOP/s':>8} {'% FP32':>7} {'torch f32':>10} {'torch bf16':>10} {'out err':>8}")
    cases = [(tile, split, shape, tree_split) for tile in args.tile or ["default"] for split in splits
             for shape in shapes for tree_split in tree_splits]
    for tile, split, (bs, t, n), tree_split in cases:
        t0 = time.perf_counter()
        r = bench_case(bs, t, n, tile, split, args.reps, args.warmup, args.sets,
                       args.seed, peers=args.torch, check=args.check, graph=args.graph, tree_split=tree_split)
        rows.append(r)
        print(f"{bs:>3} {t:>4} {n:>7} {tile:>14} {split:>6} {r['launches']:>12} {r['median_us']:>11.1f} "
              f"{r['min_us']:>9.1f} {r['max_us']:>9.1f} {r['tflops']:>8.2f} {r['pct_fp32_peak']:>6.1f}% "
              f"{r['torch_fp32_us']:>10.1f} {r['torch_bf16_us']:>10.1f} {r['out_err']:>8.1e}"
              f"{'' if r['finite'] else '  NON-FINITE OUTPUT'}  ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    if args.out:
        _write(rows, args.out, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
