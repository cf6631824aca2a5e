"""Batch-invariant FP32 matrix products on the tensor cores: ``linear_tc`` (3 x TF32 ``mma.sync``).

Why: a 33-row tree verify runs :func:`.linear.linear` on the CUDA cores at 11-20 TFLOP/s of the
H200's 67 (PERFORMANCE "Where the issue's two targets stand"): the verify forward costs 2.15 AR
steps and the issue's ratio needs <= 2. ``mma.sync`` on TF32 runs ~494 TFLOP/s dense; splitting
each float32 operand into a TF32 high part and a TF32 low part and summing three products
(lo*hi + hi*lo + hi*hi, the lo*lo term dropped) keeps near-FP32 accuracy ("3xTF32", as CUTLASS's
``OpMultiplyAddFastF32``) at a third of that rate, still far above the CUDA cores. numba-cuda has
no tensor-core API (limits §5); the ``mma`` is inline PTX in ``numba.cuda.extending.intrinsic``
codegen, as :mod:`.linear` does its vector loads, and the split is a bit mask (TF32 toward zero:
one ``and`` where ``cvt.rna.tf32.f32`` took four instructions).

Numerics: one order per weight shape (N, K), whatever shares the launch.
    Output element ``(m, n)``: the input row m (after the prologue, with :mod:`.linear`'s prologue
    arithmetic: ``(x * inv_rms) * norm_weight`` or ``silu(gate) * up``) and weight row n are each
    split per element into ``hi = tf32_trunc(v)`` and ``lo = tf32_trunc(v - hi)`` (the low 13
    mantissa bits cleared; v - hi is exact; |v - hi - lo| < 2^-20 |v| for normal v; hi, lo and
    the dropped lo * lo carry v's sign, so a product is biased toward zero by up to ~2^-19 of it,
    inside the tests' bound, where round-to-nearest would not be biased). K is cut into
    :func:`segments` ``S(N, K)`` contiguous segments of ``seg_k`` values (a multiple of 32); a
    segment runs in steps of 32 k; step ``kb`` is four ``m16n8k8`` products ``q = 0..3``, product q
    taking as its 8 k the pairs ``kb + 16 (q >> 1) + 4 t + 2 (q & 1)`` and that + 1, t = 0..3 (a
    lane holds two 16-byte quads of its rows, ``kb + 4 t`` and ``kb + 16 + 4 t``: the 4 lanes of a
    row cover 64 contiguous bytes a quad); each product is three ``mma.sync`` into one accumulator,
    in the order lo(w)*hi(x), hi(w)*lo(x), hi(w)*hi(x). The segment sums are added in segment
    order, ``((s_0 + s_1) + s_2) + ...``, then the residual. The tensor core's internal sum of an
    ``mma`` is the hardware's (PTX does not specify it), but each output element is a function of
    its own row, column and accumulator only, so which rows share the launch (and the row tile: M
    pads to multiples of 8) changes nothing: bit-identical rows alone or in a tree of 33 (tested on
    the GPU at a022ba5; the mask split and layout of 2623eff have not run there yet). The simulator's ``mma`` (:func:`sim.warp.mma_sync_m16n8k8_tf32`) sums the 8 exact
    products and C in float64 and rounds to float32, so its bits differ from the GPU's; both are
    batch-invariant and within the stated tolerance of float64.

Work layout (swap-AB: the weight is the ``mma``'s 16-row A operand, the input rows its 8-column B).
    Work items ``(row group, segment, 128 columns)``, row groups fastest (a weight tile's row groups
    run side by side, so it comes from HBM once), dealt over a 1-D persistent grid of
    ``resident_blocks x SMs`` blocks of ``WARPS`` warps. A row group is 8 x MT rows (MT = 1..5
    m-tiles, :func:`mtiles`); a warp owns 32 columns (two 16-row A tiles) for all its m-tiles, so
    each weight quad feeds MT x 3 mma and each staged input quad two column tiles. The block stages
    its row group's input rows for ``phase_k(MT)`` k at a time, prologue applied, as TF32 halves in
    shared memory (two barriers a phase); lane (g = lane / 4, t = lane % 4) loads its weight rows
    n0 + g and n0 + g + 8 at ``kb + 4 t`` and ``kb + 16 + 4 t`` (16-byte ``ld.global.nc`` into
    registers, the next step's loads issued before this step's products; or, ``ASYNC_RING``, through
    a ring of ``cp.async`` step slots a lane in shared memory). With RMSNorm and 9 rows or more the
    rows' 1 / rms come from one pre-pass launch (:func:`inv_rms_kernel`), else each block computes
    them. With S > 1 each item writes its segment's sums to ``partials [S, M, N]`` and
    :func:`segment_sum_kernel` adds them in segment order (a second launch); S = 1 stores ``out``
    directly. S(N, K) takes the fewest steps a block over the H200's one-row and 33-row grids
    (:data:`DESIGN_SLOTS`; a function of the weight's shape only, never of M or the device).
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
from llvmlite import ir
from numba import cuda, float32, int32, types

from sim.launch import check_launch, launch_bounds, opt_in_shared
from sim.profiles import active_profile

from ._args import check_shape, is_c_contiguous, is_device_array
from .linear import (
    _aligned, _f32, _kernel_weight, _row_inv_rms, _rows_aligned, _silu_mul, _stream, check_linear_args,
    commit_async, copy_async16, load_f32x4, load_x4, shared_put4, shared_x4, wait_async,
)
from .pdl import pdl_begin
from .registry import register

__all__ = ["linear_tc", "segments", "partials_shape", "mtiles", "tf32_trunc", "mma_tf32",
           "get_kernel", "segment_sum_kernel", "allocate_placeholders", "clear_plans", "set_async_ring", "uses_ring"]

SIMULATED = bool(cuda.config.ENABLE_CUDASIM)
WARP = 32
WARPS = 2 if SIMULATED else 4        # warps a block (the simulator's threads are Python threads)
TILE_N = 16                           # mma rows (output columns) of one A tile
WARP_COLS = 2 * TILE_N                # a warp's columns: two A tiles
TILE_M = 8                            # mma columns (input rows) of one B tile
MAX_MTILES = 5                        # 40 rows a row group (a 33-row tree in one)
STEP_K = 32                           # k per step: 4 lanes x two quads, 16 floats apart
UNIT_COLS = 128                       # the column block that S(N, K) counts (numerics: fixed)
# S(N, K) is the segment count that takes the fewest steps a block over two launch sizes of the
# H200: 4 blocks an SM at 1 m-tile (528 item slots) and 2 at 5 (264); constants, not read off the
# device (the order must not depend on it). lm_head 32768 x 2048: 2 segments (1 wave of 32 steps
# at one row) where "~4 items an SM" gave 3 (768 items: 44 steps for a block holding two).
DESIGN_SLOTS = (528, 264)
MIN_SEG_K = 64                        # segments of at least 64 k
PRESPLIT_MIN_MTILES = 2               # get_kernel's presplit from this many m-tiles on
PHASE_KS = (512, 256, 128, 128, 128)  # input k staged a phase, by m-tiles (<= 46 KB of static shared memory)
STAGE_UNROLLS = (2, 2, 4, 4, 4)       # input quads a thread loads at once when staging, by m-tiles
# a staged row's pad (floats): 16 puts rows g and g + 1 of a quarter-warp's 16-byte B reads 16 banks
# apart; 4 (a022ba5) put them 4 apart: two wavefronts a read, half of the 33-row lm_head's shared
# loads conflicted (Nsight Compute, PERFORMANCE "run tensor-core profile"). Layout, not numerics.
XS_PAD = 16
RESIDENT_BLOCKS = (4, 3, 3, 2, 2)       # blocks an SM by m-tiles (launch_bounds' minimum; the grid)
# the weights through the cp.async ring (else registers: mixed, PERFORMANCE): a bool for every
# m-tile count, or a tuple of the m-tile counts that take it (e.g. (1,): one-row launches only)
ASYNC_RING: bool | tuple[int, ...] = False
RING_STAGES = (4, 3, 3, 3, 3)            # the weights' cp.async ring: steps a lane has in flight, by m-tiles
SHARED_LIMIT = 227 * 1024             # an H200 SM's shared memory a block may opt in to
ALIGN = None if SIMULATED else 16     # the shared arrays' alignment (the simulator takes none)
SUM_THREADS = 256                     # threads a block of the segment sum
RMS_THREADS = 128                     # threads a block of inv_rms_kernel (a warp a row)
PRE_RMS_MIN_ROWS = 9                  # from this many rows the rms runs once (inv_rms_kernel), not in every block
PROLOGUES = ("none", "rmsnorm", "swiglu")
TF32_KEEP = np.uint32(0xFFFFE000)     # the bits a tensor core reads of a TF32 operand
ZERO = np.float32(0.0)
ONE = np.float32(1.0)


# --- the two instructions ------------------------------------------------------------------------

def _make_instructions() -> tuple[Any, Any]:
    """``tf32_trunc(v) -> float32``: v with its low 13 mantissa bits cleared (TF32 toward zero: one
    ``and``, where ``cvt.rna.tf32.f32`` is four instructions on sm_90: an add, an inf test, a
    select and the mask); ``mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)``:
    ``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32`` with PTX's fragment layout (lane g = lane
    / 4, t = lane % 4: a0 A[g][t], a1 A[g+8][t], a2 A[g][t+4], a3 A[g+8][t+4]; b0 B[t][g], b1
    B[t+4][g]; c0 C[g][2t], c1 C[g][2t+1], c2 C[g+8][2t], c3 C[g+8][2t+1]). Under the simulator:
    NumPy bit arithmetic and :func:`sim.warp.mma_sync_m16n8k8_tf32`."""
    if SIMULATED:
        from sim.warp import mma_sync_m16n8k8_tf32

        def tf32_trunc(v):
            bits = np.array(v, np.float32).view(np.uint32) & TF32_KEEP
            return np.array(bits, np.uint32).view(np.float32)[()]

        def mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            return mma_sync_m16n8k8_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        return tf32_trunc, mma_tf32

    from numba.cuda.extending import intrinsic

    f32, i32 = ir.FloatType(), ir.IntType(32)

    @intrinsic
    def tf32_trunc(typingctx, v):
        if v != types.float32:
            return None

        def codegen(context, builder, signature, args):
            bits = builder.and_(builder.bitcast(args[0], i32), ir.Constant(i32, int(TF32_KEEP)))
            return builder.bitcast(bits, f32)

        return types.float32(v), codegen

    @intrinsic
    def mma_tf32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        if any(v != types.float32 for v in (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)):
            return None
        sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

        def codegen(context, builder, signature, args):
            ab = [builder.bitcast(v, i32) for v in args[:6]]
            asm = ir.InlineAsm(
                ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4),
                "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            d = builder.call(asm, ab + list(args[6:]))
            return context.make_tuple(builder, signature.return_type,
                                      [builder.extract_value(d, e) for e in range(4)])

        return sig, codegen

    return tf32_trunc, mma_tf32


tf32_trunc, mma_tf32 = _make_instructions()


@cuda.jit(device=True, inline="always")
def _split(v):
    """(hi, lo): v's TF32 part toward zero and the TF32 part of the rest (v - hi is exact in
    float32): |v - hi - lo| < 2^-20 |v|, three instructions (and, sub, and)."""
    hi = tf32_trunc(v)
    return hi, tf32_trunc(v - hi)


def resident_blocks(mt: int, prologue: str = "none") -> int:
    """Blocks an SM that the kernel of ``mt`` m-tiles is built for (launch_bounds' minimum, so
    ptxas keeps its registers under 65536 / (blocks x 128)) and launched as (the grid)."""
    if SIMULATED:
        return 2
    if prologue == "rmsnorm" and mt == 3:
        return 2                         # at 3 (170 registers) the rms's loads spill 16 bytes (sm_90)
    return RESIDENT_BLOCKS[mt - 1]


def phase_k(mt: int) -> int:
    """Input k a block stages at once for ``mt`` m-tiles (its rows' TF32 halves in shared memory):
    few rows take long phases (fewer barriers and staging waits a segment)."""
    return PHASE_KS[mt - 1]


def xs_row(mt: int) -> int:
    """Floats of a staged input row: ``phase_k`` and XS_PAD."""
    return phase_k(mt) + XS_PAD


def stage_unroll(mt: int) -> int:
    """Input quads a thread has in flight at once while staging ``mt`` m-tiles' rows."""
    return STAGE_UNROLLS[mt - 1]


def uses_ring(mt: int) -> bool:
    """Whether launches of ``mt`` m-tiles bring their weights through the cp.async ring (ASYNC_RING)."""
    return mt in ASYNC_RING if isinstance(ASYNC_RING, tuple) else bool(ASYNC_RING)


def ring_stages(mt: int) -> int:
    """Slots of the weights' ring for ``mt`` m-tiles (each a step: 4 KB a warp)."""
    return RING_STAGES[mt - 1]


def ring_bytes(mt: int, ring: bool = True) -> int:
    """Dynamic shared memory of a block: its warps' ring slots."""
    return ring_stages(mt) * WARPS * WARP * 8 * 4 * 4 if ring else 0


@cuda.jit(device=True, inline="always")
def _put4(a, at, v0, v1, v2, v3):
    """a[at : at + 4] = v0..v3 (a register array once the callers' loops unroll)."""
    a[at] = v0
    a[at + 1] = v1
    a[at + 2] = v2
    a[at + 3] = v3


# --- the kernels -------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def get_kernel(prologue: str, residual: bool, mt: int, presplit: bool | None = None,
               ring: bool | None = None) -> Any:
    """The product kernel for one prologue ("none", "rmsnorm", "swiglu"), residual epilogue and
    m-tile count (1..MAX_MTILES; 8 mt rows a row group). Compile-time flags, no None arguments:
    ``norm_w`` and ``residual_arr`` take placeholders (the weight, ``out``) where unused.
    ``presplit`` (default: mt >= PRESPLIT_MIN_MTILES): split a step's weights into TF32 parts once
    (64 more registers a lane) rather than at each use (once per m-tile); layout, not numerics."""
    if presplit is None:
        presplit = mt >= PRESPLIT_MIN_MTILES
    if ring is None:
        ring = uses_ring(mt)
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {PROLOGUES}, got {prologue!r}")
    if not (isinstance(mt, int) and 1 <= mt <= MAX_MTILES):
        raise ValueError(f"mt must be an int in 1..{MAX_MTILES}, got {mt!r}")
    RMS = prologue == "rmsnorm"
    SWIGLU = prologue == "swiglu"
    RESIDUAL = bool(residual)
    MT = mt
    ROWS = TILE_M * MT
    NT = WARP_COLS // TILE_N              # A tiles a warp (2)
    THREADS = WARPS * WARP
    BLOCK_COLS = WARPS * WARP_COLS
    PRESPLIT = bool(presplit)
    RAW = NT * 2 * 8                      # a step's weight floats a lane: tiles x rows x 8 k
    SPLIT = RAW if PRESPLIT else 1        # the pre-split parts' registers
    MT_A = min(MT, 3)
    MT_B = MT - MT_A
    ACC_A = MT_A * NT * 4
    ACC_B = max(MT_B, 1) * NT * 4
    PART = NT * 8
    XQ = 4 * MT
    RING = bool(ring)
    STAGES = ring_stages(mt) if RING else 1
    NXT = 1 if RING else RAW
    SLOT = RAW * WARP                     # floats of one ring slot of a warp (32 lanes x 8 quads)
    wait_ring = wait_async(max(STAGES - 1, 0))   # all but the newest STAGES - 1 groups landed
    PHASE_K = phase_k(mt)
    XS_ROW = xs_row(mt)
    STAGE_U = stage_unroll(mt)
    SQ = 4 * STAGE_U                      # a staging round's floats a thread
    XS = ROWS * XS_ROW
    RESIDENT = resident_blocks(mt, prologue)

    @cuda.jit(device=True, inline="always")
    def copy_weights(w, ring, base, n_base, g, t, kb, k1, n_cols, k_dim):
        """Start the 16-byte copies of this lane's two quads (kb + 4 t, kb + 16 + 4 t) of its 2 NT weight rows at step kb
        into its ring slot at ``base`` (quad j at base + 4 (32 j + lane): a warp's reads of one j
        cover 512 contiguous bytes, no bank conflict), then close them into a group (an empty one
        past the segment, so that the wait counts stay fixed). A column past N copies row N - 1
        (never stored); quads past the segment are not copied (read back as zeros)."""
        if kb < k1:
            k = kb + 4 * t
            for nt in range(NT):
                for half in range(2):
                    col = min(n_base + nt * TILE_N + half * 8 + g, n_cols - 1)
                    for e in range(2):
                        kk = k + 16 * e
                        if kk < k1:
                            copy_async16(ring, base + 4 * WARP * ((nt * 2 + half) * 2 + e),
                                         w, col * k_dim + kk)
        commit_async()

    @cuda.jit(device=True, inline="always")
    def load_weights(w, cur, n_base, g, t, kb, k1, n_cols, k_dim):
        """Without the ring: this lane's step kb straight into registers (``ld.global.nc``), in
        read_weights' layout (zeros past the segment)."""
        k = kb + 4 * t
        for j in range(RAW // 4):
            kk = k + 16 * (j & 1)
            col = min(n_base + (j >> 2) * TILE_N + ((j >> 1) & 1) * 8 + g, n_cols - 1)
            v0, v1, v2, v3 = ZERO, ZERO, ZERO, ZERO
            if kk < k1:
                v0, v1, v2, v3 = load_f32x4(w, col * k_dim + kk)
            _put4(cur, (j >> 1) * 8 + 4 * (j & 1), v0, v1, v2, v3)

    @cuda.jit(device=True, inline="always")
    def read_weights(ring, base, cur, t, kb, k1):
        """This lane's step kb from its ring slot into cur[(nt * 2 + half) * 8 + 4 e + i] (zeros
        past the segment)."""
        k = kb + 4 * t
        for j in range(RAW // 4):
            kk = k + 16 * (j & 1)
            v0, v1, v2, v3 = ZERO, ZERO, ZERO, ZERO
            if kk < k1:
                v0, v1, v2, v3 = shared_x4(ring, base + 4 * WARP * j)
            _put4(cur, (j >> 1) * 8 + 4 * (j & 1), v0, v1, v2, v3)

    @cuda.jit(device=True, inline="always")
    def stage(x, xs_hi, xs_lo, norm_w, inv_sh, row0, m_rows, ph0, k1, k_dim, sv, su, sn):
        """Input rows row0.. of the row group at k = ph0 .. ph0 + PHASE_K (up to the segment's last
        step), prologue applied, split into TF32 halves: xs_hi / xs_lo [ROWS, XS_ROW] (zeros past
        the segment and past M). STAGE_U quads a thread and round, all the round's loads (into
        sv / su / sn) before any of its arithmetic: one memory latency a round, not one a quad."""
        # the phase's steps only (a short segment stages no dead phase tail); a step's k past the
        # segment are staged as zeros, its products read them
        quads = min(PHASE_K, (k1 - ph0 + STEP_K - 1) // STEP_K * STEP_K) // 4
        total = ROWS * quads
        for first in range(cuda.threadIdx.x, total, THREADS * STAGE_U):
            for u in range(STAGE_U):         # the round's loads
                quad = first + u * THREADS
                r = quad // quads
                k = ph0 + (quad - r * quads) * 4
                row = row0 + r
                v0, v1, v2, v3 = ZERO, ZERO, ZERO, ZERO
                if quad < total and row < m_rows and k < k1:
                    v0, v1, v2, v3 = load_x4(x, row, 0, k)
                    if SWIGLU:
                        su[4 * u], su[4 * u + 1], su[4 * u + 2], su[4 * u + 3] = load_x4(x, row, 0, k_dim + k)
                    if RMS:
                        sn[4 * u], sn[4 * u + 1], sn[4 * u + 2], sn[4 * u + 3] = load_f32x4(norm_w, k)
                _put4(sv, 4 * u, v0, v1, v2, v3)
            for u in range(STAGE_U):         # prologue, split, stores
                quad = first + u * THREADS
                if quad < total:
                    r = quad // quads
                    kk = (quad - r * quads) * 4
                    valid = row0 + r < m_rows and ph0 + kk < k1
                    if RMS:
                        inv = inv_sh[r]
                    at = r * XS_ROW + kk
                    for i in range(4):
                        v = sv[4 * u + i]
                        if valid:
                            if SWIGLU:
                                v = _silu_mul(v, su[4 * u + i])
                            if RMS:              # (x * inv) * weight, as linear's staging
                                v = v * inv * sn[4 * u + i]
                        h, low = _split(v)
                        sv[4 * u + i] = h
                        su[4 * u + i] = low
                    shared_put4(xs_hi, at, sv[4 * u], sv[4 * u + 1], sv[4 * u + 2], sv[4 * u + 3])
                    shared_put4(xs_lo, at, su[4 * u], su[4 * u + 1], su[4 * u + 2], su[4 * u + 3])

    def tile_ops(tiles, first):
        """(mma_pass, store) over m-tiles first .. first + tiles - 1, their accumulators in one
        array (indices fixed once the loops unroll)."""
        @cuda.jit(device=True, inline="always")
        def mma_pass(acc, p, qq, xh, xl, part):
            for m in range(tiles):
                at_x = 4 * (first + m) + 2 * qq
                b0 = xh[at_x] if p != 1 else xl[at_x]
                b1 = xh[at_x + 1] if p != 1 else xl[at_x + 1]
                for nt in range(NT):
                    a = nt * 8 + (4 if p == 0 else 0)
                    at = (m * NT + nt) * 4
                    d0, d1, d2, d3 = mma_tf32(part[a], part[a + 1], part[a + 2], part[a + 3], b0, b1,
                                              acc[at], acc[at + 1], acc[at + 2], acc[at + 3])
                    acc[at] = d0
                    acc[at + 1] = d1
                    acc[at + 2] = d2
                    acc[at + 3] = d3

        @cuda.jit(device=True, inline="always")
        def store(acc, out, residual_arr, partials, seg, row0, n_base, g, t, m_rows, n_cols, n_segs):
            # c0 (col g, row 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1)
            for m in range(tiles):
                for nt in range(NT):
                    at = (m * NT + nt) * 4
                    for i in range(4):
                        row = row0 + (first + m) * TILE_M + 2 * t + (i & 1)
                        col = n_base + nt * TILE_N + g + 8 * (i >> 1)
                        if row < m_rows and col < n_cols:
                            if n_segs == 1:
                                value = acc[at + i]
                                if RESIDUAL:
                                    value = value + residual_arr[row, col]
                                out[row, col] = value
                            else:
                                partials[seg, row, col] = acc[at + i]

        return mma_pass, store

    mma_pass_a, store_a = tile_ops(MT_A, 0)
    mma_pass_b, store_b = tile_ops(max(MT_B, 1), MT_A)

    @cuda.jit(**launch_bounds(THREADS, RESIDENT))
    def kernel(x, w, out, residual_arr, norm_w, eps, partials, inv_rms, m_rows, n_cols, k_dim, seg_k,
               n_segs, row_groups, col_blocks, rms_ready):
        # 16-byte aligned: read and written as float4s (shared_x4 / shared_put4), cp.async targets
        ring = cuda.shared.array(0, float32, alignment=ALIGN)    # [WARPS, STAGES, 8 quads, 32 lanes, 4]
        xs_hi = cuda.shared.array(XS, float32, alignment=ALIGN)  # staged input rows, TF32 high parts
        xs_lo = cuda.shared.array(XS, float32, alignment=ALIGN)  # ... and low parts
        inv_sh = cuda.shared.array(ROWS, float32)   # the row group's 1 / rms (RMS only)
        pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
        lane = cuda.threadIdx.x & (WARP - 1)
        warp = cuda.threadIdx.x >> 5
        g = lane >> 2
        t = lane & 3
        acc_a = cuda.local.array(ACC_A, float32)   # m-tiles 0 .. MT_A - 1 (two arrays: LLVM unrolls
        acc_b = cuda.local.array(ACC_B, float32)   # loops of <= 3 m-tiles, so both stay in registers)
        cur = cuda.local.array(RAW, float32)     # this step's weights
        nxt = cuda.local.array(NXT, float32)     # without the ring: the next step's, in flight
        hi = cuda.local.array(SPLIT, float32)
        lo = cuda.local.array(SPLIT, float32)
        part = cuda.local.array(PART, float32)   # (hi, lo) of the A operands of one q, split at use
        xh = cuda.local.array(XQ, float32)   # a quad of each m-tile's B operand: high parts
        xl = cuda.local.array(XQ, float32)   # ... low parts
        sv = cuda.local.array(SQ, float32)   # staging: a round's input quads, then high parts
        su = cuda.local.array(SQ, float32)   # ... SwiGLU's up quads, then low parts
        sn = cuda.local.array(SQ, float32)   # ... RMSNorm's weight quads
        items = row_groups * n_segs * col_blocks
        last_group = -1
        item = cuda.blockIdx.x
        while item < items:                  # persistent: block-uniform loop over work items
            group = item % row_groups        # row groups fastest: a weight tile's groups share L2
            rest = item // row_groups
            seg = rest % n_segs
            row0 = group * ROWS
            n_base = (rest // n_segs) * BLOCK_COLS + warp * WARP_COLS
            k0 = seg * seg_k
            k1 = min(k0 + seg_k, k_dim)
            # the weights first: their loads are in flight while the rms and the staging run
            lane_base = warp * STAGES * SLOT + 4 * lane
            if RING:
                for u in range(STAGES - 1):  # the ring's first STAGES - 1 steps
                    copy_weights(w, ring, lane_base + u * SLOT, n_base, g, t, k0 + u * STEP_K, k1,
                                 n_cols, k_dim)
            else:
                load_weights(w, nxt, n_base, g, t, k0, k1, n_cols, k_dim)
            if RMS and group != last_group:
                cuda.syncthreads()           # the previous item's staging no longer reads inv_sh
                if rms_ready:                # inv_rms_kernel ran first (many rows: one pass, not one a block)
                    for r in range(cuda.threadIdx.x, ROWS, THREADS):
                        inv_sh[r] = inv_rms[row0 + r] if row0 + r < m_rows else ONE
                else:
                    r = warp
                    while r < ROWS:          # warp-uniform: the rms's butterfly needs all lanes
                        inv = ONE
                        if row0 + r < m_rows:
                            inv = _row_inv_rms(x, row0 + r, k_dim, eps, lane)
                        if lane == 0:
                            inv_sh[r] = inv
                        r += WARPS
            last_group = group
            for i in range(ACC_A):
                acc_a[i] = ZERO
            for i in range(ACC_B):
                acc_b[i] = ZERO
            slot = 0
            for ph0 in range(k0, k1, PHASE_K):
                cuda.syncthreads()           # every warp done with the last phase (and inv_sh written)
                stage(x, xs_hi, xs_lo, norm_w, inv_sh, row0, m_rows, ph0, k1, k_dim, sv, su, sn)
                cuda.syncthreads()           # the phase's staged rows visible to every warp
                for kb in range(ph0, min(ph0 + PHASE_K, k1), STEP_K):
                    # step kb + STAGES - 1 into the slot read last step (this lane's own copies:
                    # no barrier), then wait for step kb's group (the oldest of STAGES pending)
                    if RING:
                        ahead = slot - 1 if slot > 0 else STAGES - 1
                        copy_weights(w, ring, lane_base + ahead * SLOT, n_base, g, t,
                                     kb + (STAGES - 1) * STEP_K, k1, n_cols, k_dim)
                        wait_ring()
                        read_weights(ring, lane_base + slot * SLOT, cur, t, kb, k1)
                        slot = slot + 1 if slot + 1 < STAGES else 0
                    else:                    # this step from registers, the next one's loads issued
                        for i in range(RAW):
                            cur[i] = nxt[i]
                        load_weights(w, nxt, n_base, g, t, kb + STEP_K, k1, n_cols, k_dim)
                    if PRESPLIT:
                        for i in range(RAW):
                            h, low = _split(cur[i])
                            hi[i] = h
                            lo[i] = low
                    for e in range(2):       # quad e of the lane's 8 k: products q = 2e, 2e + 1
                        for m in range(MT):
                            at = (m * TILE_M + g) * XS_ROW + (kb - ph0) + 4 * t + 16 * e
                            xh[4 * m], xh[4 * m + 1], xh[4 * m + 2], xh[4 * m + 3] = shared_x4(xs_hi, at)
                            xl[4 * m], xl[4 * m + 1], xl[4 * m + 2], xl[4 * m + 3] = shared_x4(xs_lo, at)
                        for qq in range(2):
                            q = 2 * e + qq
                            for nt in range(NT):
                                top = nt * 16 + 2 * q        # row g's k pair in raw/hi/lo
                                for c in range(4):           # a0 (g, k), a1 (g+8, k), a2 (g, k+1), a3 (g+8, k+1)
                                    src = top + (c >> 1) + 8 * (c & 1)
                                    if PRESPLIT:
                                        part[nt * 8 + c] = hi[src]
                                        part[nt * 8 + 4 + c] = lo[src]
                                    else:
                                        h, low = _split(cur[src])
                                        part[nt * 8 + c] = h
                                        part[nt * 8 + 4 + c] = low
                            # lo(w) hi(x), hi(w) lo(x), hi(w) hi(x): each pass over every
                            # accumulator, so consecutive mma are independent (MT x NT chains)
                            for p in range(3):
                                mma_pass_a(acc_a, p, qq, xh, xl, part)
                                if MT_B > 0:
                                    mma_pass_b(acc_b, p, qq, xh, xl, part)
            store_a(acc_a, out, residual_arr, partials, seg, row0, n_base, g, t, m_rows, n_cols, n_segs)
            if MT_B > 0:
                store_b(acc_b, out, residual_arr, partials, seg, row0, n_base, g, t, m_rows, n_cols,
                        n_segs)
            item += cuda.gridDim.x

    return kernel


@cuda.jit(**launch_bounds(RMS_THREADS))
def inv_rms_kernel(x, inv_rms, m_rows, k_dim, eps):
    """inv_rms[m] = 1 / sqrt(mean(x[m]^2) + eps), one warp a row, :func:`.linear._row_inv_rms`'s
    order (the product kernel's own rms, computed once for all its blocks)."""
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    row = cuda.blockIdx.x * (RMS_THREADS // WARP) + (cuda.threadIdx.x >> 5)
    if row < m_rows:                     # warp-uniform
        inv = _row_inv_rms(x, row, k_dim, eps, cuda.threadIdx.x & (WARP - 1))
        if (cuda.threadIdx.x & (WARP - 1)) == 0:
            inv_rms[row] = inv


@functools.lru_cache(maxsize=None)
def segment_sum_kernel(residual: bool) -> Any:
    """``out[m, n] = ((p[0, m, n] + p[1, m, n]) + ...) (+ residual[m, n])``: the segment sums of
    :func:`get_kernel` added in segment order, one thread an element."""
    RESIDUAL = bool(residual)

    @cuda.jit(**launch_bounds(SUM_THREADS))
    def kernel(partials, out, residual_arr, m_rows, n_cols, n_segs):
        pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
        i = cuda.blockIdx.x * SUM_THREADS + cuda.threadIdx.x
        if i < m_rows * n_cols:
            row = i // n_cols
            col = i - row * n_cols
            value = partials[0, row, col]
            for s in range(1, n_segs):
                value = value + partials[s, row, col]
            if RESIDUAL:
                value = value + residual_arr[row, col]
            out[row, col] = value

    return kernel


# --- registration -------------------------------------------------------------------------------

def _sigs(prologue: str) -> tuple:
    a2, c2, c3 = float32[:, :], float32[:, ::1], float32[:, :, ::1]
    nw = float32[::1] if prologue == "rmsnorm" else c2
    return ((a2, c2, a2, a2, nw, float32, c3, float32[::1], int32, int32, int32, int32, int32, int32,
             int32, int32),)


def _register_all() -> None:
    for prologue in PROLOGUES:
        for mt in range(1, MAX_MTILES + 1):
            register(f"linear_tc_{prologue}_mt{mt}", get_kernel(prologue, True, mt), _sigs(prologue),
                     f"3xTF32 tensor-core x @ w.T ({prologue} prologue, residual epilogue), "
                     f"{mt} m-tiles of 8 rows", block_threads=WARPS * WARP)
    for prologue in PROLOGUES:          # the engine's products without a residual, at its two sizes
        for mt in (1, MAX_MTILES):
            register(f"linear_tc_{prologue}_mt{mt}_plain", get_kernel(prologue, False, mt), _sigs(prologue),
                     f"3xTF32 tensor-core x @ w.T ({prologue} prologue, no residual), {mt} m-tiles of 8 rows",
                     block_threads=WARPS * WARP)
    for mt in (1, MAX_MTILES):          # the weights through the cp.async ring (ASYNC_RING)
        register(f"linear_tc_rmsnorm_mt{mt}_ring", get_kernel("rmsnorm", False, mt, ring=True), _sigs("rmsnorm"),
                 f"3xTF32 tensor-core x @ w.T (rmsnorm prologue), {mt} m-tiles, weights through the "
                 f"cp.async ring ({ring_stages(mt)} slots a warp)", block_threads=WARPS * WARP)
    register("linear_tc_inv_rms", inv_rms_kernel, ((float32[:, :], float32[::1], int32, int32, float32),),
             "the tensor-core product's RMSNorm prologue: 1 / rms of each row, one warp a row",
             block_threads=RMS_THREADS)
    for residual in (False, True):
        register(f"linear_tc_segment_sum{'_residual' if residual else ''}", segment_sum_kernel(residual),
                 ((float32[:, :, ::1], float32[:, :], float32[:, :], int32, int32, int32),),
                 "the tensor-core product's segment sums in segment order", block_threads=SUM_THREADS)


_register_all()


# --- host side -----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def segments(n_cols: int, k_dim: int) -> tuple[int, int]:
    """(S, seg_k): K's segments for an [N, K] weight, a function of the shape only (the order).
    Segments a multiple of STEP_K and at least MIN_SEG_K long (one segment where K is shorter);
    of those, the S whose items (UNIT_COLS columns x one segment) take the fewest steps a block
    summed over DESIGN_SLOTS persistent grids (waves x steps an item), then the fewest segments."""
    col_blocks = -(-n_cols // UNIT_COLS)
    best = None
    for want in range(1, max(1, -(-k_dim // MIN_SEG_K)) + 1):
        seg_k = max(MIN_SEG_K, -(-(-(-k_dim // want)) // STEP_K) * STEP_K)
        n_segs = -(-k_dim // seg_k)
        steps = sum(-(-(col_blocks * n_segs) // slots) * (seg_k // STEP_K) for slots in DESIGN_SLOTS)
        if best is None or (steps, n_segs) < best[0]:
            best = ((steps, n_segs), (n_segs, seg_k))
    return best[1]


def mtiles(rows: int) -> int:
    """m-tiles of a row group (8 rows each, at most MAX_MTILES): the fewest row groups (each reads
    the weights once more, from L2), then the fewest padded m-tiles (33 rows: one group of 5; 41
    rows: two of 3). Layout only."""
    need = -(-rows // TILE_M)
    groups = -(-need // MAX_MTILES)
    return -(-need // groups)


def partials_shape(rows: int, n_cols: int, k_dim: int) -> tuple[int, int, int]:
    """The ``partials`` workspace of a launch: (S, rows, N); S = 1 needs none (pass None)."""
    return (segments(n_cols, k_dim)[0], rows, n_cols)


@functools.lru_cache(maxsize=4096)
def _setup(prologue: str, residual: bool, rows: int, n_cols: int, k_dim: int) -> tuple:
    mt = mtiles(rows)
    n_segs, seg_k = segments(n_cols, k_dim)
    row_groups = -(-rows // (TILE_M * mt))
    col_blocks = -(-n_cols // (WARPS * WARP_COLS))
    items = row_groups * n_segs * col_blocks
    ring = uses_ring(mt)
    smem = ring_bytes(mt, ring)
    static = 4 * (2 * TILE_M * mt * xs_row(mt) + TILE_M * mt)
    profile = active_profile()
    # blocks an SM: the kernel's register bound, or fewer where its shared memory (the ring's
    # slots) fits fewer: a persistent grid of more blocks than fit would leave some waiting
    per_sm = max(1, min(resident_blocks(mt, prologue),
                        profile.smem_per_sm // (smem + static + profile.reserved_smem_per_block)))
    slots = profile.sm_count * per_sm
    # a multiple of the row groups: a block keeps one row group (its rms computed once)
    blocks = items if items <= slots else max(row_groups, slots // row_groups * row_groups)
    grid = (blocks, 1, 1)
    opt_in = smem + static > 48 * 1024
    check_launch(grid, WARPS * WARP, smem, opt_in=opt_in, static_shared_bytes=static)
    sum_grid = (-(-(rows * n_cols) // SUM_THREADS), 1, 1)
    check_launch(sum_grid, SUM_THREADS, 0)
    kernel = get_kernel(prologue, residual, mt, presplit=mt >= PRESPLIT_MIN_MTILES, ring=ring)
    return (kernel, grid, smem, opt_in, n_segs, seg_k, sum_grid, row_groups,
            col_blocks)


def linear_tc(x: Any, w: Any, out: Any, *, norm_weight: Any = None, eps: float = 1e-6,
              swiglu: bool = False, residual: Any = None, partials: Any = None,
              inv_rms: Any = None, stream: Any = 0) -> Any:
    """``out[m] = input[m] @ w.T (+ residual[m])`` on the tensor cores, batch-invariant.

    Args:
        x: float32 [M, Kx], unit inner stride, rows on 16 bytes (data pointer and row stride
            multiples of 16). Input row: x[m] (Kx == K); rmsnorm(x[m]) * norm_weight with
            ``norm_weight``; silu(x[m, :K]) * x[m, K:] with ``swiglu`` (Kx == 2K).
        w: float32 [N, K], C-contiguous, K a multiple of 4, on 16 bytes.
        out: float32 [M, N], unit inner stride.
        norm_weight: float32 [K] on 16 bytes, or None (not with ``swiglu``).
        eps: RMSNorm epsilon.
        swiglu: the SwiGLU prologue.
        residual: float32 [M, N] or None; may be ``out`` itself.
        partials: float32 :func:`partials_shape` C-contiguous workspace (device) where S > 1,
            else ignored; None allocates one (not inside a captured graph).
        inv_rms: float32 [M] C-contiguous workspace (device) for the rows' 1 / rms where
            ``norm_weight`` is given and M >= PRE_RMS_MIN_ROWS, else ignored; None allocates one.
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
    if k_dim % 4:
        raise ValueError(f"w must have K a multiple of 4 (16-byte loads), got K = {k_dim}")
    if not _aligned(w, k_dim):
        raise ValueError("w must start on 16 bytes")
    if not _rows_aligned(x):
        raise ValueError("x must have its rows on 16 bytes (data pointer and row stride multiples of 16)")
    if norm is not None and not _rows_aligned(norm):
        raise ValueError("norm_weight must start on 16 bytes")
    n_segs = segments(n_cols, k_dim)[0]
    if n_segs > 1:
        partials = _workspace(partials, "partials", (n_segs, m_rows, n_cols), out)
    pre_rms = norm is not None and m_rows >= PRE_RMS_MIN_ROWS
    if pre_rms:
        inv_rms = _workspace(inv_rms, "inv_rms", (m_rows,), out)
    if m_rows == 0:
        return out
    kernel, grid, smem, opt_in, n_segs, seg_k, sum_grid, row_groups, col_blocks = _setup(
        prologue, residual is not None, m_rows, n_cols, k_dim)
    w_k = _kernel_weight(w)
    spare_partials, spare_rows = _placeholders(not is_device_array(out))
    if pre_rms:
        inv_rms_kernel[-(-m_rows // (RMS_THREADS // WARP)), RMS_THREADS, _stream(stream), 0](
            x, inv_rms, m_rows, k_dim, eps32)
    configured = kernel[grid, WARPS * WARP, _stream(stream), smem]
    (opt_in_shared(configured, smem) if opt_in else configured)(
        x, w_k, out, out if residual is None else residual, w_k if norm is None else norm, eps32,
        partials if n_segs > 1 else spare_partials, inv_rms if pre_rms else spare_rows, m_rows, n_cols, k_dim,
        seg_k, n_segs, row_groups, col_blocks, np.int32(pre_rms))
    if n_segs > 1:
        segment_sum_kernel(residual is not None)[sum_grid, SUM_THREADS, _stream(stream), 0](
            partials, out, out if residual is None else residual, m_rows, n_cols, n_segs)
    return out


def _workspace(given: Any, name: str, shape: tuple[int, ...], out: Any) -> Any:
    """A float32 C-contiguous workspace of ``shape``: ``given`` after its checks (a device array
    where ``out`` is one), or a new one of out's kind where None (not inside a captured graph)."""
    if given is None:
        return (cuda.device_array(shape, np.float32) if is_device_array(out)
                else np.empty(shape, np.float32))
    given = _f32(given, name, len(shape))
    if is_device_array(out) and not is_device_array(given):
        raise TypeError(f"{name} must be a device array where out is one")
    check_shape(given, name, shape)
    if not is_c_contiguous(given):
        raise ValueError(f"{name} must be C-contiguous")
    return given


def clear_plans() -> None:
    """Forget the built kernels and launch plans: call after changing a layout constant
    (PHASE_KS, XS_PAD, STAGE_UNROLLS, RESIDENT_BLOCKS, ASYNC_RING, RING_STAGES, MAX_MTILES, ...),
    as an in-process A/B does; the next launches rebuild (a few seconds of JIT each on a GPU)."""
    get_kernel.cache_clear()
    _setup.cache_clear()


def set_async_ring(ring: bool | tuple[int, ...]) -> bool | tuple[int, ...]:
    """Set ASYNC_RING (a bool, or a tuple of m-tile counts) and, where it changes, clear the built
    kernels and plans (as :func:`.linear.set_async_ring` does for linear). Returns the previous."""
    global ASYNC_RING
    if not isinstance(ring, (bool, tuple)) or (isinstance(ring, tuple) and not all(
            isinstance(mt, int) and not isinstance(mt, bool) and 1 <= mt <= MAX_MTILES for mt in ring)):
        raise ValueError(f"ring must be a bool or a tuple of m-tile counts in 1..{MAX_MTILES}, got {ring!r}")
    previous = ASYNC_RING
    if ring != previous:
        ASYNC_RING = ring
        clear_plans()
    return previous


def allocate_placeholders() -> None:
    """Make the device placeholders of the kernel's unused slots now (an engine does this at
    construction: a first call inside a captured graph or a no-allocation region must not)."""
    _placeholders(False)


@functools.lru_cache(maxsize=2)
def _placeholders(host: bool) -> tuple[Any, Any]:
    """float32 [1, 1, 1] and [1] arrays (host ones, or device ones made once, also under the
    simulator: a NumPy argument beside device ones would be a copy a launch) for the kernel's
    unused ``partials`` and ``inv_rms`` slots."""
    spare = (np.zeros((1, 1, 1), np.float32), np.zeros(1, np.float32))
    return spare if host else tuple(cuda.to_device(a) for a in spare)
