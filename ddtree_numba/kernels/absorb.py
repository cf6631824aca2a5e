"""MLA weight absorption: per-head products in one fixed summation order at every row count.

``absorb(x, w_kn, out)`` computes ``out[m, g, n] = sum_k x[m, g, k] * w_kn[g, k, n]`` (the
absorbed query ``q_nope @ W_UK`` and the value projection ``o_latent @ W_UVᵀ`` of MLA; w k-major:
``w_kn[g, k, n] = W[g, n, k]``) in this order, the same bits whatever kernel or row count runs it:

    K is cut into segments of SEGMENT = 32 k values. Segment s's partial is an fma chain over its
    32 k in ascending order that starts from +0.0: p_s = fma(x[k1], w[k1], fma(x[k0], w[k0], 0.0)),
    with x = w = 0 past K (a last, partial segment runs its whole 32 fmas). The output is
    -0.0 + p_0 + p_1 + ... + p_{S-1}, added left to right.

(-0.0 + v == v bit for bit, +0.0 included. The zero fmas past K matter for one value only: a GPU
fma rounds once, so a chain whose products all underflow negative holds -0.0, and
``fma(0, 0, -0.0)`` is +0.0; both kernels run them, so they agree there too. Rows past M compute
on zeros and are not written.) Why this order and not ``linear()``'s lane chains and
butterfly (which ``head_linear`` keeps): it lets a thread own whole segments, so

- few rows (an AR step, a small batch; :func:`get_split_kernel`): the segments of one output run
  side by side in different threads (memory parallelism: one 16-byte weight load a thread and k),
  and their partials meet in shared memory, added in segment order by one thread an output;
- many rows (a tree verify, a prefill; :func:`get_tile_kernel`): a thread keeps MT rows x 4
  columns and runs its segments from a register-blocked, double-buffered shared tile of the
  head's weights and rows (a small SGEMM: no butterfly, no per-leaf folding); with segment lanes
  a round's segments go to thread groups and their partials meet in shared memory, added in
  segment order by the thread that keeps the output.

History (H200, ``small``, 33-row verify, ncu): ``head_linear``'s thread-serial kernel took 41.3 us
(q absorb, K 128) and 35.9 us (value absorb, K 512) a layer; 1-row absorbs 12.9 us each (its warp
layout) against a 3.9 us weight stream. PERFORMANCE.md has the numbers of this module.

Both kernels run under the simulator; ``plan_absorb`` picks one from the shapes (layout, never the
order), ``absorb`` validates and launches. The order is tested bit for bit against a NumPy
emulation under the simulator, and the two kernels against each other on the GPU.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda, float32, int32, int64

from sim.launch import LaunchConfigError, check_launch, launch_bounds
from sim.profiles import active_profile

from ._args import data_address, is_c_contiguous
from .linear import (NEG_ZERO, SIM_TREE, VEC, ZERO, _check_out, _f32, _kernel_weight, _rows_aligned, _stream,
                     load_f32x4, load_x4, shared_put4, shared_x4)
from .pdl import pdl_begin, pdl_begin_early
from .registry import register

__all__ = [
    "SEGMENT",
    "MAX_K",
    "FEW_ROWS",
    "AbsorbPlan",
    "plan_absorb",
    "supported",
    "split_shared_bytes",
    "tile_shared_bytes",
    "tile_block_plan",
    "absorb",
    "get_split_kernel",
    "get_tile_kernel",
    "reads_weights_first",
]

SEGMENT = 32                    # k values a partial sums before the partials are added (the order)
SEG_SHIFT = SEGMENT.bit_length() - 1
MAX_K = 1024                    # k values: a split block stages S = K / 32 partials x MT x NB floats
FEW_ROWS = 8                    # rows up to this run the split kernel (decode), more the tile kernel
SPLIT_THREADS = 128             # split block: NB / 4 column quads x SB segment lanes
SPLIT_ROW_TILES = (1, 2, 4, 8)  # rows a split thread keeps (the launch's rows, rounded up)
SPLIT_LANES = (1, 2, 4, 8, 16)  # segment lanes a split block may have
SPLIT_BLOCKS = (1, 2, 4, 8, 16, 32, 64, 128)   # split block sizes (powers of two: NB a power of two)
SPLIT_BATCH = {1: 32, 2: 16, 4: 8, 8: 8}   # k loaded ahead of the fmas, by rows (registers: 4 + MT a k)
SPLIT_MAX_LANES = 16            # segment lanes a split block may have (K 512: 16, 8 quads = 32 columns)
TILE_ROW_TILES = (4, 8)         # rows a tile thread may keep (multiples of 4: 16-byte x reads)
TILE_ROWS = 4                   # ... and keeps (H200, forward_ab run "segment absorbs": a 33-row
                                # forward 2438.8 us with 4, 2469.1 / 2474.4 with 8)
TILE_COL_QUADS = (32, 16, 8)    # column quads of a tile block: of those padding few rows (_tile_plan),
                                # the widest giving TILE_BLOCKS_PER_SM blocks an SM
TILE_BLOCKS_PER_SM = 2
# One wave: a one-lane block of at most WAVE_THREADS threads whose grid passes TILE_BLOCKS_PER_SM
# blocks an SM runs at up to WAVE_BLOCKS_PER_SM. At 4 an SM the launch bounds leave 112 registers
# at 144 threads and 96 at 160; the 144-thread blocks (16 x 9, 8 x 18, 8 x 17) compile to 96 with
# no spill on sm_90 / sm_120 (the compile check has 16 x 9 and 8 x 18), while 32 x 5 (160 threads,
# 7 weight loads a thread) spills on sm_90; blocks past 144 threads stop at 3 (32 x 5, 8 x 20: 124-127
# registers, clean). H200, small's 33-row q absorb (bench.absorb, run one wave): 512 blocks at 3 an
# SM (1.29 waves) 27.0 us, at 4 in one wave 21.7 (32 quads x 5 row groups, spilling) and 20.1
# (16 x 9: 36 rows, not 40).
WAVE_BLOCKS_PER_SM = 4
WAVE_THREADS = 144
# blocks an SM a tile kernel may be compiled for (launch bounds: its registers): 2, 3, 4
TILE_MIN_BLOCKS = tuple(range(TILE_BLOCKS_PER_SM, WAVE_BLOCKS_PER_SM + 1))
TILE_MAX_THREADS = 256          # a tile block's threads, CQ x RW x SL (rows past CQ x RW x MT take grid y)
TILE_SEG_LANES = (1, 2)         # segment lanes a tile block may have (4: past 48 KiB from 2 row groups on)
TILE_LANES = 2                  # ... and the plan's most, where threads and shared memory allow
# The 2 x 2 lane squares (get_tile_kernel's pairs) for blocks of this many segment lanes. H200,
# small's 33-row value absorb (bench.absorb, K 512, N 128, 2 lanes, runs one wave and lane squares):
# 8 x 9 28.0-28.2 us, 8 x 10 28.8, 8 x 10 with pairs 26.8-27.0; the one-lane q absorb 20.2 / 20.5
# without / with (16 x 10 at 4 an SM): one-lane plans leave them off.
PAIR_LANES = 2
TILE_X_PAD = VEC                # floats after a staged k-row of x (keeps the next k-row 16-byte aligned)
TILE_SMEM = 48 * 1024           # a tile block's stages and partials at most (the default limit: no opt-in)
SHARED_ALIGN = None if SIM_TREE else 16   # 16-byte vector accesses (the simulator takes no alignment)


MAX_GRID_Z = 65535              # CUDA's grid z limit: the heads
MAX_ROWS = 65535 * TILE_ROW_TILES[0]   # grid y at 4 rows a block (split: 8 a thread past 8 rows; tile: >= 4)


def supported(k_dim: int, n_cols: int) -> bool:
    """Whether an absorb of K = k_dim and N = n_cols fits the kernels (N % 4 == 0: 16-byte weight
    loads; K <= MAX_K: the split kernel's staged partials)."""
    return 1 <= k_dim <= MAX_K and n_cols >= 1 and n_cols % VEC == 0


def _segments(k_dim: int) -> int:
    return -(-k_dim // SEGMENT)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _split_layout_ok(mt: int, lanes: int, threads: int) -> bool:
    return mt in SPLIT_ROW_TILES and lanes in SPLIT_LANES and threads in SPLIT_BLOCKS and threads >= lanes


def _tile_layout_ok(mt: int, col_quads: int, row_groups: int, seg_lanes: int = 1,
                    blocks_per_sm: int = TILE_BLOCKS_PER_SM, pairs: bool = False) -> bool:
    return mt in TILE_ROW_TILES and col_quads in TILE_COL_QUADS and 1 <= row_groups and \
        seg_lanes in TILE_SEG_LANES and col_quads * row_groups * seg_lanes <= TILE_MAX_THREADS and \
        blocks_per_sm in TILE_MIN_BLOCKS and (not pairs or row_groups % 2 == 0)


def split_shared_bytes(k_dim: int, mt: int, lanes: int, threads: int) -> int:
    """A split block's dynamic shared memory: the partials [S, MT, NB] floats."""
    return 4 * _segments(k_dim) * mt * (threads // lanes * VEC)


# --- few rows: a segment a thread, partials met in shared memory -------------------------------------

@functools.cache
def get_split_kernel(mt: int, lanes: int, threads: int = SPLIT_THREADS) -> Any:
    """The split kernel (compiled lazily, cached): ``mt`` rows, ``lanes`` segment lanes x
    threads / lanes column quads a block; lane l runs segments l, l + lanes, ..."""
    if not _split_layout_ok(mt, lanes, threads):
        raise ValueError(f"no split absorb kernel for mt={mt!r}, lanes={lanes!r}, threads={threads!r}")
    MT, SB, THREADS = mt, lanes, threads
    QB = THREADS // SB                  # column quads a block
    NB = QB * VEC                       # columns a block
    NB_SHIFT = NB.bit_length() - 1
    BATCH = SPLIT_BATCH[mt]             # k a thread loads ahead of its fmas
    # One row (an AR step at batch 1): the first batch's weights load before the PDL wait. (With
    # 8 rows, holding them across it spilled on sm_120; more rows keep the loads after the wait.)
    WEIGHTS_FIRST = mt == 1

    @cuda.jit(device=True, inline="always")
    def load_batch(w_kn, wv, g, col, n_cols, k_dim, k0, n, b0):
        """The weight float4s of k0 + b0 .. k0 + b0 + BATCH - 1 into wv (zeros past k0 + n)."""
        for kb in range(BATCH):
            kk = b0 + kb
            v0 = v1 = v2 = v3 = ZERO
            if kk < n:
                v0, v1, v2, v3 = load_f32x4(w_kn, (int64(g) * k_dim + k0 + kk) * n_cols + col)
            wv[kb, 0] = v0
            wv[kb, 1] = v1
            wv[kb, 2] = v2
            wv[kb, 3] = v3

    @cuda.jit(device=True, inline="always")
    def chain(x, w_kn, p, wv, xv, g, row0, rows, col, n_cols, k_dim, k0, n, loaded):
        """p[r, c] = the fma chain of segment k0 .. k0 + SEGMENT - 1, zeros past k0 + n (n ==
        SEGMENT: the guards fold; the order's zero fmas past K) and past M. BATCH k's loads are
        issued before their fmas (a chain of single loads waits a memory round trip a k); with
        ``loaded`` the first batch's weights are in wv already (loaded before the PDL wait)."""
        for b0 in range(0, SEGMENT, BATCH):
            if not (loaded and b0 == 0):
                load_batch(w_kn, wv, g, col, n_cols, k_dim, k0, n, b0)
            for kb in range(BATCH):
                kk = b0 + kb
                for r in range(MT):
                    xv[kb, r] = x[row0 + r, g, k0 + kk] if kk < n and r < rows else ZERO
            for kb in range(BATCH):
                for r in range(MT):
                    p[r, 0] = cuda.fma(xv[kb, r], wv[kb, 0], p[r, 0])
                    p[r, 1] = cuda.fma(xv[kb, r], wv[kb, 1], p[r, 1])
                    p[r, 2] = cuda.fma(xv[kb, r], wv[kb, 2], p[r, 2])
                    p[r, 3] = cuda.fma(xv[kb, r], wv[kb, 3], p[r, 3])

    @cuda.jit(**launch_bounds(THREADS))
    def split_kernel(x, w_kn, out, n_cols, k_dim, release_next):
        """x [M, G, K], w_kn [G, K, N] (flat under the simulator; N % 4 == 0), out [M, G, N]. Grid
        (ceil(N / NB), ceil(M / MT), G); dynamic shared memory: the partials [S, MT, NB] floats."""
        part = cuda.shared.array(0, float32, alignment=SHARED_ALIGN)   # [S, MT, NB] segment partials
        p = cuda.local.array((MT, VEC), float32)
        wv = cuda.local.array((BATCH, VEC), float32)
        xv = cuda.local.array((BATCH, MT), float32)
        tid = int32(cuda.threadIdx.x)
        quad = tid % QB
        lane = tid // QB
        g = int32(cuda.blockIdx.z)
        row0 = int32(cuda.blockIdx.y) * MT
        col0 = int32(cuda.blockIdx.x) * NB
        col = col0 + quad * VEC
        n_segs = (k_dim + SEGMENT - 1) >> SEG_SHIFT
        # The first segment's first weights before the wait (no kernel of a step writes them:
        # pdl's WEIGHTS_BEFORE_WAIT), so that under PDL they stream while the previous kernel runs
        # (so the PTX; whether ptxas keeps them above the wait is unchecked: pdl.RELEASE_EARLY).
        if WEIGHTS_FIRST and col < n_cols and lane < n_segs:
            load_batch(w_kn, wv, g, col, n_cols, k_dim, lane << SEG_SHIFT,
                       min(SEGMENT, k_dim - (lane << SEG_SHIFT)), 0)
        pdl_begin_early(release_next)  # PDL: wait for the previous kernel (x); release the next?
        m_rows = x.shape[0]
        rows = min(MT, m_rows - row0)
        if col < n_cols:
            for s in range(lane, n_segs, SB):
                for r in range(MT):
                    for c in range(VEC):
                        p[r, c] = ZERO
                k0 = s << SEG_SHIFT
                if k0 + SEGMENT <= k_dim:
                    chain(x, w_kn, p, wv, xv, g, row0, rows, col, n_cols, k_dim, k0, SEGMENT,
                          WEIGHTS_FIRST and s == lane)
                else:
                    chain(x, w_kn, p, wv, xv, g, row0, rows, col, n_cols, k_dim, k0, k_dim - k0,
                          WEIGHTS_FIRST and s == lane)
                for r in range(MT):
                    for c in range(VEC):
                        part[(s * MT + r) * NB + quad * VEC + c] = p[r, c]
        cuda.syncthreads()                     # every segment's partials staged
        for o in range(tid, MT * NB, THREADS):
            r = o >> NB_SHIFT
            c = o - (r << NB_SHIFT)
            if r < rows and col0 + c < n_cols:
                total = NEG_ZERO
                for s in range(n_segs):        # the order: segment partials left to right
                    total += part[(s * MT + r) * NB + c]
                out[row0 + r, g, col0 + c] = total

    return split_kernel


# --- many rows: a thread keeps MT x 4 outputs, its segment lane's segments ---------------------------

@functools.cache
def get_tile_kernel(mt: int, col_quads: int, row_groups: int, seg_lanes: int = 1,
                    blocks_per_sm: int = TILE_BLOCKS_PER_SM, pairs: bool = False) -> Any:
    """The tile kernel (compiled lazily, cached): ``col_quads`` x ``row_groups`` x ``seg_lanes``
    threads a block, each MT rows x 4 adjacent columns. A round stages ``seg_lanes`` segments of
    the head's weights [SL * SEGMENT, NB] and rows [SL * SEGMENT, RB] (k-major) in one of two
    shared buffers, the next round's loads in registers while the current one computes; segment
    lane l runs segment round * SL + l. Lane 0's threads own the outputs: they add their own partial
    and then the other lanes' (met in shared memory, two buffers by round parity) in segment order.
    One lane (SL = 1) is a thread running every segment; more lanes put more loads in flight
    per round and need fewer rounds (each round waits one memory round trip when its fmas are
    fewer than the latency: the value absorb's 16 segments of 72-thread blocks).

    ``blocks_per_sm`` is the launch bounds' block count (registers: 3 fit ~124 a thread at 160
    threads, 4 ~96), so a grid that passes one wave at 3 blocks an SM can run in one. ``pairs``
    (an even ``row_groups``) deals a warp's lanes in 2 x 2 squares, lanes 4i + 2a + b on column
    quad 2 q(i) + a and row group 2 r(i) + b: lanes t and t ^ 1 read the same weight float4 and
    lanes t and t ^ 2 the same x float4, instead of 32 distinct weight quads a warp: the
    pair-uniform shared loads that an NVIDIA engineer describes on the developer forum ("Unexpected
    shared memory bank conflict", 2019) as returning an LDS.128 in 2 requests instead of 4 on
    sm_70-75; not documented for sm_90. On the H200 (bench.absorb, PERFORMANCE run one wave) the q
    absorb took 20.5 us with pairs and 20.2 without (16 x 10, 4 an SM); the value absorb 26.8 with
    pairs at 8 x 10 (2 lanes) against 28.1 for the plan's 8 x 9 without; in a later call 8 x 9
    28.2, 8 x 10 28.8 and 8 x 10 with pairs 27.0. So the plan takes pairs for blocks of
    PAIR_LANES segment lanes (the value absorb) and leaves them off for one lane. Both knobs are
    layout, never the order."""
    if not _tile_layout_ok(mt, col_quads, row_groups, seg_lanes, blocks_per_sm, pairs):
        raise ValueError(f"no tile absorb kernel for mt={mt!r}, col_quads={col_quads!r}, row_groups={row_groups!r}, "
                         f"seg_lanes={seg_lanes!r}, blocks_per_sm={blocks_per_sm!r}, pairs={pairs!r}")
    MT, CQ, RW, SL = mt, col_quads, row_groups, seg_lanes
    PAIRS = bool(pairs)
    SLOT = CQ * RW                      # threads a segment lane
    THREADS = SLOT * SL
    NB = CQ * VEC                       # columns a block
    RB = RW * MT                        # rows a block
    XR = RB + TILE_X_PAD                # a staged k-row of x: RB rows, padded
    KS = SL * SEGMENT                   # k values a round stages
    W_TILE = KS * NB
    BUF = W_TILE + KS * XR              # one stage: weights [KS, NB] | x [KS, XR]
    PART = (SL - 1) * RB * NB           # one parity's partials of lanes 1 .. SL - 1 [SL - 1, RB, NB]
    W_CHUNKS = W_TILE // VEC            # 16-byte weight chunks a stage
    W_LOADS = -(-W_CHUNKS // THREADS)
    CQ_SHIFT = CQ.bit_length() - 1
    K_CHUNKS = KS // VEC                # 16-byte x chunks a row and stage
    X_CHUNKS = RB * K_CHUNKS
    X_LOADS = -(-X_CHUNKS // THREADS)

    @cuda.jit(device=True, inline="always")
    def fetch(x, w_kn, wpre, xpre, g, row0, col0, m_rows, n_cols, k_dim, rnd):
        """Round rnd's weights and rows into registers (zeros past K, N and M)."""
        tid = int32(cuda.threadIdx.x)
        k0 = rnd * KS
        for i in range(W_LOADS):
            idx = tid + i * THREADS
            v0 = v1 = v2 = v3 = ZERO
            if idx < W_CHUNKS:
                kk = idx >> CQ_SHIFT
                col = col0 + (idx - (kk << CQ_SHIFT)) * VEC
                if k0 + kk < k_dim and col < n_cols:
                    v0, v1, v2, v3 = load_f32x4(w_kn, (int64(g) * k_dim + k0 + kk) * n_cols + col)
            wpre[i, 0] = v0
            wpre[i, 1] = v1
            wpre[i, 2] = v2
            wpre[i, 3] = v3
        for i in range(X_LOADS):
            idx = tid + i * THREADS
            v0 = v1 = v2 = v3 = ZERO
            if idx < X_CHUNKS:
                kc = idx // RB                 # rows fastest: the transposed stores spread banks
                r = idx - kc * RB
                k = k0 + kc * VEC
                if k < k_dim and row0 + r < m_rows:   # K % 4 == 0: a chunk is whole or past K
                    v0, v1, v2, v3 = load_x4(x, row0 + r, g, k)
            xpre[i, 0] = v0
            xpre[i, 1] = v1
            xpre[i, 2] = v2
            xpre[i, 3] = v3

    @cuda.jit(device=True, inline="always")
    def put(sh, wpre, xpre, base):
        """The registers of fetch() into the stage at ``base``."""
        tid = int32(cuda.threadIdx.x)
        for i in range(W_LOADS):
            idx = tid + i * THREADS
            if idx < W_CHUNKS:
                shared_put4(sh, base + idx * VEC, wpre[i, 0], wpre[i, 1], wpre[i, 2], wpre[i, 3])
        for i in range(X_LOADS):
            idx = tid + i * THREADS
            if idx < X_CHUNKS:
                kc = idx // RB
                r = idx - kc * RB
                at = base + W_TILE + kc * VEC * XR + r
                sh[at] = xpre[i, 0]
                sh[at + XR] = xpre[i, 1]
                sh[at + 2 * XR] = xpre[i, 2]
                sh[at + 3 * XR] = xpre[i, 3]

    @cuda.jit(**launch_bounds(THREADS, blocks_per_sm))   # (without a block count: 128 registers, a spill)
    def kernel(x, w_kn, out, n_cols, k_dim):
        """x [M, G, K] (16-byte aligned rows, K % 4 == 0), w_kn [G, K, N] (flat under the
        simulator; N % 4 == 0), out [M, G, N]. Grid (ceil(N / NB), ceil(M / RB), G); dynamic shared
        memory: two stages and two partial buffers, tile_shared_bytes(MT, CQ, RW, SL) (its base is
        16-byte aligned for the vector accesses)."""
        sh = cuda.shared.array(0, float32, alignment=SHARED_ALIGN)   # [2, KS, NB | KS, XR] stages, [2, PART] partials
        pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
        wpre = cuda.local.array((W_LOADS, VEC), float32)
        xpre = cuda.local.array((X_LOADS, VEC), float32)
        acc = cuda.local.array((MT, VEC), float32)
        total = cuda.local.array((MT, VEC), float32)
        xv = cuda.local.array(MT, float32)
        tid = int32(cuda.threadIdx.x)
        lane = int32(0) if SL == 1 else tid // SLOT   # (constant with one lane: the SL = 1 kernel's registers)
        st = tid - lane * SLOT
        if PAIRS:                              # lanes 4i + 2a + b: quad 2 q(i) + a, row group 2 r(i) + b
            four = st >> 2
            quad = ((four & (CQ // 2 - 1)) << 1) | ((st >> 1) & 1)
            rg = ((four >> (CQ_SHIFT - 1)) << 1) | (st & 1)
        else:                                  # column quads fastest
            quad = st & (CQ - 1)
            rg = st >> CQ_SHIFT
        g = int32(cuda.blockIdx.z)
        row0 = int32(cuda.blockIdx.y) * RB
        col0 = int32(cuda.blockIdx.x) * NB
        m_rows = x.shape[0]
        n_segs = (k_dim + SEGMENT - 1) >> SEG_SHIFT
        n_rounds = (n_segs + SL - 1) // SL
        for r in range(MT):
            for c in range(VEC):
                total[r, c] = NEG_ZERO
        fetch(x, w_kn, wpre, xpre, g, row0, col0, m_rows, n_cols, k_dim, 0)
        put(sh, wpre, xpre, 0)
        cuda.syncthreads()                     # stage 0 visible to every thread
        for rnd in range(n_rounds):
            if rnd + 1 < n_rounds:             # the next round's loads fly while this one computes
                fetch(x, w_kn, wpre, xpre, g, row0, col0, m_rows, n_cols, k_dim, rnd + 1)
            base = int32((rnd & 1) * BUF)
            for r in range(MT):
                for c in range(VEC):
                    acc[r, c] = ZERO
            # k ascending in a counted while loop over int32 offsets: numba's range() kept 64-bit
            # iterator bookkeeping (setp / selp) beside each k's 2 loads and 4 MT fmas in the PTX.
            w_at = int32(base + lane * (SEGMENT * NB) + quad * VEC)
            x_at = int32(base + W_TILE + lane * (SEGMENT * XR) + rg * MT)
            kk = int32(0)
            while kk < SEGMENT:
                w0, w1, w2, w3 = shared_x4(sh, w_at)
                for r4 in range(MT // VEC):
                    xv[4 * r4], xv[4 * r4 + 1], xv[4 * r4 + 2], xv[4 * r4 + 3] = shared_x4(sh, x_at + 4 * r4)
                for r in range(MT):
                    acc[r, 0] = cuda.fma(xv[r], w0, acc[r, 0])
                    acc[r, 1] = cuda.fma(xv[r], w1, acc[r, 1])
                    acc[r, 2] = cuda.fma(xv[r], w2, acc[r, 2])
                    acc[r, 3] = cuda.fma(xv[r], w3, acc[r, 3])
                w_at += int32(NB)
                x_at += int32(XR)
                kk += int32(1)
            if SL > 1 and lane > 0:            # this lane's partial for lane 0's threads
                p_at = int32(2 * BUF + (rnd & 1) * PART + ((lane - 1) * RB + rg * MT) * NB + quad * VEC)
                for r in range(MT):
                    shared_put4(sh, p_at + r * NB, acc[r, 0], acc[r, 1], acc[r, 2], acc[r, 3])
            if rnd + 1 < n_rounds:
                put(sh, wpre, xpre, BUF - base)
            cuda.syncthreads()                 # next stage and partials visible; this stage read by every thread
            if lane == 0:                      # the order: segment partials left to right
                for r in range(MT):
                    for c in range(VEC):
                        total[r, c] += acc[r, c]
                for ln in range(1, SL):
                    if rnd * SL + ln < n_segs:   # lanes past the last segment computed on zeros: skipped
                        p_at = int32(2 * BUF + (rnd & 1) * PART + ((ln - 1) * RB + rg * MT) * NB + quad * VEC)
                        for r in range(MT):
                            p0, p1, p2, p3 = shared_x4(sh, p_at + r * NB)
                            total[r, 0] += p0
                            total[r, 1] += p1
                            total[r, 2] += p2
                            total[r, 3] += p3
        col = col0 + quad * VEC
        if lane == 0 and col < n_cols:
            for r in range(MT):
                row = row0 + rg * MT + r
                if row < m_rows:
                    for c in range(VEC):
                        out[row, g, col + c] = total[r, c]

    return kernel


# --- plans and the host wrapper ----------------------------------------------------------------------

@dataclass(frozen=True)
class AbsorbPlan:
    """One absorb launch (a function of the shapes: layout, never the order).

    Attributes:
        kind: ``"split"`` (few rows) or ``"tile"`` (many rows).
        mt: rows a thread keeps.
        lanes: segment lanes (split: the threads sharing an output's segments; tile: the lanes a
            round's segments are dealt to, 1 = a thread runs every segment).
        col_quads / row_groups: the tile kernel's block (0 for a split launch).
        blocks_per_sm / pairs: the tile kernel's launch bounds and lane layout (get_tile_kernel).
        grid, threads, shared_bytes: the launch (dynamic shared bytes: the split's partials).
    """

    kind: str
    mt: int
    lanes: int
    col_quads: int
    row_groups: int
    grid: tuple[int, int, int]
    threads: int
    shared_bytes: int
    blocks_per_sm: int = TILE_BLOCKS_PER_SM
    pairs: bool = False

    def kernel(self) -> Any:
        if self.kind == "split":
            return get_split_kernel(self.mt, self.lanes, self.threads)
        return get_tile_kernel(self.mt, self.col_quads, self.row_groups, self.lanes, self.blocks_per_sm, self.pairs)


def _split_plan(rows: int, groups: int, n_cols: int, k_dim: int) -> AbsorbPlan:
    mt = next((t for t in SPLIT_ROW_TILES if t >= rows), SPLIT_ROW_TILES[-1])
    segs = _segments(k_dim)
    lanes = min(SPLIT_MAX_LANES, _pow2_at_least(segs))
    # The simulator's threads are Python threads: no more column quads than N has (tiny: 8).
    threads = min(SPLIT_THREADS, lanes * _pow2_at_least(-(-n_cols // VEC))) if SIM_TREE else SPLIT_THREADS
    nb = threads // lanes * VEC
    grid = (-(-n_cols // nb), -(-rows // mt), groups)
    return AbsorbPlan("split", mt, lanes, 0, 0, grid, threads, split_shared_bytes(k_dim, mt, lanes, threads))


def tile_shared_bytes(mt: int, col_quads: int, row_groups: int, seg_lanes: int = 1) -> int:
    """A tile block's dynamic shared memory: two stages of weights [SL * SEGMENT, NB] and x
    [SL * SEGMENT, RB + pad], and two buffers of lanes 1 .. SL - 1's partials [SL - 1, RB, NB]."""
    nb, rb = col_quads * VEC, row_groups * mt
    return 2 * 4 * seg_lanes * SEGMENT * (nb + rb + TILE_X_PAD) + 2 * 4 * (seg_lanes - 1) * rb * nb


def tile_block_plan(mt: int, col_quads: int, row_groups: int, seg_lanes: int, rows: int, groups: int,
                    n_cols: int, blocks_per_sm: int = TILE_BLOCKS_PER_SM, pairs: bool = False) -> AbsorbPlan:
    """The tile launch of one block shape for these rows, heads and columns (the grid follows).

    Raises:
        ValueError: no tile kernel for the block, or its stages and partials pass TILE_SMEM.
    """
    if not _tile_block_ok(mt, col_quads, row_groups, seg_lanes, blocks_per_sm, pairs):
        raise ValueError(f"no tile absorb kernel for mt={mt}, col_quads={col_quads}, row_groups={row_groups}, "
                         f"seg_lanes={seg_lanes}, blocks_per_sm={blocks_per_sm}, pairs={pairs} within "
                         f"{TILE_SMEM} bytes of shared memory")
    grid = (-(-n_cols // (col_quads * VEC)), -(-rows // (row_groups * mt)), groups)
    return AbsorbPlan("tile", mt, seg_lanes, col_quads, row_groups, grid, col_quads * row_groups * seg_lanes,
                      tile_shared_bytes(mt, col_quads, row_groups, seg_lanes), blocks_per_sm, bool(pairs))


def _tile_block_ok(mt: int, col_quads: int, row_groups: int, seg_lanes: int,
                   blocks_per_sm: int = TILE_BLOCKS_PER_SM, pairs: bool = False) -> bool:
    """A tile kernel exists for the block, and its stages and partials fit TILE_SMEM."""
    return _tile_layout_ok(mt, col_quads, row_groups, seg_lanes, blocks_per_sm, pairs) and \
        tile_shared_bytes(mt, col_quads, row_groups, seg_lanes) <= TILE_SMEM


def _tile_slab(rows: int, groups: int, n_cols: int, mt: int, cq: int) -> tuple[int, int, int]:
    """(row groups, blocks, rows computed with the padding) of a tile block of ``cq`` column
    quads: as many row groups as the threads and TILE_SMEM allow, balanced over the row blocks."""
    row_groups = min(-(-rows // mt), TILE_MAX_THREADS // cq)
    while row_groups > 1 and tile_shared_bytes(mt, cq, row_groups) > TILE_SMEM:
        row_groups -= 1
    row_blocks = -(-rows // (row_groups * mt))
    row_groups = -(-rows // (row_blocks * mt))
    return row_groups, -(-n_cols // (cq * VEC)) * row_blocks * groups, row_blocks * row_groups * mt


def _tile_plan(rows: int, groups: int, n_cols: int, k_dim: int, sm_count: int) -> AbsorbPlan:
    mt = TILE_ROWS
    min_blocks = TILE_BLOCKS_PER_SM * sm_count
    slabs = {cq: _tile_slab(rows, groups, n_cols, mt, cq) for cq in TILE_COL_QUADS}
    least = min(padded for _, _, padded in slabs.values())
    fewest = [cq for cq in TILE_COL_QUADS if 16 * slabs[cq][2] <= 17 * least]
    # Of the slabs padding at most 1/16 more rows than the fewest (a 33-row tree: 36 in 16 x 9, not
    # 40 in 32 x 5), the widest giving min_blocks, else the narrowest.
    cq = next((c for c in fewest if slabs[c][1] >= min_blocks), fewest[-1])
    row_groups, blocks, _ = slabs[cq]
    # Segment lanes: the most (up to TILE_LANES, no more than the segments) whose block and shared
    # memory fit: fewer rounds, more loads in flight a round.
    lanes = max(sl for sl in TILE_SEG_LANES
                if sl == 1 or (sl <= min(TILE_LANES, _segments(k_dim)) and _tile_block_ok(mt, cq, row_groups, sl)))
    # One wave where the grid passes TILE_BLOCKS_PER_SM an SM and a block count the registers allow
    # takes it (WAVE_BLOCKS_PER_SM up to WAVE_THREADS threads, one fewer past them).
    bps = TILE_BLOCKS_PER_SM
    most = WAVE_BLOCKS_PER_SM if cq * row_groups <= WAVE_THREADS else WAVE_BLOCKS_PER_SM - 1
    if lanes == 1 and min_blocks < blocks <= most * sm_count:
        bps = next(b for b in TILE_MIN_BLOCKS if blocks <= b * sm_count)
    # Lane squares where a block runs PAIR_LANES segment lanes, the row groups rounded up to even
    # where the block still fits (a 33-row value absorb: 8 x 9 -> 8 x 10).
    even = row_groups + row_groups % 2
    if lanes == PAIR_LANES and _tile_block_ok(mt, cq, even, lanes, bps, True):
        return tile_block_plan(mt, cq, even, lanes, rows, groups, n_cols, bps, True)
    return tile_block_plan(mt, cq, row_groups, lanes, rows, groups, n_cols, bps)


def plan_absorb(rows: int, groups: int, n_cols: int, k_dim: int, *, rows_aligned: bool = True) -> AbsorbPlan:
    """The launch for an absorb of these shapes on the active device profile: the tile kernel for
    more than FEW_ROWS rows whose x rows start on 16 bytes with K % 4 == 0, else the split kernel
    (the same bits either way). Cached per shapes and profile; a caller that changes FEW_ROWS or
    the TILE_ constants calls ``plan_absorb.cache_clear()`` (bench.forward_ab does)."""
    return _plan_absorb(rows, groups, n_cols, k_dim, rows_aligned, active_profile().sm_count)


@functools.lru_cache(maxsize=1024)
def _plan_absorb(rows: int, groups: int, n_cols: int, k_dim: int, rows_aligned: bool, sm_count: int) -> AbsorbPlan:
    if rows > FEW_ROWS and rows_aligned and k_dim % VEC == 0:
        plan = _tile_plan(rows, groups, n_cols, k_dim, sm_count)
    else:
        plan = _split_plan(rows, groups, n_cols, k_dim)
    check_launch(plan.grid, plan.threads, plan.shared_bytes)
    return plan


plan_absorb.cache_clear = _plan_absorb.cache_clear   # type: ignore[attr-defined]


def reads_weights_first(x: Any, w_kn: Any) -> bool:
    """Whether ``absorb(x, w_kn, out)`` launches the one-row split kernel, which reads its first
    weights before its PDL wait (``kernels.pdl.WEIGHTS_BEFORE_WAIT``): the engine's rule for
    releasing the kernel before it early (``release_next``). Shapes as :func:`absorb` takes them."""
    groups, k_dim, n_cols = (int(d) for d in w_kn.shape)
    if x.shape[0] == 0 or groups == 0:
        return False
    plan = plan_absorb(int(x.shape[0]), groups, n_cols, k_dim, rows_aligned=_rows_aligned(x))
    return plan.kind == "split" and plan.mt == 1


def _fits(plan: AbsorbPlan, m_rows: int, groups: int, n_cols: int, k_dim: int, aligned: bool) -> bool:
    """The plan is one of the kernels' layouts, its grid covers these shapes (a split plan stages
    every segment, a tile plan has 16-byte x rows) and it passes the launch check."""
    if plan.kind == "split":
        if not _split_layout_ok(plan.mt, plan.lanes, plan.threads):
            return False
        cols, rows = plan.threads // plan.lanes * VEC, plan.mt
        staged = plan.shared_bytes >= split_shared_bytes(k_dim, plan.mt, plan.lanes, plan.threads)
    elif plan.kind == "tile":
        if not _tile_layout_ok(plan.mt, plan.col_quads, plan.row_groups, plan.lanes, plan.blocks_per_sm, plan.pairs) or \
                plan.threads != plan.col_quads * plan.row_groups * plan.lanes:
            return False
        cols, rows = plan.col_quads * VEC, plan.row_groups * plan.mt
        staged = aligned and k_dim % VEC == 0 and \
            plan.shared_bytes == tile_shared_bytes(plan.mt, plan.col_quads, plan.row_groups, plan.lanes)
    else:
        return False
    if not (staged and len(plan.grid) == 3 and plan.grid[2] == groups and plan.grid[0] * cols >= n_cols
            and plan.grid[1] * rows >= m_rows and 0 <= plan.shared_bytes <= TILE_SMEM):
        return False
    try:
        check_launch(plan.grid, plan.threads, plan.shared_bytes)
    except (LaunchConfigError, TypeError):   # not this plan
        return False
    return True


def absorb(x: Any, w_kn: Any, out: Any, *, stream: Any = 0, plan: AbsorbPlan | None = None,
           release_next: bool = False) -> Any:
    """``out[m, g] = x[m, g] @ w_kn[g]`` in the module's order (bit-identical for any row count).

    Under programmatic launches (``sim.launch.programmatic_launches``) the one-row split kernel
    reads its first weights before it waits for the previous kernel (``kernels.pdl``): ``w_kn`` must not be
    written by the kernel launched just before it.

    Args:
        x: float32 [M, G, K], unit inner stride (a view such as q[:, :, :nope] is fine).
        w_kn: float32 [G, K, N], C-contiguous, N % 4 == 0, 1 <= K <= MAX_K (the k-major absorb
            weight: ``DeviceWeights.k_major``).
        out: float32 [M, G, N], unit inner stride.
        stream: 0, a numba stream, or a cuda.core Stream / GraphBuilder.
        plan: a plan from :func:`plan_absorb` for these shapes (e.g. the split kernel at any row
            count, as the tests do); default: plan_absorb's choice.
        release_next: the next kernel of the stream reads weights before its PDL wait (a 1-row
            gemv): a split launch lets it launch right after its own wait (``pdl_begin_early``).

    Returns:
        ``out``.

    Raises:
        TypeError / ValueError naming ``x``, ``w_kn``, ``out`` or ``plan``, before any launch.
    """
    x = _f32(x, "x", 3)
    w_kn = _f32(w_kn, "w_kn", 3)
    if not is_c_contiguous(w_kn):
        raise ValueError("w_kn must be C-contiguous")
    groups, k_dim, n_cols = (int(d) for d in w_kn.shape)
    if not supported(k_dim, n_cols) or groups > MAX_GRID_Z:
        raise ValueError(f"w_kn must have shape (G, K, N) with G <= {MAX_GRID_Z}, 1 <= K <= {MAX_K} and N a "
                         f"multiple of {VEC} (16-byte weight loads), got {tuple(w_kn.shape)}")
    if data_address(w_kn) % 16:
        raise ValueError("w_kn must start on 16 bytes (16-byte weight loads)")
    m_rows = int(x.shape[0])
    if tuple(x.shape)[1:] != (groups, k_dim):
        raise ValueError(f"x must have shape (M, {groups}, {k_dim}) (G and K from w_kn), got {tuple(x.shape)}")
    if m_rows > MAX_ROWS:
        raise ValueError(f"x has {m_rows} rows, more than an absorb launch takes ({MAX_ROWS})")
    out = _check_out(out, "out", (m_rows, groups, n_cols))
    aligned = _rows_aligned(x)
    if plan is None:
        if m_rows == 0 or groups == 0:
            return out
        plan = plan_absorb(m_rows, groups, n_cols, k_dim, rows_aligned=aligned)
    elif not isinstance(plan, AbsorbPlan):
        raise TypeError(f"plan must be an AbsorbPlan, got {type(plan).__name__}")
    elif not _fits(plan, m_rows, groups, n_cols, k_dim, aligned):
        raise ValueError(f"plan does not fit these shapes (x {tuple(x.shape)}, w_kn {tuple(w_kn.shape)}): "
                         "make it with plan_absorb (or _split_plan) for them")
    # Both kernels stay within the default 48 KiB (split: <= 32 KiB of partials; tile: TILE_SMEM):
    # no opt-in call before the launch.
    flag = (np.int32(1 if release_next else 0),) if plan.kind == "split" else ()   # the split kernel's
    plan.kernel()[plan.grid, plan.threads, _stream(stream), plan.shared_bytes](
        x, _kernel_weight(w_kn), out, n_cols, k_dim, *flag)
    return out


def _sigs(split: bool = False) -> tuple:
    a3 = float32[:, :, :]
    return ((a3, float32[:, :, ::1], a3, int32, int32) + ((int32,) if split else ()),)   # (+ release_next)


# The compile check: the H200's launches of `small` (the AR step's split kernels for K 128 and 512,
# the 33-row verify's tile kernels: the q absorb at 4 blocks an SM, the value absorb's two lanes in
# lane squares), an 8-row split (a small batch), an 8-row tile thread, the widest block the plan
# runs at 4 an SM (8 x 18: 144 threads) and the 32 x 8 block of many rows (a prefill's q absorb).
for _mt, _lanes in ((1, 4), (1, 16), (8, 4)):
    register(f"absorb_split_mt{_mt}_l{_lanes}", get_split_kernel(_mt, _lanes), _sigs(split=True),
             f"MLA absorb in segment order, {_mt} row(s), {_lanes} segment lanes a block, partials met in shared memory",
             block_threads=SPLIT_THREADS)
for _mt, _cq, _rw, _sl, _bps, _pairs in ((4, 16, 9, 1, 4, False), (4, 8, 10, 2, 2, True), (8, 32, 5, 1, 2, False),
                                         (4, 8, 18, 1, 4, False), (4, 32, 8, 1, 2, False)):
    register(f"absorb_tile_mt{_mt}_c{_cq}_r{_rw}" + (f"_s{_sl}" if _sl > 1 else "") + (f"_b{_bps}" if _bps > 2 else "")
             + ("_pairs" if _pairs else ""),
             get_tile_kernel(_mt, _cq, _rw, _sl, _bps, _pairs), _sigs(),
             f"MLA absorb in segment order, {_mt} x 4 outputs a thread, {_sl} segment lane(s), "
             f"{'2 x 2 lane squares, ' if _pairs else ''}double-buffered tiles, launch bounds for {_bps} blocks an SM", block_threads=_cq * _rw * _sl)
