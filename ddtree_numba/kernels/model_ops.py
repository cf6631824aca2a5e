"""Elementwise and per-row pieces of the MLA + MoE forward, FP32, one launch per call.

The float64 NumPy reference (``reference/model.py``) defines every result; this module computes
the same in float32 for a whole batch of M rows at once:

- :func:`embed`: ``out[m] = table[tokens[m]]`` (ids checked on the device: a bad id -> NaN row).
- :func:`rms_norm`: ``x / sqrt(mean(x²) + eps) · weight`` (``reference.model.rms_norm``).
- :func:`rope_tables`: host cos / sin tables from ``reference.model.rope_cos_sin`` (YaRN).
- :func:`mla_kv_write`: kv norm of the latent, RoPE of the key part, scattered into cache rows.
- :func:`mla_q_rope`: RoPE of every head's query rope part.
- :func:`mla_rope_kv_write`: both of the above in one launch (the engine's per-layer call).
- :func:`moe_route`: ``reference.model.moe_gate`` plus the CSR that ``linear.expert_linear``
  consumes (a second, single-block launch builds the CSR), in one of two layouts with numerics of
  their own: a block per row reading every gate row, or the expert grid (given ``logits`` and
  ``counts``: a block per (expert, row), the RMSNorm inside, the row's last block selecting).
- :func:`moe_combine`: residual + weighted expert outputs (ascending expert id) + shared expert.

Determinism and batch invariance. Every reduction has a fixed order that depends only on the
row length: in a row reduction (rms_norm, the kv norm) lane ``l`` of the row's warp sums elements
``l, l + 32, ...`` in ascending order and the 32 partials are added in lane order; a gate logit
is the ordered sum of ROUTE_SPLIT such strided partials (the row layout), or, in the expert grid,
the sum of ROUTE_LANES lanes' fma chains over ``v, v + ROUTE_LANES, ...`` in
:func:`_make_lane_sum`'s order (its RMSNorm's sum of squares too). Which warp, block or launch a row lands
in, and the launch shape, never change its bits, so a row verified inside a tree equals the same
row decoded alone (issue 4, "batch-invariant"). Routing is integer-exact given the float32
scores: ties go to the lower index, as ``reference.model._top_indices`` (stable argsort of the
negated values) does; -0.0 ties +0.0.

Launch shapes. Every kernel is grid-stride; on a GPU the grid covers the work (one warp per row,
one thread per element, one block per routed row); under the simulator each launch is one block
of one warp (simulated threads are Python threads, stack §2), with the same results.

Precision. Arithmetic is float32 (FMA contraction on the GPU), so results match the float64
reference to ~1e-6 relative; expert selection can differ from the float64 reference only where
two candidates' float64 scores are within float32 rounding of each other (a near-tie).

Device-side guards (the engine feeds valid values; checking device values on the host would
need a copy): token ids outside [0, V) -> NaN rows; positions outside [0, capacity) -> NaN RoPE
outputs; cache rows < 0 are padding and skipped, cache rows >= R are skipped too; a NaN gate
score ranks as -inf, so routing always yields k distinct valid experts and a well-formed CSR.

Host wrappers check every argument (TypeError / ValueError naming it) before any launch and
never copy device data to the host, so a step can be captured in a CUDA graph (stack §4).
Scalars passed to kernels (eps, layout, routing constants) are per-model constants.
"""
from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64

from ddtree_numba.config import ROPE_LAYOUTS, ModelConfig
from reference.model import rope_cos_sin
from sim.install import simulator_active
from sim.launch import launch, launch_bounds
from sim.profiles import active_profile

from ._args import as_kernel_array, check_array, check_shape, host_values
from .pdl import pdl_begin, pdl_begin_early
from .registry import register
from .warp import warp_inclusive_scan_i32, warp_sum_f32

__all__ = [
    "MAX_EXPERTS", "MAX_GROUPS", "MAX_TOPK", "ROW_THREADS", "ELEM_THREADS", "CSR_THREADS",
    "MAX_ROUTE_THREADS", "embed", "rms_norm", "rope_tables", "mla_kv_write", "mla_q_rope", "mla_rope_kv_write",
    "moe_route", "moe_combine", "route_threads",
]

WARP_SIZE = 32
FULL_MASK = 0xFFFFFFFF
ROW_WARPS = 4  # warp-per-row kernels: rows per block
ROW_THREADS = ROW_WARPS * WARP_SIZE
ELEM_THREADS = 128  # element-parallel kernels: elements (or RoPE pairs) per block
SIM_THREADS = WARP_SIZE  # every launch under the simulator: one block of one warp
# Loads in flight per lane ahead of the arithmetic on them (the last, partial batch guarded): a
# warp-per-row RMSNorm of D 2048 is 64 values a lane, so 8 a round was 8 round trips to L2 before
# the sum and 8 more for the normed write (~12 us an AR launch on the H200); the kv write's 512 are
# one batch now. The order of the sums does not depend on these.
ROW_LOADS = 32  # RMSNorm rows: the sum of squares and the normed write
# The routing kernel's gate partials (one (expert, partial) pair a thread), read at the call
# (moe_route_kernel). 24 or 32 inconclusive, so 16 stays: H100, run "expert rows" call 2 (f2a4f51,
# two passes, us an AR forward): 16 973.9 / 974.0, 24 973.2 / 978.1, 32 965.5 / 973.2
# (forward_ab's auto-dotN).
DOT_LOADS = 16
MAX_EXPERTS = 512  # routed experts (DeepSeek-V3 256, Kimi K2 384): shared logits and CSR cursors
MAX_TOPK = 32  # picks: the routing kernel's shared pick list
MAX_GROUPS = 32  # groups: the routing kernel's shared group scores and kept flags
ROUTE_SPLIT = 16  # partial sums per gate logit (16 consecutive threads read 64 B of a gate row)
ROUTE_PART_FLOATS = MAX_EXPERTS * ROUTE_SPLIT  # 32 KiB of shared partials
MAX_ROUTE_THREADS = 512
CSR_THREADS = 128  # the single CSR block
# The expert grid's routing (moe_route given logits and counts; engine.model.ROUTE_BY_EXPERT): a
# block per (expert, row) reads one gate row, where the row block reads all E (small: 128 KiB in
# ~8 rounds of loads from one SM; kimi-k2: 10.5 MiB). Numerics: lane v of ROUTE_LANES sums the
# values j = v, v + ROUTE_LANES, ... (an fma chain); the lanes meet in _make_lane_sum's order.
ROUTE_LANES = 512
ROUTE_GRID_THREADS = 512   # its block on a GPU: a lane a thread (layout, not numerics)
# Values a lane (hidden <= 4096; small: 4), all held in registers and loaded at once with the
# norm weight's and the gate row's. kimi-k2's 7168 (14 a lane) took 128 registers and a 116-byte
# spill on sm_90 in 512-thread blocks (the compile check's build; in batches of 2-8 gate values too),
# so a larger hidden size keeps the row layout (engine.model.ROUTE_BY_EXPERT's fallback).
MAX_ROUTE_LOADS = 8
MAX_GRID_Y = 65535   # rows a launch's grid y covers; past it a block loops over rows
# One row (an AR step at batch 1): the routing block writes the CSR itself, one launch instead of
# two (the same integers; bench.forward_ab's ``auto-csr2`` switches it off). H100, run "expert
# rows" call 3 (5937ead, one process, two passes, the routing without its RMSNorm, as the engine
# runs it): an AR forward 970.8 / 969.0 us against 982.1 / 979.1 with the CSR launch. With the
# RMSNorm in the row layout's routing launch too (engine.model.FUSED_MOE_NORM, forward_ab's
# auto-normroute) it was +6 us (run "floor"). The expert grid (the engine's default) writes the CSR
# inline under the same switch.
ROUTE_CSR_INLINE = True
ROUTE_CSR_NORM_LOADS = 16  # the RMSNorm's loads a lane in a routing launch that writes its CSR too
CSR_WORDS = 8  # row-mask words per expert and chunk: 256 rows per chunk
CSR_CHUNK_ROWS = CSR_WORDS * WARP_SIZE
CSR_MASK_WORDS = CSR_WORDS * MAX_EXPERTS
LAYOUT_CODES = {"interleaved": 0, "neox": 1}
NEOX = 1
NAN_F32 = np.float32(np.nan)
NEG_INF_F32 = np.float32(-np.inf)
# What a kernel specialised without an optional array gets in its place (never read): numba-cuda
# launches no None argument on a GPU, so the flag is compile-time and the slot a scalar.
PLACEHOLDER = np.float32(0.0)
GATE_NORM_EPS_F32 = np.float32(1e-20)  # reference.model.GATE_NORM_EPS (HF noaux_tc)


# --- device functions ------------------------------------------------------------------------

@functools.cache
def _make_strided_dot(loads: int) -> Any:
    """A device function Σ x[row, j] · w[e, j] over j = first, first + stride, ... < n in
    ascending order, ``loads`` loads of each operand in flight ahead of the products (their
    number does not change the order: the partial depends on (first, stride, n) only). Column
    indices are unsigned: a signed index gives every load a negative-index wraparound (64-bit
    selects), and with it ptxas kept fewer loads ahead of the FMA chain (the routing kernel 2.3x
    slower at kimi-k2's batch 1 on the H200)."""

    @cuda.jit(device=True)
    def strided_dot(x, row, w, e, first, stride, n):
        staged_x = cuda.local.array(loads, float32)  # registers once the loops are unrolled
        staged_w = cuda.local.array(loads, float32)
        acc = float32(0.0)
        j = uint64(first)
        step = uint64(stride)
        end = uint64(n)
        span = uint64(loads - 1) * step
        while j + span < end:
            for u in range(loads):  # all loads first
                staged_x[u] = x[row, j + uint64(u) * step]
                staged_w[u] = w[e, j + uint64(u) * step]
            for u in range(loads):
                acc += staged_x[u] * staged_w[u]
            j += uint64(loads) * step
        if j < end:   # the last, partial batch: its loads in flight together too (guarded)
            for u in range(loads):
                if j + uint64(u) * step < end:
                    staged_x[u] = x[row, j + uint64(u) * step]
                    staged_w[u] = w[e, j + uint64(u) * step]
            for u in range(loads):
                if j + uint64(u) * step < end:
                    acc += staged_x[u] * staged_w[u]
        return acc

    return strided_dot


@functools.cache
def _make_row_norm(loads: int) -> tuple[Any, Any]:
    """(warp_row_rms, write_normed) with ``loads`` loads a lane in flight (their number does not
    change a result: the same sums in the same order, the same products per element)."""
    row_dot = _make_strided_dot(loads)
    LOADS = loads

    @cuda.jit(device=True)
    def warp_row_rms(x, row, n, eps, s_part):
        """sqrt(mean(x[row, :n]²) + eps) on every lane of the calling warp.

        Lane l sums elements l, l + 32, ... (coalesced: the row's dot with itself, the same
        products in the same order); the 32 partials meet in the warp's slice of s_part (float32
        [blockDim]) and every lane adds them in lane order: one warp barrier instead of a shuffle
        butterfly (5 meetings; the simulator pays per meeting), and a fixed order.
        """
        lane = cuda.threadIdx.x % WARP_SIZE
        base = cuda.threadIdx.x - lane
        s_part[cuda.threadIdx.x] = row_dot(x, row, x, row, lane, WARP_SIZE, n)
        cuda.syncwarp()  # the warp's 32 partials are in shared memory before any lane adds them
        total = float32(0.0)
        for other in range(WARP_SIZE):
            total += s_part[base + other]
        return math.sqrt(total / float32(n) + eps)

    @cuda.jit(device=True)
    def write_normed(x, row, col0, n, rms, weight, out, out_row):
        """out[out_row, j] = x[row, col0 + j] / rms · weight[j] for the lane's j < n (lane-strided).
        Each lane reads its elements before writing them, so out may be x itself."""
        staged = cuda.local.array(LOADS, float32)
        staged_w = cuda.local.array(LOADS, float32)
        j = uint64(cuda.threadIdx.x % WARP_SIZE)   # unsigned indices, as the strided dot
        base = uint64(col0)
        end = uint64(n)
        lanes = uint64(WARP_SIZE)
        while j < end:   # batches of LOADS a lane, the last one guarded
            for u in range(LOADS):  # all loads first
                if j + uint64(u) * lanes < end:
                    staged[u] = x[row, base + j + uint64(u) * lanes]
                    staged_w[u] = weight[j + uint64(u) * lanes]
            for u in range(LOADS):
                if j + uint64(u) * lanes < end:
                    out[out_row, j + uint64(u) * lanes] = staged[u] / rms * staged_w[u]
            j += uint64(LOADS) * lanes

    return warp_row_rms, write_normed


_warp_row_rms, _write_normed = _make_row_norm(ROW_LOADS)


@cuda.jit(device=True)
def _pair_cols(i, half, layout):
    """Columns of RoPE pair i: (2i, 2i + 1) interleaved (DeepSeek), (i, i + half) NeoX."""
    if layout == NEOX:
        return i, i + half
    return 2 * i, 2 * i + 1


@cuda.jit(device=True)
def _rotate(a, b, cos, sin, pos, i):
    """(a cos - b sin, a sin + b cos) at table row pos; NaN for a position outside the table."""
    if pos < 0 or pos >= cos.shape[0]:
        return NAN_F32, NAN_F32
    c = cos[pos, i]
    s = sin[pos, i]
    return a * c - b * s, a * s + b * c


@cuda.jit(device=True)
def _score(logit, softmax_scores, row_max, denom):
    """Unbiased gate score: sigmoid through e^-|z| (reference.model.sigmoid), or softmax given
    the row's max and sum of exponentials."""
    if softmax_scores != 0:
        return math.exp(logit - row_max) / denom
    e = math.exp(-abs(logit))
    num = float32(1.0) if logit >= 0 else e
    return num / (float32(1.0) + e)


@cuda.jit(device=True)
def _group_score(s_choice, g, per_group, top2_sum):
    """Score of group g: its top-2 selection values summed (top2_sum: HF noaux_tc, with a bias)
    or its max, from one ascending pass over the group's experts in s_choice (float32 [E])."""
    top1 = NEG_INF_F32
    top2 = NEG_INF_F32
    for e in range(g * per_group, (g + 1) * per_group):
        v = s_choice[e]
        if v > top1:
            top2 = top1
            top1 = v
        elif v > top2:
            top2 = v
    if top2_sum:
        return top2 + top1
    return top1


@cuda.jit(device=True)
def _outranks(other_value, other, value, index):
    """Candidate ``other`` is picked before candidate ``index``: a larger value, or an equal one
    (-0.0 == +0.0) at a lower index (stable argsort of the negated values,
    reference.model._top_indices). A strict total order for NaN-free values, so the candidates'
    ranks (how many outrank each) are distinct: 0, 1, ..."""
    return other_value > value or (other_value == value and other < index)


# --- kernels ---------------------------------------------------------------------------------

@cuda.jit
def embed_kernel(tokens, table, out, release_next):
    """out[m, d] = table[tokens[m], d]; a NaN row for an id outside [0, V).

    tokens int32 [M], table [V, D], out [M, D]. One thread per element, grid-stride. release_next:
    1 where the next kernel reads weights before its PDL wait (an AR step's w_a gemv).
    """
    pdl_begin_early(release_next)  # PDL: wait for the previous kernel; release the next one now?
    dim = out.shape[1]
    for idx in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, out.shape[0] * dim,
                     cuda.gridDim.x * cuda.blockDim.x):
        m = idx // dim
        d = idx - m * dim
        t = tokens[m]
        if t >= 0 and t < table.shape[0]:
            out[m, d] = table[t, d]
        else:
            out[m, d] = NAN_F32


@cuda.jit
def rms_norm_kernel(x, weight, eps, out):
    """out[m] = x[m] / sqrt(mean(x[m]²) + eps) · weight; x, out [M, D], weight [D].

    One warp per row, grid-stride over rows (blockDim <= ROW_THREADS).
    """
    s_part = cuda.shared.array(ROW_THREADS, float32)  # one partial sum of squares per lane
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    warps = cuda.blockDim.x // WARP_SIZE
    for row in range(cuda.blockIdx.x * warps + cuda.threadIdx.x // WARP_SIZE, x.shape[0],
                     cuda.gridDim.x * warps):  # per warp: the whole warp iterates together
        rms = _warp_row_rms(x, row, x.shape[1], eps, s_part)
        _write_normed(x, row, 0, x.shape[1], rms, weight, out, row)
        cuda.syncwarp()  # every lane has read the partials before the next row overwrites them


@cuda.jit(device=True)
def _kv_write_rows(kv_a, norm_weight, eps, cos, sin, positions, cache_rows, kv_latent, k_rope,
                   layout, s_part, block, blocks):
    """:func:`mla_kv_write_kernel`'s rows on block ``block`` of ``blocks``: one warp per row,
    grid-stride over the rows."""
    warps = cuda.blockDim.x // WARP_SIZE
    c = kv_latent.shape[1]
    half = k_rope.shape[1] // 2
    for row in range(block * warps + cuda.threadIdx.x // WARP_SIZE, kv_a.shape[0], blocks * warps):  # per warp
        dst = cache_rows[row]
        if dst < 0 or dst >= kv_latent.shape[0]:  # padding, or no such cache row (per warp)
            continue
        rms = _warp_row_rms(kv_a, row, c, eps, s_part)
        _write_normed(kv_a, row, 0, c, rms, norm_weight, kv_latent, dst)
        pos = positions[row]
        for i in range(cuda.threadIdx.x % WARP_SIZE, half, WARP_SIZE):
            c0, c1 = _pair_cols(i, half, layout)
            y0, y1 = _rotate(kv_a[row, c + c0], kv_a[row, c + c1], cos, sin, pos, i)
            k_rope[dst, c0] = y0
            k_rope[dst, c1] = y1
        cuda.syncwarp()  # every lane has read the partials before the next row overwrites them


@cuda.jit(device=True)
def _q_rope_pairs(q, cos, sin, positions, out, layout, block, blocks):
    """:func:`mla_q_rope_kernel`'s pairs on block ``block`` of ``blocks``: one thread per
    (row, head, pair), grid-stride."""
    heads = out.shape[1]
    half = out.shape[2] // 2
    nope = q.shape[2] - out.shape[2]
    for idx in range(block * cuda.blockDim.x + cuda.threadIdx.x, out.shape[0] * heads * half,
                     blocks * cuda.blockDim.x):
        m = idx // (heads * half)
        rest = idx - m * heads * half
        h = rest // half
        i = rest - h * half
        c0, c1 = _pair_cols(i, half, layout)
        y0, y1 = _rotate(q[m, h, nope + c0], q[m, h, nope + c1], cos, sin, positions[m], i)
        out[m, h, c0] = y0
        out[m, h, c1] = y1


@cuda.jit
def mla_kv_write_kernel(kv_a, norm_weight, eps, cos, sin, positions, cache_rows, kv_latent,
                        k_rope, layout):
    """Normed latent and RoPE'd key of row m into cache row cache_rows[m] (< 0: padding).

    kv_a [M, C + R] (C = kv_lora, R = rope), norm_weight [C], cos / sin [capacity, R / 2],
    positions / cache_rows int32 [M], kv_latent [rows, C], k_rope [rows, R]. One warp per row,
    grid-stride over rows.
    """
    s_part = cuda.shared.array(ROW_THREADS, float32)  # one partial sum of squares per lane
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    _kv_write_rows(kv_a, norm_weight, eps, cos, sin, positions, cache_rows, kv_latent, k_rope,
                   layout, s_part, cuda.blockIdx.x, cuda.gridDim.x)


@cuda.jit
def mla_q_rope_kernel(q, cos, sin, positions, out, layout):
    """out[m, h] = RoPE(q[m, h, nope:]) at positions[m]; q [M, H, nope + R], out [M, H, R].

    One thread per (row, head, pair), grid-stride; each reads its pair before writing it, so
    out may be q[:, :, nope:] itself.
    """
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    _q_rope_pairs(q, cos, sin, positions, out, layout, cuda.blockIdx.x, cuda.gridDim.x)


@cuda.jit
def mla_rope_kv_write_kernel(q, q_out, q_blocks, kv_a, norm_weight, eps, cos, sin, positions,
                             cache_rows, kv_latent, k_rope, layout, release_next):
    """:func:`mla_q_rope_kernel` on blocks ``[0, q_blocks)`` and :func:`mla_kv_write_kernel` on
    the others, in one launch: an MLA layer's two RoPE steps run side by side (the same loops
    per element and per row, so the same bits). Arguments as those two kernels'; release_next: 1
    where the next kernel reads weights before its PDL wait (an AR step's split q absorb)."""
    s_part = cuda.shared.array(ROW_THREADS, float32)  # the kv rows: one partial sum per lane
    pdl_begin_early(release_next)  # PDL: wait for the previous kernel; release the next one now?
    if cuda.blockIdx.x < q_blocks:  # block-uniform
        _q_rope_pairs(q, cos, sin, positions, q_out, layout, cuda.blockIdx.x, q_blocks)
    else:
        _kv_write_rows(kv_a, norm_weight, eps, cos, sin, positions, cache_rows, kv_latent, k_rope,
                       layout, s_part, cuda.blockIdx.x - q_blocks, cuda.gridDim.x - q_blocks)


def moe_route_kernel(norm: bool, biased: bool, dot_loads: int | None = None, csr: bool = False) -> Any:
    """The routing kernel specialised on whether it normalises its rows first (``norm``) and adds
    a selection bias (``biased``). Compile-time flags, not None arguments: numba-cuda launches no
    None argument on a GPU (the simulator does), so an absent array is a float32 placeholder.
    ``dot_loads``: the gate partials' loads in flight (default DOT_LOADS, read at the call: layout,
    not numerics). ``csr``: the block writes the CSR of its one row (step 4 below; with ``norm``
    its RMSNorm keeps ROUTE_CSR_NORM_LOADS loads a lane in flight, not ROW_LOADS: at the kernel's
    128-register bound the norm and the CSR together spilled 8 bytes on sm_90 with 32)."""
    return _moe_route_kernel(norm, biased, DOT_LOADS if dot_loads is None else int(dot_loads), bool(csr))


@functools.lru_cache(maxsize=None)
def _make_select_row(biased: bool, csr: bool) -> Any:
    """The routing's selection of one row (steps 2-4 of :func:`moe_route_kernel`'s doc), a device
    function of the whole block: ``row``'s logits are in ``s_logit`` (thread t's experts t, t +
    blockDim, ... written by thread t, or all of them behind a barrier); its scores, selection
    values, group flags and picks in shared arrays of its own. ``biased`` and ``csr`` are
    compile-time, as the kernels' flags. Both routing kernels run it, so given the same logits they
    pick, weigh and write the CSR in the same bits."""

    @cuda.jit(device=True)
    def select_row(row, n_experts, s_logit, bias, n_groups, n_limited, softmax_scores, normalize, route_scale,
                   topk_ids, topk_w, row_offsets, row_index, slot_of):
        s_score = cuda.shared.array(MAX_EXPERTS, float32)  # unbiased scores (the weights)
        s_choice = cuda.shared.array(MAX_EXPERTS, float32)  # selection values: score (+ bias)
        s_group = cuda.shared.array(MAX_GROUPS, float32)  # [G] group scores
        s_kept = cuda.shared.array(MAX_GROUPS, int32)  # [G] 1: the group's experts may be picked
        s_pick = cuda.shared.array(MAX_TOPK, int32)  # [k] picked expert ids in rank order
        tid = cuda.threadIdx.x
        per_group = n_experts // n_groups
        k = topk_ids.shape[1]
        top2_sum = biased and per_group > 1  # else a group scores its max
        row_max = NEG_INF_F32
        denom = float32(1.0)
        if softmax_scores != 0:  # uniform over the block
            cuda.syncthreads()  # every logit is in shared memory before the row's max and sum
            for e in range(n_experts):  # every thread, the same order: the same bits
                if s_logit[e] > row_max:
                    row_max = s_logit[e]
            denom = float32(0.0)
            for e in range(n_experts):
                denom += math.exp(s_logit[e] - row_max)
        for e in range(tid, n_experts, cuda.blockDim.x):
            score = _score(s_logit[e], softmax_scores, row_max, denom)
            s_score[e] = score
            choice = score
            if biased:  # compile-time
                choice = score + bias[e]
            s_choice[e] = choice if choice == choice else NEG_INF_F32  # NaN ranks last: picks stay valid
        cuda.syncthreads()  # every selection value is in shared memory before the groups score
        if n_groups > 1:  # uniform over the block
            for g in range(tid, n_groups, cuda.blockDim.x):
                group_score = _group_score(s_choice, g, per_group, top2_sum)
                # NaN only from +inf + -inf (a non-finite device bias): ranks last, as NaN choices
                s_group[g] = group_score if group_score == group_score else NEG_INF_F32
            cuda.syncthreads()  # every group score is in shared memory before the groups rank
            for g in range(tid, n_groups, cuda.blockDim.x):
                rank = 0  # groups picked before g
                for other in range(n_groups):
                    if _outranks(s_group[other], other, s_group[g], g):
                        rank += 1
                s_kept[g] = 1 if rank < n_limited else 0
            cuda.syncthreads()  # every kept flag is set before the experts rank
        for e in range(tid, n_experts, cuda.blockDim.x):
            if n_groups == 1 or s_kept[e // per_group] != 0:
                value = s_choice[e]
                rank = 0  # kept experts picked before e (k <= the kept experts: config check)
                for g in range(n_groups):
                    if n_groups == 1 or s_kept[g] != 0:
                        for other in range(g * per_group, (g + 1) * per_group):
                            if _outranks(s_choice[other], other, value, e):
                                rank += 1
                if rank < k:
                    s_pick[rank] = e
        cuda.syncthreads()  # all k picks are in shared memory before the weights are summed
        for p in range(tid, k, cuda.blockDim.x):
            e = s_pick[p]
            total = float32(0.0)  # in pick order, as the reference's weights.sum(axis=1)
            place = 0  # place of pick p in ascending expert id
            for other in range(k):
                total += s_score[s_pick[other]]
                if s_pick[other] < e:
                    place += 1
            weight = s_score[e]
            if normalize != 0 and k > 1:
                weight = weight / (total + GATE_NORM_EPS_F32)
            topk_ids[row, place] = e
            topk_w[row, place] = weight * route_scale
            if csr:  # compile-time; one row (row 0): pick p is entry `place`
                row_index[place] = 0
                slot_of[0, place] = place
        if csr:  # expert e's entries start at the number of picks below e
            for e in range(tid, n_experts + 1, cuda.blockDim.x):
                below = 0
                for p in range(k):
                    if s_pick[p] < e:
                        below += 1
                row_offsets[e] = below

    return select_row


@functools.lru_cache(maxsize=None)
def _moe_route_kernel(norm: bool, biased: bool, dot_loads: int, csr: bool) -> Any:
    strided_dot = _make_strided_dot(dot_loads)   # the gate partials
    select_row = _make_select_row(biased, csr)
    warp_row_rms, write_normed = _make_row_norm(ROUTE_CSR_NORM_LOADS if csr and norm else ROW_LOADS)
    # The block size as a launch bound (one block per SM at least): without it ptxas interleaved the
    # gate loads with the FMA chain (3-4 loads in flight instead of 16; 1.4-2x slower at batch 1 on
    # the H200).
    @cuda.jit(**launch_bounds(MAX_ROUTE_THREADS, 1))
    def moe_route_kernel(x, norm_w, eps, xn, gate_w, bias, n_groups, n_limited, softmax_scores, normalize,
                         route_scale, topk_ids, topk_w, row_offsets, row_index, slot_of):
        """reference.model.moe_gate, rows blockIdx.x, + gridDim.x, ...; picks in ascending expert id.

        xn [M, D], gate_w [E, D], bias float32 [E] (biased; else a placeholder), topk_ids int32
        [M, k], topk_w [M, k].
        0. With ``norm`` (x [M, D], norm_w float32 [D]; else placeholders: xn is given), the block's
           first warp writes
           ``xn[row] = rms_norm(x[row], norm_w, eps)`` first, as :func:`rms_norm_kernel`'s warp does
           (the same bits), and the block reads it back after a barrier: the FFN's RMSNorm and the
           routing in one launch.
        1. Logit e = the sum, in order, of ROUTE_SPLIT partials, partial c over d = c, c + SPLIT, ...
           (one (expert, partial) pair per thread, consecutive threads on consecutive columns):
           a fixed order whatever the block size. 2. Scores and selection values per expert.
        3. Selection by ranks, in parallel: thread g scores group g (top-2 sum with a bias, else
           max; one ascending pass) and keeps it if fewer than n_limited groups outrank it; each
           expert of a kept group is picked if fewer than k kept experts outrank it, into slot
           rank of the pick list (:func:`_outranks`: value descending, ties to the lower index; the
           same picks as an insertion list fed in ascending index). Pick thread p sums the k
           unbiased scores in pick (rank) order, renormalises its own, times route_scale, and
           writes it at its place in ascending expert id.
        4. ``csr`` (compile time; launched for one row, one block: an AR step at batch 1):
           the block writes the CSR too, :func:`moe_csr_kernel`'s result for one row (the k picks
           are distinct experts in ascending id: pick s is entry s, and expert e's entries start
           at the number of picks below e), so the CSR launch is left out.
        """
        s_part = cuda.shared.array(ROUTE_PART_FLOATS, float32)  # [E, ROUTE_SPLIT] partial logits
        s_logit = cuda.shared.array(MAX_EXPERTS, float32)
        pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
        tid = cuda.threadIdx.x
        n_experts = gate_w.shape[0]
        for row in range(cuda.blockIdx.x, xn.shape[0], cuda.gridDim.x):  # uniform over the block
            if norm:  # compile-time
                if tid < WARP_SIZE:   # s_part[0:32] holds the warp's partial sums of squares here
                    rms = warp_row_rms(x, row, x.shape[1], eps, s_part)
                    write_normed(x, row, 0, x.shape[1], rms, norm_w, xn, row)
                cuda.syncthreads()  # the row's normed values (global, this block's) before the gate reads them
            for q in range(tid, n_experts * ROUTE_SPLIT, cuda.blockDim.x):
                e = q // ROUTE_SPLIT
                s_part[q] = strided_dot(xn, row, gate_w, e, q - e * ROUTE_SPLIT, ROUTE_SPLIT, xn.shape[1])
            cuda.syncthreads()  # every partial logit is in shared memory before they are summed
            for e in range(tid, n_experts, cuda.blockDim.x):
                logit = float32(0.0)
                for c in range(ROUTE_SPLIT):
                    logit += s_part[e * ROUTE_SPLIT + c]
                s_logit[e] = logit
            select_row(row, n_experts, s_logit, bias, n_groups, n_limited, softmax_scores, normalize, route_scale,
                       topk_ids, topk_w, row_offsets, row_index, slot_of)
            cuda.syncthreads()  # the picks and scores are read before the next row rewrites them

    return moe_route_kernel


def route_grid_blocks(n_experts: int, rows: int, sm_count: int) -> int:
    """Blocks a row of the expert grid (grid x; each loops over experts x, x + grid x, ...): one
    an expert where E blocks a row fit the SMs (small's AR step: 16), else about one wave of
    blocks in all (a 33-row verify on 132 SMs: 4 a row, 4 experts each; kimi-k2's AR step: 132, about
    3 experts each), so that each block's RMSNorm serves several gate rows. Layout, not numerics."""
    return max(1, min(n_experts, -(-sm_count // rows)))


def route_grid_loads(hidden: int) -> int:
    """Values a lane of :func:`moe_route_grid_kernel` holds for rows of ``hidden`` values."""
    return -(-hidden // ROUTE_LANES)


@functools.lru_cache(maxsize=None)
def moe_route_grid_kernel(norm: bool, biased: bool, csr: bool, threads: int, loads: int, butterfly: bool = True) -> Any:
    """The routing kernel of the expert grid (:func:`moe_route` given ``logits`` and ``counts``):
    a block per (experts, row), the row's last block to finish selects. Compile-time: ``norm`` (the
    block normalises x[row] itself), ``biased``, ``csr`` (one row: the selecting block writes the
    CSR too), ``threads`` a block (ROUTE_GRID_THREADS on a GPU, SIM_THREADS under the simulator:
    layout, not numerics), ``loads`` = :func:`route_grid_loads` (hidden) values a lane and
    ``butterfly`` (:func:`_make_lane_sum`: the warps' shuffles on a GPU, a shared-memory tree of the
    same order under the simulator)."""
    if threads % WARP_SIZE or ROUTE_LANES % threads:
        raise ValueError(f"threads must be a multiple of {WARP_SIZE} dividing {ROUTE_LANES}, got {threads}")
    select_row = _make_select_row(biased, csr)
    slots = ROUTE_LANES // threads   # lanes a thread: lane tid + s * threads in slot s
    warps = threads // WARP_SIZE
    held = slots * loads   # values a thread holds: slot s, value i at s * loads + i
    lane_sum = _make_lane_sum(slots, warps, butterfly)
    # closure constant (a shared size): two buffers of group sums on a GPU; under the simulator two
    # buffers and a row of lanes an expert
    sum_shape = (2, ROUTE_LANES // WARP_SIZE) if butterfly else (2 + MAX_EXPERTS, ROUTE_LANES)

    @cuda.jit(device=True, inline="always")
    def load_gate_row(gate_w, e, staged, end):
        """staged = this thread's values of gate_w[e] (lane layout as the row's; zeros past D)."""
        for u in range(held):
            j = uint64(cuda.threadIdx.x + (u // loads) * threads + (u % loads) * ROUTE_LANES)
            staged[u] = gate_w[e, j] if j < end else float32(0.0)

    @cuda.jit(**launch_bounds(threads, 1))
    def moe_route_grid_kernel(x, norm_w, eps, xn, gate_w, bias, n_groups, n_limited, softmax_scores, normalize,
                              route_scale, logits, counts, topk_ids, topk_w, row_offsets, row_index, slot_of):
        """reference.model.moe_gate of rows blockIdx.y, + gridDim.y, ..., experts blockIdx.x, +
        gridDim.x, ...; picks in ascending expert id.

        xn [M, D] (an output with ``norm``: x [M, D] and norm_w float32 [D] given; else the
        input, x and norm_w placeholders), gate_w [E, D], bias float32 [E] (biased; else a
        placeholder), logits float32 [M, E] scratch, counts int32 [M] (zero before the launch,
        zero after it), topk_ids int32 [M, k], topk_w [M, k]. Lane v of ROUTE_LANES holds the
        row's values j = v, v + ROUTE_LANES, ... (``loads`` of them, zeros past D).
        0. ``norm``: every block of the row finds the same rms (:func:`_make_lane_sum`'s order
           over the lanes' fma chains of x²) and scales its values by it, ``(x · (1 / rms)) ·
           norm_w``; the block of expert 0 writes them to xn[row].
        1. Logit e = the lane sum of the lanes' fma chains of xn · gate_w[e] (ascending j in a
           lane), stored to logits[row, e]; the block then counts itself done in counts[row]
           (after a fence: its logits are visible before its count).
        2. The block that counts last (the gridDim.x-th) reads the row's logits back through L2
           (atomics: no stale L1 line), selects as :func:`moe_route_kernel` does (the same
           device function) and sets counts[row] back to 0 for the next launch.
        """
        s_sum = cuda.shared.array(sum_shape, float32)  # the lane sums' (sum_shape)
        s_last = cuda.shared.array(1, int32)  # 1: this block selects the row
        s_logit = cuda.shared.array(MAX_EXPERTS, float32)
        pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
        values = cuda.local.array(held, float32)  # the row's values (normed), registers once unrolled
        scale = cuda.local.array(held, float32)  # norm_w's
        staged = cuda.local.array(held, float32)  # a gate row's values
        chains = cuda.local.array(slots, float32)  # a lane's fma chain
        tid = cuda.threadIdx.x
        n_experts = gate_w.shape[0]
        end = uint64(xn.shape[1])
        for row in range(cuda.blockIdx.y, xn.shape[0], cuda.gridDim.y):  # uniform over the block
            # every load of the row at once: x (or xn), norm_w and the block's first gate row (none
            # depends on another: one round trip, not three in a row)
            for s in range(slots):
                for i in range(loads):
                    j = uint64(tid + s * threads + i * ROUTE_LANES)
                    if norm:  # compile-time
                        values[s * loads + i] = x[row, j] if j < end else float32(0.0)
                        scale[s * loads + i] = norm_w[j] if j < end else float32(0.0)
                    else:
                        values[s * loads + i] = xn[row, j] if j < end else float32(0.0)
            first = cuda.blockIdx.x
            if first < n_experts:
                load_gate_row(gate_w, first, staged, end)
            if norm:  # compile-time
                for s in range(slots):
                    acc = float32(0.0)
                    for i in range(loads):
                        acc = cuda.fma(values[s * loads + i], values[s * loads + i], acc)
                    chains[s] = acc
                total = lane_sum(chains, s_sum, 0, xn.shape[1])
                inv = float32(1.0) / math.sqrt(total / float32(xn.shape[1]) + eps)
                for u in range(held):
                    values[u] = values[u] * inv * scale[u]
                if cuda.blockIdx.x == 0:
                    for s in range(slots):
                        for i in range(loads):
                            j = uint64(tid + s * threads + i * ROUTE_LANES)
                            if j < end:
                                xn[row, j] = values[s * loads + i]
            buf = 1   # the norm's lane sum took buffer 0
            for e in range(first, n_experts, cuda.gridDim.x):  # uniform over the block
                if e != first:   # (the first expert's gate row is loaded above)
                    load_gate_row(gate_w, e, staged, end)
                for s in range(slots):
                    acc = float32(0.0)
                    for i in range(loads):
                        acc = cuda.fma(values[s * loads + i], staged[s * loads + i], acc)
                    chains[s] = acc
                if butterfly:  # compile-time: a lane sum (one barrier) an expert
                    logit = lane_sum(chains, s_sum, buf, xn.shape[1])
                    buf = 1 - buf
                    if tid == 0:
                        logits[row, e] = logit
                else:   # the simulator: the expert's lanes to s_sum[2 + e], summed after the loop
                    for s in range(slots):
                        s_sum[2 + e, tid + s * threads] = chains[s]
            if not butterfly:  # compile-time: one barrier for all the block's experts, not one each
                cuda.syncthreads()  # every expert's lanes are in shared memory before thread 0 adds them
                if tid == 0:
                    for e in range(first, n_experts, cuda.gridDim.x):
                        logits[row, e] = _tree_total(s_sum, 2 + e, xn.shape[1])
            if tid == 0:
                cuda.threadfence()  # this block's logits reach every SM before its count does
                done = cuda.atomic.add(counts, row, 1)
                s_last[0] = 1 if done == cuda.gridDim.x - 1 else 0
            cuda.syncthreads()  # s_last is set
            if s_last[0] != 0:  # uniform over the block
                for e in range(tid, n_experts, threads):   # L2 reads (atomics): the other blocks' stores
                    s_logit[e] = cuda.atomic.add(logits, (row, e), float32(0.0))
                select_row(row, n_experts, s_logit, bias, n_groups, n_limited, softmax_scores, normalize,
                           route_scale, topk_ids, topk_w, row_offsets, row_index, slot_of)
                if tid == 0:
                    counts[row] = 0   # every block of the row has counted: ready for the next launch
            cuda.syncthreads()  # s_sum, s_last and the picks are read before the next row rewrites them

    return moe_route_grid_kernel


@functools.lru_cache(maxsize=None)
def _make_lane_sum(slots: int, warps: int, butterfly: bool) -> Any:
    """A device function ``lane_sum(chains, s_sum, buf, n)``: the sum of the block's ROUTE_LANES lane
    values (thread t's slot s is lane t + s · 32 · warps; lanes >= n hold +0.0) on every thread,
    in one order whatever the block size: each 32-lane group by :func:`.warp.warp_sum_f32`'s
    butterfly (offsets 16, 8, 4, 2, 1), then the group sums in ascending order from +0.0.

    ``butterfly`` (a GPU): the warps' shuffles, a group sum a warp and slot in s_sum[buf, :groups].
    Else (the simulator, where each shuffle is a meeting of every thread): the lanes go to
    s_sum[buf, :] and every thread adds each group's pairs at strides 16, 8, 4, 2, 1 (lane 0's
    butterfly; every lane's is the same, addition commuting) over the groups below n only
    (:func:`_tree_total`): a group of zeros sums to +0.0, and x + 0.0 is x for every x a chain from
    +0.0 can hold (never -0.0). The same bits, one barrier either way; ``buf`` (0 or 1) alternates
    between calls so that a call's writes never meet the previous call's reads without a barrier.
    (The simulator's gate dots skip this function: every expert's lanes meet behind one barrier.)"""

    @cuda.jit(device=True)
    def lane_sum(chains, s_sum, buf, n):
        lane = cuda.threadIdx.x % WARP_SIZE
        warp = cuda.threadIdx.x // WARP_SIZE
        total = float32(0.0)
        if butterfly:  # compile-time
            for s in range(slots):
                group_sum = warp_sum_f32(chains[s])
                if lane == 0:
                    s_sum[buf, warp + s * warps] = group_sum
            cuda.syncthreads()  # every group's sum is in shared memory before any thread adds them
            for g in range(ROUTE_LANES // WARP_SIZE):
                total += s_sum[buf, g]
        else:
            for s in range(slots):
                s_sum[buf, cuda.threadIdx.x + s * WARP_SIZE * warps] = chains[s]
            cuda.syncthreads()  # every lane's value is in shared memory before any thread adds them
            total = _tree_total(s_sum, buf, n)
        return total

    return lane_sum


@cuda.jit(device=True)
def _tree_total(s_sum, r, n):
    """The sum of the ROUTE_LANES lane values in s_sum[r, :] in :func:`_make_lane_sum`'s order, by
    one thread (the simulator's form): each 32-lane group's pairs at strides 16, 8, 4, 2, 1, then
    the groups below n in ascending order from +0.0 (the rest hold zeros: exact to skip)."""
    total = float32(0.0)
    pairs = cuda.local.array(16, float32)   # half a group
    for g in range(min(-(-n // WARP_SIZE), ROUTE_LANES // WARP_SIZE)):
        for i in range(16):
            pairs[i] = s_sum[r, g * WARP_SIZE + i] + s_sum[r, g * WARP_SIZE + i + 16]
        half = 8
        while half > 0:
            for i in range(half):
                pairs[i] = pairs[i] + pairs[i + half]
            half //= 2
        total += pairs[0]
    return total


@cuda.jit
def moe_csr_kernel(topk_ids, row_offsets, row_index, slot_of):
    """Routing CSR of all rows, one block: entries of expert e are its rows in ascending order.

    topk_ids int32 [M, k] (each row's k distinct experts) -> row_offsets int32 [E + 1],
    row_index int32 [M·k] (the row of each entry), slot_of int32 [M, k] (entry of each pick).
    Counts (shared atomics: integer, so order-free), an exclusive scan by warp 0, then rows in
    chunks of CSR_CHUNK_ROWS: bit r of mask word (r // 32, e) marks chunk row r choosing e, so an
    entry's place is the expert's cursor + the popcount of the chunk's earlier rows.
    """
    s_cursor = cuda.shared.array(MAX_EXPERTS, int32)  # counts, then each expert's next entry
    s_mask = cuda.shared.array(CSR_MASK_WORDS, uint32)  # [CSR_WORDS, E] row bits of a chunk
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    n_rows = topk_ids.shape[0]
    k = topk_ids.shape[1]
    n_experts = row_offsets.shape[0] - 1
    for e in range(tid, n_experts, threads):
        s_cursor[e] = 0
    cuda.syncthreads()  # counts zeroed before any thread adds
    for j in range(tid, n_rows * k, threads):
        e = topk_ids[j // k, j % k]
        if e >= 0 and e < n_experts:
            cuda.atomic.add(s_cursor, e, 1)
    cuda.syncthreads()  # every count is final before the scan reads it
    if tid < WARP_SIZE:
        carry = int32(0)
        for base in range(0, n_experts, WARP_SIZE):
            e = base + tid
            count = s_cursor[e] if e < n_experts else int32(0)
            inclusive = int32(warp_inclusive_scan_i32(count) + carry)
            if e < n_experts:
                row_offsets[e] = inclusive - count
                s_cursor[e] = inclusive - count
            carry = cuda.shfl_sync(FULL_MASK, inclusive, WARP_SIZE - 1)
        if tid == 0:
            row_offsets[n_experts] = carry
    cuda.syncthreads()  # cursors hold the offsets before entries are placed
    for first in range(0, n_rows, CSR_CHUNK_ROWS):
        chunk = min(CSR_CHUNK_ROWS, n_rows - first)
        for w in range(tid, CSR_WORDS * n_experts, threads):
            s_mask[w] = 0
        cuda.syncthreads()  # masks cleared before the chunk's bits go in
        for j in range(tid, chunk * k, threads):
            r = j // k
            e = topk_ids[first + r, j % k]
            if e >= 0 and e < n_experts:  # a row's experts are distinct: add == or
                cuda.atomic.add(s_mask, (r // WARP_SIZE) * n_experts + e, uint32(1) << uint32(r % WARP_SIZE))
        cuda.syncthreads()  # the chunk's masks are complete before entries are placed
        for j in range(tid, chunk * k, threads):
            r = j // k
            e = topk_ids[first + r, j % k]
            if e >= 0 and e < n_experts:
                place = s_cursor[e]
                for w in range(r // WARP_SIZE):
                    place += cuda.popc(s_mask[w * n_experts + e])
                below = uint32((int64(1) << int64(r % WARP_SIZE)) - 1)
                place += cuda.popc(s_mask[(r // WARP_SIZE) * n_experts + e] & below)
                row_index[place] = first + r
                slot_of[first + r, j % k] = place
            else:
                slot_of[first + r, j % k] = -1
        cuda.syncthreads()  # every entry is placed before the cursors move
        for e in range(tid, n_experts, threads):
            for w in range(CSR_WORDS):
                s_cursor[e] += cuda.popc(s_mask[w * n_experts + e])
        cuda.syncthreads()  # cursors advanced before the next chunk clears the masks


@functools.lru_cache(maxsize=None)
def moe_combine_kernel(shared: bool) -> Any:
    """The combine kernel with (``shared``) or without a shared expert's rows: a compile-time flag,
    the absent array a float32 placeholder (no None argument reaches a GPU launch)."""
    @cuda.jit
    def moe_combine_kernel(x, expert_out, slot_of, topk_w, shared_out, out, release_next):
        """out[m, d] = x[m, d] + (Σ_s topk_w[m, s] · expert_out[slot_of[m, s], d] + shared_out[m, d]).

        s ascending (= ascending expert id), shared_out [M, D] (shared; else a placeholder); a slot
        outside [0, M·k) gives NaN. One thread per element, grid-stride; out may be x. release_next:
        1 where the next kernel reads weights before its PDL wait (an AR step's w_a gemv).
        """
        pdl_begin_early(release_next)  # PDL: wait for the previous kernel; release the next one now?
        dim = out.shape[1]
        for idx in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, out.shape[0] * dim,
                         cuda.gridDim.x * cuda.blockDim.x):
            m = idx // dim
            d = idx - m * dim
            acc = float32(0.0)
            for s in range(slot_of.shape[1]):
                j = slot_of[m, s]
                if j >= 0 and j < expert_out.shape[0]:
                    acc += topk_w[m, s] * expert_out[j, d]
                else:
                    acc = NAN_F32
            if shared:  # compile-time
                acc = acc + shared_out[m, d]
            out[m, d] = x[m, d] + acc

    return moe_combine_kernel


# --- registry --------------------------------------------------------------------------------

_F1 = float32[::1]
_F2C = float32[:, ::1]
_F2A = float32[:, :]  # views: any row stride (the wrappers require a unit inner stride)
_F3A = float32[:, :, :]
_I1 = int32[::1]
_I2 = int32[:, ::1]

register("embed_rows", embed_kernel, ((_I1, _F2C, _F2A, int32),),
         "embedding gather, one thread per element, NaN rows for bad ids", block_threads=ELEM_THREADS)
register("rms_norm_rows", rms_norm_kernel, ((_F2A, _F1, float32, _F2A),),
         "RMSNorm of rows, one warp per row (fixed-order reduction)", block_threads=ROW_THREADS)
register("mla_kv_write", mla_kv_write_kernel,
         ((_F2A, _F1, float32, _F2C, _F2C, _I1, _I1, _F2A, _F2A, int32),),
         "MLA kv norm + key RoPE scattered into cache rows, one warp per row", block_threads=ROW_THREADS)
register("mla_q_rope", mla_q_rope_kernel, ((_F3A, _F2C, _F2C, _I1, _F3A, int32),),
         "RoPE of the query rope part of every head, one thread per pair", block_threads=ELEM_THREADS)
register("mla_rope_kv_write", mla_rope_kv_write_kernel,
         ((_F3A, _F3A, int32, _F2A, _F1, float32, _F2C, _F2C, _I1, _I1, _F2A, _F2A, int32, int32),),
         "the query RoPE and the kv cache write in one launch (the engine's)", block_threads=ELEM_THREADS)
for _norm, _csr in ((False, False), (True, False), (False, True), (True, True)):
    for _biased in (True, False):
        register("moe_route" + ("_norm" if _norm else "") + ("" if _biased else "_nobias") + ("_csr1" if _csr else ""),
                 moe_route_kernel(_norm, _biased, csr=_csr),
                 (((_F2A, _F1) if _norm else (float32, float32)) + (float32, _F2A, _F2C, _F1 if _biased else float32,
                                                                  int32, int32, int32, int32, float32, _I2, _F2C,
                                                                  _I1, _I1, _I2),),
                 "MoE gate (" + ("after the RMSNorm of its rows" if _norm else "on normed rows")
                 + (", selection bias" if _biased else ", no bias") + "): scores, grouped top-k, weights; "
                 + ("one row, its CSR written too" if _csr else "one block per row"), block_threads=MAX_ROUTE_THREADS)
# The expert grid's routing as the engine runs it for small (its RMSNorm inside, the selection bias;
# hidden 2048: 4 values a lane) at one row and at many, plus the normed-input form (the bias-free
# forms differ in one branch only; each registered form costs the compile check two builds).
for _norm, _biased, _csr, _loads in ((True, True, False, 4), (True, True, True, 4), (False, True, False, 4)):
    register(f"moe_route_grid_l{_loads}" + ("_norm" if _norm else "") + ("" if _biased else "_nobias")
             + ("_csr1" if _csr else ""),
             moe_route_grid_kernel(_norm, _biased, _csr, ROUTE_GRID_THREADS, _loads),
             (((_F2A, _F1) if _norm else (float32, float32)) + (float32, _F2A, _F2C, _F1 if _biased else float32,
                                                              int32, int32, int32, int32, float32, _F2C, _I1, _I2,
                                                              _F2C, _I1, _I1, _I2),),
             f"MoE gate, a block per (expert, row), {_loads} values a lane"
             + (", the RMSNorm inside" if _norm else ", normed rows") + (", selection bias" if _biased else "")
             + "; the last block of a row selects" + (", one row, its CSR written too" if _csr else ""),
             block_threads=ROUTE_GRID_THREADS)
register("moe_route_csr", moe_csr_kernel, ((_I2, _I1, _I1, _I2),),
         "MoE routing CSR (entries per expert in ascending row order), one block",
         block_threads=CSR_THREADS)
for _shared in (True, False):
    register("moe_combine" + ("" if _shared else "_noshared"), moe_combine_kernel(_shared),
             ((_F2A, _F2C, _I2, _F2C, _F2A if _shared else float32, _F2A, int32),),
             "MoE combine: residual + routed experts (ascending id)" + (" + shared expert" if _shared else "")
             + ", per element", block_threads=ELEM_THREADS)


# --- host-side checks ------------------------------------------------------------------------

def _check_matrix(x: Any, name: str, ndim: int) -> Any:
    """float32 ``ndim``-D array with a unit stride along the last axis (a view is fine)."""
    x = as_kernel_array(x, name)
    if np.dtype(x.dtype) != np.float32:
        raise TypeError(f"{name} must have dtype float32, got {np.dtype(x.dtype).name}")
    shape, strides = tuple(x.shape), tuple(x.strides)  # the simulator's shape takes no negative index
    if len(shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {shape}")
    if shape[-1] > 1 and strides[-1] != 4:
        raise ValueError(f"{name} must have a unit stride along its last axis (a column slice is fine)")
    return x


def _check_rows(x: Any, name: str, ndim: int) -> Any:
    """As :func:`_check_matrix`, with at least one row and one column."""
    x = _check_matrix(x, name, ndim)
    if min(tuple(x.shape)) < 1:
        raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    return x


def _check_vector(x: Any, name: str, length: int) -> Any:
    """float32 [length], C-contiguous."""
    x = check_array(x, name, (np.float32,), 1)
    check_shape(x, name, (length,))
    return x


def _check_eps(eps: Any) -> np.float32:
    """A finite eps > 0, as the float32 the kernel adds."""
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be finite and > 0, got {eps}")
    return np.float32(eps)


def _check_layout(layout: Any) -> np.int32:
    """"interleaved" or "neox", as the kernel's layout code."""
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a str, got {type(layout).__name__}")
    if layout not in ROPE_LAYOUTS:
        raise ValueError(f"layout must be one of {ROPE_LAYOUTS}, got {layout!r}")
    return np.int32(LAYOUT_CODES[layout])


def _check_tables(cos: Any, sin: Any, rope: int) -> tuple[Any, Any]:
    """cos / sin float32 [capacity, rope / 2], C-contiguous, the same shape."""
    cos = check_array(cos, "cos", (np.float32,), 2)
    sin = check_array(sin, "sin", (np.float32,), 2)
    if cos.shape[0] < 1 or cos.shape[1] != rope // 2:
        raise ValueError(f"cos must have shape (capacity >= 1, {rope // 2}), got {tuple(cos.shape)}")
    check_shape(sin, "sin", tuple(cos.shape))
    return cos, sin


def _check_positions(positions: Any, rows: int, capacity: int) -> Any:
    """int32 [rows]; host values in [0, capacity)."""
    positions = check_array(positions, "positions", (np.int32,), 1)
    check_shape(positions, "positions", (rows,))
    values = host_values(positions)
    if values is not None and (values.min() < 0 or values.max() >= capacity):
        raise ValueError(f"positions must be in [0, {capacity}) (the rows of cos / sin)")
    return positions


def _shape(items: int, per_block: int, threads: int) -> tuple[int, int]:
    """(grid, block) covering ``items`` at ``per_block`` per block of ``threads``; under the
    simulator one warp-sized block loops over everything (every kernel is grid-stride and its
    results do not depend on the launch shape; simulated threads are what costs)."""
    if simulator_active():
        return 1, SIM_THREADS
    return -(-items // per_block), threads


# --- host wrappers ---------------------------------------------------------------------------

def embed(tokens: Any, table: Any, out: Any, *, stream: Any = 0, release_next: bool = False) -> Any:
    """``out[m] = table[tokens[m]]``.

    Args:
        tokens: int32 [M], M >= 1. Host values must be in [0, V); device ids outside [0, V)
            give a NaN row (checked on the device).
        table: float32 [V, D], C-contiguous (``model.embed_tokens.weight``).
        out: float32 [M, D], unit inner stride (a view is fine).
        stream: 0, a numba stream, or a cuda.core Stream / GraphBuilder.
        release_next: the next kernel of the stream reads weights before its PDL wait (a 1-row
            gemv): let it launch right after this one's wait (``kernels.pdl.pdl_begin_early``).

    Returns:
        ``out``. Bit-exact (a copy).
    """
    tokens = check_array(tokens, "tokens", (np.int32,), 1)
    table = check_array(table, "table", (np.float32,), 2)
    if table.shape[0] < 1 or table.shape[1] < 1:
        raise ValueError(f"table must have at least one row and one column, got shape {tuple(table.shape)}")
    if tokens.shape[0] < 1:
        raise ValueError("tokens must hold at least one token")
    out = _check_matrix(out, "out", 2)
    check_shape(out, "out", (tokens.shape[0], table.shape[1]))
    values = host_values(tokens)
    if values is not None and (values.min() < 0 or values.max() >= table.shape[0]):
        raise ValueError(f"tokens must be in [0, {table.shape[0]})")
    launch(embed_kernel, *_shape(out.shape[0] * out.shape[1], ELEM_THREADS, ELEM_THREADS), stream, 0,
           tokens, table, out, np.int32(1 if release_next else 0))
    return out


def rms_norm(x: Any, weight: Any, eps: float, out: Any, *, stream: Any = 0) -> Any:
    """``out[m] = x[m] / sqrt(mean(x[m]²) + eps) · weight`` (``reference.model.rms_norm``).

    Args:
        x: float32 [M, D], M, D >= 1, unit inner stride (a column slice is fine).
        weight: float32 [D], C-contiguous.
        eps: finite, > 0.
        out: float32 [M, D], unit inner stride; may be ``x`` itself.
        stream: as :func:`embed`.

    Returns:
        ``out``. One warp per row, fixed-order sum of squares: bit-identical per row whatever
        else is in the launch.
    """
    x = _check_rows(x, "x", 2)
    weight = _check_vector(weight, "weight", x.shape[1])
    eps32 = _check_eps(eps)
    out = _check_matrix(out, "out", 2)
    check_shape(out, "out", tuple(x.shape))
    launch(rms_norm_kernel, *_shape(x.shape[0], ROW_WARPS, ROW_THREADS), stream, 0, x, weight, eps32, out)
    return out


def rope_tables(config: ModelConfig, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Host RoPE tables for positions 0..capacity-1: (cos, sin) float32 [capacity, qk_rope / 2].

    Computed in float64 by ``reference.model.rope_cos_sin`` (YaRN frequencies and amplitude
    included), rounded once to float32; the engine uploads them once.

    Raises:
        TypeError: config not a ModelConfig, capacity not an int.
        ValueError: capacity outside [1, config.max_seq_len].
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    if isinstance(capacity, (bool, np.bool_)) or not isinstance(capacity, numbers.Integral):
        raise TypeError(f"capacity must be an int, got {type(capacity).__name__}")
    if not 1 <= capacity <= config.max_seq_len:
        raise ValueError(f"capacity must be in [1, max_seq_len = {config.max_seq_len}], got {capacity}")
    cos, sin = rope_cos_sin(config, np.arange(int(capacity)))  # [capacity, R / 2] float64
    return cos.astype(np.float32), sin.astype(np.float32)


def _kv_write_args(kv_a: Any, kv_norm_weight: Any, eps: float, cos: Any, sin: Any, positions: Any,
                   cache_rows: Any, kv_latent: Any, k_rope: Any, layout: str) -> tuple:
    """:func:`mla_kv_write`'s arguments checked, as its kernel takes them."""
    kv_a = _check_rows(kv_a, "kv_a", 2)
    kv_latent = _check_matrix(kv_latent, "kv_latent", 2)
    k_rope = _check_matrix(k_rope, "k_rope", 2)
    c, r = kv_latent.shape[1], k_rope.shape[1]
    if c < 1 or r < 2 or r % 2:
        raise ValueError(f"kv_latent / k_rope: need C >= 1 and an even R >= 2, got C = {c}, R = {r}")
    if kv_a.shape[1] != c + r:
        raise ValueError(f"kv_a must have C + R = {c + r} columns (kv_latent, k_rope), got {kv_a.shape[1]}")
    check_shape(k_rope, "k_rope", (kv_latent.shape[0], r))
    kv_norm_weight = _check_vector(kv_norm_weight, "kv_norm_weight", c)
    eps32 = _check_eps(eps)
    cos, sin = _check_tables(cos, sin, r)
    layout_code = _check_layout(layout)
    m = kv_a.shape[0]
    positions = _check_positions(positions, m, cos.shape[0])
    cache_rows = check_array(cache_rows, "cache_rows", (np.int32,), 1)
    check_shape(cache_rows, "cache_rows", (m,))
    values = host_values(cache_rows)
    if values is not None:
        real = values[values >= 0]
        if real.size and real.max() >= kv_latent.shape[0]:
            raise ValueError(f"cache_rows must be < {kv_latent.shape[0]} (the cache rows)")
        if np.unique(real).size != real.size:
            raise ValueError("cache_rows must not repeat a row (>= 0)")
    return kv_a, kv_norm_weight, eps32, cos, sin, positions, cache_rows, kv_latent, k_rope, layout_code


def _q_rope_args(q: Any, cos: Any, sin: Any, positions: Any, out: Any, layout: str,
                 out_name: str = "out") -> tuple:
    """:func:`mla_q_rope`'s arguments checked, as its kernel takes them (``out_name``: how the
    caller names ``out``)."""
    q = _check_rows(q, "q", 3)
    out = _check_matrix(out, out_name, 3)
    r = out.shape[2]
    if r < 2 or r % 2:
        raise ValueError(f"{out_name}: the rope width must be even and >= 2, got {r}")
    if q.shape[2] < r:
        raise ValueError(f"q must have at least R = {r} columns per head, got {q.shape[2]}")
    check_shape(out, out_name, (q.shape[0], q.shape[1], r))
    cos, sin = _check_tables(cos, sin, r)
    layout_code = _check_layout(layout)
    positions = _check_positions(positions, q.shape[0], cos.shape[0])
    return q, cos, sin, positions, out, layout_code


def mla_kv_write(kv_a: Any, kv_norm_weight: Any, eps: float, cos: Any, sin: Any, positions: Any,
                 cache_rows: Any, kv_latent: Any, k_rope: Any, *, layout: str, stream: Any = 0) -> None:
    """Write the new MLA cache rows: normed latent and RoPE'd key (``reference.model.mla_project``).

    For each row m with ``cache_rows[m] >= 0``: ``kv_latent[cache_rows[m]] = rms_norm(kv_a[m, :C],
    kv_norm_weight, eps)`` and ``k_rope[cache_rows[m]] = rope(kv_a[m, C:], positions[m])``.

    Args:
        kv_a: float32 [M, C + R] (C = kv_lora, R = rope), unit inner stride: e.g. the kv columns
            of the fused [wq_a | wkv_a] output.
        kv_norm_weight: float32 [C] (``kv_a_layernorm.weight``); eps: finite, > 0.
        cos, sin: float32 [capacity, R / 2] from :func:`rope_tables`.
        positions: int32 [M], RoPE positions (host values in [0, capacity); device values
            outside give a NaN key row).
        cache_rows: int32 [M], flat row of the [bs * S] layer cache; < 0 = padding (skipped).
            Host values must be < rows and the non-negative ones distinct; device values
            >= rows are skipped.
        kv_latent: float32 [rows, C]; k_rope: float32 [rows, R] (unit inner stride; views of
            a combined [rows, C + R] cache are fine).
        layout: "interleaved" or "neox" (``config.rope_layout``).
        stream: as :func:`embed`.
    """
    args = _kv_write_args(kv_a, kv_norm_weight, eps, cos, sin, positions, cache_rows, kv_latent, k_rope, layout)
    launch(mla_kv_write_kernel, *_shape(args[0].shape[0], ROW_WARPS, ROW_THREADS), stream, 0, *args)


def mla_q_rope(q: Any, cos: Any, sin: Any, positions: Any, out: Any, *, layout: str,
               stream: Any = 0) -> Any:
    """``out[m, h] = rope(q[m, h, nope:], positions[m])`` for every head.

    Args:
        q: float32 [M, H, nope + R], unit inner stride (a view of the q_b output is fine).
        cos, sin: float32 [capacity, R / 2] from :func:`rope_tables`.
        positions: int32 [M] (host values in [0, capacity); device values outside give NaN).
        out: float32 [M, H, R], unit inner stride; may be ``q[:, :, nope:]`` (in place).
        layout: "interleaved" or "neox".
        stream: as :func:`embed`.

    Returns:
        ``out``.
    """
    q, cos, sin, positions, out, layout_code = _q_rope_args(q, cos, sin, positions, out, layout)
    pairs = q.shape[0] * q.shape[1] * (out.shape[2] // 2)
    launch(mla_q_rope_kernel, *_shape(pairs, ELEM_THREADS, ELEM_THREADS), stream, 0, q, cos, sin, positions, out,
           layout_code)
    return out


def mla_rope_kv_write(q: Any, q_out: Any, kv_a: Any, kv_norm_weight: Any, eps: float, cos: Any, sin: Any,
                      positions: Any, cache_rows: Any, kv_latent: Any, k_rope: Any, *, layout: str,
                      stream: Any = 0, release_next: bool = False) -> Any:
    """:func:`mla_q_rope` ``(q, cos, sin, positions, q_out)`` and :func:`mla_kv_write` ``(kv_a,
    kv_norm_weight, eps, cos, sin, positions, cache_rows, kv_latent, k_rope)`` in one launch
    (the engine's per-layer RoPE step: one kernel instead of two, the same bits).

    Args: as those two functions; ``q`` and ``kv_a`` have the same rows M (one position each),
    ``q_out`` the rope width of ``k_rope``. The two parts run at once: ``q_out`` may be
    ``q[:, :, nope:]`` but must not overlap ``kv_a``, ``kv_latent`` or ``k_rope``. Every argument
    is checked before the launch. ``release_next``: as :func:`embed`'s (the next kernel a split
    absorb). Returns ``q_out``.
    """
    kv_args = _kv_write_args(kv_a, kv_norm_weight, eps, cos, sin, positions, cache_rows, kv_latent, k_rope, layout)
    q = _check_rows(q, "q", 3)
    if q.shape[0] != kv_args[0].shape[0]:
        raise ValueError(f"q must have the rows of kv_a ({kv_args[0].shape[0]}), got {q.shape[0]}")
    q_out = _check_matrix(q_out, "q_out", 3)
    if q_out.shape[2] != kv_args[8].shape[1]:
        raise ValueError(f"q_out must have the rope width of k_rope ({kv_args[8].shape[1]}), got {q_out.shape[2]}")
    q, cos, sin, positions, q_out, layout_code = _q_rope_args(q, cos, sin, positions, q_out, layout, "q_out")
    pairs = q.shape[0] * q.shape[1] * (q_out.shape[2] // 2)
    q_blocks, threads = _shape(pairs, ELEM_THREADS, ELEM_THREADS)
    kv_blocks, kv_threads = _shape(kv_args[0].shape[0], ROW_WARPS, ROW_THREADS)
    assert threads == kv_threads   # one block size for both parts: ELEM_THREADS == ROW_THREADS
    launch(mla_rope_kv_write_kernel, q_blocks + kv_blocks, threads, stream, 0, q, q_out, np.int32(q_blocks),
           *kv_args, np.int32(1 if release_next else 0))
    return q_out


def route_threads(n_experts: int) -> int:
    """Block size of the routing kernel: one thread per (expert, partial) pair, up to
    MAX_ROUTE_THREADS (the results do not depend on it: the partials' order is fixed)."""
    return min(MAX_ROUTE_THREADS, -(-n_experts * ROUTE_SPLIT // WARP_SIZE) * WARP_SIZE)


def _check_routing_config(config: Any) -> None:
    """A ModelConfig whose routing fits the kernel's fixed-size shared and local arrays."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    if config.n_routed_experts > MAX_EXPERTS:
        raise ValueError(f"config: n_routed_experts must be <= {MAX_EXPERTS}, got {config.n_routed_experts}")
    if config.n_expert_groups > MAX_GROUPS:
        raise ValueError(f"config: n_expert_groups must be <= {MAX_GROUPS}, got {config.n_expert_groups}")
    if config.n_activated_experts > MAX_TOPK:
        raise ValueError(f"config: n_activated_experts must be <= {MAX_TOPK}, got {config.n_activated_experts}")


def moe_route(xn: Any, gate_w: Any, bias: Any, config: ModelConfig, topk_ids: Any, topk_w: Any,
              row_offsets: Any, row_index: Any, slot_of: Any, *, x: Any = None, norm_weight: Any = None,
              eps: float = 1e-6, logits: Any = None, counts: Any = None, stream: Any = 0) -> None:
    """MoE routing of M rows (``reference.model.moe_gate``) and the CSR for ``expert_linear``.

    Scores are sigmoid (or softmax) of ``gate_w · xn[m]``; ``bias`` shifts them for selection
    only; with groups, a group scores the sum of its top-2 biased scores (max without a bias),
    the ``n_limited_groups`` best groups are kept, then the k best experts among them (ties:
    lower index). Weights are the unbiased scores of the picks, renormalised (``norm_topk_prob``,
    k > 1, +1e-20), times ``route_scale``.

    Args:
        xn: float32 [M, hidden], M >= 1, unit inner stride (the normed residual).
        gate_w: float32 [E, hidden] (``mlp.gate.weight``), C-contiguous.
        bias: float32 [E] (``e_score_correction_bias``; finite on the host) or None.
        config: the model (E, k, groups, score function, normalisation, route_scale).
        topk_ids: int32 [M, k] out: row m's experts in ascending id.
        topk_w: float32 [M, k] out: their weights.
        row_offsets: int32 [E + 1] out: entries of expert e are [row_offsets[e], row_offsets[e+1]).
        row_index: int32 [M * k] out: each entry's row, ascending within an expert.
        slot_of: int32 [M, k] out: the entry of (m, topk_ids[m, s]).
        x, norm_weight, eps: None, or float32 [M, hidden] (unit inner stride), float32 [hidden]
            and eps: then ``xn`` is an output too, ``rms_norm(x, norm_weight, eps)`` (the bits of
            :func:`rms_norm`), written in the routing launch before the gate reads it (the
            engine's MoE layers: one launch less). Both or neither.
        logits, counts: None (the row layout), or float32 [M, E] scratch and int32 [M] zeros
            (caller-owned; zeros again after the launch): the expert grid, a block per (expert,
            row) (:func:`moe_route_grid_kernel`). Its numerics are its own: the gate dots (and,
            with ``x``, the RMSNorm) in ROUTE_LANES lanes, not ROUTE_SPLIT partials (and not
            :func:`rms_norm`'s warp), so one model keeps one layout. Both or neither.
        stream: as :func:`embed`.

    Two launches: one block per row (the RMSNorm when asked, then the routing) or the expert
    grid, then one block (the CSR); one row (an AR step at batch 1, ROUTE_CSR_INLINE): one launch,
    the selecting block writes the CSR too (the same values).
    """
    _check_routing_config(config)
    xn = _check_rows(xn, "xn", 2)
    n_experts, k, hidden = config.n_routed_experts, config.n_activated_experts, config.hidden_size
    check_shape(xn, "xn", (xn.shape[0], hidden))
    if (x is None) != (norm_weight is None):
        raise ValueError("x and norm_weight must be given together (the RMSNorm before the gate) or not at all")
    eps32 = np.float32(0.0)
    if x is not None:
        x = _check_rows(x, "x", 2)
        check_shape(x, "x", tuple(xn.shape))
        norm_weight = _check_vector(norm_weight, "norm_weight", hidden)
        eps32 = _check_eps(eps)
    gate_w = check_array(gate_w, "gate_w", (np.float32,), 2)
    check_shape(gate_w, "gate_w", (n_experts, hidden))
    if bias is not None:
        bias = _check_vector(bias, "bias", n_experts)
        values = host_values(bias)
        if values is not None and not np.all(np.isfinite(values)):
            raise ValueError("bias must be finite")
    m = xn.shape[0]
    topk_ids = check_array(topk_ids, "topk_ids", (np.int32,), 2)
    check_shape(topk_ids, "topk_ids", (m, k))
    topk_w = check_array(topk_w, "topk_w", (np.float32,), 2)
    check_shape(topk_w, "topk_w", (m, k))
    row_offsets = check_array(row_offsets, "row_offsets", (np.int32,), 1)
    check_shape(row_offsets, "row_offsets", (n_experts + 1,))
    row_index = check_array(row_index, "row_index", (np.int32,), 1)
    check_shape(row_index, "row_index", (m * k,))
    slot_of = check_array(slot_of, "slot_of", (np.int32,), 2)
    check_shape(slot_of, "slot_of", (m, k))
    if (logits is None) != (counts is None):
        raise ValueError("logits and counts must be given together (the expert grid's scratch) or not at all")
    if logits is not None:
        if route_grid_loads(hidden) > MAX_ROUTE_LOADS:
            raise ValueError(f"config: hidden_size must be <= {ROUTE_LANES * MAX_ROUTE_LOADS} for the expert grid's "
                             f"routing, got {hidden}")
        logits = check_array(logits, "logits", (np.float32,), 2)
        check_shape(logits, "logits", (m, n_experts))
        counts = check_array(counts, "counts", (np.int32,), 1)
        check_shape(counts, "counts", (m,))
    norm, biased = x is not None, bias is not None
    inline = ROUTE_CSR_INLINE and m == 1   # one row: the routing block writes the CSR
    head = (x if norm else PLACEHOLDER, norm_weight if norm else PLACEHOLDER, eps32, xn, gate_w,
            bias if biased else PLACEHOLDER, np.int32(config.n_expert_groups), np.int32(config.n_limited_groups),
            np.int32(config.score_func == "softmax"), np.int32(config.norm_topk_prob), np.float32(config.route_scale))
    tail = (topk_ids, topk_w, row_offsets, row_index, slot_of)
    if logits is None:
        launch(moe_route_kernel(norm, biased, csr=inline), *_shape(m, 1, route_threads(n_experts)), stream, 0,
               *head, *tail)
    else:   # a block per (expert, row); the simulator's one block loops over both
        sim = simulator_active()
        threads = SIM_THREADS if sim else ROUTE_GRID_THREADS
        grid = (1, 1) if sim else (route_grid_blocks(n_experts, m, active_profile().sm_count), min(m, MAX_GRID_Y))
        kernel = moe_route_grid_kernel(norm, biased, inline, threads, route_grid_loads(hidden), not sim)
        launch(kernel, grid, threads,
               stream, 0, *head, logits, counts, *tail)
    if not inline:
        csr_threads = SIM_THREADS if simulator_active() else CSR_THREADS
        launch(moe_csr_kernel, 1, csr_threads, stream, 0, topk_ids, row_offsets, row_index, slot_of)


def moe_combine(x: Any, expert_out: Any, slot_of: Any, topk_w: Any, shared_out: Any, out: Any, *,
                stream: Any = 0, release_next: bool = False) -> Any:
    """``out[m] = x[m] + (Σ_s topk_w[m, s] · expert_out[slot_of[m, s]] + shared_out[m])``.

    The sum runs over s ascending (ascending expert id, the reference's ``moe`` loop order),
    then the shared expert is added, then the residual.

    Args:
        x: float32 [M, D], unit inner stride (the residual stream).
        expert_out: float32 [M * k, D], C-contiguous (``expert_linear`` output, CSR entries).
        slot_of: int32 [M, k] from :func:`moe_route` (device values outside [0, M·k) -> NaN).
        topk_w: float32 [M, k] from :func:`moe_route`.
        shared_out: float32 [M, D] (shared expert output, unit inner stride) or None.
        out: float32 [M, D], unit inner stride; may be ``x``.
        stream, release_next: as :func:`embed`'s.

    Returns:
        ``out``.
    """
    x = _check_rows(x, "x", 2)
    m, dim = x.shape
    slot_of = check_array(slot_of, "slot_of", (np.int32,), 2)
    if slot_of.shape[0] != m or slot_of.shape[1] < 1:
        raise ValueError(f"slot_of must have shape ({m}, k) with k >= 1, got {tuple(slot_of.shape)}")
    k = slot_of.shape[1]
    topk_w = check_array(topk_w, "topk_w", (np.float32,), 2)
    check_shape(topk_w, "topk_w", (m, k))
    expert_out = check_array(expert_out, "expert_out", (np.float32,), 2)
    check_shape(expert_out, "expert_out", (m * k, dim))
    if shared_out is not None:
        shared_out = _check_matrix(shared_out, "shared_out", 2)
        check_shape(shared_out, "shared_out", (m, dim))
    out = _check_matrix(out, "out", 2)
    check_shape(out, "out", (m, dim))
    values = host_values(slot_of)
    if values is not None and (values.min() < 0 or values.max() >= m * k):
        raise ValueError(f"slot_of must be in [0, {m * k})")
    shared = shared_out is not None
    launch(moe_combine_kernel(shared), *_shape(m * dim, ELEM_THREADS, ELEM_THREADS), stream, 0, x, expert_out, slot_of,
           topk_w, shared_out if shared else PLACEHOLDER, out, np.int32(1 if release_next else 0))
    return out
