"""A/B of layout variants of one target forward (CUDA-graph replay, median of CUDA events).

Layout choices are not numerics (the same bits), so they can be timed against each other on the
same weights and cache in one process: for each variant the module constants that pick them are
set, the launch-plan caches cleared, and a fresh model is built, captured and replayed for each
row count (1: an AR step; 33: a B 32 tree verify; ``bench.profile_forward``'s inputs: a binary
tree over ``--past`` cached rows).

Variants ``TILE/COLS``: TILE = ``auto`` (``engine.model.attention_tile_config``: score-first 2-head
tiles for an AR step, 8-head tiles for a 33-node tree; every TILE but ``auto-noskip`` keeps the default of
``engine.model.ATTENTION_SKIP_DEAD_KEYS``, on), ``auto-skip`` / ``auto-noskip`` (the same tiles with /
without the skip of the score FMAs of key tiles past a pass's last key), ``auto-pf`` (the same tiles with the L2 prefetch
of the next chunk's key rows, ``engine.model.ATTENTION_PREFETCH_L2``), ``auto-pfs`` (the whole
segment's key rows prefetched at the start, ``ATTENTION_PREFETCH_CHUNKS``), ``auto-merge`` (the
segment merge launched where the plan needs none, ``verify_attention.MERGE_FREE_SHORT_CACHES`` off;
an AR step's attention then takes the one launch too, as ``auto-onelaunch``: the two-launch path
needs a merge-free plan),
``auto-unfused`` (that, with the query RoPE and the kv write in two launches and the MoE RMSNorm
in its own, ``engine.model.FUSED_ROPE_KV_WRITE`` and ``FUSED_MOE_NORM`` off: the launches before the
three, the attention blocks' fill stores aside), ``auto-normroute`` (the MoE RMSNorm inside the routing launch, ``FUSED_MOE_NORM`` on; at one row
the routing block writes the CSR too, so the AR step's MoE starts with one launch, not two),
``auto-route1`` (the MoE RMSNorm and the routing of a block per row, ``engine.model.ROUTE_BY_EXPERT`` off:
the layout before it, numerics of its own; ``auto-normroute``, ``auto-unfused`` and ``auto-dotN`` time
that layout too; ``auto-csr2`` keeps the default layout), ``auto-unfold`` (the shared expert in two launches of its own, ``engine.model.FOLD_SHARED_EXPERT``
off; by default it runs inside the routed experts' launches), ``auto-bound`` (the expert launches'
grid y chosen for every slot of ``linear.expert_slots``' bound, ``linear.EXPERT_TYPICAL_WAVES`` off;
by default for the tiles a uniform routing fills), ``auto-entrytile`` (the experts' down projection
in the row tile of its entries, ``engine.model.EXPERT_TILE_BY_ROWS`` off; by default of M rows),
``auto-unfold-bound`` (all three off: the MoE launches of ``4d403ab``, before run "fold"),
``auto-nogemv`` (the 1-row products in ``linear``'s tile, ``engine.model.ROW_PRODUCTS`` off; by
default ``kernels.gemv`` where it has a layout), ``auto-noexgemv`` (an AR step's MoE expert
products in ``expert_linear``'s one-row tiles, ``engine.model.EXPERT_ROW_PRODUCTS`` off; by default
``gemv.expert_gemv``, a block row an entry), ``auto-dotN`` (the routing kernel's gate partials
with N loads in flight, ``model_ops.DOT_LOADS`` = N, N in 24, 32; by default 16), ``auto-csr2`` (an
AR step's MoE CSR in a launch of its own, ``model_ops.ROUTE_CSR_INLINE`` off; by default the
routing block writes it), ``auto-dshN`` (an AR step's score blocks of N heads,
``verify_attention.DECODE_SCORE_HEADS`` = N, N in 8, 32; by default 16), ``auto-pvdN`` (its P·V
blocks of N latent dims, ``verify_attention.DECODE_PV_DIMS`` = N, N in 32, 128; by default 64),
``auto-pva1`` (its P·V blocks' scores loaded chunk by chunk and one value chunk in flight,
``verify_attention.DECODE_PV_AHEAD`` = 1, the layout before it; by default 2: a pass's scores at
once, two value chunks in flight), ``auto-dsbN`` (an AR step's attention scores with N dim runs of q and k
loaded a lane before their fmas, ``verify_attention.DECODE_SCORE_BATCH`` = N, N in 8, 24; by
default 16), ``auto-dst128`` / ``auto-dst128b8`` (score blocks of 128 threads, twice the blocks,
``verify_attention.DECODE_SCORE_THREADS``; the latter with 8 runs), ``auto-onelaunch`` (an AR step's attention in the
score-first tile's one launch, ``verify_attention.DECODE_SPLIT`` off; by default scores and P·V
in two wide launches), ``auto-treeone`` (a small tree's attention in the score-first tile's one
launch, ``verify_attention.TREE_SPLIT`` off) or ``auto-tree`` (the tree's scores in one GEMM launch
and its softmax and P·V in another, ``TREE_SPLIT`` on; every other TILE keeps its default, off), ``auto-tskN`` / ``auto-tsrN`` (``auto-tree`` with score blocks of N
keys, N in 16, 64, / N query rows, N in 32, 128: ``TREE_SCORE_KEYS``, ``TREE_SCORE_ROWS``, by
default 32 / 64), ``auto-tphN`` / ``auto-tpvdN`` / ``auto-tpassN`` (``auto-tree`` with P·V blocks
of N heads, 16 or 64 / N latent dims, 64 or 256 / N keys a pass, 64: ``TREE_PV_HEADS``,
``TREE_PV_DIMS``, ``TREE_PASS``, by default 32 / 128 / 32; ``auto-tree`` and these time the one
launch where the plan is not merge-free, ``--past`` + rows past 2047), ``auto-occ3`` (a small tree's attention kernel compiled for 3 blocks an SM,
``engine.model.FEW_NODES_MIN_BLOCKS``: 168 registers, a 16-byte spill on sm_90, against 232 and 2
blocks an SM by default; more warps only where the tree's blocks pass 2 an SM: rows past 33 at
batch 1), ``h8``
(8-head chunk-layout
decode tiles), ``sfHxK`` (score-first decode tiles of H heads and K keys a pass,
``engine.model.DECODE_TILE``; ``sfHxK+`` small trees too; ``tsfHxK`` small trees only,
``engine.model.FEW_NODES_TILE``; H in 1, 2, 4, 8, 16; a suffix ``rR`` before the ``+``: R heads
per thread in the score tile, ``score_rows``), ``automTxH`` (the default tiles, the small trees'
segment merge in blocks of T threads and H heads, ``engine.model.FEW_NODES_MERGE``) or ``64`` (the
default 64-head tile at every size); COLS = ``auto`` (``linear.columns``: the 8 x 8 tile on sm_90) or
``4`` (8 x 4 everywhere), either with ``-plain`` (the linears' load-then-FMA weight loop for every
row tile, ``linear.PIPELINE_WEIGHTS`` off) or ``-ring1`` (the weight ring for every row tile,
``linear.PIPELINE_MIN_ROW_TILE`` 1; by default the ring runs from 4-row tiles on), or ``auto-serial``
(the MLA absorbs of >= 8 rows in ``head_linear``'s thread-serial kernel, ``linear.SERIAL_HEADS`` on,
the GPU default; every other COLS runs them in the warp layout: run "staged absorbs", a 33-row
forward 2763.6 us with the serial kernel, 2812.2 without), ``auto-serial-mtR`` (the same with R rows
a thread, ``linear.SERIAL_ROW_TILES`` = (R,)), ``auto-serial-lS`` (S leaf subsets a block where
they fit, else one: ``linear.SERIAL_LEAF_SPLITS`` = (S,)), ``auto-serial-odd`` / ``auto-serial-even``
(the same with the 11-row tiles for many-row linear and head launches, ``linear.ODD_TILES``, on /
off: a 33-row tree in 3 x 11 or 5 x 8; every other COLS keeps the default, on; run odd tiles:
2632.0 / 2634.5 us odd against 2692.2 / 2704.5), or ``auto-seg`` (the absorbs in ``kernels.absorb``'s
segment order, ``engine.model.SEGMENT_ABSORBS`` on, the default since it was timed; every other COLS
runs them in ``head_linear``, the earlier path) with ``-cN`` (tile blocks of N column quads,
``absorb.TILE_COL_QUADS`` = (N,)), ``-mt4`` / ``-mt8`` (4 / 8 rows a tile thread), ``-l1`` / ``-l2``
(at most 1 / 2 segment lanes a tile block, ``absorb.TILE_LANES``) or ``-split`` (the split kernel at
every row count, ``absorb.FEW_ROWS`` past any launch), or ``auto-sx`` (the linears' staged rows
read with four scalar shared loads a lane and staged one float a load, as before run "quads":
``linear.VECTOR_X_LOADS`` and ``linear.VECTOR_STAGING`` off), ``auto-sstage`` (the scalar staging
only) or ``auto-seg-asyncN`` (``auto-seg`` with the weights' async ``cp.async`` ring at N slots a
warp, N in 2..8, where ``linear._launch_plan`` gives it; every other COLS keeps
``linear.ASYNC_RING_STAGES``, 0 by default), ``auto-seg-occ2`` (``auto-seg`` with the 11-row
tiles compiled and gridded for 2 blocks an SM, ``linear.ODD_TILE_BLOCKS`` 2: 128 registers with
spills, 16 warps an SM, where two blocks' staged rows fit; every other COLS keeps it, 1 by default),
``auto-seg-u3`` / ``auto-seg-u4`` (``auto-seg`` with the 11-row tiles' register ring at 3 / 4 weight
steps, ``linear.ODD_TILE_UNROLL``; every other COLS keeps it, 2 by default), or ``auto-tc`` (the dense products on the tensor
cores, ``TargetModel(products="tensor-core")``: numerics, not layout, so its models get a cache of
their own; the routed experts and the absorbs as ``auto-seg``, the engine's default, its A/B
partner), ``auto-tc-ring1`` (that, with the one-row products' weights through the cp.async ring,
``linear_tc.ASYNC_RING = (1,)``) or ``auto-tc-ring`` (every product's, ``ASYNC_RING = True``). A
third part ``/pdl`` (``TILE/COLS/pdl``) captures that variant's forward with programmatic dependent
launches (``sim.launch.programmatic_launches``: each kernel may start while the previous one
drains; the same arithmetic) with ``engine.model.PDL_RELEASE_EARLY`` on (a launch before a
weights-first gemv / split absorb releases it right after its own wait, under the default
``--pdl-release early``); ``/pdlx`` does too with it off (the engine's default: every release at
the blocks' exits), so the early release is timed against its absence in one process. A variant named twice is timed twice and printed twice; the HDF5
group keeps every pass, the repeats labelled ``NAME #2``, ``NAME #3`` ... (:func:`pass_labels`).

Each variant's logits after its replays are compared bit for bit with those of the first variant
of the same numerics (products kind, absorb order and routing layout) and row count: the line printed says
``same bits`` or ``DIFFERENT BITS`` (a layout that changed the numerics), and the HDF5 run keeps
it (``same_bits``, 1 / 0; the first of each numerics compares with itself).

    python3 -m ddtree_numba.bench.forward_ab --preset small --variants auto/auto,64/auto,auto/4,64/4
    python3 -m ddtree_numba.bench.forward_ab --preset small --variants auto/auto,auto-pf/auto,auto-pfs/auto
    python3 -m ddtree_numba.bench.forward_ab --preset small --variants auto/auto-seg,auto/auto-tc,auto/auto-tc-ring1,auto/auto-tc-ring,auto/auto-seg,auto/auto-tc
    python3 -m ddtree_numba.bench.forward_ab --preset small --variants auto/auto-seg,auto/auto-seg/pdl,auto/auto-tc/pdl,auto/auto-seg,auto/auto-seg/pdl

Run 2e050e0 (H200, past 192, us per forward; measured with this module's predecessor script, the
same method): auto/auto 1969.2 / 5189.1, 64/auto 1966.7 / 5502.0,
auto/4 1967.7 / 7155.7, 64/4 1982.6 / 7464.6 (1 / 33 rows); PERFORMANCE.md "decode step".
Run attention score-first (2df84b9): auto 1793.2 / 3377.4, sf2x128 1424.7 / 3379.0,
sf4x128+ 1445.1 / 3278.6 (the tiles 6bff5da made the default).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

REPS = 40
TILE_VARIANTS = ("auto", "auto-skip", "auto-noskip", "auto-pf", "auto-pfs", "auto-merge", "auto-unfused",
                 "auto-normroute", "auto-route1", "auto-unfold", "auto-bound", "auto-entrytile", "auto-unfold-bound", "auto-nogemv", "auto-noexgemv", "auto-dot24", "auto-dot32", "auto-csr2", "auto-dsh8", "auto-dsh32", "auto-pvd32", "auto-pvd128", "auto-pva1", "auto-dsb8", "auto-dsb24", "auto-dst128", "auto-dst128b8", "auto-onelaunch", "auto-treeone", "auto-tree", "auto-tsk16", "auto-tsk64", "auto-tsr32", "auto-tsr128", "auto-tph16", "auto-tph64", "auto-tpvd64", "auto-tpvd256", "auto-tpass64", "auto-occ3", "64",
                 "h8")   # and sfHxK, sfHxK+
# Variants that time the routing of a block per row (engine.model.ROUTE_BY_EXPERT off: numerics of
# their own, compared with their own first logits): auto-route1 itself, and the row layout's knobs.
ROW_ROUTING = ("auto-route1", "auto-normroute", "auto-unfused", "auto-dot24", "auto-dot32")
TREE_KNOBS = ("auto-tsk", "auto-tsr", "auto-tph", "auto-tpvd", "auto-tpass")   # auto-tree with a layout knob
SCORE_FIRST_HEADS = (1, 2, 4, 8, 16)  # verify_attention.default_config's score-first tiles
SCORE_FIRST_ROWS = (1, 2, 4, 8)
COLS_VARIANTS = ("auto", "4", "auto-plain", "4-plain", "auto-ring1", "4-ring1", "auto-serial",
                 "auto-serial-mt1", "auto-serial-mt2", "auto-serial-mt3",
                 "auto-serial-l1", "auto-serial-l2", "auto-serial-l4", "auto-serial-odd",
                 "auto-serial-even", "auto-seg", "auto-seg-c32", "auto-seg-c16", "auto-seg-c8", "auto-seg-mt4", "auto-seg-mt8", "auto-seg-split",
                 "auto-seg-l1", "auto-seg-l2", "auto-sx", "auto-sstage", "auto-tc", "auto-tc-ring1", "auto-tc-ring",
                 "auto-seg-occ2", "auto-seg-u3", "auto-seg-u4", *(f"auto-seg-async{n}" for n in range(2, 9)))


class Variant(tuple):
    """One ``TILE/COLS[/pdl|/pdlx]`` variant: the pair ``(tile, cols)`` (equal to that plain
    tuple), ``score_first``, the parsed (H heads, K keys, R score rows) of an ``sfHxK[rR][+]`` or
    ``tsfHxK[rR]`` tile (None for any other tile), ``pdl``, whether its launches are programmatic,
    and ``exit_release``, whether they all release at their blocks' exits (``/pdlx``):
    :func:`_variants` parses a name once."""

    score_first: tuple[int, int, int] | None
    pdl: bool
    exit_release: bool

    def __new__(cls, tile: str, cols: str, score_first: tuple[int, int, int] | None = None,
                pdl: bool = False, exit_release: bool = False) -> Variant:
        self = super().__new__(cls, (tile, cols))
        self.score_first = score_first
        self.pdl = pdl
        self.exit_release = exit_release
        return self

    def __getnewargs__(self) -> tuple:   # copy and pickle call __new__ with these
        return (*self, self.score_first, self.pdl, self.exit_release)

    @property
    def name(self) -> str:
        """``TILE/COLS``, with ``/pdl`` (``/pdlx``) for a programmatic variant (its key in the results)."""
        return f"{self[0]}/{self[1]}" + (("/pdlx" if self.exit_release else "/pdl") if self.pdl else "")


def pass_labels(names: list[str]) -> list[str]:
    """A label a timed pass: the variant's name, with `` #n`` for its n-th pass (n >= 2), so a
    variant named twice keeps both medians (results, same_bits, the HDF5 group's variant axis)."""
    seen: dict[str, int] = {}
    labels = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        labels.append(name if seen[name] == 1 else f"{name} #{seen[name]}")
    return labels


def time_variants(preset: str, past: int, row_counts: list[int], variants: list[Variant],
                  seed: int = 0, same_bits: dict[str, dict[int, bool]] | None = None,
                  logits: dict[int, np.ndarray] | None = None) -> dict[str, dict[int, float]]:
    """Median microseconds per forward, per pass (:func:`pass_labels`) and row count (variants from
    :func:`_variants`).
    ``same_bits``, if given, is filled per variant and row count: whether the logits equal those
    of the first variant of the same numerics (products kind, absorb order, routing layout) at that row count.
    ``logits``, if given, gets the first variant's logits per row count (``--save-logits``)."""
    from cuda.core import Device, EventOptions
    from numba import cuda

    import ddtree_numba.engine.model as em
    import ddtree_numba.kernels.absorb as ab
    import ddtree_numba.kernels.linear as lin
    import ddtree_numba.kernels.linear_tc as ltc
    import ddtree_numba.kernels.model_ops as mo
    from ddtree_numba.kernels import verify_attention as va
    from ddtree_numba.bench.profile_forward import forward_inputs
    from ddtree_numba.config import ModelConfig
    from ddtree_numba.engine.graphs import StepGraph
    from ddtree_numba.engine.model import TargetModel
    from reference.weights import init_weights
    from sim.launch import programmatic_launch_count, programmatic_launches

    config = ModelConfig.from_name(preset)
    weights, caches = init_weights(config, seed), {}   # a cache per products kind (numerics)
    dev = Device()
    dev.set_current()
    stream = dev.create_stream()
    timing = EventOptions(timing_enabled=True)
    saved = (em.FEW_NODES_PER_SM, lin.WIDE_ARCHS, em.ATTENTION_PREFETCH_L2, em.ATTENTION_PREFETCH_CHUNKS,
             em.DECODE_TILE, em.FEW_NODES_TILE, lin.PIPELINE_WEIGHTS, lin.PIPELINE_MIN_ROW_TILE,
             lin.SERIAL_HEADS, em.FEW_NODES_MERGE, lin.SERIAL_ROW_TILES, lin.SERIAL_LEAF_SPLITS,
             lin.ODD_TILES, lin.VECTOR_X_LOADS, lin.VECTOR_STAGING)
    async_ring = (lin.ASYNC_RING_STAGES, lin.ASYNC_RING_MIN_ROW_TILE)
    merge_free = va.MERGE_FREE_SHORT_CACHES
    fused = (em.FUSED_ROPE_KV_WRITE, em.FUSED_MOE_NORM)
    fold, typical_waves, tile_by_rows = em.FOLD_SHARED_EXPERT, lin.EXPERT_TYPICAL_WAVES, em.EXPERT_TILE_BY_ROWS
    row_products, expert_rows = em.ROW_PRODUCTS, em.EXPERT_ROW_PRODUCTS
    dot_loads, csr_inline = mo.DOT_LOADS, mo.ROUTE_CSR_INLINE
    route_by_expert = em.ROUTE_BY_EXPERT
    score_batch, score_threads = va.DECODE_SCORE_BATCH, va.DECODE_SCORE_THREADS
    score_heads, pv_dims, pv_ahead = va.DECODE_SCORE_HEADS, va.DECODE_PV_DIMS, va.DECODE_PV_AHEAD
    release_early = em.PDL_RELEASE_EARLY
    decode_split = va.DECODE_SPLIT
    tree = (va.TREE_SPLIT, va.TREE_SCORE_KEYS, va.TREE_SCORE_ROWS, va.TREE_PV_HEADS, va.TREE_PV_DIMS, va.TREE_PASS)
    occupancy = em.FEW_NODES_MIN_BLOCKS
    odd_blocks = lin.ODD_TILE_BLOCKS
    odd_unroll = lin.ODD_TILE_UNROLL
    first_logits: dict[tuple[str, bool, bool, int], np.ndarray] = {}   # (products, segment absorbs, route by expert, rows)
    same_bits = {} if same_bits is None else same_bits
    skip = em.ATTENTION_SKIP_DEAD_KEYS
    tc_ring = ltc.ASYNC_RING
    few, wide = saved[0], saved[1]
    segment, saved_ab = em.SEGMENT_ABSORBS, (ab.TILE_COL_QUADS, ab.TILE_ROWS, ab.FEW_ROWS, ab.TILE_LANES)
    results: dict[str, dict[int, float]] = {}
    try:
        for variant, label in zip(variants, pass_labels([v.name for v in variants])):
            tile, cols = variant
            em.FEW_NODES_PER_SM = 0 if tile == "64" else few
            em.ATTENTION_PREFETCH_L2 = tile in ("auto-pf", "auto-pfs")
            em.ATTENTION_SKIP_DEAD_KEYS = tile == "auto-skip" or (skip and tile != "auto-noskip")
            em.ATTENTION_PREFETCH_CHUNKS = va.SEGMENT_PREFETCH_CHUNKS if tile == "auto-pfs" else 1
            va.MERGE_FREE_SHORT_CACHES = merge_free and tile not in ("auto-merge", "auto-unfused")
            em.FUSED_ROPE_KV_WRITE = fused[0] and tile != "auto-unfused"
            em.FUSED_MOE_NORM = tile == "auto-normroute" or (fused[1] and tile != "auto-unfused")
            em.FOLD_SHARED_EXPERT = fold and tile not in ("auto-unfold", "auto-unfold-bound")
            lin.EXPERT_TYPICAL_WAVES = typical_waves and tile not in ("auto-bound", "auto-unfold-bound")   # read per call
            em.EXPERT_TILE_BY_ROWS = tile_by_rows and tile not in ("auto-entrytile", "auto-unfold-bound")
            em.ROW_PRODUCTS = row_products and tile != "auto-nogemv"
            em.EXPERT_ROW_PRODUCTS = expert_rows and tile != "auto-noexgemv"
            mo.DOT_LOADS = int(tile[len("auto-dot"):]) if tile.startswith("auto-dot") else dot_loads
            mo.ROUTE_CSR_INLINE = csr_inline and tile != "auto-csr2"
            em.ROUTE_BY_EXPERT = route_by_expert and tile not in ROW_ROUTING   # numerics: its own first logits
            va.DECODE_SCORE_BATCH = {"auto-dsb8": 8, "auto-dsb24": 24, "auto-dst128b8": 8}.get(tile, score_batch)
            va.DECODE_SCORE_THREADS = 128 if tile.startswith("auto-dst128") else score_threads
            va.DECODE_SCORE_HEADS = int(tile[len("auto-dsh"):]) if tile.startswith("auto-dsh") else score_heads
            va.DECODE_PV_DIMS = int(tile[len("auto-pvd"):]) if tile.startswith("auto-pvd") else pv_dims
            va.DECODE_PV_AHEAD = 1 if tile == "auto-pva1" else pv_ahead
            em.PDL_RELEASE_EARLY = variant.pdl and not variant.exit_release   # /pdl early; /pdlx, no PDL: off
            va.DECODE_SPLIT = decode_split and tile != "auto-onelaunch"
            knob = lambda prefix, default: int(tile[len(prefix):]) if tile.startswith(prefix) else default  # noqa: E731
            va.TREE_SPLIT = tile == "auto-tree" or tile.startswith(TREE_KNOBS) or (tree[0] and tile != "auto-treeone")
            va.TREE_SCORE_KEYS, va.TREE_SCORE_ROWS = knob("auto-tsk", tree[1]), knob("auto-tsr", tree[2])
            va.TREE_PV_HEADS, va.TREE_PV_DIMS = knob("auto-tph", tree[3]), knob("auto-tpvd", tree[4])
            va.TREE_PASS = knob("auto-tpass", tree[5])
            em.FEW_NODES_MIN_BLOCKS = 3 if tile == "auto-occ3" else occupancy
            em.DECODE_TILE, em.FEW_NODES_TILE = saved[4], saved[5]
            if tile.startswith("tsf"):  # tsfHxK[rR]: score-first small-tree tiles only
                em.FEW_NODES_TILE = variant.score_first
            elif tile.startswith("sf"):   # sfHxK[rR]: score-first decode tiles; a trailing +: small trees too
                em.DECODE_TILE = variant.score_first
                if tile.endswith("+"):
                    em.FEW_NODES_TILE = variant.score_first
            elif tile == "h8":
                em.DECODE_TILE = 8
            em.FEW_NODES_MERGE = _merge_tile(tile) or saved[9]
            lin.WIDE_ARCHS = () if cols.startswith("4") else wide
            lin.PIPELINE_WEIGHTS = not cols.endswith("-plain")
            lin.PIPELINE_MIN_ROW_TILE = 1 if cols.endswith("-ring1") else saved[7]
            lin.SERIAL_HEADS = "-serial" in cols
            em.SEGMENT_ABSORBS = cols.startswith("auto-seg") or cols.startswith("auto-tc")
            ab.TILE_COL_QUADS = (int(cols.rsplit("-c", 1)[1]),) if "-seg-c" in cols else saved_ab[0]
            ab.TILE_ROWS = 4 if cols.endswith("-mt4") else 8 if cols.endswith("-mt8") else saved_ab[1]
            ab.FEW_ROWS = 1 << 30 if cols.endswith("-split") else saved_ab[2]
            ab.TILE_LANES = _tile_lanes(cols) or saved_ab[3]
            ab.plan_absorb.cache_clear()
            lin.SERIAL_ROW_TILES = (int(cols[-1]),) if cols.startswith("auto-serial-mt") else saved[10]
            lin.SERIAL_LEAF_SPLITS = (int(cols[-1]),) if cols.startswith("auto-serial-l") else saved[11]
            lin.serial_plan.cache_clear()
            lin.VECTOR_X_LOADS = saved[13] and cols != "auto-sx"
            lin.VECTOR_STAGING = saved[14] and cols not in ("auto-sx", "auto-sstage")
            lin.set_odd_tiles(cols.endswith("-odd") or (saved[12] and not cols.endswith("-even")))   # (clears row_tile and the plans)
            lin.set_async_ring(int(cols[len("auto-seg-async"):]) if cols.startswith("auto-seg-async") else async_ring[0])
            lin.set_odd_tile_blocks(2 if cols == "auto-seg-occ2" else odd_blocks)
            lin.set_odd_tile_unroll({"auto-seg-u3": 3, "auto-seg-u4": 4}.get(cols, odd_unroll))
            products = "tensor-core" if cols.startswith("auto-tc") else "cuda-core"
            ltc.set_async_ring({"auto-tc-ring1": (1,), "auto-tc-ring": True}.get(cols, tc_ring))
            per_rows = {}
            programmatic_before = programmatic_launch_count()
            for rows in row_counts:
                model = TargetModel(config, weights, batch_size=1, kv_capacity=past + max(row_counts),
                                    max_rows=rows, cache=caches.get(products), products=products)
                weights = model.weights
                if products not in caches:
                    caches[products] = model.cache
                    model.advance(cuda.to_device(np.array([past], np.int32)))
                args = forward_inputs(rows, past)
                graph = StepGraph(lambda s, m=model, a=args: m.forward(*a, stream=s), stream)
                started = time.perf_counter()
                with programmatic_launches(variant.pdl):   # the warm-up and the capture: the replays keep it
                    graph.warm_up()
                    graph.capture()
                # the first variant's warm-up compiles the engine (minutes): printed at once, so a run
                # stopped by a time limit shows how far it got
                print(f"  {variant.name} {rows} rows: warm-up and capture {time.perf_counter() - started:.1f} s",
                      flush=True)
                for _ in range(5):
                    graph.replay()
                stream.sync()
                times = []
                for _ in range(REPS):
                    e0 = stream.record(options=timing)
                    graph.replay()
                    e1 = stream.record(options=timing)
                    e1.sync()
                    times.append((e1 - e0) * 1e3)
                per_rows[rows] = round(float(np.median(times)), 1)
                host_logits = model.buffers.logits.copy_to_host()   # the replays' (every one the same inputs)
                if logits is not None:
                    logits.setdefault(rows, host_logits)
                same = first_logits.setdefault((products, model._segment_absorbs, model._route_by_expert, rows),
                                               host_logits)
                same_bits.setdefault(label, {})[rows] = bool(np.array_equal(same, host_logits, equal_nan=True))
                graph.close()
            results[label] = per_rows
            programmatic = programmatic_launch_count() - programmatic_before   # > 0 for a /pdl variant on a GPU
            bits = "same bits" if all(same_bits[label].values()) else "DIFFERENT BITS " + json.dumps(
                same_bits[label])
            launch_kind = ("pdlx" if variant.exit_release else "pdl ") if variant.pdl else "    "
            print(f"tile {tile:11s} cols {cols:10s} {launch_kind} " + json.dumps(per_rows)
                  + f" {bits}"
                  + (f" ({programmatic} programmatic launches in warm-up and capture)" if variant.pdl else ""),
                  flush=True)
    finally:   # every switch back, also when a variant fails
        (em.FEW_NODES_PER_SM, lin.WIDE_ARCHS, em.ATTENTION_PREFETCH_L2, em.ATTENTION_PREFETCH_CHUNKS,
         em.DECODE_TILE, em.FEW_NODES_TILE, lin.PIPELINE_WEIGHTS, lin.PIPELINE_MIN_ROW_TILE,
         lin.SERIAL_HEADS, em.FEW_NODES_MERGE, lin.SERIAL_ROW_TILES, lin.SERIAL_LEAF_SPLITS,
         odd, lin.VECTOR_X_LOADS, lin.VECTOR_STAGING) = saved
        em.SEGMENT_ABSORBS = segment
        em.ATTENTION_SKIP_DEAD_KEYS = skip
        ltc.set_async_ring(tc_ring)
        ab.TILE_COL_QUADS, ab.TILE_ROWS, ab.FEW_ROWS, ab.TILE_LANES = saved_ab
        ab.plan_absorb.cache_clear()
        lin.serial_plan.cache_clear()
        lin.set_odd_tiles(odd)   # (clears row_tile and the plans)
        lin.set_async_ring(*async_ring)
        lin.set_odd_tile_blocks(odd_blocks)
        lin.set_odd_tile_unroll(odd_unroll)
        va.MERGE_FREE_SHORT_CACHES = merge_free
        em.FUSED_ROPE_KV_WRITE, em.FUSED_MOE_NORM = fused
        em.FOLD_SHARED_EXPERT, lin.EXPERT_TYPICAL_WAVES, em.EXPERT_TILE_BY_ROWS = fold, typical_waves, tile_by_rows
        em.ROW_PRODUCTS, em.EXPERT_ROW_PRODUCTS = row_products, expert_rows
        mo.DOT_LOADS, mo.ROUTE_CSR_INLINE = dot_loads, csr_inline
        em.ROUTE_BY_EXPERT = route_by_expert
        va.DECODE_SCORE_BATCH, va.DECODE_SCORE_THREADS = score_batch, score_threads
        va.DECODE_SCORE_HEADS, va.DECODE_PV_DIMS, va.DECODE_PV_AHEAD = score_heads, pv_dims, pv_ahead
        em.PDL_RELEASE_EARLY = release_early
        va.DECODE_SPLIT = decode_split
        (va.TREE_SPLIT, va.TREE_SCORE_KEYS, va.TREE_SCORE_ROWS, va.TREE_PV_HEADS, va.TREE_PV_DIMS,
         va.TREE_PASS) = tree
        em.FEW_NODES_MIN_BLOCKS = occupancy
    return results


def _tile_lanes(cols: str) -> int | None:
    """``auto-seg-lN`` -> N, the absorb tiles' segment lanes; None for any other COLS (a name that only
    starts like it gives no count: a run once read the 's' of ``auto-seg-lanes`` as N)."""
    digits = cols[len("auto-seg-l"):] if cols.startswith("auto-seg-l") else ""
    return int(digits) if digits.isdigit() else None


def _score_first_tile(tile: str) -> tuple[int, int, int] | None:
    """``sfHxK[rR][+]`` -> (H heads, K score keys, R score rows, default 1); None for any other
    name (``tsf...`` is parsed without its ``t``)."""
    body = tile[2:].rstrip("+") if tile.startswith("sf") else ""
    heads, _, rest = body.partition("x")
    keys, _, rows = rest.partition("r")
    rows = rows or "1"
    if not (heads.isdigit() and keys.isdigit() and rows.isdigit()):
        return None
    if int(heads) not in SCORE_FIRST_HEADS or int(rows) not in SCORE_FIRST_ROWS or int(heads) % int(rows):
        return None
    return int(heads), int(keys), int(rows)


def _merge_tile(tile: str) -> tuple[int, int] | None:
    """``automTxH`` -> (T merge threads, H merge heads) of the small-tree launches; None else."""
    threads, _, heads = tile[5:].partition("x") if tile.startswith("autom") else ("", "", "")
    if not (threads.isdigit() and heads.isdigit()) or int(threads) % 32 or not 32 <= int(threads) <= 1024 \
            or int(heads) not in (1, 2, 4, 8, 16):
        return None
    return int(threads), int(heads)


def _variants(text: str) -> list[Variant]:
    """``TILE/COLS[/pdl|/pdlx],...`` -> its variants (argparse type: ArgumentTypeError naming a bad one)."""
    out = []
    for item in text.split(","):
        tile, _, cols = item.partition("/")
        cols, slash, launch = cols.partition("/")
        score_first = _score_first_tile(tile[1:] if tile.startswith("tsf") else tile)
        if (tile not in TILE_VARIANTS and not score_first and not _merge_tile(tile)) or cols not in COLS_VARIANTS \
                or (slash and launch not in ("pdl", "pdlx")):
            raise argparse.ArgumentTypeError(f"variant {item!r}: TILE in {'|'.join(TILE_VARIANTS)}|sfHxK[rR][+]|tsfHxK[rR]|automTxH, "
                                             f"COLS in {'|'.join(COLS_VARIANTS)}, then optionally /pdl or /pdlx")
        out.append(Variant(tile, cols, score_first, launch in ("pdl", "pdlx"), launch == "pdlx"))
    return out


def main(argv: list[str] | None = None) -> int:
    from ddtree_numba.bench.common import add_pdl_release_argument
    from ddtree_numba.kernels.pdl import set_release_mode

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--preset", default="small", help="model preset (default: %(default)s)")
    parser.add_argument("--past", type=int, default=192, help="cached rows (default: %(default)s)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 33], help="rows per forward (default: 1 33)")
    parser.add_argument("--variants", type=_variants, default=_variants("auto/auto,64/auto,auto/4,64/4"),
                        help="comma-separated TILE/COLS[/pdl|/pdlx] variants (default: all four pairs of auto/64 "
                             "and auto/4); /pdl: programmatic launches with the early release before weights-first kernels "
                             "(engine.model.PDL_RELEASE_EARLY on), /pdlx: with every release at the blocks' exits "
                             "(off, decode's pdl=True)")
    add_pdl_release_argument(parser, "/pdl and /pdlx variants")
    parser.add_argument("--out", help="append the run to this HDF5 file (bench.common.write_run)")
    parser.add_argument("--save-logits", metavar="NPZ",
                        help="write the first variant's logits per row count (rows_N arrays) to this .npz, atomically: "
                             "another process, say another build of the kernels, then checks its bits with --compare-logits")
    parser.add_argument("--compare-logits", metavar="NPZ",
                        help="compare the first variant's logits with a --save-logits file, bit for bit (dtype, shape "
                             "and bytes); exit 1 if any row count differs or is missing from the file")
    args = parser.parse_args(argv)
    saved_logits = _check_logits_paths(parser, args.save_logits, args.compare_logits)   # before any run
    set_release_mode(args.pdl_release)   # before the first kernel compiles
    same_bits: dict[str, dict[int, bool]] = {}
    logits: dict[int, np.ndarray] = {}
    results = time_variants(args.preset, args.past, args.rows, args.variants, same_bits=same_bits, logits=logits)
    if args.out:
        import xarray as xr

        from ddtree_numba.bench.common import write_run

        names = list(results)
        ds = xr.Dataset({"forward_us": (("variant", "rows"), [[results[v][r] for r in args.rows] for v in names]),
                         "same_bits": (("variant", "rows"),
                                       np.array([[same_bits[v][r] for r in args.rows] for v in names], np.int8))},
                        coords={"variant": names, "rows": args.rows},
                        attrs={"benchmark": "forward_ab", "units": "us", "preset": args.preset, "past": args.past,
                               "pdl_release": args.pdl_release})
        print("wrote", write_run(args.out, ds, command=["forward_ab.py", *(sys.argv[1:] if argv is None else argv)]))
    # the logits after the timings are stored
    status = 0
    if args.save_logits:
        from ddtree_numba.atomic import atomic_path

        with atomic_path(args.save_logits) as tmp, open(tmp, "wb") as f:
            np.savez(f, **{f"rows_{rows}": value for rows, value in logits.items()})
        print("wrote", args.save_logits)
    if saved_logits is not None:
        for rows, value in logits.items():
            verdict = _same_bits_verdict(saved_logits.get(f"rows_{rows}"), value)
            print(f"logits at {rows} rows: {verdict} {args.compare_logits}", flush=True)
            status = status if verdict == "same bits as" else 1
    return status


def _check_logits_paths(parser: argparse.ArgumentParser, save: str | None,
                        compare: str | None) -> dict[str, np.ndarray] | None:
    """--save-logits / --compare-logits checked before any run (parser.error, exit 2): the save
    path a file in an existing, writable directory, not the compare path; the compare file a
    readable .npz, returned as its arrays."""
    if save:
        folder = os.path.dirname(os.path.abspath(save))
        if os.path.isdir(save) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            parser.error(f"--save-logits: {save!r} must be a file in an existing, writable directory")
        if compare and os.path.abspath(save) == os.path.abspath(compare):
            parser.error("--save-logits and --compare-logits name the same file")
    if not compare:
        return None
    if not os.path.isfile(compare):
        parser.error(f"--compare-logits: {compare!r} does not exist")
    try:
        with np.load(compare) as data:
            return {key: data[key] for key in data.files}
    except (OSError, ValueError) as exc:   # not an .npz (np.load raises either)
        parser.error(f"--compare-logits: {compare!r} is not a --save-logits .npz ({exc})")


def _same_bits_verdict(saved: np.ndarray | None, value: np.ndarray) -> str:
    """Bit for bit: the same dtype, shape and bytes (so -0.0 is not 0.0, NaN payloads count)."""
    if saved is None:
        return "MISSING from"
    same = saved.dtype == value.dtype and saved.shape == value.shape and saved.tobytes() == value.tobytes()
    return "same bits as" if same else "DIFFERENT BITS from"


if __name__ == "__main__":
    raise SystemExit(main())
