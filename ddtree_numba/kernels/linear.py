"""Batch-invariant FP32 matrix products with HF ``[out, in]`` weights: ``linear``,
``head_linear`` (per-head groups), ``expert_linear`` (MoE groups over a CSR routing) and
``linear_argmax`` (the lm_head fused with the greedy posterior's argmax).

Numerics: one reduction order per K, whatever shares the launch.
    Output element ``(m, n)`` is the dot product of input row m (after the prologue) with weight
    row n. K is cut into ``k_split(K)`` contiguous segments of ``seg_steps`` steps of
    ``STEP = 128`` values; in every step lane ``l`` of a warp owns ``k = 128 j + 4 l + e``,
    e = 0..3. Per segment, each lane runs ONE fma chain over its k (j ascending, then e
    ascending; k >= K skipped), the 32 lane partials are summed by the fixed xor butterfly
    (offsets 16, 8, 4, 2, 1, :func:`.warp.warp_sum_f32`), and the segment sums are added in
    segment order: ``((s_0 + s_1) + s_2) + ...``. ``k_split`` and ``seg_steps`` are functions of K
    only, every product is an explicit ``cuda.fma`` (no contraction choice left to the
    compiler), and the row tile, the column group and the launch shape only decide WHICH
    elements a warp computes, never how. So row m's output is bit-identical whether it is
    computed alone, in a batch of 7 or in a tree-verify batch of 1056 rows, and run to run (no
    atomics): what makes DDTree verification lossless (spec §1.4).

Work layout (limits §3, §7).
    A block computes an ``MT x (C * groups)`` output tile: MT rows (compile-time row tile, 1 to
    8, or 11 for many rows (ODD_TILES): a 33-row tree in 3 tiles instead of 5) by column
    groups of C adjacent columns (4, or 8 for the 8-row tile on sm_90: :func:`columns`), one
    column group per
    ``k_split`` warps (one warp per K segment). Grid:
    (row tiles, column blocks[, heads]): blockIdx.x, the fastest, is the row tile, so the row
    tiles of one column block run side by side and its weight rows come from HBM once and from
    L2 for the others (column-fastest, a 1056-row launch streamed W 132 times). The MT input
    rows are staged in dynamic shared memory ``[MT, k_split, phase_steps * 128]`` with the
    prologue applied (none, RMSNorm with the row's rms, or SwiGLU); a thread stages 4 adjacent
    k of every row with one 16-byte load and one 16-byte shared store a row (STAGE_LOADS // MT
    such positions a round, at least one, all loads in flight) where K % 4 == 0 and the rows
    (and the RMSNorm weight) sit on 16 bytes, else one k a load (VECTOR_STAGING; the head
    kind's 8 x 8 tile always one k a load). When they fit in one phase a block stages them once and
    loops over column blocks (grid-stride, about one block per SM: decode streams W with no tail
    wave). The staging budget (:func:`xs_budget`) is the device's opt-in shared memory on a GPU
    (H200: 215 KiB of 227; launches above 48 KiB go through ``sim.launch.opt_in_shared``) and
    40 KiB in the simulator; :func:`row_tile` halves MT while its rows overflow the budget and a
    smaller tile fits (33 rows at K 8192: 4-row tiles), and only when no tile fits are the rows
    restaged in phases for every column block (two barriers and a staging latency per phase and
    column block). The weight stream is the hot
    path: each lane issues ``U x C`` 16-byte loads (``ld.global.nc.v4.f32``, addressed from the
    weight's data pointer) before their ``4 * MT * C`` FMAs, lanes covering 512 contiguous bytes
    of a weight row per load; each staged float4 (one 16-byte shared load) feeds ``4 * C`` FMAs.
    Columns past N load the last row and are not stored; rows past M are staged as zeros and
    not stored. The lane partials are reduced by a transposed butterfly: at each xor offset a
    lane trades half of its MT x C partials with its partner, so the same pairs are summed as
    in warp_sum_f32 (bit-identical, a + b == b + a) with MT * C - 1 shuffles instead of
    5 * MT * C; lane l then owns fixed elements (:func:`get_kernel`'s ``owned_element``).

Weight ring (row tiles of at least ``PIPELINE_MIN_ROW_TILE`` rows, :func:`ring_for`;
    :func:`get_kernel`'s ``pipelined``). The U weight slots of a lane form a ring: the loads of step j + U - 1 are issued before the FMAs of step j, so U - 1
    steps of loads stay in flight through every FMA phase instead of a warp issuing its loads
    and then waiting on them (long_scoreboard stalls with 8 warps per SM). A segment's last
    steps come from the ring too, loads past its vector steps clamped to the last one (never out
    of bounds, unused); the 8-row tiles (U = 2) load their last 1-2 steps one at a time
    (registers). Layout, not numerics: the same fma chains in the same order, bit for bit with
    the load-then-FMA loop (tested both ways), in the same U x C x 4 weight registers.

Async weight ring (off by default: ASYNC_RING_STAGES, :func:`_launch_plan`). The weights'
    vector steps go through D step slots a warp in dynamic shared memory after the staged rows
    (``[warps, D, C, 128]`` floats), filled by ``cp.async`` (:func:`copy_async16`) D - 1 steps
    ahead of the FMAs; each lane reads back with one 16-byte shared load only the quads it
    copied, so no barrier is needed, and ``cp.async.wait_group D - 2`` orders the copies before
    those loads. With rows staged once, a column block's first D - 1 steps are copied before the
    rows' staging (and, for the linear and argmax kinds, their rms) for the first block, or under
    the previous block's butterfly and stores.
    Layout only: the same values reach the same fma chains.

Decode (M = 1..16) streams W at HBM bandwidth when enough loads are in flight: C = 4 columns
and U = 2-4 steps per lane, 8 warps per block. Large K is split over up to 8 warps
(``k_split``) so that narrow outputs (N = 2048, K = 8192) still fill the GPU. The simulator
(threads are Python threads, shuffles cost a thread barrier each) runs one column group per
block over a grid-stride loop and reduces through shared memory in the butterfly's exact tree
(``shuffles=False``), so its results are the same bits the shuffles give (tested both ways).

Host cost: launch plans and checked launch configurations are cached per shape
(``functools.lru_cache``); a call reads each argument's dtype, shape and strides once and
launches the cached kernel directly (its configuration was checked against the device profile
when the plan was made, sim.launch.check_launch); no NumPy work, no reshaped views.

Fused argmax (``linear_argmax``, PERFORMANCE "Posterior, accept walk and KV compaction").
    The full logits of a verify batch (bs 64 x 513 rows x V 163840 fp32 = 21.5 GB) cost 5 ms to
    write and 5 ms to read back for the argmax. ``linear_argmax`` runs the SAME tile code as
    ``linear`` (so every logit has ``linear``'s bits) but instead of storing a logit it ranks it:
    the columns are cut into ``argmax_parts(N)`` parts of ``argmax_part_cols(N)`` contiguous
    columns (a function of N only), one block per (row tile, part); the lane that owns an
    output element keeps a running (max value, lowest column) over the part's column groups,
    and the block reduces its lanes to one candidate per row: ``part_val`` float32 [M, P],
    ``part_idx`` int32 [M, P]. :func:`.accept.posterior_argmax_parts` merges the P candidates of
    a row. The ranking is :func:`.accept.outranks` (ties -> lower id, NaN logits skipped): the
    merged token is bit for bit ``posterior_argmax(linear(...))``. P is ~96 on a GPU (8 bytes x
    96 per row for the merge to read, and still ~96 blocks for a decode step), parts of 8
    columns under the simulator (so tiny tests cross parts).

Compile-time specialisations (closure factory, registered with real signatures): kind
(linear / head / expert / argmax) x prologue (none / rmsnorm / swiglu) x residual epilogue x MT.

Device-side inputs (expert ``row_offsets`` / ``row_index``) are not checked on the host (no
copy, graph-capturable); an entry whose row index is outside x gets a NaN output row, offsets
are clamped to the entries, never indexed out of bounds.
"""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np
from llvmlite import ir
from numba import cuda, float32, int32, int64, types, uint64

from sim.launch import check_launch, launch, launch_bounds, opt_in_shared
from sim.profiles import active_profile

from ._args import as_kernel_array, data_address, int_arg, is_c_contiguous, is_device_array
from .accept import NEG_INF_F32, NO_INDEX, outranks
from .pdl import pdl_begin
from .registry import register
from .warp import warp_inclusive_scan_i32, warp_min_i32, warp_sum_f32

__all__ = [
    "ROW_TILES",
    "STEP",
    "BLOCK_WARPS",
    "MAX_EXPERTS",
    "COLUMNS",
    "WIDE_COLUMNS",
    "WIDE_ARCHS",
    "columns",
    "LinearPlan",
    "k_split",
    "row_tile",
    "set_odd_tiles",
    "set_odd_tile_blocks",
    "blocks_per_sm",
    "set_async_ring",
    "check_ring_stages",
    "plan_linear",
    "expert_busy_tiles",
    "expert_wave_tiles",
    "expert_slots",
    "linear",
    "head_linear",
    "check_expert_args",
    "expert_linear",
    "argmax_part_cols",
    "argmax_parts",
    "linear_argmax",
    "split_k_segments",
    "split_k_pays",
    "split_k_weight",
    "linear_split_k",
    "swiglu_rows",
    "get_kernel",
    "SERIAL_HEADS",
    "SERIAL_MIN_ROWS",
    "serial_plan",
    "get_serial_kernel",
]

WARP = 32
VEC = 4                      # floats per lane per step (one 16-byte load)
STEP = WARP * VEC            # 128 k values per warp step
STEP_SHIFT = STEP.bit_length() - 1
SPLIT_STEPS = 16             # a segment of K per warp holds at least ~2048 values
MAX_K_SPLIT = 8              # K segments (one warp each) per column group, at most
BLOCK_WARPS = MAX_K_SPLIT    # warps per block on a GPU (k_split divides it)
SIM_GROUPS = 1               # column groups per block under the simulator (threads are costly)
SIM_GRID_COLS = 1            # column-group blocks under the simulator (grid-stride loop)
# C: adjacent output columns per warp (16 FMAs per staged float4). The 8-row tile is 8 x 8 on
# sm_90 (251 registers, no spill; measured on the H200 at 13-15 TFLOP/s for M >= 64, run
# 18774bc); it spills 128-188 B on sm_120 at the 255-register cap, so there (and for argmax,
# one ranked element per lane) every tile keeps 4 columns. C is layout, never the order.
COLUMNS = 4
WIDE_COLUMNS = 8
WIDE_ARCHS = ("sm_90",)
ROW_TILES = (1, 2, 4, 8)     # 16 rows: LLVM leaves the row loop rolled, acc goes to local memory
MAX_ROW_TILE = ROW_TILES[-1]
# Many-row tiles off the powers of two (linear and head kinds, C = COLUMNS): a B 32 tree's 33 rows
# in 3 x 11 instead of 5 x 8, the fifth 8-row tile holding one row. Their MT x C partials are
# reduced by the transposed butterfly padded to a power of two (zeros, never stored). On
# (ODD_TILES; switch it with :func:`set_odd_tiles`): a 33-row forward on the H200 took 2632.0 /
# 2634.5 us with them against 2692.2 / 2704.5 with 8-row tiles only (PERFORMANCE, run odd tiles);
# bench.forward_ab's ``auto-serial-even`` variant switches it off.
ODD_ROW_TILES = (11,)
ODD_KINDS = ("linear", "head")
ODD_TILES = True
XS_BUDGET_BYTES = 40 * 1024  # staged input rows; with the static arrays < 48 KiB (limits §4)
# On a GPU the staged rows may use the opt-in limit (sim.launch.opt_in_shared; H200 227 KiB,
# sm_120 99 KiB) less the static arrays (bounded by all of them together: comb 2 KiB, expert
# offsets 4 KiB, argmax candidates 4 KiB) and the system's 1 KiB per block: one block per SM
# either way (launch bounds).
STATIC_BOUND_BYTES = 11 * 1024
STATIC_RESERVE_BYTES = STATIC_BOUND_BYTES + 1024
STAGE_LOADS = 8              # staging: loads in flight per thread (SU positions x MT rows)
RMS_LOADS = 32               # the RMSNorm prologue's rms: loads in flight per lane (K 2048: 2 rounds, K 768: 1)
PERSIST_BLOCKS_PER_SM = 1    # one-phase tiles: a block loops over column blocks (x staged once)
# Blocks an SM that the odd (11-row) tiles' launch bounds ask for and their grids count on: 1 by
# default (236-250 registers, 8 warps an SM); 2 caps them at 128 registers (spills of 192-264 /
# 320-492 bytes on sm_90; the densest ~320-FFMA stretch of the FMA loop's SASS holds 2-3 of the
# local loads, the rest lie outside it) for 16 warps an SM, where the two
# blocks' staged rows fit an SM's shared memory (else 1). Layout, not numerics. Off: timed slower,
# a 33-row forward 2371.5 / 2365.9 us against 2179.0 / 2179.3 (H100, PERFORMANCE.md run occ2): the
# doubled warps do not pay for the spills (bench.forward_ab's ``auto-seg-occ2`` times it).
ODD_TILE_BLOCKS = 1
# Weight steps an odd (11-row) tile's register ring holds (U; U - 1 steps of loads in flight while a
# step's fmas run). 3 or 4 build the ring's rounds as Python-unrolled chains (:func:`_chain`): LLVM
# left the loop over slots rolled at these sizes and put the ring in local memory (192 / 256-byte
# stacks). Layout, not numerics. 2: the deeper rings timed slower, a 33-row forward 2234.5 / 2244.6
# (U 3) and 2237.7 / 2249.8 us (U 4) against 2182.6 / 2173.9 (H100, PERFORMANCE.md run occ2).
ODD_TILE_UNROLL = 2
MAX_GRID_Y = 65535           # CUDA's grid y / z limit: column blocks past it are grid-strided
MAX_EXPERTS = 1024           # expert_linear stages row_offsets [E + 1] in shared memory
# expert_linear's grid covers expert_slots' bound (any routing), but its column blocks (grid y)
# are chosen for the tiles a uniform routing fills (:func:`expert_busy_tiles`): the blocks of empty
# slots exit at once. By the bound, 33 rows with the shared expert folded in (165 entries, 17
# experts, 8-row tiles) were 35 slots, 140 blocks at y = 4, two waves on 132 SMs, so y = 3 (the
# H200, session script: the two launches 79.4 us, against 63.7 without the shared expert at
# (30, 4)); ~29 tiles are filled: y = 4. Layout, not numerics. In a forward (run "fold timed",
# bench.forward_ab's ``auto-bound``): 76.7 us off a 33-row one, an AR step's grid unchanged.
EXPERT_TYPICAL_WAVES = True
FULL_MASK = 0xFFFFFFFF
NO_SLOT = np.int32(2**31 - 1)  # warp_min identity: "this lane holds no tile"
PROLOGUES = ("none", "rmsnorm", "swiglu")
KINDS = ("linear", "head", "expert", "argmax")
RED_ROW = WARP + 1           # simulator reduction rows, padded
SIM_TREE = bool(cuda.config.ENABLE_CUDASIM)  # frozen: the GPU build keeps only the shuffles
# linear_argmax parts: a multiple of every block's columns per pass (groups_per_block * C, at
# most BLOCK_WARPS * C), so a part is whole passes; at most TARGET_PARTS parts and at most one
# per MIN_PART_COLS columns (the simulator runs one group per block and wants small parts)
PART_ALIGN = COLUMNS * (SIM_GROUPS if SIM_TREE else BLOCK_WARPS)
MIN_PART_COLS = PART_ALIGN * (2 if SIM_TREE else 8)
TARGET_PARTS = 96
ZERO = np.float32(0.0)
ONE = np.float32(1.0)
F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)
MAX_DIM = np.iinfo(np.int32).max // 2   # int32 geometry with room for offsets
# staged rows: 16-byte shared loads (shared_x4); the simulator takes no alignment
XS_ALIGN = None if SIM_TREE else 4 * VEC


# The weight loop per row tile: the ring (module docstring: the next steps' loads issued before
# the current step's FMAs) for row tiles of at least PIPELINE_MIN_ROW_TILE rows (a tree verify),
# load-then-FMA below (an AR step: a first version of the ring slowed the 1-row forward of
# `small` on the H200 and sped up the 33-row one, PERFORMANCE.md run "score rows").
# PIPELINE_WEIGHTS off: load-then-FMA everywhere. Layout only: the same bits either way.
PIPELINE_WEIGHTS = True
PIPELINE_MIN_ROW_TILE = 4
# The staged rows' traffic (layout only, the same values; get_kernel's vector_x / vector_stage,
# read per launch shape by _setup so that a bench can switch them). The FMA loop's reads of a
# lane's 4 staged floats were four scalar shared loads until run "quads": 4 lanes on each bank,
# 16 wavefronts a row and step where one 16-byte load takes 4. Staging moved one float a load.
VECTOR_X_LOADS = True
VECTOR_STAGING = True
# The weights' async ring (get_kernel's ring_stages; layout only, the same bits): row tiles of at
# least ASYNC_RING_MIN_ROW_TILE rows whose blocks loop over at least ASYNC_RING_MIN_LOOPS column
# blocks (:func:`_launch_plan`) stream W through ASYNC_RING_STAGES step slots a warp in shared
# memory, filled by cp.async D - 1 steps ahead, a column block's first copies issued before the
# rows' staging or under the previous block's butterfly (0: off, the register ring /
# load-then-FMA rounds above). The ring takes at most RING_BUDGET_BYTES of the staging budget
# (fewer slots where the staged rows leave less; off below 2 and where rows are staged in
# phases). W's loads in flight cost no registers (the register ring kept 1 step ahead at the
# 11-row tile: 2 or 3 spilled it, run lane squares).
# Off by default: on the H200 (run ring) it made the 33-row w_q and dense gate | up 8 % faster
# alone but the 33-row w_a 18 % and the 1-row tiles up to 13 % slower; in one process with this
# plan (run async pair, two interleaved passes of bench.forward_ab) the 33-row forward took
# 2313.9 / 2310.7 us with 4 slots and 2307.6 / 2311.8 with 3, against 2276.5 / 2277.3 without
# (the 1-row forward, which it leaves alone: 1081-1083 us in every setting). Switch with
# :func:`set_async_ring` (clears the plans), ``bench.decode_step --ring 4`` or
# ``bench.forward_ab``'s ``auto-seg-async4``.
ASYNC_RING_STAGES = 0
ASYNC_RING_MIN_ROW_TILE = 8
ASYNC_RING_MIN_LOOPS = 2
MAX_RING_STAGES = 8
RING_BUDGET_BYTES = (32 if SIM_TREE else 96) * 1024   # sim: 2 slots of 8 warps over a 40 KiB budget


def check_blocks(blocks: Any, name: str = "blocks") -> None:
    """ValueError naming ``name`` unless ``blocks`` (blocks an SM a launch bound asks for) is the
    int 1 or 2."""
    if isinstance(blocks, bool) or not isinstance(blocks, numbers.Integral) or blocks not in (1, 2):
        raise ValueError(f"{name} must be 1 or 2, got {blocks!r}")


def check_unroll(unroll: Any, name: str = "unroll") -> None:
    """ValueError naming ``name`` unless ``unroll`` (weight steps a register ring holds) is the int
    2, 3 or 4."""
    if isinstance(unroll, bool) or not isinstance(unroll, numbers.Integral) or unroll not in (2, 3, 4):
        raise ValueError(f"{name} must be 2, 3 or 4, got {unroll!r}")


def check_ring_stages(stages: Any, name: str = "stages") -> None:
    """Raise ValueError naming ``name`` unless ``stages`` is an int, 0 (no async ring) or
    2..MAX_RING_STAGES."""
    if isinstance(stages, bool) or not isinstance(stages, numbers.Integral) or \
            not (stages == 0 or 2 <= stages <= MAX_RING_STAGES):
        raise ValueError(f"{name} must be 0 or 2-{MAX_RING_STAGES}, got {stages!r}")


def ring_for(mt: int) -> bool:
    """Whether row tiles of ``mt`` rows stream their weights through the ring."""
    return PIPELINE_WEIGHTS and mt >= PIPELINE_MIN_ROW_TILE


def _unroll(mt: int, c: int) -> int:
    """Weight steps loaded before their FMAs (U x C float4 loads in flight per lane; the 4 x 4
    tile takes 4: 64 registers of weights next to 16 accumulators; the odd tiles ODD_TILE_UNROLL)."""
    if mt in ODD_ROW_TILES:
        return ODD_TILE_UNROLL
    return 4 if mt * c <= 16 else 2


def set_odd_tile_unroll(unroll: int) -> int:
    """Set ODD_TILE_UNROLL (2, 3 or 4) and clear the launch cache that holds the kernels built with
    it (_setup). Returns the previous setting."""
    global ODD_TILE_UNROLL
    check_unroll(unroll)
    previous, ODD_TILE_UNROLL = ODD_TILE_UNROLL, int(unroll)
    _setup.cache_clear()
    return previous


def _chain(make_step: Any, count: int) -> Any:
    """A device function running ``make_step(k, rest)``'s steps k = 0 .. count - 1 in order, each a
    device function ``(w, wbase, j, jl, jv, xs, xo0, row_floats, wv, acc)`` that does step k and then
    calls ``rest``: an unroll at the Python level, so a step's ring slot is a constant (LLVM left
    loops of this size rolled, and a rolled slot index kept the ring in local memory)."""
    @cuda.jit(device=True, **LOCAL_INLINE)
    def done(w, wbase, j, jl, jv, xs, xo0, row_floats, wv, acc):
        pass

    chained = done
    for k in reversed(range(count)):
        chained = make_step(k, chained)
    return chained


# --- the 16-byte weight load --------------------------------------------------------------------

def vector_load(context: Any, builder: Any, signature: Any, ptr: Any) -> Any:
    """Codegen of a 16-byte ``ld.global.nc.v4.f32`` at ``ptr`` (float*), returned as the
    intrinsic's UniTuple(float32, 4) (GPU build only; x and weights are read-only in a kernel
    once its ``pdl_begin`` has returned: the previous kernel wrote x).

    The asm has no side effects (so LLVM may schedule, merge and drop it like a load), which
    also lets LLVM execute it whatever branch guards it: a caller's address must be inside the
    array even where the guard is false (verify_attention's ``load_row_f32x4`` clamps its
    latent and rope addresses, and linear's quad staging its row and k). The guarded loads of the
    absorb kernels and of ``head_linear``'s staging still form addresses past their arrays where
    the guard is false:
    in their sm_90 PTX (checked for the absorb kernels) each sits in a block with its own
    address arithmetic and stays a branch, and compute-sanitizer found nothing there, but
    that is the compiler's choice, not the code's."""
    f32 = ir.FloatType()
    asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([f32] * VEC), [ptr.type]),
                       "ld.global.nc.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l")
    value = builder.call(asm, [ptr])
    return context.make_tuple(builder, signature.return_type, [builder.extract_value(value, e) for e in range(VEC)])


def _make_loads() -> tuple[Any, Any]:
    """``load_f32x4(w, i) -> (w.flat[i], ..., w.flat[i + 3])`` and ``load_f32(w, i) -> w.flat[i]``
    for a C-contiguous float32 weight of any rank, element i 16-byte aligned for the vector load:
    ``ld.global.nc.v4.f32`` / ``ld.global.nc.f32`` at the data pointer plus i on a GPU (numba-cuda
    has no vector load, stack §1; a flat index needs no reshaped view, one host call less per
    launch), plain element reads of the flat view the wrappers pass under the simulator."""
    if cuda.config.ENABLE_CUDASIM:
        def load_f32x4(w, i):
            return w[i], w[i + 1], w[i + 2], w[i + 3]

        def load_f32(w, i):
            return w[i]
        return load_f32x4, load_f32

    from numba.cuda.extending import intrinsic

    def _pointer(context, builder, signature, args):
        array_type, index_type = signature.args
        ary = context.make_array(array_type)(context, builder, value=args[0])
        idx = context.cast(builder, args[1], index_type, types.intp)
        return builder.gep(ary.data, [idx])

    def _accepts(array, index) -> bool:
        return (isinstance(array, types.Array) and array.layout == "C"
                and array.dtype == types.float32 and isinstance(index, types.Integer))

    @intrinsic
    def load_f32x4(typingctx, array, index):
        if not _accepts(array, index):
            return None
        sig = types.UniTuple(types.float32, 4)(array, index)

        def codegen(context, builder, signature, args):
            # Weights are read-only for the kernel's lifetime: the non-coherent path is safe.
            return vector_load(context, builder, signature, _pointer(context, builder, signature, args))

        return sig, codegen

    @intrinsic
    def load_f32(typingctx, array, index):
        if not _accepts(array, index):
            return None
        sig = types.float32(array, index)

        def codegen(context, builder, signature, args):
            ptr = _pointer(context, builder, signature, args)
            asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [ptr.type]),
                               "ld.global.nc.f32 $0, [$1];", "=f,l")
            return builder.call(asm, [ptr])

        return sig, codegen

    return load_f32x4, load_f32


load_f32x4, load_f32 = _make_loads()


def _make_async_copy() -> tuple[Any, Any, Any]:
    """The weight ring's copies (sm_80 on): ``copy_async16(sh, i, w, k)`` starts a 16-byte copy
    of ``w.flat[k : k + 4]`` into the shared float32 array ``sh[i : i + 4]`` (both 16-byte
    aligned) without registers (``cp.async.cg.shared.global``, L2 to shared memory);
    ``commit_async()`` closes the thread's copies issued since the last commit into a group
    (``cp.async.commit_group``; a group may be empty); ``wait_async(n)`` (``n`` a Python int,
    fixed when the kernel is built) returns the device function that waits until at most the
    ``n`` most recent groups of this thread are pending (``cp.async.wait_group n``): the older
    groups' values are then in shared memory and visible to this thread. Every asm has side
    effects and clobbers memory, so LLVM keeps them in program order with the shared loads
    around them. Under the simulator (each CUDA thread a Python thread) a copy reads its four
    source floats and queues them in the thread's open group; ``commit_async`` closes the group
    and ``wait_async(n)`` writes every group but the newest n into shared memory, in order: a
    read of a slot whose copy has not been waited for sees the slot's old values, as it may on a
    GPU, so a wrong wait count changes the bits the tests compare."""
    if cuda.config.ENABLE_CUDASIM:
        from sim.scheduler import thread_local

        def _groups() -> list:
            # this CUDA thread's own (the simulator's threads are pooled: a threading.local would
            # carry a block's unwaited groups into the next block the worker runs)
            return thread_local().setdefault("cp_async_groups", [[]])   # the closed groups, then the open one

        def copy_async16(sh, i, w, k):
            _groups()[-1].append((sh, int(i), (w[k], w[k + 1], w[k + 2], w[k + 3])))

        def commit_async():
            _groups().append([])

        def _wait(n: int) -> Any:
            def wait_async():
                groups = _groups()
                closed = len(groups) - 1
                for group in groups[:max(0, closed - n)]:
                    for sh, i, values in group:
                        for e in range(VEC):
                            sh[i + e] = values[e]
                del groups[:max(0, closed - n)]
            return wait_async

        return copy_async16, commit_async, functools.cache(_wait)

    from numba.cuda.extending import intrinsic

    def _asm(builder, text, args=(), constraints=""):
        fnty = ir.FunctionType(ir.VoidType(), [a.type for a in args])
        clobber = "~{memory}" if not constraints else constraints + ",~{memory}"
        builder.call(ir.InlineAsm(fnty, text, clobber, side_effect=True), list(args))

    @intrinsic
    def copy_async16(typingctx, sh, i, w, k):
        if not (isinstance(sh, types.Array) and sh.dtype == types.float32 and isinstance(i, types.Integer)
                and isinstance(w, types.Array) and w.layout == "C" and w.dtype == types.float32
                and isinstance(k, types.Integer)):
            return None
        sig = types.void(sh, i, w, k)

        def codegen(context, builder, signature, args):
            sh_ary = context.make_array(signature.args[0])(context, builder, value=args[0])
            w_ary = context.make_array(signature.args[2])(context, builder, value=args[2])
            i_ = context.cast(builder, args[1], signature.args[1], types.intp)
            k_ = context.cast(builder, args[3], signature.args[3], types.intp)
            dst = builder.addrspacecast(builder.gep(sh_ary.data, [i_]), ir.PointerType(ir.FloatType(), 3))
            dst32 = builder.ptrtoint(dst, ir.IntType(32))       # a shared address fits 32 bits
            src = builder.gep(w_ary.data, [k_])
            _asm(builder, "cp.async.cg.shared.global [$0], [$1], 16;", (dst32, src), "r,l")
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def commit_async(typingctx):
        def codegen(context, builder, signature, args):
            _asm(builder, "cp.async.commit_group;")
            return context.get_dummy_value()

        return types.void(), codegen

    @functools.cache
    def _wait(n: int) -> Any:
        if not 0 <= n < 8:
            raise ValueError(f"wait_async: n must be 0-7, got {n!r}")

        @intrinsic
        def wait_group(typingctx):
            def codegen(context, builder, signature, args):
                _asm(builder, f"cp.async.wait_group {n};")
                return context.get_dummy_value()

            return types.void(), codegen

        @cuda.jit(device=True, inline="always")
        def wait_async():
            wait_group()
        return wait_async

    return copy_async16, commit_async, _wait


copy_async16, commit_async, wait_async = _make_async_copy()


# --- device helpers shared by every specialisation ----------------------------------------------

# Inlining. The device functions that only this module's kernels call are inlined by LLVM
# (forceinline=True: NVVM's alwaysinline) rather than by numba's IR inliner (inline="always"),
# which was most of a compile of these kernels: every kernel x signature of the compile check for
# sm_90 and sm_120 took 7m16s with the IR inliner here and 4m45s with LLVM's (2 cores), with the
# same registers and cubin sizes for every kernel outside this module. The helpers other modules
# import (_silu_mul, _row_inv_rms, warp_place, wait_async: gemv's 1-row products, linear_tc) keep
# the IR inliner, so those kernels' code stays as timed: with LLVM's inliner everywhere (a build
# not kept) an AR forward on the H100 gave the same logits bit for bit and took ~8 us more
# (PERFORMANCE.md run "inline"); this split gave the IR inliner's logits (values compared) in the
# same time (H100, run "branches").
# The simulator's jit takes no forceinline (it runs the Python functions): there, inline="always".
LOCAL_INLINE = {"inline": "always"} if SIM_TREE else {"forceinline": True}

@cuda.jit(device=True, inline="always")
def _silu_mul(gate, up):
    """silu(gate) * up in float32 (gate / (1 + exp(-gate)), as reference.model.silu)."""
    return gate / (ONE + math.exp(-gate)) * up


@cuda.jit(device=True, inline="always")
def _row_inv_rms(x, row, k_dim, eps, lane):
    """1 / sqrt(mean(x[row, :K]^2) + eps), on every lane: lane l sums k = l, l + 32, ...
    ascending (fma chain), then the butterfly: a function of K only. A lane issues RMS_LOADS
    loads (unsigned indices) before their fmas; the last, partial batch holds zeros past K, and
    fma(0, 0, t) is t exactly (t >= +0), so the chain and its bits are those of one fma per
    element. A signed index costs each load a negative-index wraparound, and ptxas then kept 4
    loads ahead of the chain: 16 round trips a lane at K 2048 before the block could stage x."""
    staged = cuda.local.array(RMS_LOADS, float32)   # registers once the loops are unrolled
    total = ZERO
    r = uint64(row)
    k = uint64(lane)
    end = uint64(k_dim)
    span = uint64((RMS_LOADS - 1) * WARP)
    while k + span < end:                # whole batches: all loads first
        for u in range(RMS_LOADS):
            staged[u] = x[r, k + uint64(u * WARP)]
        for u in range(RMS_LOADS):
            total = cuda.fma(staged[u], staged[u], total)
        k += uint64(RMS_LOADS * WARP)
    if k < end:                          # the last, partial batch: zeros past K
        for u in range(RMS_LOADS):
            at = k + uint64(u * WARP)
            staged[u] = x[r, at] if at < end else ZERO
        for u in range(RMS_LOADS):
            total = cuda.fma(staged[u], staged[u], total)
    total = warp_sum_f32(total)
    return ONE / math.sqrt(total / float32(k_dim) + eps)


@cuda.jit(device=True, inline="always")
def warp_place(k_split_):
    """(lane, warp, K segment, column group, column groups a block) of this thread: warp = group *
    k_split + segment. k_split_ is a power of two (k_split): shifts and masks, not runtime divisions."""
    lane = cuda.threadIdx.x % WARP
    warp = cuda.threadIdx.x // WARP
    ks_shift = 0
    while (1 << ks_shift) < k_split_:
        ks_shift += 1
    return lane, warp, warp & (k_split_ - 1), warp >> ks_shift, (cuda.blockDim.x // WARP) >> ks_shift


@cuda.jit(device=True, **LOCAL_INLINE)
def _staged_k(pos, row_floats, kcw, seg_steps, phase, phase_steps, total_steps, k_dim):
    """(k, inside) of staged offset ``pos`` of a row: pos = s * kcw + r (segment s, offset r) holds
    k = (s * seg_steps + phase * phase_steps) * STEP + r; inside: within the row's staged floats,
    the segment's steps and K. The split takes no division: a runtime divisor made each position
    a 64-bit division and its floor fix-up (linear_none_mt1's sm_90 PTX: 2967 instructions with
    them, 1751 without; PERFORMANCE, run odd tiles)."""
    s = 0
    r = pos
    if pos < row_floats:
        while r >= kcw:
            r -= kcw
            s += 1
    j = s * seg_steps + phase * phase_steps + (r >> STEP_SHIFT)
    k = j * STEP + (r & (STEP - 1))
    inside = pos < row_floats and j < min((s + 1) * seg_steps, total_steps) and k < k_dim
    return k, inside


@cuda.jit(device=True, **LOCAL_INLINE)
def _tree_sum(red, base):
    """Sum of red[base : base + 32] in :func:`.warp.warp_sum_f32`'s butterfly order, as lane 0
    sees it (v_l + v_(l + o) for o = 16, 8, 4, 2, 1; every lane ends with these bits because
    a + b == b + a exactly). Destroys the row. Simulator only."""
    offset = WARP // 2
    while offset > 0:
        for lane in range(offset):
            red[base + lane] = red[base + lane] + red[base + lane + offset]
        offset //= 2
    return red[base]


# --- kernel factory ------------------------------------------------------------------------------

def columns(kind: str, mt: int, arch: str | None = None) -> int:
    """C, the adjacent output columns per warp: WIDE_COLUMNS for the 8-row tile on WIDE_ARCHS
    (64 accumulators per lane: each staged float4 feeds 32 FMAs and each weight float4 8 rows),
    else COLUMNS; argmax keeps COLUMNS. ``arch``: default the active device profile's."""
    arch = _device_arch() if arch is None else arch
    wide = mt == MAX_ROW_TILE and kind != "argmax" and arch in WIDE_ARCHS
    return WIDE_COLUMNS if wide else COLUMNS


@functools.cache
def _device_arch() -> str:
    """The architecture launches run on (sim.profiles.active_profile: H200 under the simulator)."""
    return active_profile().arch


@functools.cache
def get_kernel(kind: str, prologue: str, residual: bool, mt: int, *, columns: int = COLUMNS,
               shuffles: bool = not SIM_TREE, pipelined: bool | None = None,
               vector_x: bool = True, vector_stage: bool = True, ring_stages: int = 0,
               min_blocks: int = 1, unroll: int | None = None) -> Any:
    """The kernel for one specialisation (compiled lazily on first launch, cached).

    kind: "linear" (x [M, Kx], out [M, N]), "head" (x [M, G, K], w [G, N, K], out [M, G, N]),
    "expert" (x [R, Kx], w [E, N, K], out [J, N], CSR routing) or "argmax" (x [M, K] -> per-part
    (max, argmax) part_val / part_idx [M, P]); prologue: "none", "rmsnorm" (linear, argmax) or
    "swiglu" (linear, expert); residual: out = residual + x @ w.T (linear only); mt: rows per
    tile, one of ROW_TILES, or of ODD_ROW_TILES for the linear and head kinds with C = COLUMNS;
    columns: C, COLUMNS or (not argmax) WIDE_COLUMNS (:func:`columns`
    picks it per architecture); shuffles: reduce the lane partials with the transposed shuffle
    butterfly (the GPU build) rather than its tree in shared memory (the simulator's default,
    same bits; tests run the shuffles under the simulator too); pipelined: stream the weights
    through a ring of U register slots, the next steps' loads issued before the current step's
    FMAs (None: :func:`ring_for`, by the row tile; same bits); vector_x: the FMA loop reads a
    lane's 4 staged floats of a row with one 16-byte shared load, not four scalar ones (same
    values; :data:`VECTOR_X_LOADS`); vector_stage: the rows are staged in 16-byte quads where K
    and the rows' alignment allow (same values; :data:`VECTOR_STAGING`; ignored by the head
    kind's 8 x 8 tile, which the quads spilled on sm_90); ring_stages: 0, or D >= 2: the
    weights' vector steps stream through a ring of D step slots a warp in shared memory, after
    the staged rows, filled by ``cp.async`` copies D - 1 steps ahead of the FMAs (no weight
    registers in flight; :data:`ASYNC_RING_STAGES`; same values, so the same bits; it replaces
    the register ring and the load-then-FMA rounds); min_blocks: blocks an SM the launch bounds
    ask for (1: up to 255 registers; 2: 128, :data:`ODD_TILE_BLOCKS`; layout, same bits); unroll:
    the register ring's slots U (2-4; None: :func:`_unroll`'s for the tile when this key is first
    built, then cached, so _setup passes it explicitly; layout, same bits).
    """
    check_blocks(min_blocks, "min_blocks")
    odd = mt in ODD_ROW_TILES and kind in ODD_KINDS and columns == COLUMNS
    if kind not in KINDS or prologue not in PROLOGUES or (mt not in ROW_TILES and not odd) or \
            columns not in (COLUMNS, WIDE_COLUMNS) or (kind == "argmax" and columns != COLUMNS):
        raise ValueError(f"no linear kernel for kind={kind!r}, prologue={prologue!r}, mt={mt!r}, "
                         f"columns={columns!r}")
    if (kind == "head" and (prologue != "none" or residual)) or \
            (kind == "expert" and (prologue == "rmsnorm" or residual)) or \
            (kind == "argmax" and (prologue == "swiglu" or residual)):
        raise ValueError(f"no linear kernel for kind={kind!r}, prologue={prologue!r}, residual={residual}")
    MT = mt
    C = columns
    if unroll is not None:
        check_unroll(unroll)
    U = _unroll(mt, C) if unroll is None else int(unroll)
    MTC = MT * C
    PIPELINED = ring_for(mt) if pipelined is None else bool(pipelined)
    check_ring_stages(ring_stages, "ring_stages")
    ASYNC = ring_stages >= 2
    D = max(2, ring_stages)        # the async ring's slots a warp (D - 1 steps in flight)
    RING_FLOATS = D * C * STEP     # one warp's ring: [D, C, 128] floats after the staged rows
    wait_ahead = wait_async(D - 2)  # the oldest step's copies landed, D - 2 newer may be pending
    wait_all = wait_async(0)
    AHEAD = U - 1                  # ring: steps loaded ahead of the one whose FMAs run
    # The last steps of a segment come from the ring's slots with U = 4; the 8-row tiles (U = 2:
    # 1-2 steps, the first already loaded) re-load them instead: a ring live past the loop
    # spilled the 8 x 8 head_linear tile on sm_90.
    RING_TAIL = AHEAD > 1
    # The odd tiles' deeper rings run as Python-unrolled chains (ODD_TILE_UNROLL, _chain)
    CHAINED = PIPELINED and mt in ODD_ROW_TILES and U > 2
    RMS = prologue == "rmsnorm"
    # With the ring, tile() finds the rows of the linear and argmax kinds (tile_rows) after its
    # first weight copies; without it the kernel body does, before tile() (as before the ring)
    ROWS_IN_TILE = kind in ("linear", "argmax")
    SWIGLU = prologue == "swiglu"
    RESIDUAL = residual
    ARGMAX = kind == "argmax"
    COMB = BLOCK_WARPS * MTC       # segment sums of every warp of a block
    TREE = not shuffles
    SU = max(1, STAGE_LOADS // MT)  # staging positions per thread and round
    SU_MT = SU * MT                 # their values (a compile-time local array size)
    # The head kind's 8 x 8 tile sat at 255 registers; the quads spilled it (sm_90: 32 / 56 bytes).
    VSTAGE = bool(vector_stage) and not (kind == "head" and C == WIDE_COLUMNS)
    SU_MT4 = SU_MT * VEC            # the quad staging's values (SU quads for MT rows)
    VX = bool(vector_x)
    RED = BLOCK_WARPS * MTC * RED_ROW if TREE else 1   # the tree's lane partials
    OFFS = MAX_EXPERTS + 1
    CAND = BLOCK_WARPS * MTC       # argmax: one candidate per (warp, owned element)
    assert not ARGMAX or MTC <= WARP   # argmax: each tile element ranked by one lane
    # The transposed butterfly (GPU): at xor offset 16 >> t, t < XT, a lane keeps half of its
    # partials (the upper half of the slots where lane bit 4 - t is set) and trades the other
    # half with its partner, so the same pairs are summed as in warp_sum_f32 (a + b == b + a
    # exactly) with MTC - 1 shuffles instead of 5 MTC. HALF[t]: slots traded at stage t (0: a
    # plain butterfly step on the R_SLOTS left).
    # MTP: MTC padded to a power of two (an odd row tile: 11 x 4 = 44 -> 64); the padding slots
    # hold zeros through the butterfly and are never stored.
    MTP = 1 << (MTC - 1).bit_length()
    XT = min(5, MTP.bit_length() - 1)
    H0, H1, H2, H3, H4 = [MTP >> (t + 1) if t < XT else 0 for t in range(5)]
    R_SLOTS = max(1, MTP >> 5)     # reduced elements per lane: a0 + r, r < R_SLOTS
    OWNER_MASK = (WARP >> XT) - 1  # lanes holding a copy of the same elements: the lowest stores

    # ---- per-kind row access: x value at (src row, group, k); output store ----
    if kind == "head":
        @cuda.jit(device=True, **LOCAL_INLINE)
        def x_value(x, src, g, k, k_dim):
            return x[src, g, k]

        @cuda.jit(device=True, **LOCAL_INLINE)
        def store(out, residual_arr, dst, g, col, value):
            out[dst, g, col] = value
    else:
        @cuda.jit(device=True, **LOCAL_INLINE)
        def x_value(x, src, g, k, k_dim):
            if SWIGLU:
                return _silu_mul(x[src, k], x[src, k_dim + k])
            return x[src, k]

        if ARGMAX:
            @cuda.jit(device=True, **LOCAL_INLINE)
            def store(best_v, best_i, dst, g, col, value):
                """Rank the logit instead of storing it: best_v / best_i [1], this lane's
                candidate (the same tile element every pass)."""
                if outranks(value, int32(col), best_v[0], best_i[0]):
                    best_v[0] = value
                    best_i[0] = int32(col)
        else:
            @cuda.jit(device=True, **LOCAL_INLINE)
            def store(out, residual_arr, dst, g, col, value):
                if RESIDUAL:
                    out[dst, col] = residual_arr[dst, col] + value
                else:
                    out[dst, col] = value

    @cuda.jit(device=True, **LOCAL_INLINE)
    def stage(x, xs, src_sh, inv_sh, norm_w, g, phase, k_dim, k_split_, seg_steps, phase_steps):
        """Input rows of the tile -> xs [MT, k_split, phase_steps * STEP] for one phase: segment s,
        offset kk holds k = (s * seg_steps + phase * phase_steps) * STEP + kk, prologue applied;
        zeros past K, past the segment and for absent rows, NaN for invalid source rows. A thread
        takes SU positions for all MT rows per round: SU * MT loads into registers, then the
        stores (loads first, so all are in flight: a round costs one latency, not SU * MT).
        With VSTAGE, K a multiple of 4 and 16-byte aligned rows (x, and the RMSNorm weight), a
        position is 4 adjacent k (one 16-byte load a row, one 16-byte shared store): a quarter of
        the rounds (11-row tiles at K 2048: 2 round trips, not 8), the same values."""
        kcw = phase_steps * STEP
        row_floats = k_split_ * kcw
        total_steps = (k_dim + STEP - 1) // STEP
        stride = cuda.blockDim.x
        vec = VSTAGE and (k_dim & (VEC - 1)) == 0 and rows_aligned16(x)
        if RMS:
            vec = vec and rows_aligned16(norm_w)
        if vec:
            quads = cuda.local.array(SU_MT4, float32)
            for base in range(cuda.threadIdx.x, row_floats >> 2, stride * SU):
                for q in range(SU):
                    pos = (base + q * stride) * VEC
                    # k: a multiple of 4, so the quad is all inside or all out
                    k, inside = _staged_k(pos, row_floats, kcw, seg_steps, phase, phase_steps,
                                          total_steps, k_dim)
                    n0 = ONE
                    n1 = ONE
                    n2 = ONE
                    n3 = ONE
                    # Loads from in-bounds addresses even where their guard is false (a
                    # side-effect-free load may be hoisted past it: vector_load).
                    k_in = k if inside else 0
                    if RMS and inside:
                        n0, n1, n2, n3 = load_f32x4(norm_w, k_in)
                    for i in range(MT):
                        src = src_sh[i]
                        v0 = ZERO
                        v1 = ZERO
                        v2 = ZERO
                        v3 = ZERO
                        if inside and src != -1:
                            if src < 0:      # -2: an invalid source row (expert routing)
                                v0 = float32(math.nan)
                                v1 = v0
                                v2 = v0
                                v3 = v0
                            else:
                                v0, v1, v2, v3 = load_x4(x, max(src, 0), g, k_in)
                                if SWIGLU:
                                    u0, u1, u2, u3 = load_x4(x, max(src, 0), g, k_dim + k_in)
                                    v0 = _silu_mul(v0, u0)
                                    v1 = _silu_mul(v1, u1)
                                    v2 = _silu_mul(v2, u2)
                                    v3 = _silu_mul(v3, u3)
                                if RMS:      # (x * inv) * weight, as the scalar path
                                    inv = inv_sh[i]
                                    v0 = v0 * inv * n0
                                    v1 = v1 * inv * n1
                                    v2 = v2 * inv * n2
                                    v3 = v3 * inv * n3
                        at = (q * MT + i) * VEC
                        quads[at] = v0
                        quads[at + 1] = v1
                        quads[at + 2] = v2
                        quads[at + 3] = v3
                for q in range(SU):
                    pos = (base + q * stride) * VEC
                    if pos < row_floats:
                        for i in range(MT):
                            at = (q * MT + i) * VEC
                            shared_put4(xs, uint64(i * row_floats + pos), quads[at], quads[at + 1],
                                        quads[at + 2], quads[at + 3])
        else:
            vals = cuda.local.array(SU_MT, float32)
            for base in range(cuda.threadIdx.x, row_floats, stride * SU):
                for q in range(SU):
                    pos = base + q * stride
                    k, inside = _staged_k(pos, row_floats, kcw, seg_steps, phase, phase_steps,
                                          total_steps, k_dim)
                    scale = ONE
                    if RMS and inside:
                        scale = load_f32(norm_w, k)
                    for i in range(MT):
                        src = src_sh[i]
                        value = ZERO
                        if inside and src != -1:
                            if src < 0:      # -2: an invalid source row (expert routing)
                                value = float32(math.nan)
                            elif RMS:
                                value = x_value(x, src, g, k, k_dim) * inv_sh[i] * scale
                            else:
                                value = x_value(x, src, g, k, k_dim)
                        vals[q * MT + i] = value
                for q in range(SU):
                    pos = base + q * stride
                    if pos < row_floats:
                        for i in range(MT):
                            xs[uint64(i * row_floats + pos)] = vals[q * MT + i]

    @cuda.jit(device=True, **LOCAL_INLINE)
    def load_step(w, wbase, j, wv, u):
        """The C float4s of step j for this lane's columns into wv[u]."""
        for c in range(C):
            v0, v1, v2, v3 = load_f32x4(w, wbase[c] + j * STEP)
            wv[u, c, 0] = v0
            wv[u, c, 1] = v1
            wv[u, c, 2] = v2
            wv[u, c, 3] = v3

    @cuda.jit(device=True, **LOCAL_INLINE)
    def ring_prologue(w, wbase, xs, ring0, j, jv):
        """The async ring's first D - 1 steps j .. j + D - 2 (those < jv), one group each, into
        slots 0 .. D - 2."""
        for u in range(D - 1):
            if j + u < jv:
                copy_step(w, wbase, j + u, xs, ring0 + u * (C * STEP))
            commit_async()

    @cuda.jit(device=True, **LOCAL_INLINE)
    def copy_step(w, wbase, j, xs, at):
        """The C quads of step j for this lane's columns: cp.async into xs[at + c * STEP]."""
        for c in range(C):
            copy_async16(xs, uint64(at + c * STEP), w, wbase[c] + j * STEP)

    @cuda.jit(device=True, **LOCAL_INLINE)
    def fma_step(xs, xo, row_floats, wv, u, acc):
        """acc[i * C + c] += x[i, 4l + e] * w[c, 4l + e], e ascending (xs offset xo of row 0)."""
        for i in range(MT):
            if VX:      # one 16-byte shared load (xo, row_floats: multiples of 4; xs 16-byte aligned)
                x0, x1, x2, x3 = shared_x4(xs, uint64(xo + i * row_floats))
            else:       # four scalar loads: lanes 16 bytes apart, 4 lanes a bank, 16 wavefronts not 4
                base = uint64(xo + i * row_floats)
                x0 = xs[base]
                x1 = xs[base + uint64(1)]
                x2 = xs[base + uint64(2)]
                x3 = xs[base + uint64(3)]
            for c in range(C):
                a = cuda.fma(x0, wv[u, c, 0], acc[i * C + c])
                a = cuda.fma(x1, wv[u, c, 1], a)
                a = cuda.fma(x2, wv[u, c, 2], a)
                acc[i * C + c] = cuda.fma(x3, wv[u, c, 3], a)

    def _head_step(k, rest):
        """Ring prologue step k < AHEAD: step j + k (clamped to jl) into slot k."""
        @cuda.jit(device=True, **LOCAL_INLINE)
        def step(w, wbase, j, jl, jv, xs, xo0, row_floats, wv, acc):
            load_step(w, wbase, min(j + k, jl), wv, k)
            rest(w, wbase, j, jl, jv, xs, xo0, row_floats, wv, acc)
        return step

    def _round_step(k, rest):
        """A full round's step k < U: step j + k + AHEAD's loads into the slot step j + k - 1 used,
        then step j + k's fmas from slot k (every step in range)."""
        ahead_slot = (k + AHEAD) % U

        @cuda.jit(device=True, **LOCAL_INLINE)
        def step(w, wbase, j, jl, jv, xs, xo0, row_floats, wv, acc):
            load_step(w, wbase, j + k + AHEAD, wv, ahead_slot)
            fma_step(xs, xo0 + (j + k) * STEP, row_floats, wv, k, acc)
            rest(w, wbase, j, jl, jv, xs, xo0, row_floats, wv, acc)
        return step

    def _tail_step(k, rest):
        """The last rounds' step k < 2U - 2: loads clamped to jl, fmas only for steps below jv."""
        ahead_slot = (k + AHEAD) % U
        slot = k % U

        @cuda.jit(device=True, **LOCAL_INLINE)
        def step(w, wbase, j, jl, jv, xs, xo0, row_floats, wv, acc):
            load_step(w, wbase, min(j + k + AHEAD, jl), wv, ahead_slot)
            if j + k < jv:
                fma_step(xs, xo0 + (j + k) * STEP, row_floats, wv, slot, acc)
            rest(w, wbase, j, jl, jv, xs, xo0, row_floats, wv, acc)
        return step

    ring_head = _chain(_head_step, AHEAD)
    ring_round = _chain(_round_step, U)
    ring_tail = _chain(_tail_step, 2 * U - 2)

    @cuda.jit(device=True, **LOCAL_INLINE)
    def accumulate(xs, w, wbase, acc, wv, lane, warp, seg, j0, j1, vec_steps, k_dim, k_split_,
                   phase_steps, primed):
        """Steps [j0, j1) of this warp's segment (staged from step j0 on) into acc. primed (the
        async ring): :func:`ring_prologue` already issued these steps' first copies."""
        kcw = phase_steps * STEP
        row_floats = k_split_ * kcw
        xo0 = seg * kcw + VEC * lane - j0 * STEP   # xs offset of step j is xo0 + j * STEP
        jv = min(j1, max(j0, vec_steps))
        j = j0
        if ASYNC:
            if j < jv:
                # This lane's quad of column c in slot s: ring0 + (s * C + c) * STEP (tile()'s
                # ring0, derived here again: passing it changed the ring kernels' code). A lane
                # reads back only the 16 bytes it copied, so no warp barrier is needed.
                ring0 = int64(MT * row_floats + warp * RING_FLOATS + VEC * lane)
                if not primed:
                    ring_prologue(w, wbase, xs, ring0, j, jv)
                slot = 0
                while j < jv:
                    wait_ahead()                    # step j's group has landed in its slot
                    # step j + D - 1 into the slot step j - 1 used: its shared loads fed that
                    # step's FMAs, issued before this copy
                    ahead = slot - 1 if slot > 0 else D - 1
                    if j + D - 1 < jv:
                        copy_step(w, wbase, j + D - 1, xs, ring0 + ahead * (C * STEP))
                    commit_async()                  # (empty past the last step: the count stays)
                    for c in range(C):
                        v0, v1, v2, v3 = shared_x4(xs, uint64(ring0 + (slot * C + c) * STEP))
                        wv[0, c, 0] = v0
                        wv[0, c, 1] = v1
                        wv[0, c, 2] = v2
                        wv[0, c, 3] = v3
                    fma_step(xs, xo0 + j * STEP, row_floats, wv, 0, acc)
                    slot = slot + 1 if slot + 1 < D else 0
                    j += 1
                wait_all()                          # nothing lands in the ring after this loop
        elif CHAINED:       # the same ring, its rounds unrolled in Python (constant slots)
            if j < jv:
                jl = jv - 1
                ring_head(w, wbase, j, jl, jv, xs, xo0, row_floats, wv, acc)
                while j + 2 * U - 1 <= jv:
                    ring_round(w, wbase, j, jl, jv, xs, xo0, row_floats, wv, acc)
                    j += U
                ring_tail(w, wbase, j, jl, jv, xs, xo0, row_floats, wv, acc)
                j = jv
        elif PIPELINED:
            if j < jv:
                # A ring of U slots: slot u holds step j + u at the top of the loop; step
                # j + u + AHEAD goes into the slot step j + u - 1 freed, before step j + u's FMAs.
                jl = jv - 1
                for u in range(AHEAD):
                    load_step(w, wbase, min(j + u, jl), wv, u)
                # Every load in range: unclamped, so the steps' addresses share one base (the
                # loop's pointers plus immediate offsets, as the plain loop's; clamped ones
                # each took a register pair and spilled the 8 x 8 tile).
                while j + 2 * U - 1 <= jv:
                    for u in range(U):
                        load_step(w, wbase, j + u + AHEAD, wv, (u + AHEAD) % U)
                        fma_step(xs, xo0 + (j + u) * STEP, row_floats, wv, u, acc)
                    j += U
                if RING_TAIL:
                    # The last jv - j <= 2U - 2 steps from the ring: loads clamped to step jl (a
                    # re-read past it, never out of bounds, unused), FMAs for steps < jv only.
                    for t in range(2 * U - 2):
                        load_step(w, wbase, min(j + t + AHEAD, jl), wv, (t + AHEAD) % U)
                        if j + t < jv:
                            fma_step(xs, xo0 + (j + t) * STEP, row_floats, wv, t % U, acc)
                    j = jv
                while j < jv:                       # the 2-slot ring's last 1-2 steps
                    load_step(w, wbase, j, wv, 0)
                    fma_step(xs, xo0 + j * STEP, row_floats, wv, 0, acc)
                    j += 1
        else:
            while j < jv:                           # rounds of up to U steps: all loads, then all FMAs
                # A short last round keeps its loads in flight together (one round trip, not
                # one per step); the slots past it are neither loaded nor used.
                n = min(U, jv - j)
                for u in range(U):
                    if u < n:
                        load_step(w, wbase, j + u, wv, u)
                for u in range(U):
                    if u < n:
                        fma_step(xs, xo0 + (j + u) * STEP, row_floats, wv, u, acc)
                j += n
        while j < j1:                               # scalar steps: the tail, or unaligned rows
            for e in range(VEC):
                k = j * STEP + VEC * lane + e
                if k < k_dim:
                    for c in range(C):
                        wv[0, c, 0] = load_f32(w, wbase[c] - VEC * lane + k)
                    for i in range(MT):
                        xv = xs[uint64(xo0 + j * STEP + e + i * row_floats)]
                        for c in range(C):
                            acc[i * C + c] = cuda.fma(xv, wv[0, c, 0], acc[i * C + c])
            j += 1

    @cuda.jit(device=True, **LOCAL_INLINE)
    def xpose_stage(acc, lane, half, offset):
        """One butterfly level at xor ``offset`` (compile-time ``half``, see XT above)."""
        if half > 0:
            upper = (lane & offset) != 0
            for p in range(half):
                lo = acc[p]
                hi = acc[p + half]
                keep = hi if upper else lo
                send = lo if upper else hi
                acc[p] = keep + cuda.shfl_xor_sync(FULL_MASK, send, offset)
        else:
            for r in range(R_SLOTS):
                acc[r] += cuda.shfl_xor_sync(FULL_MASK, acc[r], offset)

    @cuda.jit(device=True, **LOCAL_INLINE)
    def owned_element(lane):
        """The first tile element a (a = i * C + c) whose reduced sum this lane stores (elements
        a .. a + R_SLOTS - 1), or -1 when another lane stores its copy."""
        if TREE:
            return lane if lane < MTC else -1
        if lane & OWNER_MASK:
            return -1
        return (((lane >> 4) & 1) * H0 + ((lane >> 3) & 1) * H1 + ((lane >> 2) & 1) * H2
                + ((lane >> 1) & 1) * H3 + (lane & 1) * H4)

    @cuda.jit(device=True, **LOCAL_INLINE)
    def combined_element(lane, r):
        """Tile element r of ``lane`` in the segment combine, or -1: the lane that emitted it
        (the tree: a = lane + 32 r, as its emit loop; the butterfly: owned_element + r)."""
        if TREE:
            a = lane + r * WARP
            return a if a < MTC else -1
        a0 = owned_element(lane)
        return a0 + r if a0 >= 0 and a0 + r < MTC else -1

    @cuda.jit(device=True, **LOCAL_INLINE)
    def put(out, residual_arr, dst_sh, g, col0, n_cols, a, total):
        """Store element a = i * C + c of the tile (skipping absent rows and columns past N)."""
        i = a // C
        c = a - i * C
        dst = dst_sh[i]
        if dst >= 0 and col0 + c < n_cols:
            store(out, residual_arr, dst, g, col0 + c, total)

    @cuda.jit(device=True, **LOCAL_INLINE)
    def emit(out, residual_arr, comb, dst_sh, g, warp, col0, n_cols, k_split_, a, total):
        """A segment sum: stored when K is one segment, else parked in comb for the combine."""
        if k_split_ == 1:
            put(out, residual_arr, dst_sh, g, col0, n_cols, a, total)
        else:
            comb[uint64(warp * MTC + a)] = total

    @cuda.jit(device=True, **LOCAL_INLINE)
    def tile_rows(x, src_sh, dst_sh, inv_sh, k_dim, eps):
        """Rows of tile blockIdx.x: src_sh / dst_sh [MT] (-1: past M) and, for RMSNorm, the
        rows' 1 / rms in inv_sh [MT] (the linear and argmax kinds: their kernel body, or tile()
        with the async ring). The caller syncs before reading them."""
        row0 = cuda.blockIdx.x * MT
        tid = cuda.threadIdx.x
        if tid < MT:
            row = row0 + tid
            src_sh[tid] = row if row < x.shape[0] else -1
            dst_sh[tid] = row if row < x.shape[0] else -1
        if RMS:
            lane = tid % WARP
            for i in range(tid // WARP, MT, cuda.blockDim.x // WARP):
                row = min(row0 + i, x.shape[0] - 1)
                inv = _row_inv_rms(x, row, k_dim, eps, lane)
                if lane == 0:
                    inv_sh[i] = inv

    @cuda.jit(device=True, **LOCAL_INLINE)
    def column_bases(wbase, w_group, group_index, n_cols, k_dim, lane):
        """wbase[c]: the flat offset of this lane's first quad in the weight row of column
        group_index * C + c (columns past N re-read the last row)."""
        for c in range(C):
            col = min(group_index * C + c, n_cols - 1)
            wbase[c] = (w_group + col) * k_dim + VEC * lane

    @cuda.jit(device=True, **LOCAL_INLINE)
    def tile(x, w, out, residual_arr, norm_w, xs, comb, red, src_sh, dst_sh, inv_sh, g, w_group,
             n_cols, k_dim, k_split_, seg_steps, phase_steps, vec_steps, part_cols, eps):
        """The row tile (src_sh / dst_sh staged) times column blocks blockIdx.y, + gridDim.y, ...
        (a grid-stride: the tile is staged once when K fits in one phase), or (argmax) the
        passes of part blockIdx.y, part_cols columns from column blockIdx.y * part_cols."""
        acc = cuda.local.array(MTP, float32)
        wv = cuda.local.array((U, C, VEC), float32)
        wbase = cuda.local.array(C, int64)
        lane, warp, seg, group, groups_per_block = warp_place(k_split_)
        total_steps = (k_dim + STEP - 1) // STEP
        n_phases = (seg_steps + phase_steps - 1) // phase_steps
        j_seg = min(seg * seg_steps, total_steps)
        j_seg_end = min(j_seg + seg_steps, total_steps)
        if not ASYNC:       # (this order: the head kind's 8 x 8 tile spilled with the ring's)
            if n_phases == 1:   # the whole segment fits: stage once for every column group
                stage(x, xs, src_sh, inv_sh, norm_w, g, 0, k_dim, k_split_, seg_steps, phase_steps)
                cuda.syncthreads()  # staged rows visible to every warp
        n_groups = (n_cols + C - 1) // C
        n_group_blocks = (n_groups + groups_per_block - 1) // groups_per_block
        gb_first = cuda.blockIdx.y
        gb_end = n_group_blocks
        gb_step = cuda.gridDim.y
        if ARGMAX:          # the part's own passes (whole passes: PART_ALIGN divides part_cols)
            passes = part_cols // (groups_per_block * C)
            gb_first = cuda.blockIdx.y * passes
            gb_end = min(gb_first + passes, n_group_blocks)
            gb_step = 1
        # The async ring, rows staged once: a column group's first weight copies are issued
        # before the work that precedes its FMAs (the rows' rms and staging for the first group,
        # the previous group's butterfly and stores for the next), which W does not depend on.
        prime = ASYNC and n_phases == 1
        jv_first = min(j_seg_end, max(j_seg, vec_steps))
        # this lane's quad of column 0 in slot 0 of its warp's ring, after the staged rows
        ring0 = int64(MT * k_split_ * phase_steps * STEP + warp * RING_FLOATS + VEC * lane)
        if ASYNC:
            if prime and gb_first < gb_end:
                column_bases(wbase, w_group, gb_first * groups_per_block + group, n_cols, k_dim, lane)
                ring_prologue(w, wbase, xs, ring0, j_seg, jv_first)
            if ROWS_IN_TILE:
                tile_rows(x, src_sh, dst_sh, inv_sh, k_dim, eps)
                cuda.syncthreads()  # tile rows (and their rms) visible before staging
            if n_phases == 1:   # the whole segment fits: stage once for every column group
                stage(x, xs, src_sh, inv_sh, norm_w, g, 0, k_dim, k_split_, seg_steps, phase_steps)
                cuda.syncthreads()  # staged rows visible to every warp
        for gb in range(gb_first, gb_end, gb_step):
            col0 = (gb * groups_per_block + group) * C
            column_bases(wbase, w_group, gb * groups_per_block + group, n_cols, k_dim, lane)
            for a in range(MTP):
                acc[a] = ZERO
            for phase in range(n_phases):
                j0 = min(j_seg + phase * phase_steps, j_seg_end)
                j1 = min(j0 + phase_steps, j_seg_end)
                if n_phases > 1:
                    cuda.syncthreads()  # every warp is done with the previous phase's rows
                    stage(x, xs, src_sh, inv_sh, norm_w, g, phase, k_dim, k_split_, seg_steps,
                          phase_steps)
                    cuda.syncthreads()  # this phase's rows staged
                accumulate(xs, w, wbase, acc, wv, lane, warp, seg, j0, j1, vec_steps, k_dim,
                           k_split_, phase_steps, prime)
            if prime and gb + gb_step < gb_end:    # the next group's first copies (above)
                column_bases(wbase, w_group, (gb + gb_step) * groups_per_block + group, n_cols,
                             k_dim, lane)
                ring_prologue(w, wbase, xs, ring0, j_seg, jv_first)
            if TREE:        # the butterfly's tree through shared memory (simulated shuffles are slow)
                red_base = warp * MTC * RED_ROW
                for a in range(MTC):
                    red[red_base + a * RED_ROW + lane] = acc[a]
                cuda.syncwarp()  # the warp's partials visible to the lane that reduces each
                for a in range(lane, MTC, WARP):
                    emit(out, residual_arr, comb, dst_sh, g, warp, col0, n_cols, k_split_, a,
                         _tree_sum(red, red_base + a * RED_ROW))
                cuda.syncwarp()  # red read before the next column group rewrites it
            else:           # the transposed butterfly: offsets 16, 8, 4, 2, 1
                xpose_stage(acc, lane, H0, 16)
                xpose_stage(acc, lane, H1, 8)
                xpose_stage(acc, lane, H2, 4)
                xpose_stage(acc, lane, H3, 2)
                xpose_stage(acc, lane, H4, 1)
                a0 = owned_element(lane)
                if a0 >= 0:
                    for r in range(R_SLOTS):
                        if a0 + r < MTC:    # (padding slots of an odd tile: never stored)
                            emit(out, residual_arr, comb, dst_sh, g, warp, col0, n_cols, k_split_,
                                 a0 + r, acc[r])
            if k_split_ > 1:
                cuda.syncthreads()  # every segment's sums in comb
                # Element a is combined by the lane that emitted it (combined_element), so an
                # argmax lane ranks the same element on every pass.
                if seg == 0:
                    for r in range(R_SLOTS):
                        a = combined_element(lane, r)
                        if a >= 0:
                            total = comb[uint64(warp * MTC + a)]
                            for s in range(1, k_split_):   # segment order
                                total += comb[uint64((warp + s) * MTC + a)]
                            put(out, residual_arr, dst_sh, g, col0, n_cols, a, total)
                cuda.syncthreads()  # comb read before the next column group rewrites it

    # One block per SM as the bound's minimum by default: without it ptxas held the 1-row tile to
    # 128 registers and spilled (min_blocks 2 asks for that, for the odd tiles: ODD_TILE_BLOCKS).
    options = launch_bounds(BLOCK_WARPS * WARP, min_blocks)

    if kind == "linear":
        @cuda.jit(**options)
        def kernel(x, w, out, residual_arr, norm_w, eps, n_cols, k_dim, k_split_, seg_steps,
                   phase_steps, vec_steps):
            """out[m] = (residual[m] +) prologue(x[m]) @ w.T. x [M, Kx], w flat [N * K],
            out / residual [M, N], norm_w [K] (rmsnorm; else unused). Grid (ceil(M / MT),
            column blocks): the row tiles of one column block run together and share its weight
            rows through L2. Dynamic shared xs."""
            xs = cuda.shared.array(0, float32, alignment=XS_ALIGN)
            comb = cuda.shared.array(COMB, float32)
            red = cuda.shared.array(RED, float32)
            src_sh = cuda.shared.array(MT, int32)
            dst_sh = cuda.shared.array(MT, int32)
            inv_sh = cuda.shared.array(MT, float32)
            pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
            if not ASYNC:   # (with the ring, tile() finds the rows after its first copies)
                tile_rows(x, src_sh, dst_sh, inv_sh, k_dim, eps)
                cuda.syncthreads()  # tile rows (and their rms) visible before staging
            tile(x, w, out, residual_arr, norm_w, xs, comb, red, src_sh, dst_sh, inv_sh, 0, 0,
                 n_cols, k_dim, k_split_, seg_steps, phase_steps, vec_steps, 0, eps)

    elif ARGMAX:
        @cuda.jit(**options)
        def kernel(x, w, part_val, part_idx, norm_w, eps, n_cols, k_dim, k_split_, seg_steps,
                   phase_steps, vec_steps, part_cols):
            """part_val[m, p], part_idx[m, p] = max and lowest argmax over columns
            [p * part_cols, min((p + 1) * part_cols, N)) of prologue(x[m]) @ w.T (the logits
            ``linear`` computes, never stored). x [M, K], w flat [N * K], part_val float32 /
            part_idx int32 [M, P], norm_w [K] (rmsnorm; else unused). Grid (ceil(M / MT), P)."""
            xs = cuda.shared.array(0, float32, alignment=XS_ALIGN)
            comb = cuda.shared.array(COMB, float32)
            red = cuda.shared.array(RED, float32)
            src_sh = cuda.shared.array(MT, int32)
            dst_sh = cuda.shared.array(MT, int32)
            inv_sh = cuda.shared.array(MT, float32)
            cand_v = cuda.shared.array(CAND, float32)
            cand_i = cuda.shared.array(CAND, int32)
            pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
            best_v = cuda.local.array(1, float32)   # this lane's candidate for its tile element
            best_i = cuda.local.array(1, int32)
            best_v[0] = NEG_INF_F32
            best_i[0] = NO_INDEX
            if not ASYNC:   # (with the ring, tile() finds the rows after its first copies)
                tile_rows(x, src_sh, dst_sh, inv_sh, k_dim, eps)
                cuda.syncthreads()  # tile rows (and their rms) visible before staging
            tile(x, w, best_v, best_i, norm_w, xs, comb, red, src_sh, dst_sh, inv_sh, 0, 0,
                 n_cols, k_dim, k_split_, seg_steps, phase_steps, vec_steps, part_cols, eps)
            tid = cuda.threadIdx.x
            a = owned_element(tid % WARP)
            if a >= 0:          # this lane ranked element a = i * C + c of its warp's groups
                cand_v[(tid // WARP) * MTC + a] = best_v[0]
                cand_i[(tid // WARP) * MTC + a] = best_i[0]
            cuda.syncthreads()  # every lane's candidate visible to the row's reducer
            if tid < MT and dst_sh[tid] >= 0:
                value = NEG_INF_F32
                index = NO_INDEX
                for warp in range(cuda.blockDim.x // WARP):
                    for c in range(C):
                        slot = warp * MTC + tid * C + c
                        if outranks(cand_v[slot], cand_i[slot], value, index):
                            value = cand_v[slot]
                            index = cand_i[slot]
                part_val[dst_sh[tid], cuda.blockIdx.y] = value
                part_idx[dst_sh[tid], cuda.blockIdx.y] = index

    elif kind == "head":
        @cuda.jit(**options)
        def kernel(x, w, out, n_cols, k_dim, k_split_, seg_steps, phase_steps, vec_steps):
            """out[m, g] = x[m, g] @ w[g].T. x [M, G, K], w flat [G * N * K], out [M, G, N].
            Grid (ceil(M / MT), column blocks, G)."""
            xs = cuda.shared.array(0, float32, alignment=XS_ALIGN)
            comb = cuda.shared.array(COMB, float32)
            red = cuda.shared.array(RED, float32)
            src_sh = cuda.shared.array(MT, int32)
            dst_sh = cuda.shared.array(MT, int32)
            pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
            row0 = cuda.blockIdx.x * MT
            g = cuda.blockIdx.z
            tid = cuda.threadIdx.x
            if tid < MT:
                row = row0 + tid
                src_sh[tid] = row if row < x.shape[0] else -1
                dst_sh[tid] = row if row < x.shape[0] else -1
            cuda.syncthreads()  # tile rows visible before staging
            tile(x, w, out, out, w, xs, comb, red, src_sh, dst_sh, comb, g, g * n_cols,
                 n_cols, k_dim, k_split_, seg_steps, phase_steps, vec_steps, 0, ZERO)

    else:
        @cuda.jit(**options)
        def kernel(x, w, out, row_offsets, row_index, n_cols, k_dim, k_split_, seg_steps,
                   phase_steps, vec_steps):
            """out[j] = prologue(x[row_index[j]]) @ w[e].T for CSR entries j of expert e.
            x [R, Kx], w flat [E * N * K], out [J, N], row_offsets int32 [E + 1], row_index int32
            [J]. Grid (tile slots, column blocks): slot t is the t-th non-empty MT-row tile in
            expert order; slots past the last tile exit."""
            xs = cuda.shared.array(0, float32, alignment=XS_ALIGN)
            comb = cuda.shared.array(COMB, float32)
            red = cuda.shared.array(RED, float32)
            src_sh = cuda.shared.array(MT, int32)
            dst_sh = cuda.shared.array(MT, int32)
            offs = cuda.shared.array(OFFS, int32)
            found = cuda.shared.array(2, int32)
            pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
            tid = cuda.threadIdx.x
            n_experts = row_offsets.shape[0] - 1
            n_entries = out.shape[0]
            for e in range(tid, n_experts + 1, cuda.blockDim.x):
                offs[e] = min(max(row_offsets[e], 0), n_entries)   # clamped: never out of bounds
            cuda.syncthreads()  # offsets staged
            if tid < WARP:     # warp 0: which expert and which of its tiles is this slot?
                slot = cuda.blockIdx.x
                carry = 0
                best = NO_SLOT
                best_tile = NO_SLOT
                for base in range(0, n_experts, WARP):
                    e = base + tid
                    tiles = 0
                    if e < n_experts:
                        tiles = (max(offs[e + 1] - offs[e], 0) + MT - 1) // MT
                    incl = int32(warp_inclusive_scan_i32(int32(tiles)) + carry)
                    excl = incl - tiles
                    hit = tiles > 0 and excl <= slot and slot < incl
                    best = min(best, warp_min_i32(int32(e) if hit else NO_SLOT))
                    best_tile = min(best_tile, warp_min_i32(int32(slot - excl) if hit else NO_SLOT))
                    carry = cuda.shfl_sync(FULL_MASK, incl, WARP - 1)
                if tid == 0:
                    found[0] = best
                    found[1] = best_tile
            cuda.syncthreads()  # the slot's expert and tile
            expert = found[0]
            if expert == NO_SLOT:   # past the last tile: the whole block leaves together
                return
            if tid < MT:
                entry = offs[expert] + found[1] * MT + tid
                src = -1
                dst = -1
                if entry < offs[expert + 1]:
                    dst = entry
                    src = row_index[entry]
                    if src < 0 or src >= x.shape[0]:
                        src = -2         # invalid row: NaN output
                src_sh[tid] = src
                dst_sh[tid] = dst
            cuda.syncthreads()  # tile rows visible before staging
            tile(x, w, out, out, w, xs, comb, red, src_sh, dst_sh, comb, 0, expert * n_cols,
                 n_cols, k_dim, k_split_, seg_steps, phase_steps, vec_steps, 0, ZERO)

    return kernel


# --- registration (real signatures; the contiguous and view variants are both launched) ---------

_GEOMETRY = (int32, int32, int32, int32, int32, int32)   # n_cols, k_dim, k_split, seg, phase, vec


def _norm_sig(prologue: str) -> Any:
    """norm_w's type: the norm weight [K], or (no RMSNorm) the weight itself as a placeholder."""
    return float32[::1] if prologue == "rmsnorm" else float32[:, ::1]


def _linear_sigs(prologue: str) -> tuple:
    c2, a2, nw = float32[:, ::1], float32[:, :], _norm_sig(prologue)
    return ((c2, c2, c2, c2, nw, float32) + _GEOMETRY,
            (a2, c2, a2, a2, nw, float32) + _GEOMETRY)


def _head_sigs() -> tuple:
    c3 = float32[:, :, ::1]
    return ((c3, c3, c3) + _GEOMETRY,
            (float32[:, :, :], c3, float32[:, :, :]) + _GEOMETRY)


def _argmax_sigs(prologue: str) -> tuple:
    c2, a2, nw, part_i = float32[:, ::1], float32[:, :], _norm_sig(prologue), int32[:, ::1]
    return ((c2, c2, c2, part_i, nw, float32) + _GEOMETRY + (int32,),   # + part_cols
            (a2, c2, c2, part_i, nw, float32) + _GEOMETRY + (int32,))


def _expert_sigs() -> tuple:
    c3, ix = float32[:, :, ::1], int32[::1]
    return ((float32[:, ::1], c3, float32[:, ::1], ix, ix) + _GEOMETRY,
            (float32[:, :], c3, float32[:, :], ix, ix) + _GEOMETRY)


# The compile check covers every kernel kind at its smallest and largest row tile, with the strided
# (view) signature: the intermediate tiles are the same source between those register footprints, the
# contiguous signature is the view's special case, and each specialisation costs 10-25 s of CI time.
CHECKED_ROW_TILES = (ROW_TILES[0], ROW_TILES[-1])


def _register_all() -> None:
    threads = BLOCK_WARPS * WARP
    for mt in CHECKED_ROW_TILES:
        for prologue in PROLOGUES:
            for residual in (False, True):
                name = f"linear_{prologue}{'_residual' if residual else ''}_mt{mt}"
                register(name, get_kernel("linear", prologue, residual, mt), _linear_sigs(prologue)[1:],
                         f"batch-invariant x @ w.T, {prologue} prologue"
                         f"{', residual epilogue' if residual else ''}, {mt}-row tiles",
                         block_threads=threads)
        for prologue in ("none", "rmsnorm"):
            register(f"linear_argmax_{prologue}_mt{mt}", get_kernel("argmax", prologue, False, mt),
                     _argmax_sigs(prologue)[1:], f"lm_head x @ w.T ({prologue} prologue) ranked into per-part "
                     f"(max, lowest argmax) per row, logits never stored, {mt}-row tiles",
                     block_threads=threads)
        register(f"head_linear_mt{mt}", get_kernel("head", "none", False, mt), _head_sigs()[1:],
                 f"batch-invariant per-head x[:, g] @ w[g].T, {mt}-row tiles", block_threads=threads)
        for prologue in ("none", "swiglu"):
            register(f"expert_linear_{prologue}_mt{mt}", get_kernel("expert", prologue, False, mt),
                     _expert_sigs()[1:], f"batch-invariant MoE expert products over a CSR routing, "
                     f"{prologue} prologue, {mt}-row tiles", block_threads=threads)
    # The 8 x 8 tiles exist on WIDE_ARCHS only (they spill elsewhere): checked there, the
    # widest register footprint of each kind (none / residual prologues share the tile).
    for kind, prologue, residual, sigs in (("linear", "rmsnorm", True, _linear_sigs("rmsnorm")),
                                           ("linear", "swiglu", True, _linear_sigs("swiglu")),
                                           ("head", "none", False, _head_sigs()),
                                           ("expert", "swiglu", False, _expert_sigs())):
        name = f"{kind}_linear" if kind != "linear" else "linear"
        register(f"{name}_{prologue}{'_residual' if residual else ''}_mt{MAX_ROW_TILE}_wide",
                 get_kernel(kind, prologue, residual, MAX_ROW_TILE, columns=WIDE_COLUMNS), sigs[1:],
                 f"the {kind} kernel's {MAX_ROW_TILE} x {WIDE_COLUMNS} register tile ({prologue} prologue), "
                 f"launched on {', '.join(WIDE_ARCHS)} only", block_threads=threads, archs=WIDE_ARCHS)
    # The odd row tiles (ODD_TILES, C = COLUMNS on every arch): the linear kind's widest prologue
    # (rmsnorm + residual; swiglu differs in the staged value only) and the head kind.
    for mt in ODD_ROW_TILES:
        register(f"linear_rmsnorm_residual_mt{mt}", get_kernel("linear", "rmsnorm", True, mt),
                 _linear_sigs("rmsnorm")[1:], f"the linear kernel's {mt}-row tile (rmsnorm prologue, "
                 f"residual epilogue): many-row launches, ODD_TILES", block_threads=threads)
        register(f"head_linear_mt{mt}", get_kernel("head", "none", False, mt), _head_sigs()[1:],
                 f"batch-invariant per-head x[:, g] @ w[g].T, {mt}-row tiles (ODD_TILES)",
                 block_threads=threads)
    # The async weight ring (off by default, ASYNC_RING_STAGES): the tiles that bench.decode_step
    # --ring 4 launches with it (the 11-row linear, the 8-row lm_head argmax, the 8 x 8 expert at 3
    # slots), and the 1-row tile that set_async_ring(4, 1) gives.
    for name, kernel, sigs, what, archs in (
            ("linear_rmsnorm_residual_mt11_ring4", get_kernel("linear", "rmsnorm", True, 11, ring_stages=4),
             _linear_sigs("rmsnorm"), "the 11-row linear tile", None),
            ("linear_none_mt1_ring4", get_kernel("linear", "none", False, 1, ring_stages=4),
             _linear_sigs("none"), "the 1-row linear tile", None),
            ("linear_argmax_rmsnorm_mt8_ring4", get_kernel("argmax", "rmsnorm", False, 8, ring_stages=4),
             _argmax_sigs("rmsnorm"), "the lm_head argmax's 8-row tile", None),
            ("expert_linear_swiglu_mt8_ring3_wide",
             get_kernel("expert", "swiglu", False, 8, columns=WIDE_COLUMNS, ring_stages=3),
             _expert_sigs(), "the expert kernel's 8 x 8 tile", WIDE_ARCHS)):
        register(name, kernel, sigs[1:], f"{what} with its weights through the async cp.async ring "
                 f"(ASYNC_RING_STAGES, off by default)", block_threads=threads, archs=archs)


_register_all()


# --- host side: plans (functions of the shapes, cached) --------------------------------------------

def k_split(k_dim: int) -> int:
    """K segments (warps) per column group: the smallest power of two giving segments of at
    most SPLIT_STEPS * 128 values, capped at MAX_K_SPLIT. A function of K only (the order)."""
    total_steps = -(-k_dim // STEP)
    split = 1
    while split < MAX_K_SPLIT and split * SPLIT_STEPS < total_steps:
        split *= 2
    return split


@functools.cache
def xs_budget() -> int:
    """Bytes of staged input rows a block may hold: the opt-in limit of the active device profile
    less STATIC_RESERVE_BYTES on a GPU; XS_BUDGET_BYTES (under the 48 KiB default) in the
    simulator, which checks every launch against the default limit."""
    if SIM_TREE:
        return XS_BUDGET_BYTES
    return max(XS_BUDGET_BYTES, active_profile().smem_per_block_optin - STATIC_RESERVE_BYTES)


def _seg_steps(k_dim: int) -> int:
    """Steps of STEP values in each of the k_split(K) segments (the last may be short)."""
    return -(-(-(-k_dim // STEP)) // k_split(k_dim))


def _stage_bytes(mt: int, k_dim: int) -> int:
    """Shared bytes of MT staged rows of K values in one phase (whole segments, k_split(K))."""
    return 4 * mt * k_split(k_dim) * _seg_steps(k_dim) * STEP


def _opts_in(shared_bytes: int) -> bool:
    """Whether a launch stages more than the default budget (opt-in shared memory, GPU only)."""
    return shared_bytes > XS_BUDGET_BYTES


@functools.lru_cache(maxsize=1024)
def row_tile(rows: int, k_dim: int = 0, kind: str = "") -> int:
    """MT for a launch with ``rows`` rows per group: the smallest tile >= rows, else the largest;
    halved, for K = ``k_dim``, while its rows do not fit :func:`xs_budget` in one phase and a
    smaller tile does (rows staged in phases are restaged for every column block; smaller tiles
    staged once re-read W from L2 instead). With ODD_TILES on, a launch of a ``kind`` in ODD_KINDS
    (linear, head) with more rows than the largest tile takes an ODD_ROW_TILES tile where it pads
    fewer rows and fits (33 rows: 3 x 11). Layout, never the order."""
    mt = next((t for t in ROW_TILES if rows <= t), MAX_ROW_TILE)
    fits = [t for t in ROW_TILES if t <= mt and _stage_bytes(t, k_dim) <= xs_budget()]
    mt = fits[-1] if fits else mt
    if ODD_TILES and kind in ODD_KINDS and rows > MAX_ROW_TILE and mt == MAX_ROW_TILE:
        for t in ODD_ROW_TILES:
            if _stage_bytes(t, k_dim) <= xs_budget() and -(-rows // t) * t < -(-rows // mt) * mt:
                mt = t
    return mt


def set_async_ring(stages: int, min_row_tile: int | None = None) -> tuple[int, int]:
    """Set ASYNC_RING_STAGES (0: off, else 2..MAX_RING_STAGES) and, if given,
    ASYNC_RING_MIN_ROW_TILE, and clear the plan caches that read them. Returns the previous
    (stages, min_row_tile)."""
    global ASYNC_RING_STAGES, ASYNC_RING_MIN_ROW_TILE
    check_ring_stages(stages)
    if min_row_tile is not None and (isinstance(min_row_tile, bool)
                                     or not isinstance(min_row_tile, numbers.Integral) or min_row_tile < 1):
        raise ValueError(f"min_row_tile must be a positive int, got {min_row_tile!r}")
    previous = (ASYNC_RING_STAGES, ASYNC_RING_MIN_ROW_TILE)
    ASYNC_RING_STAGES = int(stages)
    if min_row_tile is not None:
        ASYNC_RING_MIN_ROW_TILE = int(min_row_tile)
    for cached in (_plan, _grid_cols, _launch_plan, _setup):
        cached.cache_clear()
    return previous


def set_odd_tiles(on: bool) -> bool:
    """Switch ODD_TILES and clear the plan caches that read it (row_tile, _plan, _grid_cols,
    _setup: a stale plan could launch a tile other than its caller's grid assumes). Returns the
    previous setting."""
    global ODD_TILES
    previous, ODD_TILES = ODD_TILES, bool(on)
    for cached in (row_tile, _plan, _grid_cols, _launch_plan, _setup):
        cached.cache_clear()
    return previous


def set_odd_tile_blocks(blocks: int) -> int:
    """Set ODD_TILE_BLOCKS (1 or 2) and clear the plan caches that read it (_grid_cols,
    _launch_plan, _setup). Returns the previous setting."""
    global ODD_TILE_BLOCKS
    check_blocks(blocks)
    previous, ODD_TILE_BLOCKS = ODD_TILE_BLOCKS, int(blocks)
    for cached in (_grid_cols, _launch_plan, _setup):
        cached.cache_clear()
    return previous


def blocks_per_sm(plan: "LinearPlan") -> int:
    """Blocks an SM a launch of ``plan`` is compiled and gridded for: ODD_TILE_BLOCKS for an odd
    row tile whose blocks (staged rows, static arrays, the system's reserve) fit an SM's shared
    memory that many times, else 1."""
    if plan.mt not in ODD_ROW_TILES or ODD_TILE_BLOCKS == 1:
        return 1
    prof = active_profile()
    block_bytes = plan.shared_bytes + STATIC_BOUND_BYTES + prof.reserved_smem_per_block
    return ODD_TILE_BLOCKS if ODD_TILE_BLOCKS * block_bytes <= prof.smem_per_sm else 1


@dataclass(frozen=True)
class LinearPlan:
    """Launch geometry of one product (a function of the shapes only; numerics depend on K only).

    Attributes:
        mt: rows per tile; columns: C, columns per warp (:func:`columns`); k_split, seg_steps:
        the K segmentation (from K); phase_steps: steps staged per phase; vec_steps: steps read
        with 16-byte loads (K // 128 when the weight rows are 16-byte aligned, else 0: scalar
        loads, same order); threads: block size; col_blocks: column blocks covering N;
        shared_bytes: dynamic shared memory (the staged rows, then the weight ring);
        ring_stages: the async weight ring's slots a warp (0: none; :func:`get_kernel`).
    """

    mt: int
    columns: int
    k_split: int
    seg_steps: int
    phase_steps: int
    vec_steps: int
    threads: int
    col_blocks: int
    shared_bytes: int
    ring_stages: int = 0

    @property
    def one_phase(self) -> bool:
        """The tile's rows are staged once for every column block (a grid-stride pays)."""
        return self.phase_steps >= self.seg_steps

    def geometry(self, n_cols: int, k_dim: int) -> tuple[int, ...]:
        """The kernels' trailing scalar arguments."""
        return (n_cols, k_dim, self.k_split, self.seg_steps, self.phase_steps, self.vec_steps)


@functools.lru_cache(maxsize=1024)
def _plan(kind: str, rows: int, n_cols: int, k_dim: int, aligned: bool, ring: bool = False) -> LinearPlan:
    """The geometry of a launch; ``ring``: with the async weight ring where the knobs, the tile
    and the shared memory allow (:func:`_launch_plan` decides per launch)."""
    mt = row_tile(rows, k_dim, kind)
    c = columns(kind, mt)
    split = k_split(k_dim)
    seg_steps = _seg_steps(k_dim)
    groups = SIM_GROUPS if SIM_TREE else max(1, BLOCK_WARPS // split)
    step_bytes = 4 * mt * split * STEP          # one staged step of every segment's rows
    slot_bytes = 4 * groups * split * c * STEP  # one ring slot of every warp
    vec_steps = k_dim // STEP if aligned else 0
    want = 0
    if ring and ASYNC_RING_STAGES >= 2 and mt >= ASYNC_RING_MIN_ROW_TILE and vec_steps > 0:
        want = min(ASYNC_RING_STAGES, MAX_RING_STAGES, RING_BUDGET_BYTES // slot_bytes)
        want = want if want >= 2 else 0
    budget = xs_budget()
    phase_steps = max(1, min(seg_steps, budget // step_bytes))
    stages = 0
    if phase_steps == seg_steps:                # rows staged once: the ring takes what is left
        stages = min(want, (budget - step_bytes * seg_steps) // slot_bytes)
    stages = stages if stages >= 2 else 0
    col_blocks = -(-(-(-n_cols // c)) // groups)
    return LinearPlan(mt, c, split, seg_steps, phase_steps, vec_steps, groups * split * WARP,
                      col_blocks, step_bytes * phase_steps + stages * slot_bytes, stages)


def _aligned(w: Any, k_dim: int) -> bool:
    """Every weight row starts on 16 bytes (the vector loads' requirement)."""
    return k_dim % VEC == 0 and data_address(w) % (4 * VEC) == 0


def plan_linear(rows: int, n_cols: int, k_dim: int, *, w: Any = None,
                kind: str = "linear") -> LinearPlan:
    """Launch geometry for ``rows`` rows per tile group, N = n_cols, K = k_dim (``w``: the weight,
    for the 16-byte alignment check; ``kind`` as :func:`get_kernel`), as a launch of ceil(rows /
    MT) row tiles (one group; the argmax kind over its parts) plans it, async ring included."""
    aligned = k_dim % VEC == 0 if w is None else _aligned(w, k_dim)
    mt = row_tile(rows, k_dim, kind)
    return _launch_plan(kind, mt, n_cols, k_dim, aligned, -(-rows // mt), 1,
                        argmax_parts(n_cols) if kind == "argmax" else 0)[0]


@functools.lru_cache(maxsize=1024)
def _launch_plan(kind: str, rows: int, n_cols: int, k_dim: int, aligned: bool, tiles: int,
                 groups: int, grid_y: int, busy: int = 0) -> tuple[LinearPlan, int]:
    """(plan, grid y) of a launch (:func:`_setup`'s arguments). The async weight ring runs where
    the blocks loop over up to ceil(column blocks / grid y) >= ASYNC_RING_MIN_LOOPS column blocks
    (the argmax kind: passes of a part) with their rows staged once: there a column block's first
    copies are issued under the previous one's butterfly and stores (run ring: the 33-row w_q
    and dense gate | up, 8-9 column blocks a block, 8 % faster on the H200), while a block of
    one column block (the 33-row w_a) and the 1-row tiles' load-then-FMA rounds were faster
    without it. (:func:`_plan` gives a ring only to rows staged once.) ``busy``: the tiles
    expected to work, where fewer than ``tiles`` (the expert slots), for the waves of grid y."""
    plan = _plan(kind, rows, n_cols, k_dim, aligned)
    y = grid_y or _grid_cols(plan, (busy or tiles) * groups)
    if plan.one_phase and -(-plan.col_blocks // y) >= ASYNC_RING_MIN_LOOPS:
        ringed = _plan(kind, rows, n_cols, k_dim, aligned, True)
        # the ring's slots may cost an odd tile its second block an SM (ODD_TILE_BLOCKS): y was
        # counted for the blocks of ``plan``, so the ring runs only where the count holds
        if ringed.ring_stages and blocks_per_sm(ringed) == blocks_per_sm(plan):
            return ringed, y
    return plan, y


@functools.lru_cache(maxsize=1024)
def _grid_cols(plan: LinearPlan, blocks_per_col: int) -> int:
    """Column blocks launched along grid y. One phase: blocks loop over column blocks with their
    rows staged once, and y is the count that finishes soonest: waves of PERSIST_BLOCKS_PER_SM
    blocks per SM times (the column blocks each block loops over + 1 for its staging); on a tie
    the fewest waves, then the most blocks (M = 1: one block per SM streams W). The count of
    waves matters: a grid a few blocks over the resident count runs those blocks, each a full
    share of the columns, as a second wave (5 row tiles x 27 = 135 blocks on 132 SMs doubled the
    33-row linears' time: ncu, SM active cycles 53 % of elapsed). Else one block per column
    block (each restages anyway). ``blocks_per_col``: the blocks along x and z (row tiles x
    groups)."""
    if SIM_TREE:
        return SIM_GRID_COLS
    cols = min(plan.col_blocks, MAX_GRID_Y)
    if not plan.one_phase:
        return cols
    resident = PERSIST_BLOCKS_PER_SM * blocks_per_sm(plan) * active_profile().sm_count

    def finish(y: int) -> tuple[int, int, int]:   # a staging counts as one more column block
        waves = -(-blocks_per_col * y // resident)
        return waves * (-(-plan.col_blocks // y) + 1), waves, -y
    return min(range(1, cols + 1), key=finish)


@functools.lru_cache(maxsize=4096)
def _setup(kind: str, prologue: str, residual: bool, rows: int, n_cols: int, k_dim: int,
           aligned: bool, tiles: int, groups: int = 1, grid_y: int = 0, busy: int = 0) -> tuple:
    """(kernel, grid, threads, shared bytes, geometry) of one launch shape, its configuration
    checked once against the device profile (sim.launch.check_launch). ``tiles``: blocks along
    x (row tiles or expert slots); ``groups``: along z; ``grid_y``: 0 for the column blocks of
    :func:`_grid_cols`, else that many (the argmax parts); ``busy``: as :func:`_launch_plan`."""
    plan, y = _launch_plan(kind, rows, n_cols, k_dim, aligned, tiles, groups, grid_y, busy)
    grid = (tiles, y, groups)
    opt_in = _opts_in(plan.shared_bytes)
    check_launch(grid, plan.threads, plan.shared_bytes, opt_in=opt_in,
                 static_shared_bytes=STATIC_BOUND_BYTES if opt_in else 0)
    # The loop is read per launch shape (not get_kernel's default, frozen at import): a bench can
    # switch PIPELINE_WEIGHTS / PIPELINE_MIN_ROW_TILE and clear this cache.
    return (get_kernel(kind, prologue, residual, plan.mt, columns=plan.columns,
                       pipelined=ring_for(plan.mt), vector_x=VECTOR_X_LOADS,
                       vector_stage=VECTOR_STAGING, ring_stages=plan.ring_stages,
                       min_blocks=blocks_per_sm(plan), unroll=_unroll(plan.mt, plan.columns)), grid, plan.threads,
            plan.shared_bytes, plan.geometry(n_cols, k_dim))


def _configured(kernel: Any, grid: tuple, threads: int, stream: Any, smem: int) -> Any:
    """``kernel[grid, threads, stream, smem]``, opted in to more than the default shared memory
    when the plan staged more than XS_BUDGET_BYTES (a GPU only: sim.launch.opt_in_shared)."""
    configured = kernel[grid, threads, _stream(stream), smem]
    return opt_in_shared(configured, smem) if _opts_in(smem) else configured


# --- argument checks (shapes, dtypes and strides read once per call) -------------------------------

def _f32(x: Any, name: str, ndim: int) -> Any:
    """A float32 array of rank ndim with unit inner stride (views allowed), no dimension over
    2**30 (the kernels' int32 geometry)."""
    if not (isinstance(x, np.ndarray) or is_device_array(x)):
        x = as_kernel_array(x, name)
    if x.dtype != F32:
        raise TypeError(f"{name} must have dtype float32, got {np.dtype(x.dtype).name}")
    shape, strides = tuple(x.shape), tuple(x.strides)   # the simulator's shape has no [-1]
    if len(shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(shape)}")
    if shape[-1] > 1 and strides[-1] != 4:
        raise ValueError(f"{name} must have a unit inner stride (a view of whole rows or a "
                         f"column slice), got strides {tuple(strides)}")
    if min(strides) < 0:
        raise ValueError(f"{name} must not have negative strides")
    if max(shape) > MAX_DIM:
        raise ValueError(f"{name} is too large (a dimension over 2**30)")
    return x


def _weight(w: Any, ndim: int) -> Any:
    """w float32, rank ndim, C-contiguous, N >= 1 and K >= 1."""
    w = _f32(w, "w", ndim)
    if not is_c_contiguous(w):
        raise ValueError("w must be C-contiguous")
    if min(tuple(w.shape)[ndim - 2:]) < 1:
        raise ValueError(f"w must have N >= 1 and K >= 1, got shape {tuple(w.shape)}")
    return w


def _check_out(out: Any, name: str, shape: tuple[int, ...]) -> Any:
    out = _f32(out, name, len(shape))
    if tuple(out.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(out.shape)}")
    return out


def _check_prologue_args(x: Any, k_dim: int, swiglu: Any, norm_weight: Any) -> tuple[str, Any]:
    """(prologue, norm_weight or None) after the checks of x's width, swiglu and norm_weight."""
    if swiglu is not True and swiglu is not False:
        raise TypeError(f"swiglu must be a bool, got {type(swiglu).__name__}")
    if norm_weight is not None and swiglu:
        raise ValueError("norm_weight and swiglu cannot be combined (one prologue)")
    want = 2 * k_dim if swiglu else k_dim
    if x.shape[1] != want:
        raise ValueError(f"x must have {want} columns ({'2K, swiglu' if swiglu else 'K'} with "
                         f"K = {k_dim} from w), got shape {tuple(x.shape)}")
    if norm_weight is None:
        return ("swiglu" if swiglu else "none"), None
    norm = _f32(norm_weight, "norm_weight", 1)
    if tuple(norm.shape) != (k_dim,):
        raise ValueError(f"norm_weight must have shape ({k_dim},), got {tuple(norm.shape)}")
    return "rmsnorm", norm


def _kernel_weight(w: Any) -> Any:
    """The weight as the kernels take it: as is on a GPU (flat addressing through the data
    pointer), a flat view under the simulator (plain element reads)."""
    return w.reshape(w.size) if SIM_TREE else w


def _check_eps(eps: Any) -> np.float32:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    return np.float32(eps)


def _stream(stream: Any) -> Any:
    return 0 if stream is None else stream


def check_linear_args(x: Any, w: Any, out: Any, norm_weight: Any, eps: Any, swiglu: Any,
                      residual: Any) -> tuple:
    """:func:`linear`'s argument checks (shared with :mod:`.linear_tc`): (x, w, out, residual,
    prologue, norm_weight or None, eps as float32), TypeError / ValueError naming the argument."""
    x = _f32(x, "x", 2)
    w = _weight(w, 2)
    n_cols, k_dim = w.shape
    m_rows = x.shape[0]
    prologue, norm = _check_prologue_args(x, k_dim, swiglu, norm_weight)
    out = _check_out(out, "out", (m_rows, n_cols))
    eps32 = _check_eps(eps)
    if residual is not None:
        residual = _check_out(residual, "residual", (m_rows, n_cols))
    return x, w, out, residual, prologue, norm, eps32


# --- host wrappers ---------------------------------------------------------------------------------

def linear(x: Any, w: Any, out: Any, *, norm_weight: Any = None, eps: float = 1e-6,
           swiglu: bool = False, residual: Any = None, stream: Any = 0) -> Any:
    """``out[m] = (residual[m] if given else 0) + input[m] @ w.T``, batch-invariant.

    Args:
        x: float32 [M, Kx], unit inner stride (a column-slice view is fine). The input row is
            x[m] (Kx == K); rmsnorm(x[m]) * norm_weight when ``norm_weight`` is given (rms over
            the K values, eps added to the mean square); silu(x[m, :K]) * x[m, K:] when
            ``swiglu`` (Kx == 2K).
        w: float32 [N, K], C-contiguous (HF [out, in] layout).
        out: float32 [M, N], unit inner stride (a view is fine).
        norm_weight: float32 [K] or None (not with ``swiglu``).
        eps: RMSNorm epsilon.
        swiglu: apply the SwiGLU prologue.
        residual: float32 [M, N] or None; may be ``out`` itself (read before written, per element).
        stream: 0, a numba stream, or a cuda.core Stream / GraphBuilder.

    Returns:
        ``out``.

    Raises:
        TypeError / ValueError naming the argument, before any launch.
    """
    x, w, out, residual, prologue, norm, eps32 = check_linear_args(x, w, out, norm_weight, eps, swiglu,
                                                                   residual)
    n_cols, k_dim = w.shape
    m_rows = x.shape[0]
    if m_rows == 0:
        return out
    mt = row_tile(m_rows, k_dim, "linear")
    kernel, grid, threads, smem, geometry = _setup(
        "linear", prologue, residual is not None, mt, n_cols, k_dim, _aligned(w, k_dim),
        -(-m_rows // mt))
    w_k = _kernel_weight(w)
    _configured(kernel, grid, threads, stream, smem)(
        x, w_k, out, out if residual is None else residual, w_k if norm is None else norm, eps32,
        *geometry)
    return out


def _rows_aligned(x: Any) -> bool:
    """Every x[m, g] starts on 16 bytes (the serial kernel's vector row loads)."""
    return data_address(x) % 16 == 0 and all(s % 16 == 0 for s in tuple(x.strides)[:-1])


def head_linear(x: Any, w: Any, out: Any, *, w_kn: Any = None, stream: Any = 0) -> Any:
    """Per-group products ``out[m, g] = x[m, g] @ w[g].T`` (MLA absorb), batch-invariant.

    With SERIAL_HEADS on (the GPU default) and ``w_kn`` given, a product of SERIAL_MIN_ROWS rows
    or more (a tree verify) with a one-segment K runs in the thread-serial kernel
    (:func:`serial_plan`; K and N multiples of 4, x's rows on 16 bytes), anything else in the warp
    layout: the same bits either way.

    Args:
        x: float32 [M, G, K], unit inner stride (a view such as q[:, :, :nope] is fine).
        w: float32 [G, N, K], C-contiguous.
        out: float32 [M, G, N], unit inner stride.
        w_kn: None, or w k-major: float32 [G, K, N], C-contiguous, ``w_kn[g, k, n] == w[g, n, k]``
            (the caller's copy; its values are not checked).
        stream: as :func:`linear`.

    Returns:
        ``out``.
    """
    x = _f32(x, "x", 3)
    w = _weight(w, 3)
    groups, n_cols, k_dim = w.shape
    m_rows = x.shape[0]
    if x.shape[1] != groups or x.shape[2] != k_dim:
        raise ValueError(f"x must have shape (M, {groups}, {k_dim}) (G and K from w), got "
                         f"{tuple(x.shape)}")
    out = _check_out(out, "out", (m_rows, groups, n_cols))
    if w_kn is not None:
        w_kn = _f32(w_kn, "w_kn", 3)
        if tuple(w_kn.shape) != (groups, k_dim, n_cols) or not is_c_contiguous(w_kn):
            raise ValueError(f"w_kn must be C-contiguous with shape {(groups, k_dim, n_cols)} (w k-major), "
                             f"got {tuple(w_kn.shape)}")
    if m_rows == 0 or groups == 0:
        return out
    serial = serial_plan(m_rows, groups, n_cols, k_dim) if w_kn is not None and _rows_aligned(x) else None
    if serial is not None:   # many rows: the thread-serial kernel, the same bits
        kernel = get_serial_kernel(serial.mt, serial.steps, serial.phases, serial.col_warps, serial.row_warps,
                                   serial.leaf_split)
        _configured(kernel, serial.grid, serial.threads, stream, serial.shared_bytes)(
            x, _kernel_weight(w_kn), out, n_cols, k_dim)
        return out
    mt = row_tile(m_rows, k_dim, "head")
    kernel, grid, threads, smem, geometry = _setup(
        "head", "none", False, mt, n_cols, k_dim, _aligned(w, k_dim), -(-m_rows // mt), groups)
    _configured(kernel, grid, threads, stream, smem)(x, _kernel_weight(w), out, *geometry)
    return out


# --- head products of many rows, one thread per output tile (same order, no butterfly) ------------
#
# A one-segment product (k_split(K) == 1: the MLA absorbs, K = 128 and 512) sums, per output, 32
# lane chains (lane l: k = 128 j + 4 l + e, j then e ascending) by the butterfly of offsets 16, 8,
# 4, 2, 1. One thread can run that exact order alone: the butterfly is a perfect binary tree whose
# leaves, read left to right, are the lanes in 5-bit bit-reversed order (0, 16, 8, 24, 4, ...), so
# the thread runs lane bitrev(i)'s chain for i = 0..31 and folds each finished subtree into the next
# level (a binary counter of five partial sums, each starting at -0.0: -0.0 + v == v bit for bit,
# +0.0 included). Every output gets the same fmas and adds as in the warp layout (a + b == b + a),
# so the bits are head_linear's whatever kernel runs.
#
# Layout (the fourth version): a block holds one head's column slab of NB = 32 x CW columns for
# every row of the launch (RB = 4 x RW x MT rows, grid y only past that), so the head's weights come
# from HBM once per launch. The leaves run in P phases of 32 / P leaves; per phase the block stages
# the weights' k-rows those leaves read (w_kn [G, K, N], the k-major copy the model keeps beside
# w: 16-byte coalesced loads, SERIAL_STAGE_LOADS in flight per thread) and the rows' matching x
# chunks into shared memory, leaf-major, then computes from shared memory. A warp is 8 column lanes
# (4 adjacent columns each) x 4 row lanes (MT rows each): per leaf step of 4 k, MT 16-byte x loads
# (4 rows, bank-spread by a 4-float pad) and 4 16-byte weight loads (32 adjacent columns, broadcast
# over the row lanes), one shared wavefront each, feed 16 MT fmas. The fifth version runs the 32
# leaves as S = 4 or 2 subsets side by side (SERIAL_LEAF_SPLITS), each a whole subtree of the
# butterfly run by its own warps from the same staged phases; the subtrees meet in the tree's order
# through the staging buffer at the end.
#
# History (H200, forward_ab, a 33-row forward of `small`, warp layout 2813-2837 us): weights read
# [G, N, K] per lane from global memory 6567.4 us; k-major, one column and one scalar x load per
# lane and k 4381.6 us; k-major, 4 adjacent columns and 16-byte x loads per lane (each thread a
# chain of 32 dependent global round trips) 2904.0 us; the fourth version 2763.6 us against 2812.2 (same
# process, run "staged absorbs"), so it is the GPU default (bench.forward_ab ``auto-serial``; the
# other variants switch it off); the leaf subsets 2726.7-2727.2 against 2749.0-2749.4 with one
# subset (run "leaf subsets"). An AR step keeps the warp layout: its weight stream is the work.

# The thread-serial kernel for head products of >= SERIAL_MIN_ROWS rows: on a GPU; the simulator
# keeps the warp layout (the same bits, tested both ways; Python threads make the serial kernel's
# many-row launches of the engine tests slow there).
SERIAL_HEADS = not SIM_TREE
SERIAL_MIN_ROWS = 8
SERIAL_ROW_TILES = (4, 3, 2, 1)   # rows per thread: the one wasting fewest rows (ties: larger)
SERIAL_COLS = VEC                 # adjacent columns per thread: 16-byte loads of a staged k-row
SERIAL_COL_LANES = 8              # lanes of a warp across columns (lane % 8) ...
SERIAL_ROW_LANES = WARP // SERIAL_COL_LANES   # ... and across row groups (lane // 8)
SERIAL_WARP_COLS = SERIAL_COL_LANES * SERIAL_COLS
SERIAL_COL_WARPS = (4, 2, 1)      # column warps per block: the widest giving SERIAL_BLOCKS_PER_SM
SERIAL_MAX_WARPS = 8              # warps per block (up to 255 registers a thread); more row warps
                                  # than that take grid y
SIM_SERIAL_ROW_WARPS = 2          # the simulator's threads are Python threads: small blocks (one
                                  # column warp, two row warps)
SERIAL_PHASES = (1, 2, 4, 8, 16, 32)   # leaf phases: the fewest whose staging fits SERIAL_SMEM
SERIAL_LEAF_SPLITS = (4, 2, 1)    # S, leaf subsets a block runs side by side (S x the warps of one
                                  # subset); the largest within serial_split_warps(MT) and 32 / P
SERIAL_MAX_SPLIT_WARPS = 12       # warps per block with the leaf subsets: 384 threads leave a thread
                                  # 170 registers (3-row threads take 128 on sm_90, 168 on sm_120)
SERIAL_SMEM = 72 * 1024           # staged bytes per block on a GPU (three fit an H200 SM; with the
                                  # leaf subsets the registers allow one or two)
SERIAL_BLOCKS_PER_SM = 2          # column slabs narrow until the grid has this many blocks an SM
SERIAL_STAGE_LOADS = 8            # 16-byte staging loads in flight per thread
SERIAL_X_PAD = VEC                # floats after each staged x row: a warp's 4 rows on distinct banks
SERIAL_LEVELS = 5                 # log2(WARP): the butterfly's depth
NEG_ZERO = np.float32(-0.0)


def serial_split_warps(mt: int) -> int:
    """Warps a serial block may have with its leaf subsets: SERIAL_MAX_SPLIT_WARPS, SERIAL_MAX_WARPS
    for 4-row threads (their 16 accumulators and levels spill under the 128 registers of a 448- or
    512-thread block, sm_90 compile of the review of run "leaf subsets"; 153 registers alone)."""
    return SERIAL_MAX_SPLIT_WARPS if mt < 4 else SERIAL_MAX_WARPS


def _make_row_load() -> tuple[Any, Any]:
    """``load_x4(x, r, g, k) -> x[r, g, k : k + 4]`` for a float32 [M, G, K] array (``x[r, k : k + 4]``
    for [M, K], g unused) of any outer strides and a unit last stride whose element (r, [g,] k)
    is 16-byte aligned: one
    ``ld.global.nc.v4.f32`` on a GPU (numba-cuda has no vector load, stack §1), four element reads
    under the simulator; and ``rows_aligned16(x)``: whether every row of such an array starts on 16
    bytes with unit stride along its last axis (data pointer and outer strides multiples of 16, the
    last stride 4 bytes), so that k a multiple of 4 gives an aligned ``load_x4``."""
    if cuda.config.ENABLE_CUDASIM:
        def load_x4(x, r, g, k):
            if x.ndim == 2:
                return x[r, k], x[r, k + 1], x[r, k + 2], x[r, k + 3]
            return x[r, g, k], x[r, g, k + 1], x[r, g, k + 2], x[r, g, k + 3]

        def rows_aligned16(x):
            address = x.__array_interface__["data"][0]
            return (x.strides[-1] == 4 and address % 16 == 0
                    and all(stride % 16 == 0 for stride in x.strides[:-1]))
        return load_x4, rows_aligned16

    from numba.core import cgutils
    from numba.cuda.extending import intrinsic

    def _rows(array) -> bool:
        return isinstance(array, types.Array) and array.ndim in (1, 2, 3) and array.dtype == types.float32

    @intrinsic
    def load_x4(typingctx, array, r, g, k):
        if not (_rows(array) and array.ndim > 1 and all(isinstance(t, types.Integer) for t in (r, g, k))):
            return None
        sig = types.UniTuple(types.float32, 4)(array, r, g, k)

        def codegen(context, builder, signature, args):
            ndim = signature.args[0].ndim
            ary = context.make_array(signature.args[0])(context, builder, value=args[0])
            strides = cgutils.unpack_tuple(builder, ary.strides, ndim)   # bytes
            r_, g_, k_ = (context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], signature.args[1:]))
            intp = context.get_value_type(types.intp)
            offset = builder.add(builder.mul(r_, strides[0]), builder.mul(k_, ir.Constant(intp, 4)))
            if ndim == 3:
                offset = builder.add(offset, builder.mul(g_, strides[1]))
            ptr = builder.inttoptr(builder.add(builder.ptrtoint(ary.data, intp), offset), ary.data.type)
            return vector_load(context, builder, signature, ptr)

        return sig, codegen

    @intrinsic
    def rows_aligned16(typingctx, array):
        if not _rows(array):
            return None
        sig = types.boolean(array)

        def codegen(context, builder, signature, args):
            ndim = signature.args[0].ndim
            ary = context.make_array(signature.args[0])(context, builder, value=args[0])
            strides = cgutils.unpack_tuple(builder, ary.strides, ndim)
            intp = context.get_value_type(types.intp)
            bits = builder.ptrtoint(ary.data, intp)
            for stride in strides[:-1]:
                bits = builder.or_(bits, stride)
            low = builder.icmp_unsigned("==", builder.and_(bits, ir.Constant(intp, 15)), ir.Constant(intp, 0))
            unit = builder.icmp_signed("==", strides[-1], ir.Constant(intp, 4))
            return builder.and_(low, unit)

        return sig, codegen

    return load_x4, rows_aligned16


load_x4, rows_aligned16 = _make_row_load()


def _make_shared_x4() -> tuple[Any, Any]:
    """``shared_x4(a, i) -> a[i : i + 4]`` and ``shared_put4(a, i, v0, v1, v2, v3)`` for a float32
    shared array, i a multiple of 4 from a 16-byte aligned start: one ``ld.shared.v4.f32`` /
    ``st.shared.v4.f32`` on a GPU (NVVM leaves four scalar accesses of computed indices scalar),
    element accesses under the simulator."""
    if cuda.config.ENABLE_CUDASIM:
        def shared_x4(a, i):
            return a[i], a[i + 1], a[i + 2], a[i + 3]

        def shared_put4(a, i, v0, v1, v2, v3):
            a[i] = v0
            a[i + 1] = v1
            a[i + 2] = v2
            a[i + 3] = v3
        return shared_x4, shared_put4

    from numba.cuda.extending import intrinsic

    def _vector_pointer(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, value=args[0])
        idx = context.cast(builder, args[1], signature.args[1], types.intp)
        generic = builder.gep(ary.data, [idx])
        f32x4 = ir.VectorType(ir.FloatType(), VEC)
        return builder.bitcast(builder.addrspacecast(generic, ir.PointerType(ir.FloatType(), 3)),
                               ir.PointerType(f32x4, 3))

    def _accepts(array, index) -> bool:
        return isinstance(array, types.Array) and array.dtype == types.float32 and isinstance(index, types.Integer)

    @intrinsic
    def shared_x4(typingctx, array, index):
        if not _accepts(array, index):
            return None
        sig = types.UniTuple(types.float32, 4)(array, index)

        def codegen(context, builder, signature, args):
            value = builder.load(_vector_pointer(context, builder, signature, args), align=16)
            return context.make_tuple(builder, signature.return_type,
                                      [builder.extract_element(value, ir.Constant(ir.IntType(32), e))
                                       for e in range(VEC)])

        return sig, codegen

    @intrinsic
    def shared_put4(typingctx, array, index, v0, v1, v2, v3):
        if not _accepts(array, index) or any(v != types.float32 for v in (v0, v1, v2, v3)):
            return None
        sig = types.void(array, index, v0, v1, v2, v3)

        def codegen(context, builder, signature, args):
            value = ir.Constant(ir.VectorType(ir.FloatType(), VEC), None)
            for e in range(VEC):
                value = builder.insert_element(value, args[2 + e], ir.Constant(ir.IntType(32), e))
            builder.store(value, _vector_pointer(context, builder, signature, args), align=16)
            return context.get_dummy_value()

        return sig, codegen

    return shared_x4, shared_put4


shared_x4, shared_put4 = _make_shared_x4()


@dataclass(frozen=True)
class SerialPlan:
    """A thread-serial head launch (a function of the shapes; layout, never the order).

    Attributes:
        mt: rows per thread; steps: J, steps of STEP values covering K; phases: P, leaf phases;
        col_warps / row_warps: the warps of one leaf subset across columns / row groups;
        leaf_split: S, leaf subsets (of 32 / S leaves) run by S x col_warps x row_warps warps;
        grid: (column slabs, row blocks, G); threads; shared_bytes: the dynamic shared memory of
        one phase.
    """

    mt: int
    steps: int
    phases: int
    col_warps: int
    row_warps: int
    leaf_split: int
    grid: tuple[int, int, int]
    threads: int
    shared_bytes: int

    @property
    def block_rows(self) -> int:
        return SERIAL_ROW_LANES * self.row_warps * self.mt


def _serial_floats(mt: int, steps: int, phases: int, col_warps: int, row_warps: int) -> tuple[int, int, int]:
    """(staged weight floats, staged x floats, x row stride) of one phase."""
    phase_k = (WARP // phases) * steps * VEC          # k values the phase's leaves read
    x_stride = phase_k + SERIAL_X_PAD
    return phase_k * col_warps * SERIAL_WARP_COLS, SERIAL_ROW_LANES * row_warps * mt * x_stride, x_stride


@functools.cache
def get_serial_kernel(mt: int, steps: int, phases: int, col_warps: int, row_warps: int,
                      leaf_split: int = 1) -> Any:
    """The thread-serial head kernel (compiled lazily, cached): ``mt`` rows x SERIAL_COLS columns a
    thread, K of ``steps`` steps of STEP values (one segment, K % 4 == 0), the 32 leaves in
    ``phases`` staged phases, each run by ``leaf_split`` subsets of ``col_warps`` x ``row_warps``
    warps (subset s: leaves s 32 / S .. (s + 1) 32 / S - 1, a whole subtree of the butterfly)."""
    if mt not in SERIAL_ROW_TILES or not 1 <= steps <= SPLIT_STEPS or phases not in SERIAL_PHASES or \
            col_warps not in SERIAL_COL_WARPS or not 1 <= row_warps <= SERIAL_MAX_WARPS or \
            leaf_split not in (1, 2, 4) or leaf_split * phases > WARP or \
            leaf_split * col_warps * row_warps > max(serial_split_warps(mt), col_warps * row_warps):
        raise ValueError(f"no serial head kernel for mt={mt!r}, steps={steps!r}, phases={phases!r}, "
                         f"col_warps={col_warps!r}, row_warps={row_warps!r}, leaf_split={leaf_split!r}")
    MT, C, J, P, S = mt, SERIAL_COLS, steps, phases, leaf_split
    MTC = MT * C
    LP = WARP // P                             # leaves per phase (staged)
    LS = WARP // S                             # leaves per subset (a subtree of LS leaves)
    LPS = LP // S                              # leaves per phase and subset
    # The level a subset's subtree ends in: log2(LS), the root's level (SERIAL_LEVELS - 1) for 32.
    TOP = min(SERIAL_LEVELS - 1, LS.bit_length() - 1)
    NB = col_warps * SERIAL_WARP_COLS          # the block's columns
    N4 = NB // VEC                             # 16-byte chunks of a staged weight k-row
    RB = SERIAL_ROW_LANES * row_warps * MT     # the block's rows
    CHUNKS = LP * J                            # x chunks of 4 k a row holds per phase
    SUB_THREADS = col_warps * row_warps * WARP  # the threads of one leaf subset
    THREADS = S * SUB_THREADS
    SL = SERIAL_STAGE_LOADS
    W_FLOATS, _, XS = _serial_floats(mt, steps, phases, col_warps, row_warps)
    W_CHUNKS = W_FLOATS // VEC
    X_CHUNKS = RB * CHUNKS

    @cuda.jit(device=True, **LOCAL_INLINE)
    def leaf_lane(i):
        """The lane whose chain is leaf i of the butterfly's tree (5-bit bit reversal)."""
        return (((i & 1) << 4) | ((i & 2) << 2) | (i & 4) | ((i & 8) >> 2) | ((i & 16) >> 4))

    @cuda.jit(device=True, **LOCAL_INLINE)
    def promote(level, t):
        """Level t holds a finished subtree: add it to level t + 1 and restart level t."""
        for a in range(MTC):
            level[t + 1, a] += level[t, a]
            level[t, a] = NEG_ZERO

    @cuda.jit(device=True, **LOCAL_INLINE)
    def fold(level, i):
        """Leaf i (its chains added to level 0) done: every subtree it finishes moves up a level;
        the root forms in the top level. Constant indices: the levels stay in registers."""
        if i & 1:
            promote(level, 0)
            if i & 2:
                promote(level, 1)
                if i & 4:
                    promote(level, 2)
                    if i & 8:
                        promote(level, 3)

    @cuda.jit(device=True, **LOCAL_INLINE)
    def staged_leaf(ph, li):
        """The leaf (0..31, left to right in the butterfly's tree) in staged slot li of phase ph:
        slot s LPS + l holds leaf l of the phase's share of subset s."""
        return (li // LPS) * LS + ph * LPS + li % LPS

    @cuda.jit(device=True, **LOCAL_INLINE)
    def stage(x, w_kn, sh, buf, g, ph, row_base, col_base, n_cols, k_dim):
        """Phase ph's staging: weights [CHUNKS * 4 k, NB] (k-row (li * J + j) * 4 + e is k = 128 j +
        4 bitrev(staged_leaf(ph, li)) + e) and x [RB, XS] (chunk li * J + j of a row: its 4 k);
        zeros past K, past N and past M. SL 16-byte loads in flight a thread, then their stores."""
        tid = int32(cuda.threadIdx.x)
        m_rows = x.shape[0]
        for base in range(tid, W_CHUNKS, THREADS * SL):
            for s in range(SL):
                idx = int32(base + s * THREADS)
                v0 = v1 = v2 = v3 = ZERO
                if idx < W_CHUNKS:
                    t = idx // N4
                    col = col_base + (idx - t * N4) * VEC
                    k = (t // VEC % J) * STEP + VEC * leaf_lane(staged_leaf(ph, t // (VEC * J))) + t % VEC
                    if k < k_dim and col < n_cols:
                        v0, v1, v2, v3 = load_f32x4(w_kn, (int64(g) * k_dim + k) * n_cols + col)
                buf[s, 0] = v0
                buf[s, 1] = v1
                buf[s, 2] = v2
                buf[s, 3] = v3
            for s in range(SL):
                idx = int32(base + s * THREADS)
                if idx < W_CHUNKS:
                    shared_put4(sh, idx * VEC, buf[s, 0], buf[s, 1], buf[s, 2], buf[s, 3])
        for base in range(tid, X_CHUNKS, THREADS * SL):
            for s in range(SL):
                idx = int32(base + s * THREADS)
                v0 = v1 = v2 = v3 = ZERO
                if idx < X_CHUNKS:
                    r = idx // CHUNKS
                    c = idx - r * CHUNKS
                    k0 = (c % J) * STEP + VEC * leaf_lane(staged_leaf(ph, c // J))
                    if k0 < k_dim and row_base + r < m_rows:
                        v0, v1, v2, v3 = load_x4(x, row_base + r, g, k0)
                buf[s, 0] = v0
                buf[s, 1] = v1
                buf[s, 2] = v2
                buf[s, 3] = v3
            for s in range(SL):
                idx = int32(base + s * THREADS)
                if idx < X_CHUNKS:
                    r = idx // CHUNKS
                    shared_put4(sh, W_FLOATS + r * XS + (idx - r * CHUNKS) * VEC,
                                buf[s, 0], buf[s, 1], buf[s, 2], buf[s, 3])

    @cuda.jit(**launch_bounds(THREADS))
    def kernel(x, w_kn, out, n_cols, k_dim):
        """out[m, g] = x[m, g] @ w[g].T in head_linear's order. x [M, G, K] (16-byte aligned rows,
        K % 4 == 0), w_kn flat [G * K * N] (w k-major: w_kn[g, k, n] = w[g, n, k]; N % 4 == 0),
        out [M, G, N]. Grid (ceil(N / NB), ceil(M / RB), G); dynamic shared memory: one phase's
        staging, W_FLOATS + RB * XS floats (and, after the last phase, the subsets' subtrees)."""
        sh = cuda.shared.array(0, float32)     # [CHUNKS * 4, NB] weights | [RB, XS] x chunks
        pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
        buf = cuda.local.array((SL, VEC), float32)
        p = cuda.local.array(MTC, float32)     # the current leaf's chains
        level = cuda.local.array((SERIAL_LEVELS, MTC), float32)   # unfinished subtrees
        xv = cuda.local.array((MT, VEC), float32)
        wv = cuda.local.array((VEC, C), float32)
        lane = int32(cuda.threadIdx.x) % WARP
        sub = int32(cuda.threadIdx.x) // SUB_THREADS          # the thread's leaf subset
        sub_tid = int32(cuda.threadIdx.x) - sub * SUB_THREADS
        warp = sub_tid // WARP
        g = int32(cuda.blockIdx.z)
        row_base = int32(cuda.blockIdx.y) * RB
        col_base = int32(cuda.blockIdx.x) * NB
        c_sh = (warp % col_warps) * SERIAL_WARP_COLS + (lane % SERIAL_COL_LANES) * C   # staged column
        r_sh = ((warp // col_warps) * SERIAL_ROW_LANES + lane // SERIAL_COL_LANES) * MT   # staged row
        x_at = W_FLOATS + r_sh * XS            # the thread's first staged x row
        for a in range(MTC):
            for t in range(SERIAL_LEVELS):
                level[t, a] = NEG_ZERO
        for ph in range(P):
            if ph > 0:
                cuda.syncthreads()             # every warp done with the previous phase's staging
            stage(x, w_kn, sh, buf, g, ph, row_base, col_base, n_cols, k_dim)
            cuda.syncthreads()                 # the phase's staging visible to every warp
            for ll in range(LPS):
                li = sub * LPS + ll                # staged slot
                i = ph * LPS + ll                  # the leaf's place in its subset's subtree
                k_lane = VEC * leaf_lane(sub * LS + i)
                for a in range(MTC):
                    p[a] = ZERO
                for j in range(J):
                    if j * STEP + k_lane < k_dim:      # the chunk is whole (K % 4 == 0)
                        at = int32((li * J + j) * VEC)
                        for r in range(MT):
                            xv[r, 0], xv[r, 1], xv[r, 2], xv[r, 3] = shared_x4(sh, x_at + r * XS + at)
                        for e in range(VEC):
                            wv[e, 0], wv[e, 1], wv[e, 2], wv[e, 3] = shared_x4(sh, (at + e) * NB + c_sh)
                        for e in range(VEC):   # the chain: j, then e ascending
                            for r in range(MT):
                                for c in range(C):
                                    p[r * C + c] = cuda.fma(xv[r, e], wv[e, c], p[r * C + c])
                for a in range(MTC):
                    level[0, a] += p[a]
                fold(level, i)
        if S > 1:
            # The subsets' subtrees meet in the butterfly's order: (t0 + t1) (+ (t2 + t3)).
            cuda.syncthreads()                 # every warp done with the last phase's staging
            if sub > 0:
                for a in range(MTC):
                    sh[((sub - 1) * SUB_THREADS + sub_tid) * MTC + a] = level[TOP, a]
            cuda.syncthreads()                 # the other subsets' subtrees visible to subset 0
            if sub == 0:
                for a in range(MTC):
                    root = level[TOP, a] + sh[sub_tid * MTC + a]
                    if S == 4:
                        right = sh[(SUB_THREADS + sub_tid) * MTC + a] + sh[(2 * SUB_THREADS + sub_tid) * MTC + a]
                        root = root + right
                    level[TOP, a] = root
        m_rows = x.shape[0]
        if sub == 0:
            for r in range(MT):
                row = row_base + r_sh + r
                if row < m_rows:
                    for c in range(C):
                        col = col_base + c_sh + c
                        if col < n_cols:
                            out[row, g, col] = level[TOP, r * C + c]

    return kernel


def _serial_sigs() -> tuple:
    a3 = float32[:, :, :]
    return ((a3, float32[:, :, ::1], a3, int32, int32),)


# The compile check: W_UV's launch of a 33-row verify on the H200 (3 rows a thread, K 512 in two
# phases, one column warp, three row warps, four leaf subsets); W_UK's (one phase, two column warps,
# two subsets) differs only in constants, and each entry costs CI time.
for _args in ((3, 4, 2, 1, 3, 4),):
    register("head_linear_serial_mt{}_s{}_p{}_c{}_r{}_l{}".format(*_args), get_serial_kernel(*_args), _serial_sigs(),
             f"head_linear's order run by one thread per {_args[0]} x {SERIAL_COLS} outputs from staged leaves "
             f"in {_args[5]} subtrees (no butterfly), K <= {_args[1] * STEP}",
             block_threads=_args[5] * _args[3] * _args[4] * WARP)


def _serial_budget() -> int:
    """Staged bytes a serial block may take: SERIAL_SMEM on a GPU (within the opt-in limit), the
    default limit's XS_BUDGET_BYTES under the simulator."""
    return XS_BUDGET_BYTES if SIM_TREE else min(SERIAL_SMEM, xs_budget())


@functools.lru_cache(maxsize=1024)
def serial_plan(rows: int, groups: int, n_cols: int, k_dim: int) -> SerialPlan | None:
    """The thread-serial launch of a head product, or None where the warp layout runs
    (SERIAL_HEADS off, fewer than SERIAL_MIN_ROWS rows, K of several segments, K or N not a
    multiple of 4, or no phase count whose staging fits). Rows per thread: the fewest wasted rows;
    column warps: the widest slab giving SERIAL_BLOCKS_PER_SM blocks an SM (else one); phases: the fewest
    that fit the staging budget. A function of the shapes; layout, never the order."""
    if not SERIAL_HEADS or rows < SERIAL_MIN_ROWS or k_split(k_dim) != 1 or k_dim % VEC or n_cols % SERIAL_COLS:
        return None
    mt = min(SERIAL_ROW_TILES, key=lambda t: (-(-rows // (SERIAL_ROW_LANES * t)) * SERIAL_ROW_LANES * t - rows, -t))
    row_groups = -(-rows // (SERIAL_ROW_LANES * mt))      # warp rows needed
    row_blocks = -(-row_groups // (SIM_SERIAL_ROW_WARPS if SIM_TREE else SERIAL_MAX_WARPS))
    row_warps = -(-row_groups // row_blocks)              # balanced over the row blocks
    steps = -(-k_dim // STEP)
    widths = [c for c in SERIAL_COL_WARPS if c * row_warps <= SERIAL_MAX_WARPS] or SERIAL_COL_WARPS[-1:]
    min_blocks = SERIAL_BLOCKS_PER_SM * active_profile().sm_count
    for col_warps in widths[-1:] if SIM_TREE else widths:
        slabs = -(-n_cols // (col_warps * SERIAL_WARP_COLS))
        if slabs * row_blocks * groups >= min_blocks or col_warps == SERIAL_COL_WARPS[-1]:
            break
    for phases in SERIAL_PHASES:
        w_floats, x_floats, _ = _serial_floats(mt, steps, phases, col_warps, row_warps)
        smem = 4 * (w_floats + x_floats)
        if smem <= _serial_budget():
            break
    else:
        return None
    # Leaf subsets: the most whose warps fit, at least one leaf a phase each, and whose subtrees
    # (S - 1 subsets' MT x 4 sums a thread) fit the staging buffer they meet in.
    sub_warps = col_warps * row_warps
    leaf_split = next((s for s in SERIAL_LEAF_SPLITS
                       if s * sub_warps <= serial_split_warps(mt) and s * phases <= WARP
                       and (s - 1) * sub_warps * WARP * mt * SERIAL_COLS <= w_floats + x_floats), 1)
    grid = (slabs, row_blocks, groups)
    threads = leaf_split * sub_warps * WARP
    check_launch(grid, threads, smem, opt_in=_opts_in(smem))
    return SerialPlan(mt, steps, phases, col_warps, row_warps, leaf_split, grid, threads, smem)

# --- split K: a product whose rows overflow the staging budget, as per-segment products --------
#
# linear() at K = k_split(K) x K' sums K' = seg_steps * STEP wide segments, each a one-segment
# product of K' (k_split(K') == 1: the same lane chains and butterfly), and adds the segment sums
# in order. So the head kernel over x viewed [M, G, K'] and w re-laid [G, N, K'] (a one-time copy)
# computes every segment sum with linear()'s bits, and segment_sum adds them in linear()'s order:
# the same output, bit for bit. It pays where K's rows overflow the staging budget (the 33-row
# verify forward's wo at K 8192: 4-row tiles that re-read W nine times, where the segments take
# 8-row tiles staged once).

def split_k_segments(k_dim: int) -> int:
    """G, the segments of K when a split product reproduces linear()'s order (every segment full
    and one segment of its own width), else 0."""
    split, seg = k_split(k_dim), _seg_steps(k_dim)
    return split if split > 1 and k_dim == split * seg * STEP and k_split(seg * STEP) == 1 else 0


@functools.lru_cache(maxsize=1024)
def split_k_pays(rows: int, k_dim: int) -> bool:
    """Whether the split reproduces linear()'s order and ``rows`` rows take either a smaller row
    tile at K than at K' (the staging budget shrank it: wo of a 33-row tree, 4-row tiles) or more
    than one full tile (the segments' own blocks instead of a barrier and a combine per column
    block; a 33-row dense w2 ran at 4.2 TFLOP/s, the 8-row K 2048 lm_head at 18). Decode rows
    (one tile) keep linear(): the weight stream is the work there."""
    g = split_k_segments(k_dim)
    return g > 0 and (row_tile(rows, k_dim) < row_tile(rows, k_dim // g) or rows > MAX_ROW_TILE)


def split_k_weight(w: Any, *, stream: Any = 0) -> Any:
    """w [N, K] (host or device) re-laid as the device array [G, N, K'] that :func:`linear_split_k`
    takes: [g, n, :] = w[n, g K' : (g + 1) K'] (one copy through the host; a model-load step)."""
    host = w.copy_to_host() if is_device_array(w) else np.asarray(w)
    if host.dtype != F32 or host.ndim != 2:
        raise TypeError(f"w must be a float32 [N, K] array, got {host.dtype} {host.shape}")
    g = split_k_segments(host.shape[1])
    if not g:
        raise ValueError(f"w: K = {host.shape[1]} has no split that keeps linear()'s order")
    n_cols, k_dim = host.shape
    return cuda.to_device(np.ascontiguousarray(host.reshape(n_cols, g, k_dim // g).transpose(1, 0, 2)),
                          stream=_stream(stream))


SUM_THREADS = 256


def _make_segment_sum(residual: bool) -> Any:
    @cuda.jit
    def segment_sum_kernel(parts, out, residual_arr):
        """out[m, n] = (residual[m, n] +) ((parts[m, 0, n] + parts[m, 1, n]) + ...): linear()'s
        segment combine and residual epilogue. One thread per element (read, then written: out
        may be residual)."""
        pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
        i = cuda.grid(1)
        n_cols = out.shape[1]
        if i < out.shape[0] * n_cols:
            m = i // n_cols
            n = i - m * n_cols
            total = parts[m, 0, n]
            for g in range(1, parts.shape[1]):   # segment order
                total += parts[m, g, n]
            if residual:
                out[m, n] = residual_arr[m, n] + total
            else:
                out[m, n] = total
    return segment_sum_kernel


segment_sum_kernel = _make_segment_sum(False)
segment_sum_residual_kernel = _make_segment_sum(True)
_SUM_SIGS = ((float32[:, :, :], float32[:, :], float32[:, :]),)
register("segment_sum", segment_sum_kernel, _SUM_SIGS,
         "split-K linear: the per-segment sums added in linear()'s segment order", block_threads=SUM_THREADS)
register("segment_sum_residual", segment_sum_residual_kernel, _SUM_SIGS,
         "split-K linear: segment sums added in order, plus the residual", block_threads=SUM_THREADS)


@cuda.jit
def swiglu_rows_kernel(x, out):
    """out[m, k] = silu(x[m, k]) * x[m, K + k] (:func:`_silu_mul`, the bits linear()'s swiglu
    prologue stages). One thread per element."""
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    i = cuda.grid(1)
    k_dim = out.shape[1]
    if i < out.shape[0] * k_dim:
        m = i // k_dim
        k = i - m * k_dim
        out[m, k] = _silu_mul(x[m, k], x[m, k_dim + k])


register("swiglu_rows", swiglu_rows_kernel, ((float32[:, :], float32[:, :]),),
         "split-K linear: the SwiGLU prologue as its own pass (linear's staged bits)",
         block_threads=SUM_THREADS)


def swiglu_rows(x: Any, out: Any, *, stream: Any = 0) -> Any:
    """``out = silu(x[:, :K]) * x[:, K:]``, the input rows ``linear(x, w, ..., swiglu=True)``
    multiplies (the same bits), for :func:`linear_split_k`.

    Args:
        x: float32 [M, 2K], unit inner stride; out: float32 [M, K], unit inner stride.
    """
    x = _f32(x, "x", 2)
    if x.shape[1] % 2:
        raise ValueError(f"x must have an even number of columns (gate | up), got {tuple(x.shape)}")
    out = _check_out(out, "out", (x.shape[0], x.shape[1] // 2))
    if out.size:
        launch(swiglu_rows_kernel, -(-out.size // SUM_THREADS), SUM_THREADS, stream, 0, x, out)
    return out


def linear_split_k(x: Any, w_split: Any, parts: Any, out: Any, *, residual: Any = None,
                   stream: Any = 0) -> Any:
    """``linear(x, w, out, residual=residual)``, bit for bit, as per-segment products: the head
    kernel writes the G segment sums to ``parts``, then :data:`segment_sum_kernel` adds them in
    order (two launches).

    Args:
        x: float32 [M, G, K'], unit inner stride: the input [M, K] viewed by segments.
        w_split: float32 [G, N, K'], C-contiguous, from :func:`split_k_weight`.
        parts: float32 [M, G, N], unit inner stride (caller-owned workspace).
        out: float32 [M, N], unit inner stride.
        residual: float32 [M, N] or None; may be ``out`` itself.
        stream: as :func:`linear`.

    Raises:
        TypeError / ValueError naming the argument, before any launch (G and K' must be
        ``split_k_segments(G K')`` and K' / G).
    """
    w_split = _weight(w_split, 3)
    groups, n_cols, seg = w_split.shape
    if split_k_segments(groups * seg) != groups:
        raise ValueError(f"w_split: G = {groups} segments of {seg} are not linear()'s split of "
                         f"K = {groups * seg}")
    x = _f32(x, "x", 3)
    m_rows = x.shape[0]
    if tuple(x.shape[1:]) != (groups, seg):
        raise ValueError(f"x must have shape (M, {groups}, {seg}) (from w_split), got {tuple(x.shape)}")
    parts = _check_out(parts, "parts", (m_rows, groups, n_cols))
    out = _check_out(out, "out", (m_rows, n_cols))
    if residual is not None:
        residual = _check_out(residual, "residual", (m_rows, n_cols))
    if m_rows == 0:
        return out
    head_linear(x, w_split, parts, stream=stream)
    kernel = segment_sum_kernel if residual is None else segment_sum_residual_kernel
    launch(kernel, -(-m_rows * n_cols // SUM_THREADS), SUM_THREADS, stream, 0,
           parts, out, out if residual is None else residual)
    return out


def expert_slots(entries: int, experts: int, mt: int) -> int:
    """Tile slots launched for ``entries`` CSR entries over ``experts`` groups: the least upper
    bound of sum_e ceil(count_e / mt) over routings (sum_e count_e <= entries, at most
    n = min(experts, entries) experts non-empty): each ceil is at most (count_e + mt - 1) / mt, so
    the sum is at most floor((entries + n (mt - 1)) / mt), reached by n - 1 experts of one entry
    and the rest in one. Exact at one-row tiles (an AR step's gate | up: ``entries`` slots, every
    one a tile; the bound of one more slot per non-empty expert launched 8 blocks a column block
    for 4 tiles and sized the grid for them, and `small`'s AR down projection took 9.67 us in
    (5, 26) blocks against 8.12 in (4, 32): H200, PERFORMANCE run "lane squares")."""
    n = min(experts, entries)
    return (entries + n * (mt - 1)) // mt


def expert_busy_tiles(entries: int, experts: int, mt: int) -> int:
    """The tiles a uniform routing of ``entries`` over ``experts`` fills, about: entries / mt plus,
    per non-empty expert, the mean padding of its last tile, (mt - 1) / (2 mt), and at least one
    tile per non-empty expert (E (1 - (1 - 1 / E)^J) of them expected: an AR step's entries, one
    an expert, fill one tile each); at most :func:`expert_slots`; exact (``entries``) at one-row
    tiles. What expert_linear's grid y is chosen for (:func:`expert_wave_tiles`): 29 of 35 slots
    for 33 rows with the shared expert folded in (165 entries, 17 experts, mt 8)."""
    hit = experts * (1.0 - (1.0 - 1.0 / experts) ** entries)   # non-empty experts expected
    typical = max(math.ceil(hit), math.ceil(entries / mt + hit * (mt - 1) / (2 * mt)))
    return min(expert_slots(entries, experts, mt), typical)


def expert_wave_tiles(entries: int, experts: int, mt: int) -> int:
    """The tiles expert_linear's grid y is chosen for: :func:`expert_busy_tiles` with
    EXPERT_TYPICAL_WAVES on, else every slot of :func:`expert_slots`."""
    return (expert_busy_tiles if EXPERT_TYPICAL_WAVES else expert_slots)(entries, experts, mt)


def _check_routing(row_offsets: Any, row_index: Any, experts: int, entries: int,
                   x_rows: int) -> tuple[Any, Any]:
    """row_offsets int32 [E + 1] and row_index int32 [J], contiguous; their values are checked
    only when they are host arrays (device values are never read: graph-capturable)."""
    row_offsets = as_kernel_array(row_offsets, "row_offsets")
    if row_offsets.dtype != I32:
        raise TypeError(f"row_offsets must have dtype int32, got {np.dtype(row_offsets.dtype).name}")
    if tuple(row_offsets.shape) != (experts + 1,) or not is_c_contiguous(row_offsets):
        raise ValueError(f"row_offsets must be a contiguous ({experts + 1},) array, got shape "
                         f"{tuple(row_offsets.shape)}")
    row_index = as_kernel_array(row_index, "row_index")
    if row_index.dtype != I32:
        raise TypeError(f"row_index must have dtype int32, got {np.dtype(row_index.dtype).name}")
    if tuple(row_index.shape) != (entries,) or not is_c_contiguous(row_index):
        raise ValueError(f"row_index must be a contiguous ({entries},) array (J from out), got "
                         f"shape {tuple(row_index.shape)}")
    if isinstance(row_offsets, np.ndarray):
        if row_offsets[0] < 0 or row_offsets[-1] > entries or np.any(np.diff(row_offsets) < 0):
            raise ValueError(f"row_offsets must be non-decreasing within [0, {entries}]")
        if isinstance(row_index, np.ndarray):
            used = row_index[row_offsets[0]:row_offsets[-1]]
            if used.size and (used.min() < 0 or used.max() >= x_rows):
                raise ValueError(f"row_index must be in [0, {x_rows}) on routed entries")
    return row_offsets, row_index


def check_expert_args(x: Any, w: Any, out: Any, row_offsets: Any, row_index: Any, swiglu: Any) -> tuple:
    """:func:`expert_linear`'s argument checks (shared with ``gemv.expert_gemv``): (x, w, out,
    row_offsets, row_index, prologue), TypeError / ValueError naming the argument."""
    x = _f32(x, "x", 2)
    w = _weight(w, 3)
    experts, n_cols, k_dim = w.shape
    if experts > MAX_EXPERTS:
        raise ValueError(f"w has {experts} experts, at most {MAX_EXPERTS} are supported")
    prologue, _ = _check_prologue_args(x, k_dim, swiglu, None)
    out = _f32(out, "out", 2)
    if out.shape[1] != n_cols:
        raise ValueError(f"out must have shape (J, {n_cols}) (N from w), got {tuple(out.shape)}")
    row_offsets, row_index = _check_routing(row_offsets, row_index, experts, out.shape[0], x.shape[0])
    return x, w, out, row_offsets, row_index, prologue


def expert_linear(x: Any, w: Any, out: Any, row_offsets: Any, row_index: Any, *,
                  swiglu: bool = False, max_rows: int | None = None, stream: Any = 0) -> Any:
    """Grouped (MoE) products over a CSR routing, batch-invariant.

    Entries j in [row_offsets[e], row_offsets[e + 1]) use expert e on input row x[row_index[j]]
    and write out[j] = input @ w[e].T (input = silu(x[r, :K]) * x[r, K:] when ``swiglu``).

    Args:
        x: float32 [R, Kx] (Kx = K, or 2K with swiglu), unit inner stride.
        w: float32 [E, N, K], C-contiguous (E <= MAX_EXPERTS).
        out: float32 [J, N], unit inner stride; J = the entry capacity (the engine's: M * k,
            M * (k + 1) with the shared expert folded in). Entries past row_offsets[E] are not
            written.
        row_offsets: int32 [E + 1], non-decreasing, within [0, J] (device values are clamped, not
            checked); row_index: int32 [J], rows of x (a device value outside [0, R) gives a NaN
            output row).
        swiglu: apply the SwiGLU prologue.
        max_rows: the most entries one expert can hold, for the row tile only (layout: any
            routing is computed right whatever it is): the token rows M where each row picks an
            expert at most once, e.g. a down projection whose x has one row per entry; default
            min(R, J).
        stream: as :func:`linear`.

    Returns:
        ``out``. The grid is fixed by (J, E, R, max_rows): blocks past the last non-empty tile exit.
    """
    x, w, out, row_offsets, row_index, prologue = check_expert_args(x, w, out, row_offsets, row_index, swiglu)
    experts, n_cols, k_dim = w.shape
    entries = out.shape[0]
    rows = min(x.shape[0], entries)
    if max_rows is not None:
        rows = min(rows, int_arg(max_rows, "max_rows", 1))
    if entries == 0 or x.shape[0] == 0:
        return out
    mt = row_tile(rows, k_dim, "expert")
    kernel, grid, threads, smem, geometry = _setup(
        "expert", prologue, False, mt, n_cols, k_dim, _aligned(w, k_dim),
        expert_slots(entries, experts, mt), busy=expert_wave_tiles(entries, experts, mt))
    _configured(kernel, grid, threads, stream, smem)(x, _kernel_weight(w), out, row_offsets,
                                                  row_index, *geometry)
    return out


# --- the lm_head fused with the greedy posterior's argmax -----------------------------------------

def _check_n_cols(n_cols: Any) -> int:
    if isinstance(n_cols, bool) or not isinstance(n_cols, numbers.Integral):
        raise TypeError(f"n_cols must be an int, got {type(n_cols).__name__}")
    if n_cols < 1:
        raise ValueError(f"n_cols must be >= 1, got {n_cols}")
    return int(n_cols)


@functools.lru_cache(maxsize=256)
def _part_cols(n_cols: int) -> int:
    parts = max(1, min(TARGET_PARTS, -(-n_cols // MIN_PART_COLS)))
    width = -(-n_cols // parts)
    return -(-width // PART_ALIGN) * PART_ALIGN


def argmax_part_cols(n_cols: int) -> int:
    """Columns per part of :func:`linear_argmax` for N = n_cols (the last part may be shorter):
    about N / P for P = min(TARGET_PARTS, ceil(N / MIN_PART_COLS)) parts, rounded up to a
    multiple of PART_ALIGN (whole column-group passes of every block shape).
    A function of N only (and of the build: GPU or simulator)."""
    return _part_cols(_check_n_cols(n_cols))


def argmax_parts(n_cols: int) -> int:
    """P, the parts (column blocks) per row of :func:`linear_argmax` for N = n_cols: the width of
    its ``part_val`` / ``part_idx`` buffers. 95 for V = 163840 on a GPU."""
    n_cols = _check_n_cols(n_cols)
    return -(-n_cols // _part_cols(n_cols))


def _check_parts(a: Any, name: str, dtype: np.dtype, shape: tuple[int, int], n_cols: int) -> Any:
    """A C-contiguous [M, P] part buffer of ``dtype``."""
    if not (isinstance(a, np.ndarray) or is_device_array(a)):
        a = as_kernel_array(a, name)
    if a.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype.name}, got {np.dtype(a.dtype).name}")
    if len(a.shape) != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(a.shape)}")
    if not is_c_contiguous(a):
        raise ValueError(f"{name} must be C-contiguous")
    if tuple(a.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} (M, argmax_parts(N = {n_cols})), got "
                         f"{tuple(a.shape)}")
    return a


def linear_argmax(x: Any, w: Any, part_val: Any, part_idx: Any, *, norm_weight: Any = None,
                  eps: float = 1e-6, stream: Any = 0) -> tuple[Any, Any]:
    """The lm_head ranked instead of stored: per row m and part p, the largest of the logits
    ``linear(x, w, out, norm_weight=norm_weight, eps=eps)`` would write in columns
    [p * W, min((p + 1) * W, N)), W = ``argmax_part_cols(N)``, and its lowest column.

    Every logit is computed by ``linear``'s own tile code (bit-identical, batch-invariant); only
    the store is replaced by :func:`.accept.outranks` (larger value, ties -> lower id, NaN
    skipped). A part whose logits are all NaN gives (-inf, ``accept.NO_INDEX``).
    :func:`.accept.posterior_argmax_parts` merges a row's parts into
    ``posterior_argmax(logits)``'s token.

    Args:
        x: float32 [M, K], unit inner stride (a view is fine); the input row is x[m], or
            rmsnorm(x[m]) * norm_weight when ``norm_weight`` is given.
        w: float32 [N, K], C-contiguous (HF [out, in]).
        part_val: float32 [M, P], C-contiguous, caller-owned; P = ``argmax_parts(N)``.
        part_idx: int32 [M, P], C-contiguous, caller-owned.
        norm_weight: float32 [K] or None.
        eps: RMSNorm epsilon.
        stream: 0, a numba stream, or a cuda.core Stream / GraphBuilder.

    Returns:
        ``(part_val, part_idx)``. No host read of device data (graph-capturable).

    Raises:
        TypeError / ValueError naming the argument, before any launch.
    """
    x = _f32(x, "x", 2)
    w = _weight(w, 2)
    n_cols, k_dim = w.shape
    m_rows = x.shape[0]
    n_parts = -(-n_cols // _part_cols(n_cols))
    part_val = _check_parts(part_val, "part_val", F32, (m_rows, n_parts), n_cols)
    part_idx = _check_parts(part_idx, "part_idx", I32, (m_rows, n_parts), n_cols)
    eps32 = _check_eps(eps)
    prologue, norm = _check_prologue_args(x, k_dim, False, norm_weight)
    if m_rows == 0:
        return part_val, part_idx
    mt = row_tile(m_rows, k_dim, "argmax")
    kernel, grid, threads, smem, geometry = _setup(
        "argmax", prologue, False, mt, n_cols, k_dim, _aligned(w, k_dim), -(-m_rows // mt), 1,
        n_parts)
    w_k = _kernel_weight(w)
    _configured(kernel, grid, threads, stream, smem)(
        x, w_k, part_val, part_idx, w_k if norm is None else norm, eps32, *geometry,
        _part_cols(n_cols))
    return part_val, part_idx
