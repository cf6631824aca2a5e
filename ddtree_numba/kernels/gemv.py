"""One-row matrix products (an AR step at batch 1) with ``linear``'s numerics, bit for bit.

``gemv(x, w, out)`` computes what :func:`.linear.linear` computes for an input of one row
(prologue none / RMSNorm / SwiGLU, residual epilogue), in the same order, so its result is the
same bits as ``linear``'s for that row, alone or in a batch of any size (linear's module doc,
"Numerics"): K cut into ``linear.k_split(K)`` segments of ``seg_steps`` steps of 128 values;
lane ``l`` of a segment's warp runs one fma chain over ``k = 128 j + 4 l + e`` (j ascending,
then e), from +0.0; the 32 lane partials are summed by :func:`.warp.warp_sum_f32`'s butterfly;
the segment sums are added in segment order; the residual is added last. The RMSNorm prologue's
``1 / rms`` is :func:`.linear._row_inv_rms` and a staged value is ``(x * inv) * weight``; SwiGLU's
is :func:`.linear._silu_mul`.

Why a kernel of its own. ``linear``'s 1-row tile is the many-row kernel's: a block of 8 warps
(210-240 registers: one block an SM) stages the row in shared memory behind the rms and a
barrier, then each warp streams its columns' weights in rounds of U = 4 steps. On the H200 that
1-row launch cost ~6-7 us beyond its weight bytes in queue-ahead timing, instructions issued by two
warps a scheduler (PERFORMANCE, runs rms loads and odd tiles). In a replayed graph of its own
launches over cold weights this kernel costs ~2.5 us plus its bytes at ~3.2 TB/s on the H100, the
same as a launch that only reads them (``bench.stream_floor``); in the replayed forward its
launches cost 1-4 us more each (PERFORMANCE run "floor").
Here a warp reads its x quads straight from global memory (L1 / L2 hits: one 8-32 KiB row),
blocks are small (4-8 warps, at most 128 registers a thread) so that several share an SM and their
weight rounds overlap, and nothing waits at a barrier or for the rms before the first weight load. The engine
runs it for its 1-row products up to MAX_WEIGHT_BYTES (``engine.model.ROW_PRODUCTS``).

Layout (never the order; :class:`GemvLayout`, picked per shape by :func:`plan_gemv`): a block is
``warps`` warps = column groups x K segments (as linear's block: warp = group * k_split +
segment); a column group is ``columns`` adjacent output columns; the grid has one block per
``warps / k_split`` column groups. A warp issues its first ``unroll`` steps of weight loads
before its PDL wait and before it finds the rms (RMSNorm), then runs rounds: a round's x quads (and the RMSNorm weight's, or SwiGLU's gate and up) load and feed
the fmas of the weight steps loaded before it; then the next round's weights load. Segment sums
meet in shared memory and the segment-0 warp adds them in order. Columns past N re-read the last
weight row and are not stored.

Limits (checked by :func:`supported`): one row, K a multiple of 128 (whole vector steps), 16-byte
aligned weight rows and input row. Otherwise use ``linear``.

MoE experts (:func:`expert_gemv`): ``expert_linear``'s grouped products for a few CSR entries (an AR
step's k + 1 at batch 1, the shared expert folded in), a block row (grid y) per entry: the block
finds its entry's expert in the offsets after its PDL wait, then runs the same warp code on that
expert's weights and the entry's source row, so each entry gets linear's row, the bits of
``expert_linear`` (``engine.model.EXPERT_ROW_PRODUCTS``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda, float32, int32, int64

from sim.launch import check_launch, launch_bounds

from ._args import data_address
from .linear import (ONE, STEP, VEC, WARP, ZERO, _kernel_weight, _row_inv_rms, _rows_aligned, _silu_mul, _stream,
                     check_linear_args, k_split, load_f32x4, load_x4, warp_place)
from .linear import _norm_sig, check_expert_args
from .pdl import pdl_begin, pdl_begin_early
from .registry import register
from .warp import warp_sum_f32

__all__ = ["GemvLayout", "LAYOUTS", "MAX_WEIGHT_BYTES", "MAX_EXPERT_ENTRIES", "supported", "takes", "plan_gemv", "gemv",
           "get_gemv_kernel", "expert_takes", "expert_gemv"]


@dataclass(frozen=True)
class GemvLayout:
    """A launch layout (never the order): ``columns`` adjacent output columns a warp, ``unroll``
    steps of weight loads in flight before their fmas (columns x unroll 16-byte loads a lane),
    ``warps`` a block, ``min_blocks`` blocks an SM the registers must allow (launch bounds)."""

    columns: int
    unroll: int
    warps: int
    min_blocks: int


# The layouts plan_gemv picks. Measured on an H100 (out of the lent kinds; bench script of run
# "row products", us a launch, queue-ahead medians, weights rotated past the L2) against linear's
# 1-row tile: w_a 1344 x 2048 + RMSNorm 11.3 vs 13.5, w_q 12288 x 768 + RMSNorm 19.3 vs 21.1,
# wo 2048 x 8192 + residual 26.9 vs 31.2 (LAYOUTS["narrow"]); dense w2 2048 x 5632 SwiGLU +
# residual 25.5 vs 27.9 (LAYOUTS["swiglu"]: four columns a warp compute each silu for four
# columns, two columns 28.3); dense w13 11264 x 2048 (92 MB) 41.9-46.1 vs 39.9 and the lm_head
# (268 MB) 96.3 vs 96.4: past MAX_WEIGHT_BYTES linear's persistent tile is as fast or faster.
LAYOUTS = {"narrow": GemvLayout(columns=2, unroll=4, warps=4, min_blocks=4),
           "swiglu": GemvLayout(columns=4, unroll=4, warps=8, min_blocks=2)}
MAX_WEIGHT_BYTES = 80 * 1024 * 1024
# expert_gemv's grid has a block row per CSR entry (grid y): it is for the few entries of an AR
# step (k + 1 at batch 1 with the shared expert folded in); past this many, expert_linear's tiles
# read each expert's weights once for all its entries.
MAX_EXPERT_ENTRIES = 16


def supported(rows: int, k_dim: int, w: Any, x: Any, norm_weight: Any = None) -> bool:
    """Whether :func:`gemv` runs this product: one row, whole 128-value steps, 16-byte rows (x,
    w and the RMSNorm weight: all read with 16-byte loads)."""
    return rows == 1 and k_dim % STEP == 0 and data_address(w) % 16 == 0 and _rows_aligned(x) and \
        (norm_weight is None or data_address(norm_weight) % 16 == 0)


def takes(x: Any, w: Any, *, norm_weight: Any = None, swiglu: bool = False) -> bool:
    """Whether a product with ``linear``'s arguments runs here: :func:`supported` and a layout from
    :func:`plan_gemv` (the engine's rule for its 1-row products)."""
    prologue = "swiglu" if swiglu else "rmsnorm" if norm_weight is not None else "none"
    return supported(x.shape[0], w.shape[1], w, x, norm_weight) and plan_gemv(prologue, *w.shape) is not None


@functools.lru_cache(maxsize=1024)
def plan_gemv(prologue: str, n_cols: int, k_dim: int) -> GemvLayout | None:
    """The layout for a 1-row product of an N x K weight, or None where ``linear`` is as fast
    (weights past MAX_WEIGHT_BYTES) or the K segments (``linear.k_split``) outnumber a block's warps."""
    if 4 * n_cols * k_dim > MAX_WEIGHT_BYTES or k_dim % STEP:
        return None
    layout = LAYOUTS["swiglu" if prologue == "swiglu" else "narrow"]
    return layout if k_split(k_dim) <= layout.warps else None


@functools.cache
def get_gemv_kernel(prologue: str, residual: bool, layout: GemvLayout = LAYOUTS["narrow"], expert: bool = False) -> Any:
    """The kernel for one prologue ("none", "rmsnorm", "swiglu"), residual epilogue and layout;
    ``expert``: :func:`expert_gemv`'s (prologue none or swiglu, no residual)."""
    if prologue not in ("none", "rmsnorm", "swiglu") or not isinstance(layout, GemvLayout) or \
            (expert and (prologue == "rmsnorm" or residual)):
        raise ValueError(f"no gemv kernel for prologue={prologue!r}, residual={residual!r}, layout={layout!r}, "
                         f"expert={expert!r}")
    columns, unroll, warps, min_blocks = layout.columns, layout.unroll, layout.warps, layout.min_blocks
    RMS = prologue == "rmsnorm"
    SWIGLU = prologue == "swiglu"
    RESIDUAL = residual
    EXPERT = expert
    NAN = float32(np.nan)
    U = unroll
    CW = columns
    COMB = warps * CW

    @cuda.jit(device=True, inline="always")
    def load_round(w, wbase, wv, j, n):
        """The weight float4s of steps j .. j + n - 1 (n <= U) into wv."""
        for u in range(U):
            if u < n:
                for c in range(CW):
                    v0, v1, v2, v3 = load_f32x4(w, wbase[c] + (j + u) * STEP)
                    wv[u, c, 0] = v0
                    wv[u, c, 1] = v1
                    wv[u, c, 2] = v2
                    wv[u, c, 3] = v3

    @cuda.jit(device=True, inline="always")
    def fma_round(x, row, norm_w, inv, k_dim, lane, wv, acc, j, n, nan_row):
        """acc[c] += x[row, k] * w[c, k] over steps j .. j + n - 1, k = 128 j + 4 lane + e ascending
        (x as NaN where ``nan_row``: the expert kernel's invalid source row)."""
        for u in range(U):
            if u < n:
                k = (j + u) * STEP + VEC * lane
                x0, x1, x2, x3 = load_x4(x, row, 0, k)
                if SWIGLU:
                    g0, g1, g2, g3 = load_x4(x, row, 0, k_dim + k)
                    x0 = _silu_mul(x0, g0)
                    x1 = _silu_mul(x1, g1)
                    x2 = _silu_mul(x2, g2)
                    x3 = _silu_mul(x3, g3)
                if RMS:                 # (x * inv) * weight, as linear's staging
                    n0, n1, n2, n3 = load_f32x4(norm_w, k)
                    x0 = x0 * inv * n0
                    x1 = x1 * inv * n1
                    x2 = x2 * inv * n2
                    x3 = x3 * inv * n3
                if EXPERT and nan_row:   # as expert_linear's staged NaN (after any prologue)
                    x0 = NAN
                    x1 = NAN
                    x2 = NAN
                    x3 = NAN
                for c in range(CW):
                    a = cuda.fma(x0, wv[u, c, 0], acc[c])
                    a = cuda.fma(x1, wv[u, c, 1], a)
                    a = cuda.fma(x2, wv[u, c, 2], a)
                    acc[c] = cuda.fma(x3, wv[u, c, 3], a)

    @cuda.jit(device=True, inline="always")
    def first_round(w, w_row0, n_cols, k_dim, k_split_, seg_steps, wv, acc, wbase):
        """This warp's columns of weight rows w_row0 + col: their flat bases into wbase, acc
        zeroed, the first round's weights loaded into wv; returns (lane, warp, seg, col0, j, j_end,
        n): the warp's place, its first column, its steps and the round's. Reads only weights (no kernel of a step writes them: pdl's
        WEIGHTS_BEFORE_WAIT), so the dense kernel calls it before its PDL wait."""
        lane, warp, seg, group, groups_per_block = warp_place(k_split_)
        col0 = (cuda.blockIdx.x * groups_per_block + group) * CW
        total_steps = k_dim // STEP
        j = min(seg * seg_steps, total_steps)
        j_end = min(j + seg_steps, total_steps)
        for c in range(CW):
            wbase[c] = (int64(w_row0) + min(col0 + c, n_cols - 1)) * k_dim + VEC * lane
            acc[c] = ZERO
        n = min(U, j_end - j)
        load_round(w, wbase, wv, j, n)
        return lane, warp, seg, col0, j, j_end, n

    @cuda.jit(device=True, inline="always")
    def finish(x, row, w, out, out_row, residual_arr, norm_w, eps, n_cols, k_dim, k_split_, wv, acc, wbase,
               lane, warp, seg, col0, j, j_end, n, comb, nan_row):
        """The rest of the product after :func:`first_round`: out[out_row, col] = (residual +)
        prologue(x[row]) @ w[row of col].T for this warp's columns. nan_row: x read as NaN
        (an expert entry's invalid source row), so the row is NaN through the same fmas as
        expert_linear's staged NaN rows (the same NaN bits)."""
        inv = ONE
        if RMS:
            inv = _row_inv_rms(x, row, k_dim, eps, lane)
        while True:
            fma_round(x, row, norm_w, inv, k_dim, lane, wv, acc, j, n, nan_row)
            j += n
            if j >= j_end:
                break
            n = min(U, j_end - j)
            load_round(w, wbase, wv, j, n)
        for c in range(CW):
            acc[c] = warp_sum_f32(acc[c])   # every lane: the butterfly's bits
        if k_split_ == 1:
            for c in range(CW):
                if lane == c and col0 + c < n_cols:
                    value = acc[c]
                    if RESIDUAL:
                        value = residual_arr[out_row, col0 + c] + value
                    out[out_row, col0 + c] = value
        else:
            for c in range(CW):
                if lane == c:
                    comb[warp * CW + c] = acc[c]
            cuda.syncthreads()  # every segment's sums in comb
            if seg == 0:
                for c in range(CW):
                    if lane == c and col0 + c < n_cols:
                        total = comb[warp * CW + c]
                        for s in range(1, k_split_):    # segment order
                            total += comb[(warp + s) * CW + c]
                        if RESIDUAL:
                            total = residual_arr[out_row, col0 + c] + total
                        out[out_row, col0 + c] = total

    if not EXPERT:
        @cuda.jit(**launch_bounds(warps * WARP, min_blocks))
        def kernel(x, w, out, residual_arr, norm_w, eps, n_cols, k_dim, k_split_, seg_steps, release_next):
            """out[0] = (residual[0] +) prologue(x[0]) @ w.T; w [N, K] C-contiguous (flat indices);
            release_next: 1 where the next kernel reads weights before its PDL wait (pdl_begin_early)."""
            comb = cuda.shared.array(COMB, float32)
            wv = cuda.local.array((U, CW, VEC), float32)
            acc = cuda.local.array(CW, float32)
            wbase = cuda.local.array(CW, int64)
            # The first round's weights before the wait, so that under PDL they stream while the
            # previous kernel runs (so the PTX; the sm_90 SASS has the wait first: pdl.RELEASE_EARLY),
            # and before the rms: their latency covers its loads and sums.
            lane, warp, seg, col0, j, j_end, n = first_round(w, 0, n_cols, k_dim, k_split_, seg_steps, wv, acc,
                                                             wbase)
            pdl_begin_early(release_next)  # PDL: wait for the previous kernel (x, residual); release the next?
            finish(x, 0, w, out, 0, residual_arr, norm_w, eps, n_cols, k_dim, k_split_, wv, acc, wbase,
                   lane, warp, seg, col0, j, j_end, n, comb, False)
        return kernel

    @cuda.jit(**launch_bounds(warps * WARP, min_blocks))
    def expert_kernel(x, w, out, row_offsets, row_index, n_cols, k_dim, k_split_, seg_steps):
        """out[j] = prologue(x[row_index[j]]) @ w[e].T for CSR entry j = blockIdx.y of expert e
        (row_offsets[e] <= j < row_offsets[e + 1], offsets clamped to [0, J]); entries past
        row_offsets[E] exit; a source row outside x gives a NaN row. w flat [E * N * K]."""
        comb = cuda.shared.array(COMB, float32)
        pdl_begin()  # PDL: wait for the routing (the expert and the row depend on it)
        wv = cuda.local.array((U, CW, VEC), float32)
        acc = cuda.local.array(CW, float32)
        wbase = cuda.local.array(CW, int64)
        entry = cuda.blockIdx.y
        n_entries = out.shape[0]
        expert = -1
        lo = min(max(row_offsets[0], 0), n_entries)
        for e in range(row_offsets.shape[0] - 1):   # block-uniform: the first expert holding it
            hi = min(max(row_offsets[e + 1], 0), n_entries)
            if expert < 0 and lo <= entry and entry < hi:
                expert = e
            lo = hi
        if expert < 0:   # past the routed entries: the whole block leaves together
            return
        src = row_index[entry]
        bad = src < 0 or src >= x.shape[0]
        lane, warp, seg, col0, j, j_end, n = first_round(w, expert * n_cols, n_cols, k_dim, k_split_, seg_steps,
                                                         wv, acc, wbase)
        finish(x, 0 if bad else src, w, out, entry, out, x, ONE, n_cols, k_dim, k_split_, wv, acc, wbase,
               lane, warp, seg, col0, j, j_end, n, comb, bad)

    return expert_kernel


def _register_all() -> None:
    """The specialisations the engine launches (compile check): q_a / kv_a and q_b (RMSNorm), wo
    (residual), the dense down projection (SwiGLU + residual), and the unfolded shared expert's
    gate | up (none) and down projection (SwiGLU)."""
    a2, c2 = float32[:, :], float32[:, ::1]
    for prologue, residual in (("rmsnorm", False), ("none", True), ("swiglu", True), ("none", False),
                               ("swiglu", False)):
        name = "swiglu" if prologue == "swiglu" else "narrow"
        layout = LAYOUTS[name]
        sig = (a2, c2, a2, a2, _norm_sig(prologue), float32, int32, int32, int32, int32, int32)
        register(f"gemv_{prologue}{'_residual' if residual else ''}", get_gemv_kernel(prologue, residual, layout),
                 (sig,), f"1-row x @ w.T with linear's bits, {prologue} prologue"
                 f"{', residual epilogue' if residual else ''}, layout {name}", block_threads=layout.warps * WARP)


    x2, i1 = float32[:, :], int32[::1]
    for prologue in ("none", "swiglu"):
        name = "swiglu" if prologue == "swiglu" else "narrow"
        layout = LAYOUTS[name]
        sig = (x2, float32[:, :, ::1], x2, i1, i1, int32, int32, int32, int32)
        register(f"expert_gemv_{prologue}", get_gemv_kernel(prologue, False, layout, expert=True), (sig,),
                 f"MoE expert products, a CSR entry a block row, with linear's bits, {prologue} prologue, "
                 f"layout {name}", block_threads=layout.warps * WARP)


_register_all()


def _column_blocks(n_cols: int, k_dim: int, layout: GemvLayout) -> tuple[int, tuple]:
    """(blocks over the N columns, the kernels' geometry arguments (n_cols, k_dim, k_split,
    seg_steps)) of one product shape and layout."""
    split = k_split(k_dim)
    seg_steps = -(-(k_dim // STEP) // split)
    groups = layout.warps // split          # column groups a block (the callers check split <= warps)
    return -(-(-(-n_cols // layout.columns)) // groups), (n_cols, k_dim, split, seg_steps)


@functools.lru_cache(maxsize=1024)
def _setup(prologue: str, residual: bool, n_cols: int, k_dim: int, layout: GemvLayout) -> tuple:
    """(kernel, blocks, threads, geometry) of one launch shape, checked once (sim.launch)."""
    blocks, geometry = _column_blocks(n_cols, k_dim, layout)
    check_launch((blocks, 1, 1), layout.warps * WARP, 0)
    return get_gemv_kernel(prologue, residual, layout), blocks, layout.warps * WARP, geometry


def gemv(x: Any, w: Any, out: Any, *, norm_weight: Any = None, eps: float = 1e-6, swiglu: bool = False,
         residual: Any = None, stream: Any = 0, layout: GemvLayout | None = None,
         release_next: bool = False) -> Any:
    """``linear(x, w, out, ...)`` for one row: the same arguments and the same bits.

    Under programmatic launches (``sim.launch.programmatic_launches``) the kernel reads its first
    weights before it waits for the previous kernel (``kernels.pdl``): ``w`` must not be written
    by the kernel launched just before it.

    Args:
        x, w, out, norm_weight, eps, swiglu, residual, stream: as :func:`.linear.linear`.
        layout: a :class:`GemvLayout` (default: :func:`plan_gemv`'s, else LAYOUTS["narrow"]).
        release_next: the next kernel of the stream reads weights before its PDL wait (a gemv, a
            split absorb): let it launch right after this one's wait (``kernels.pdl.pdl_begin_early``).

    Raises:
        TypeError / ValueError naming the argument, before any launch (``x``: not one 16-byte
        aligned row, or K not a multiple of 128: :func:`supported`).
    """
    x, w, out, residual, prologue, norm, eps32 = check_linear_args(x, w, out, norm_weight, eps, swiglu,
                                                                   residual)
    n_cols, k_dim = w.shape
    if not supported(x.shape[0], k_dim, w, x, norm):
        raise ValueError(f"x, w, norm_weight: gemv needs one 16-byte aligned row of x, 16-byte aligned rows of "
                         f"w and norm_weight, and K % {STEP} == 0, got x {tuple(x.shape)}, K {k_dim}")
    if layout is None:
        layout = plan_gemv(prologue, n_cols, k_dim) or LAYOUTS["narrow"]
    if not isinstance(layout, GemvLayout):
        raise TypeError(f"layout must be a GemvLayout, got {type(layout).__name__}")
    if k_split(k_dim) > layout.warps:
        raise ValueError(f"layout: {layout.warps} warps a block, fewer than K {k_dim}'s {k_split(k_dim)} segments")
    kernel, blocks, threads, geometry = _setup(prologue, residual is not None, n_cols, k_dim, layout)
    w_k = _kernel_weight(w)
    kernel[blocks, threads, _stream(stream), 0](x, w_k, out, out if residual is None else residual,
                                                w_k if norm is None else norm, eps32, *geometry,
                                                np.int32(1 if release_next else 0))
    return out


# --- MoE experts: a block row per CSR entry --------------------------------------------------------

def expert_takes(x: Any, w: Any, out: Any, *, swiglu: bool = False) -> bool:
    """Whether :func:`expert_gemv` runs this grouped product (the engine's rule for an AR step's
    expert launches): at most MAX_EXPERT_ENTRIES entries, whole 128-value steps, 16-byte rows, and
    a layout whose warps hold K's segments."""
    experts, n_cols, k_dim = w.shape
    layout = LAYOUTS["swiglu" if swiglu else "narrow"]
    return (0 < out.shape[0] <= MAX_EXPERT_ENTRIES and k_dim % STEP == 0 and data_address(w) % 16 == 0
            and _rows_aligned(x) and k_split(k_dim) <= layout.warps)


@functools.lru_cache(maxsize=256)
def _expert_setup(prologue: str, n_cols: int, k_dim: int, entries: int, layout: GemvLayout) -> tuple:
    """(kernel, grid, threads, geometry) of one expert launch shape, checked once (sim.launch)."""
    blocks, geometry = _column_blocks(n_cols, k_dim, layout)
    check_launch((blocks, entries, 1), layout.warps * WARP, 0)
    return get_gemv_kernel(prologue, False, layout, expert=True), (blocks, entries, 1), layout.warps * WARP, geometry


def expert_gemv(x: Any, w: Any, out: Any, row_offsets: Any, row_index: Any, *, swiglu: bool = False,
                stream: Any = 0, layout: GemvLayout | None = None) -> Any:
    """``expert_linear(x, w, out, row_offsets, row_index, swiglu=...)`` for a few entries: the
    same arguments and the same bits (each entry's row is linear's row, whichever kernel runs it).

    Grid (column blocks, J): block row j finds entry j's expert in ``row_offsets`` (clamped to
    [0, J], as expert_linear) and streams that expert's weights as :func:`gemv` streams a dense
    product's, so an AR step's k + 1 entries read their experts with gemv's many small blocks
    instead of expert_linear's one-row tiles. Entries past row_offsets[E] exit unwritten; a source
    row outside x gives a NaN row. The routing is read after the PDL wait (the weights depend on it).

    Args:
        x, w, out, row_offsets, row_index, swiglu, stream: as :func:`.linear.expert_linear`.
        layout: a :class:`GemvLayout` (default: LAYOUTS["swiglu"] with swiglu, else "narrow").

    Raises:
        TypeError / ValueError naming the argument, before any launch (as expert_linear's, and
        ``out``: more than MAX_EXPERT_ENTRIES entries; ``w``: K not a multiple of 128 or rows
        not 16-byte aligned; ``x``: rows not 16-byte aligned; ``layout``: too few warps for K).
    """
    x, w, out, row_offsets, row_index, prologue = check_expert_args(x, w, out, row_offsets, row_index, swiglu)
    n_cols, k_dim = w.shape[1], w.shape[2]
    entries = out.shape[0]
    if entries > MAX_EXPERT_ENTRIES:
        raise ValueError(f"out: expert_gemv takes at most {MAX_EXPERT_ENTRIES} entries, got {entries} "
                         f"(use expert_linear)")
    if k_dim % STEP or data_address(w) % 16:
        raise ValueError(f"w: expert_gemv needs K % {STEP} == 0 and 16-byte aligned rows, got K {k_dim}")
    if not _rows_aligned(x):
        raise ValueError("x: expert_gemv needs 16-byte aligned rows")
    if layout is None:
        layout = LAYOUTS["swiglu" if swiglu else "narrow"]
    if not isinstance(layout, GemvLayout):
        raise TypeError(f"layout must be a GemvLayout, got {type(layout).__name__}")
    if k_split(k_dim) > layout.warps:
        raise ValueError(f"layout: {layout.warps} warps a block, fewer than K {k_dim}'s {k_split(k_dim)} segments")
    if entries == 0 or x.shape[0] == 0:
        return out
    kernel, grid, threads, geometry = _expert_setup(prologue, n_cols, k_dim, entries, layout)
    kernel[grid, threads, _stream(stream), 0](x, _kernel_weight(w), out, row_offsets, row_index, *geometry)
    return out
