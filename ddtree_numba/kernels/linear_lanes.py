"""Many-row matrix products with ``linear``'s numerics, bit for bit, in warps that share k-lanes.

``linear_lanes(x, w, out)`` computes what :func:`.linear.linear` computes (prologue none /
RMSNorm / SwiGLU, residual epilogue) in the same order, so every row's result is the same bits
as ``linear``'s, whatever else shares the launch (linear's module doc, "Numerics"): K cut into
``linear.k_split(K)`` segments of ``seg_steps`` steps of 128 values; the "lane" ``l`` of a
segment runs one fma chain over ``k = 128 j + 4 l + e`` (j ascending, then e), from +0.0; the
32 lane partials are summed in :func:`.warp.warp_sum_f32`'s butterfly order (xor 16, 8, 4, 2, 1);
the segment sums are added in segment order; the residual is added last.

Why a layout of its own (PERFORMANCE, "k-lane warps"). ``linear``'s many-row tile gives a warp
one K segment of MT rows x C columns, its 32 lanes the 32 k-lanes: each lane's 16-byte shared
load of a staged row is its own (a warp's load spans 512 bytes: 4 shared wavefronts) and feeds
4 C fmas. At 11 x 4 a warp step is 11 such loads (44 wavefronts) and 4 weight loads (16) for 176
fma instructions, and the 33-row products sat at 25-40 % of the FP32 peak, latency-bound, their
L1 / shared data path at 57-63 % (run wide tiles' lm_head profile). Here a warp holds 8 k-lanes
(l = 8 h + t, t = lane % 8) for 4 column groups (lane // 8): the 4 lanes of one k-lane read the
same staged quad (a broadcast), so a row's load is 8 quads, 128 bytes, one wavefront, and a
weight load covers 128 contiguous bytes of 4 weight rows. The same 11 x 4 tile a thread, the
same loads and fmas a thread: 27 wavefronts a warp step instead of 60.

Layout (never the order). A block is 8 warps: warp ``v`` holds k-lanes ``8 (v % 4) .. + 7`` of
column half ``v // 4``; a thread holds MT rows x C = 4 columns (column ``half * 16 + group * 4 +
c`` of the block's 32-column tile). The MT rows of a row tile are staged in dynamic shared memory
``[MT, seg_steps * 128]`` with the prologue applied, once for all column tiles when K is one
segment (blocks loop over column tiles, grid y about one block an SM), else per column tile and
segment. The weights stream from global memory through a ring of U register slots (the loads of
step j + U - 1 issued before the fmas of step j). A lane's 44 partials go to shared memory
(``red [32 k-lanes, elements]``), ROUND_ROWS rows at a time, and one thread per element adds its
32 partials in the butterfly's tree (:func:`_tree32`), keeps the running segment total, and stores
it. Columns past N re-read the last weight row and are not stored; rows past M are staged as zeros
and not stored.

Limits (:func:`supported`): K a multiple of 4, 16-byte aligned weight rows, input rows and RMSNorm
weight (all read with 16-byte loads), the staged rows and partials within the device's shared
memory. Otherwise use ``linear``. The engine runs it for its many-row linear-kind products when
``engine.model.LANE_PRODUCTS`` is on (off until a GPU times it: bench.forward_ab ``auto-seg-lanes``).
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numba import cuda, float32, int32, int64, uint64

from sim.launch import check_launch, launch_bounds, opt_in_shared
from sim.profiles import active_profile

from ._args import data_address
from .linear import (ONE, STEP, VEC, WARP, ZERO, _kernel_weight, _norm_sig, _row_inv_rms, _rows_aligned, _silu_mul,
                     _stream, check_linear_args, k_split, load_f32x4, load_x4, shared_put4, shared_x4)
from .pdl import pdl_begin
from .registry import register

__all__ = ["ROW_TILE", "MIN_ROWS", "supported", "takes", "plan_lanes", "get_lanes_kernel", "linear_lanes"]

ROW_TILE = 11                 # rows a tile (33 = 3 x 11, as linear's odd tile)
COLUMNS = 4                   # adjacent columns a thread (C)
LANES_A_WARP = 8              # k-lanes a warp: l = 8 h + t, t = lane % 8
GROUPS_A_WARP = WARP // LANES_A_WARP       # column groups a warp (lane // 8)
LANE_SETS = WARP // LANES_A_WARP           # warps covering the 32 k-lanes of a column half
HALVES = 2                    # column halves a block
BLOCK_WARPS = LANE_SETS * HALVES           # 8
THREADS = BLOCK_WARPS * WARP               # 256
HALF_COLS = GROUPS_A_WARP * COLUMNS        # 16
TILE_COLS = HALVES * HALF_COLS             # 32 output columns a column tile
UNROLL = 3                    # weight steps a lane holds in flight (register ring slots)
MIN_ROWS = 17                 # the engine's threshold: below it linear's 1-8 row tiles pad less
SIM = bool(cuda.config.ENABLE_CUDASIM)
# Rows reduced together: all of the tile on a GPU (one round of barriers a segment); 2 under the
# simulator, whose launches check the 48 KiB default (the rounds' code runs there either way).
ROUND_ROWS = 2 if SIM else ROW_TILE
SHARED_BUDGET_SIM = 40 * 1024
SMEM_ALIGN = None if SIM else 16   # shared_x4's 16-byte loads (the simulator takes no alignment)
STATIC_BYTES = 1024           # the kernel's static shared arrays, rounded up (inv_sh)


def _red_stride(round_rows: int) -> int:
    """Floats between two k-lanes' rows of ``red``: the round's elements padded to 4 (mod 32) banks,
    so the 32 lanes' stores of one (row, column) slot (4 columns x 8 k-lanes) hit 32 banks."""
    elems = round_rows * TILE_COLS
    return elems + (4 - elems) % WARP


def _red_floats(round_rows: int) -> int:
    return WARP * _red_stride(round_rows)


@functools.cache
def get_lanes_kernel(prologue: str, residual: bool, mt: int = ROW_TILE, round_rows: int = ROUND_ROWS,
                     unroll: int = UNROLL) -> Any:
    """The kernel for one prologue ("none", "rmsnorm", "swiglu"), residual epilogue, MT rows a tile,
    rows a reduction round and weight ring slots (layout only: every choice gives the same bits)."""
    if prologue not in ("none", "rmsnorm", "swiglu") or not isinstance(residual, bool) or \
            not 1 <= mt <= 16 or not 1 <= round_rows <= mt or unroll not in (2, 3, 4):
        raise ValueError(f"no lanes kernel for prologue={prologue!r}, residual={residual!r}, mt={mt!r}, "
                         f"round_rows={round_rows!r}, unroll={unroll!r}")
    MT = mt
    C = COLUMNS
    U = unroll
    AHEAD = U - 1
    RMS = prologue == "rmsnorm"
    SWIGLU = prologue == "swiglu"
    RESIDUAL = residual
    RR = round_rows
    ROUNDS = -(-MT // RR)
    RED_STRIDE = _red_stride(RR)
    ROUND_ELEMS = RR * TILE_COLS
    PER_THREAD = -(-ROUND_ELEMS // THREADS)     # elements a thread reduces a round
    TOTALS = ROUNDS * PER_THREAD
    ACC = MT * C                                # a thread's partials (a compile-time size)
    STAGE_ROWS = MT                             # staged quads loaded before their stores (a round)

    @cuda.jit(device=True, inline="always")
    def tree32(smem, red_at, e):
        """The 32 k-lane partials of element e (red at smem[red_at:]), in warp_sum_f32's order:
        (v_l + v_(l+16)), then offsets 8, 4, 2, 1 (a + b == b + a exactly: who adds is immaterial)."""
        t = cuda.local.array(16, float32)
        for q in range(16):
            t[q] = smem[uint64(red_at + q * RED_STRIDE + e)] + smem[uint64(red_at + (q + 16) * RED_STRIDE + e)]
        for q in range(8):
            t[q] = t[q] + t[q + 8]
        for q in range(4):
            t[q] = t[q] + t[q + 4]
        t[0] = t[0] + t[2]
        t[1] = t[1] + t[3]
        return t[0] + t[1]

    @cuda.jit(device=True, inline="always")
    def stage(x, xs, inv_sh, norm_w, row0, k0, row_floats, k_dim):
        """Rows row0 .. row0 + MT - 1 of x, k0 .. k0 + row_floats - 1, prologue applied, into xs
        [MT, row_floats]; zeros past K and past the last row. A thread loads one quad of every row
        (MT loads in flight), then stores them."""
        quads = cuda.local.array((STAGE_ROWS, VEC), float32)
        m_rows = x.shape[0]
        for q in range(cuda.threadIdx.x, row_floats // VEC, THREADS):
            k = k0 + q * VEC
            inside = k < k_dim
            k_in = k if inside else 0     # in-bounds addresses even where unused
            n0 = ONE
            n1 = ONE
            n2 = ONE
            n3 = ONE
            if RMS and inside:
                n0, n1, n2, n3 = load_f32x4(norm_w, k_in)
            for i in range(MT):
                row = row0 + i
                v0 = ZERO
                v1 = ZERO
                v2 = ZERO
                v3 = ZERO
                if inside and row < m_rows:
                    v0, v1, v2, v3 = load_x4(x, row, 0, k_in)
                    if SWIGLU:
                        u0, u1, u2, u3 = load_x4(x, row, 0, k_dim + k_in)
                        v0 = _silu_mul(v0, u0)
                        v1 = _silu_mul(v1, u1)
                        v2 = _silu_mul(v2, u2)
                        v3 = _silu_mul(v3, u3)
                    if RMS:      # (x * inv) * weight, as linear's staging
                        inv = inv_sh[i]
                        v0 = v0 * inv * n0
                        v1 = v1 * inv * n1
                        v2 = v2 * inv * n2
                        v3 = v3 * inv * n3
                quads[i, 0] = v0
                quads[i, 1] = v1
                quads[i, 2] = v2
                quads[i, 3] = v3
            for i in range(MT):
                shared_put4(xs, uint64(i * row_floats + q * VEC), quads[i, 0], quads[i, 1], quads[i, 2],
                            quads[i, 3])

    @cuda.jit(device=True, inline="always")
    def load_step(w, wbase, j, wv, u):
        """The C weight quads of step j for this lane's columns into slot u."""
        for c in range(C):
            v0, v1, v2, v3 = load_f32x4(w, wbase[c] + j * STEP)
            wv[u, c, 0] = v0
            wv[u, c, 1] = v1
            wv[u, c, 2] = v2
            wv[u, c, 3] = v3

    @cuda.jit(device=True, inline="always")
    def fma_step(xs, xo, row_floats, wv, u, acc):
        """acc[i * C + c] += x[i, k] * w[c, k] for this lane's 4 k of one step, e ascending."""
        for i in range(MT):
            x0, x1, x2, x3 = shared_x4(xs, uint64(xo + i * row_floats))
            for c in range(C):
                a = cuda.fma(x0, wv[u, c, 0], acc[i * C + c])
                a = cuda.fma(x1, wv[u, c, 1], a)
                a = cuda.fma(x2, wv[u, c, 2], a)
                acc[i * C + c] = cuda.fma(x3, wv[u, c, 3], a)

    @cuda.jit(**launch_bounds(THREADS, 1))
    def kernel(x, w, out, residual_arr, norm_w, eps, n_cols, k_dim, k_split_, seg_steps, vec_steps):
        """out[m] = (residual[m] +) prologue(x[m]) @ w.T. x [M, Kx], w flat [N * K], out / residual
        [M, N], norm_w [K] (rmsnorm; else unused). Grid (row tiles, column-tile blocks): a block
        loops over column tiles blockIdx.y, + gridDim.y, ... Dynamic shared: xs [MT, seg floats],
        then red [32, RED_STRIDE]."""
        smem = cuda.shared.array(0, float32, alignment=SMEM_ALIGN)
        inv_sh = cuda.shared.array(16, float32)
        acc = cuda.local.array(ACC, float32)
        wv = cuda.local.array((U, C, VEC), float32)
        wbase = cuda.local.array(C, int64)
        totals = cuda.local.array(TOTALS, float32)
        pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        k_lane = (warp % LANE_SETS) * LANES_A_WARP + lane % LANES_A_WARP   # l
        group = lane // LANES_A_WARP
        half = warp // LANE_SETS
        row0 = cuda.blockIdx.x * MT
        m_rows = x.shape[0]
        row_floats = seg_steps * STEP
        red_at = MT * row_floats                  # red after the staged rows
        total_steps = (k_dim + STEP - 1) // STEP
        n_tiles = (n_cols + TILE_COLS - 1) // TILE_COLS
        if RMS:
            for i in range(warp, MT, BLOCK_WARPS):
                inv = _row_inv_rms(x, min(row0 + i, m_rows - 1), k_dim, eps, lane)
                if lane == 0:
                    inv_sh[i] = inv
            cuda.syncthreads()  # the rows' 1 / rms visible before staging
        if k_split_ == 1:
            stage(x, smem, inv_sh, norm_w, row0, 0, row_floats, k_dim)
            cuda.syncthreads()  # staged rows visible to every warp (kept for every column tile)
        for tile in range(cuda.blockIdx.y, n_tiles, cuda.gridDim.y):
            col_tile = tile * TILE_COLS
            for c in range(C):
                col = min(col_tile + half * HALF_COLS + group * C + c, n_cols - 1)
                wbase[c] = col * k_dim + VEC * k_lane
            for seg in range(k_split_):
                j0 = min(seg * seg_steps, total_steps)
                j1 = min(j0 + seg_steps, total_steps)
                jv = min(j1, max(j0, vec_steps))
                if k_split_ > 1:
                    cuda.syncthreads()  # every warp is done with the previous segment's rows
                    stage(x, smem, inv_sh, norm_w, row0, j0 * STEP, row_floats, k_dim)
                    cuda.syncthreads()  # this segment's rows staged
                for a in range(ACC):
                    acc[a] = ZERO
                xo0 = VEC * k_lane - j0 * STEP      # xs offset of step j is xo0 + j * STEP
                if j0 < jv:
                    jl = jv - 1
                    for u in range(AHEAD):
                        load_step(w, wbase, min(j0 + u, jl), wv, u)
                    j = j0
                    while j < jv:
                        for u in range(U):
                            # slot u holds step j + u; step j + u + AHEAD goes into the slot step
                            # j + u - 1 used (clamped: a re-read past the last step, unused)
                            load_step(w, wbase, min(j + u + AHEAD, jl), wv, (u + AHEAD) % U)
                            if j + u < jv:
                                fma_step(smem, xo0 + (j + u) * STEP, row_floats, wv, u, acc)
                        j += U
                for j in range(jv, j1):            # the last, partial step (K % 128 != 0)
                    k = j * STEP + VEC * k_lane
                    if k < k_dim:                  # K % 4 == 0: this lane's quad is all in
                        for c in range(C):
                            v0, v1, v2, v3 = load_f32x4(w, wbase[c] + j * STEP)
                            wv[0, c, 0] = v0
                            wv[0, c, 1] = v1
                            wv[0, c, 2] = v2
                            wv[0, c, 3] = v3
                        fma_step(smem, xo0 + j * STEP, row_floats, wv, 0, acc)
                for r in range(ROUNDS):
                    for i in range(RR):
                        row_in = r * RR + i
                        if row_in < MT:
                            for c in range(C):
                                # element (row i of the round, column half * 16 + group * 4 + c),
                                # numbered i * 32 + half * 16 + c * 4 + group: the 32 lanes of a
                                # store hit 32 banks (RED_STRIDE = 4 mod 32)
                                e = i * TILE_COLS + half * HALF_COLS + c * GROUPS_A_WARP + group
                                smem[uint64(red_at + k_lane * RED_STRIDE + e)] = acc[row_in * C + c]
                    cuda.syncthreads()  # every k-lane's partials of the round in red
                    for p in range(PER_THREAD):
                        e = tid + p * THREADS
                        if e < ROUND_ELEMS:
                            s = tree32(smem, red_at, e)
                            slot = r * PER_THREAD + p
                            totals[slot] = s if seg == 0 else totals[slot] + s   # segment order
                    cuda.syncthreads()  # red read before the next round rewrites it
            for r in range(ROUNDS):
                for p in range(PER_THREAD):
                    e = tid + p * THREADS
                    i = e // TILE_COLS
                    rest = e - i * TILE_COLS
                    h = rest // HALF_COLS
                    c = (rest // GROUPS_A_WARP) % C
                    g = rest % GROUPS_A_WARP
                    row = row0 + r * RR + i
                    col = col_tile + h * HALF_COLS + g * C + c
                    if e < ROUND_ELEMS and r * RR + i < MT and row < m_rows and col < n_cols:
                        value = totals[r * PER_THREAD + p]
                        if RESIDUAL:
                            out[row, col] = residual_arr[row, col] + value
                        else:
                            out[row, col] = value

    return kernel


def _register_all() -> None:
    """The specialisations the engine launches at many rows (compile check): q_a / kv_a, q_b, the
    dense gate | up and the lm_head (RMSNorm), wo (residual) and the dense down projection (SwiGLU +
    residual)."""
    c2, a2 = float32[:, ::1], float32[:, :]
    geometry = (int32, int32, int32, int32, int32)
    for prologue, residual in (("rmsnorm", False), ("none", True), ("swiglu", True)):
        sig = (a2, c2, a2, a2, _norm_sig(prologue), float32) + geometry
        register(f"linear_lanes_{prologue}{'_residual' if residual else ''}", get_lanes_kernel(prologue, residual),
                 (sig,), f"many-row x @ w.T with linear's bits in k-lane warps, {prologue} prologue"
                 f"{', residual epilogue' if residual else ''}", smem_opt_in=True, block_threads=THREADS)


_register_all()


def _shared_budget() -> int:
    """Dynamic shared bytes a block may take: the device's opt-in limit less the static arrays (a
    GPU), or the simulator's default-limit budget."""
    return SHARED_BUDGET_SIM if SIM else active_profile().smem_per_block_optin - STATIC_BYTES


@functools.lru_cache(maxsize=1024)
def plan_lanes(rows: int, n_cols: int, k_dim: int, mt: int = ROW_TILE) -> tuple[tuple[int, int, int], int, tuple] | None:
    """(grid, dynamic shared bytes, geometry (n_cols, k_dim, k_split, seg_steps, vec_steps)) of a
    product of ``rows`` rows in tiles of ``mt`` rows, or None where the staged rows and partials
    overflow the shared memory. Grid y: one segment, the rows staged once, blocks loop over column
    tiles (about one block an SM over the row tiles); several segments, one block a column tile
    (each restages anyway)."""
    split = k_split(k_dim)
    seg_steps = -(-(-(-k_dim // STEP)) // split)
    smem = 4 * (mt * seg_steps * STEP + _red_floats(min(ROUND_ROWS, mt)))
    if smem > _shared_budget():
        return None
    row_tiles = -(-rows // mt)
    n_tiles = -(-n_cols // TILE_COLS)
    if SIM:
        y = 1
    elif split == 1:
        y = max(1, min(n_tiles, active_profile().sm_count // row_tiles))
    else:
        y = n_tiles
    return (row_tiles, y, 1), smem, (n_cols, k_dim, split, seg_steps, k_dim // STEP)


def supported(x: Any, w: Any, norm_weight: Any = None, row_tile: int = ROW_TILE) -> bool:
    """Whether :func:`linear_lanes` runs this product: K a multiple of 4, 16-byte aligned rows of w,
    x and the RMSNorm weight, and a plan (``row_tile`` rows and their partials fit the shared memory)."""
    n_cols, k_dim = w.shape
    return k_dim % VEC == 0 and data_address(w) % 16 == 0 and _rows_aligned(x) and \
        (norm_weight is None or data_address(norm_weight) % 16 == 0) and \
        plan_lanes(max(1, x.shape[0]), n_cols, k_dim, row_tile) is not None


def takes(x: Any, w: Any, *, norm_weight: Any = None, swiglu: bool = False) -> bool:
    """The engine's rule: at least MIN_ROWS rows and :func:`supported` (``swiglu``: x holds gate | up)."""
    return x.shape[0] >= MIN_ROWS and supported(x, w, norm_weight)


def linear_lanes(x: Any, w: Any, out: Any, *, norm_weight: Any = None, eps: float = 1e-6, swiglu: bool = False,
                 residual: Any = None, stream: Any = 0, row_tile: int = ROW_TILE) -> Any:
    """``linear(x, w, out, ...)`` in k-lane warps: the same arguments and the same bits.

    Args:
        x, w, out, norm_weight, eps, swiglu, residual, stream: as :func:`.linear.linear`.
        row_tile: rows a tile, 1 to 16 (layout only; ROW_TILE, 3 tiles for a 33-row tree).

    Raises:
        TypeError / ValueError naming the argument, before any launch (``x``, ``w``, ``norm_weight``:
        rows not on 16 bytes, K not a multiple of 4, or rows of K that overflow the shared memory:
        :func:`supported`).
    """
    x, w, out, residual, prologue, norm, eps32 = check_linear_args(x, w, out, norm_weight, eps, swiglu,
                                                                   residual)
    n_cols, k_dim = w.shape
    if isinstance(row_tile, bool) or not isinstance(row_tile, (int, np.integer)) or not 1 <= row_tile <= 16:
        raise ValueError(f"row_tile must be an int in [1, 16], got {row_tile!r}")
    row_tile = int(row_tile)
    if not supported(x, w, norm, row_tile):
        raise ValueError(f"x, w, norm_weight: linear_lanes needs 16-byte aligned rows of x, w and norm_weight, "
                         f"K % {VEC} == 0 and {row_tile} rows of a K segment in shared memory, got x "
                         f"{tuple(x.shape)}, K {k_dim}")
    if x.shape[0] == 0:
        return out
    grid, smem, geometry = plan_lanes(x.shape[0], n_cols, k_dim, row_tile)
    _check(grid, smem)
    kernel = get_lanes_kernel(prologue, residual is not None, row_tile, min(ROUND_ROWS, row_tile))
    w_k = _kernel_weight(w)
    configured = kernel[grid, THREADS, _stream(stream), smem]
    if smem > 48 * 1024:
        configured = opt_in_shared(configured, smem)
    configured(x, w_k, out, out if residual is None else residual, w_k if norm is None else norm, eps32, *geometry)
    return out


@functools.lru_cache(maxsize=1024)
def _check(grid: tuple, smem: int) -> None:
    """The launch configuration against the device profile, once per shape (sim.launch)."""
    opt_in = smem > 48 * 1024
    check_launch(grid, THREADS, smem, opt_in=opt_in, static_shared_bytes=STATIC_BYTES if opt_in else 0)

