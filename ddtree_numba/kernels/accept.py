"""Posterior tokens and the acceptance walk for a whole batch, on the GPU (spec §1.4).

Two launches per round, results left on the device (one on the greedy fused-lm_head path):

1. Posterior token of every tree node, one block per (request, node) row of the target logits
   float32 [bs, N, V]: greedy argmax (:func:`posterior_argmax`), or per request greedy below
   ``GREEDY_TEMPERATURE`` and Gumbel-max on Philox4x32-10 noise above it
   (:func:`posterior_sample`), exactly as ``reference.sampling.sample_posterior``. Engines
   that fuse the argmax into the lm_head (:func:`.linear.linear_argmax`: per column block one
   (max, lowest argmax) per row, never the full logits) can merge those parts for every node
   (:func:`posterior_argmax_parts`, one warp per row, ~n_parts x 8 bytes read per row) and
   hand the int32 [bs, N] posterior to the walk.
2. The walk (:func:`accept_walk`), one block per request: the request's child CSR, tokens and
   posterior are staged in shared memory with coalesced loads, then warp 0 follows the
   posterior from the root (spec §1.4), scanning each node's children 32 at a time. Staging
   replaces ~4 dependent global-memory round trips per step (up to L + 1 steps) by one
   coalesced pass. Bit-exact against ``reference.accept_batch``.

The greedy fused path needs only the posterior of the nodes the walk visits (at most W = L + 1
per request), so :func:`accept_walk_parts` does both steps in one launch: the walk of 2. with
the CSR and tokens staged (no posterior), merging at each visited node that row's parts as 1.
does (same device function, :func:`_merge_parts`: each lane loads up to MERGE_UNROLL parts
before comparing, so a node costs about one memory latency). It reads <= W rows of parts per
request instead of all bs x N (25 MB at bs 64, B 512, V 163840), and its outputs are bit for
bit those of :func:`posterior_argmax_parts` + :func:`accept_walk`.

Sampling exactness: the Philox words and u are exact integer / float64 arithmetic; the two
float64 logs come from libdevice on the GPU (<= 1 ulp, like NumPy's), so only two scores within
an ulp of each other could ever be ordered differently from the reference.

Tie rule everywhere: the largest score wins, equal scores go to the lower token id
(docs/ARCHITECTURE.md). Logits must be finite: NumPy (host) logits are checked before any launch,
as the reference does; device logits are not checked (that would cost a copy). On the device a
NaN is skipped (:func:`outranks` never lets it win, not even against -inf), so a row's token is
the lowest id of its largest non-NaN logit, and an all-NaN row gives ``NO_INDEX`` (2**31 - 1, no
token). The fused lm_head argmax and :func:`posterior_argmax_parts` keep exactly this rule.

The host-side array checks come from :mod:`._args` (shared with the other kernel modules).
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
from numba import cuda, float32, float64, int32, int64, uint64

from sim.launch import launch

from ._args import check_array, check_shape, host_values
from .pdl import pdl_begin
from .registry import register
from .warp import warp_argmax_f32, warp_argmax_f64, warp_min_i32

__all__ = [
    "GREEDY_TEMPERATURE",
    "ARGMAX_THREADS",
    "WALK_THREADS",
    "MAX_ARGMAX_THREADS",
    "MAX_SAMPLE_THREADS",
    "NO_INDEX",
    "MERGE_THREADS",
    "MAX_MERGE_THREADS",
    "outranks",
    "posterior_argmax_kernel",
    "posterior_argmax_parts_kernel",
    "posterior_sample_kernel",
    "accept_walk_kernel",
    "accept_walk_parts_kernel",
    "posterior_argmax",
    "posterior_argmax_parts",
    "posterior_sample",
    "accept_walk",
    "accept_walk_parts",
    "walk_shared_bytes",
]

GREEDY_TEMPERATURE = 1e-5  # below this, argmax (official threshold, spec §1.4)
WARP_SIZE = 32
MAX_WARPS = 32  # 1024 threads per block at most (limits §4)
ARGMAX_THREADS = 256  # default block size of the posterior kernels: 8 warps stream one row
MAX_ARGMAX_THREADS = MAX_WARPS * WARP_SIZE  # 32-40 registers: a 1024-thread block fits
MAX_SAMPLE_THREADS = 512  # 66 registers on sm_120 allow 896 threads: cap at a power of two
WALK_THREADS = 128  # threads that stage a request's tree; warp 0 then walks it
MERGE_THREADS = 256  # posterior_argmax_parts default block: one warp per row, 8 rows per block
MAX_MERGE_THREADS = MAX_WARPS * WARP_SIZE
NO_INDEX = np.int32(2**31 - 1)  # "no candidate": loses every tie against a real index
NEG_INF_F32 = np.float32(-np.inf)
UNROLL = 8  # argmax: loads in flight per thread before the compares
MERGE_UNROLL = 4  # part merge: parts in flight per lane (one latency a row up to 128 parts)

# Philox4x32-10 (Salmon et al. 2011, Random123), on uint64 words holding 32-bit values so the
# 32x32 -> 64-bit product is one exact uint64 multiply (the high word is the product >> 32).
PHILOX_M0 = np.uint64(0xD2511F53)
PHILOX_M1 = np.uint64(0xCD9E8D57)
PHILOX_W0 = np.uint64(0x9E3779B9)  # Weyl key increments
PHILOX_W1 = np.uint64(0xBB67AE85)
PHILOX_ROUNDS = 10
PHILOX_WORDS = 4  # tokens 4g..4g+3 share the Philox call with counter word 0 = g
MASK32 = np.uint64(0xFFFFFFFF)
SHIFT32 = np.uint64(32)
ZERO64 = np.uint64(0)
UNIT_SCALE = 2.0**-32  # (x + 0.5) * 2^-32 maps a uint32 into the open interval (0, 1)


# --- device functions ------------------------------------------------------------------------

@cuda.jit(device=True)
def _philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of counter (c0..c3) under key (k0, k1); uint64 in/out holding 32-bit words."""
    for _ in range(PHILOX_ROUNDS):
        p0 = PHILOX_M0 * c0  # < 2^64: exact
        p1 = PHILOX_M1 * c2
        n0 = (p1 >> SHIFT32) ^ c1 ^ k0
        n2 = (p0 >> SHIFT32) ^ c3 ^ k1
        c0, c1, c2, c3 = n0, p1 & MASK32, n2, p0 & MASK32
        k0 = (k0 + PHILOX_W0) & MASK32  # the bump after the last round is never used
        k1 = (k1 + PHILOX_W1) & MASK32
    return c0, c1, c2, c3


@cuda.jit(device=True)
def _gumbel(word):
    """Standard Gumbel noise from one uint32 Philox word (held in a uint64), in float64."""
    u = (float64(word) + 0.5) * UNIT_SCALE  # exact: (0, 1)
    return -math.log(-math.log(u))


@cuda.jit(device=True)
def outranks(value, index, best, best_index):
    """(value, index) outranks (best, best_index): larger value, equal values -> lower index.

    A NaN value never outranks anything (every comparison is false), and a NaN best is never
    reached from a (-inf, NO_INDEX) start: NaN logits are skipped. The one ranking rule of every
    argmax here and of :func:`.linear.linear_argmax` (order-free: merging candidates in any
    grouping gives the same winner).
    """
    return value > best or (value == best and index < best_index)


@cuda.jit(device=True)
def _block_argmax_f32(value, index, sh_value, sh_index):
    """Block argmax of per-thread float32 candidates; the result is valid on warp 0.

    sh_value float32 [MAX_WARPS], sh_index int32 [MAX_WARPS]: the kernel's shared scratch.
    Every thread of the block must call this (it has a block barrier).
    """
    lane = cuda.threadIdx.x % WARP_SIZE
    warp = cuda.threadIdx.x // WARP_SIZE
    value, index = warp_argmax_f32(value, index)
    if lane == 0:
        sh_value[warp] = value
        sh_index[warp] = index
    cuda.syncthreads()  # every warp's winner is in shared memory before warp 0 reads them
    if warp == 0:
        value = NEG_INF_F32
        index = NO_INDEX
        if lane < cuda.blockDim.x // WARP_SIZE:
            value = sh_value[lane]
            index = sh_index[lane]
        value, index = warp_argmax_f32(value, index)
    return value, index


@cuda.jit(device=True)
def _block_argmax_f64(value, index, sh_value, sh_index):
    """As :func:`_block_argmax_f32` for float64 scores (sh_value float64 [MAX_WARPS])."""
    lane = cuda.threadIdx.x % WARP_SIZE
    warp = cuda.threadIdx.x // WARP_SIZE
    value, index = warp_argmax_f64(value, index)
    if lane == 0:
        sh_value[warp] = value
        sh_index[warp] = index
    cuda.syncthreads()  # every warp's winner is in shared memory before warp 0 reads them
    if warp == 0:
        value = -math.inf
        index = NO_INDEX
        if lane < cuda.blockDim.x // WARP_SIZE:
            value = sh_value[lane]
            index = sh_index[lane]
        value, index = warp_argmax_f64(value, index)
    return value, index


@cuda.jit(device=True)
def _merge_parts(part_val, part_idx, row, lane):
    """The part winner of ``row``: the largest part value, equal values -> the lowest id, NaN
    parts skipped (NO_INDEX when every part is NaN); on every lane.

    part_val float32 [rows, P], part_idx int32 [rows, P] (:func:`.linear.linear_argmax`). Lane
    ``lane`` takes parts lane, lane + 32, ...: MERGE_UNROLL of them are loaded before any
    compare, so a row of up to 32 * MERGE_UNROLL parts costs one memory latency. All 32 lanes
    of the warp call this (it ends in a warp argmax).
    """
    staged_val = cuda.local.array(MERGE_UNROLL, float32)  # registers once the loops are unrolled
    staged_idx = cuda.local.array(MERGE_UNROLL, int32)
    n_parts = part_val.shape[1]
    best = NEG_INF_F32
    best_index = NO_INDEX
    for first in range(lane, n_parts, MERGE_UNROLL * WARP_SIZE):
        for k in range(MERGE_UNROLL):  # all loads first: MERGE_UNROLL requests in flight per lane
            p = first + k * WARP_SIZE
            staged_val[k] = NEG_INF_F32  # past the last part: the empty candidate, never a winner
            staged_idx[k] = NO_INDEX
            if p < n_parts:
                staged_val[k] = part_val[row, p]
                staged_idx[k] = part_idx[row, p]
        for k in range(MERGE_UNROLL):
            if outranks(staged_val[k], staged_idx[k], best, best_index):
                best, best_index = staged_val[k], staged_idx[k]
    best, best_index = warp_argmax_f32(best, best_index)
    return best_index


@cuda.jit(device=True)
def _stage_tree(smem, child_ptr, child_index, tokens, posterior):
    """Stage this block's request (b = blockIdx.x) in ``smem`` with coalesced loads: its child CSR
    and tokens and, unless ``posterior`` is None, its posterior; returns the views s_ptr [N + 1],
    s_child [N], s_token [N], s_post [N] (not written, nor to be read, without a posterior).
    Every thread of the block calls this; it ends with a block barrier."""
    b = cuda.blockIdx.x
    n_cap = child_index.shape[1]
    s_ptr = smem[0:n_cap + 1]
    s_child = smem[n_cap + 1:2 * n_cap + 1]
    s_token = smem[2 * n_cap + 1:3 * n_cap + 1]
    s_post = smem[3 * n_cap + 1:4 * n_cap + 1]
    for i in range(cuda.threadIdx.x, n_cap, cuda.blockDim.x):
        s_ptr[i] = child_ptr[b, i]
        s_child[i] = child_index[b, i]
        s_token[i] = tokens[b, i]
        if posterior is not None:  # a compile-time branch (numba prunes it when posterior is None)
            s_post[i] = posterior[b, i]
    if cuda.threadIdx.x == 0:
        s_ptr[n_cap] = child_ptr[b, n_cap]
    cuda.syncthreads()  # the whole tree is staged before warp 0 walks it
    return s_ptr, s_child, s_token, s_post


@cuda.jit(device=True)
def _accept_child(b, length, node, token, s_ptr, s_child, s_token, accepted):
    """Accept the child of ``node`` whose token is ``token`` as request b's node number ``length``
    (lane 0 stores it in accepted[b, length]): (child, length + 1) on every lane, or
    (NO_INDEX, length) when there is no such child or the W = accepted.shape[1] slots are full.

    Children are scanned 32 at a time in ascending order: tokens are unique among siblings, the
    lowest index wins if they are not. Malformed device pointers never index outside the staged
    [N] child slots: the range is clamped to [0, N) and children outside [1, N) are skipped.
    All 32 lanes of warp 0 call this.
    """
    if length >= accepted.shape[1]:
        return NO_INDEX, length
    lane = cuda.threadIdx.x
    n_cap = s_child.shape[0]
    end = min(s_ptr[node + 1], n_cap)
    found = NO_INDEX
    base = max(s_ptr[node], 0)
    while base < end and found == NO_INDEX:  # uniform over the warp
        candidate = NO_INDEX
        j = base + lane
        if j < end:
            child = s_child[j]
            if child > 0 and child < n_cap and s_token[child] == token:
                candidate = child
        found = warp_min_i32(candidate)
        base += WARP_SIZE
    if found == NO_INDEX:
        return NO_INDEX, length
    if lane == 0:
        accepted[b, length] = found
    return found, length + 1


@cuda.jit(device=True)
def _end_walk(b, length, token, accepted, lengths, bonus):
    """Warp 0 closes request b's walk of ``length`` nodes (root first): the root and -1 padding
    in accepted, the length, and ``token`` (the last node's posterior) as the bonus."""
    lane = cuda.threadIdx.x
    for j in range(length + lane, accepted.shape[1], WARP_SIZE):
        accepted[b, j] = -1
    if lane == 0:
        accepted[b, 0] = 0
        lengths[b] = length
        bonus[b] = token


# --- kernels ---------------------------------------------------------------------------------

@cuda.jit
def posterior_argmax_kernel(logits, sizes, out):
    """out[b, i] = argmax_v logits[b, i, v] (ties -> lowest v) for i < sizes[b], else -1.

    logits float32 [bs, N, V], sizes int32 [bs], out int32 [bs, N]. Grid (N, bs), one block per
    row; each thread scans v = tid, tid + blockDim, ... (coalesced), UNROLL loads in flight.
    """
    sh_value = cuda.shared.array(MAX_WARPS, float32)
    sh_index = cuda.shared.array(MAX_WARPS, int32)
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    staged = cuda.local.array(UNROLL, float32)  # registers once the loops are unrolled
    node = cuda.blockIdx.x
    b = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    if node >= sizes[b]:  # padding row: the whole block leaves before any barrier
        if tid == 0:
            out[b, node] = -1
        return
    vocab = logits.shape[2]
    stride = cuda.blockDim.x
    best = NEG_INF_F32
    best_index = NO_INDEX
    v = tid
    while v + (UNROLL - 1) * stride < vocab:
        for k in range(UNROLL):  # all loads first: UNROLL requests in flight per thread
            staged[k] = logits[b, node, v + k * stride]
        for k in range(UNROLL):
            if outranks(staged[k], int32(v + k * stride), best, best_index):
                best, best_index = staged[k], int32(v + k * stride)
        v += UNROLL * stride
    while v < vocab:
        x = logits[b, node, v]
        if outranks(x, int32(v), best, best_index):
            best, best_index = x, int32(v)
        v += stride
    best, best_index = _block_argmax_f32(best, best_index, sh_value, sh_index)
    if tid == 0:
        out[b, node] = best_index


@cuda.jit
def posterior_argmax_parts_kernel(part_val, part_idx, sizes, out):
    """out[b, i] = the part winner of row b * N + i (ties -> lowest id) for i < sizes[b], else -1.

    part_val float32 [bs * N, P], part_idx int32 [bs * N, P] (per row, per column block of the
    lm_head: its largest logit and that logit's lowest id, :func:`.linear.linear_argmax`), sizes
    int32 [bs], out int32 [bs, N]. One warp per row (grid-stride), lanes over the parts.
    """
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    lane = cuda.threadIdx.x % WARP_SIZE
    warps_per_block = cuda.blockDim.x // WARP_SIZE
    n_cap = out.shape[1]
    row = cuda.blockIdx.x * warps_per_block + cuda.threadIdx.x // WARP_SIZE
    while row < part_val.shape[0]:  # row is per warp: the warp stays converged
        b = row // n_cap
        node = row - b * n_cap
        if node >= sizes[b]:  # padding row: its parts are not read
            if lane == 0:
                out[b, node] = -1
        else:
            token = _merge_parts(part_val, part_idx, row, lane)
            if lane == 0:
                out[b, node] = token
        row += cuda.gridDim.x * warps_per_block


@cuda.jit
def posterior_sample_kernel(logits, sizes, temperatures, seeds, positions, out):
    """Greedy or Gumbel-max posterior token per row, as reference.sampling.sample_posterior.

    logits float32 [bs, N, V], sizes int32 [bs], temperatures float64 [bs], seeds uint64 [bs],
    positions int32 or int64 [bs, N] (node position = past_len + depth), out int32 [bs, N]
    (-1 on padding rows). Request b is greedy when temperatures[b] < GREEDY_TEMPERATURE, else
    out = argmax_v float64(logit) / T + g(seed, position, v) with Philox noise g.
    Grid (N, bs); each thread takes groups of PHILOX_WORDS consecutive tokens (one Philox call).
    """
    sh_value = cuda.shared.array(MAX_WARPS, float64)
    sh_index = cuda.shared.array(MAX_WARPS, int32)
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    node = cuda.blockIdx.x
    b = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    if node >= sizes[b]:  # padding row: the whole block leaves before any barrier
        if tid == 0:
            out[b, node] = -1
        return
    vocab = logits.shape[2]
    temperature = temperatures[b]
    greedy = temperature < GREEDY_TEMPERATURE
    seed = seeds[b]
    k0 = seed & MASK32
    k1 = seed >> SHIFT32
    position = uint64(positions[b, node])
    c1 = position & MASK32
    c2 = position >> SHIFT32
    best = -math.inf
    best_index = NO_INDEX
    n_groups = (vocab + PHILOX_WORDS - 1) // PHILOX_WORDS
    group = tid
    while group < n_groups:
        first = group * PHILOX_WORDS
        if greedy:
            for w in range(PHILOX_WORDS):
                v = first + w
                if v < vocab:
                    score = float64(logits[b, node, v])
                    if outranks(score, int32(v), best, best_index):
                        best, best_index = score, int32(v)
        else:
            words = _philox4x32_10(uint64(group), c1, c2, ZERO64, k0, k1)
            for w in range(PHILOX_WORDS):
                v = first + w
                if v < vocab:
                    # same operations, same order as the reference: x / T + g, in float64
                    score = float64(logits[b, node, v]) / temperature + _gumbel(words[w])
                    if outranks(score, int32(v), best, best_index):
                        best, best_index = score, int32(v)
        group += cuda.blockDim.x
    best, best_index = _block_argmax_f64(best, best_index, sh_value, sh_index)
    if tid == 0:
        out[b, node] = best_index


@cuda.jit
def accept_walk_kernel(posterior, child_ptr, child_index, tokens, accepted, lengths, bonus):
    """The acceptance walk of every request (spec §1.4), one block per request.

    posterior int32 [bs, N], child_ptr int32 [bs, N + 1], child_index int32 [bs, N],
    tokens int32 [bs, N] -> accepted int32 [bs, W] (node indices, root first, -1 padded),
    lengths int32 [bs], bonus int32 [bs]. At most W nodes are accepted (W >= 1 + max depth
    gives the reference's walk; a narrower buffer truncates it, and the bonus is then the
    posterior of the last accepted node, still the target's own next token).
    Dynamic shared memory: walk_shared_bytes(N).
    """
    smem = cuda.shared.array(0, int32)
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    s_ptr, s_child, s_token, s_post = _stage_tree(smem, child_ptr, child_index, tokens, posterior)
    if cuda.threadIdx.x >= WARP_SIZE:
        return
    b = cuda.blockIdx.x
    node = 0
    length = 1
    while node != NO_INDEX:  # warp 0 walks from the root
        token = s_post[node]
        node, length = _accept_child(b, length, node, token, s_ptr, s_child, s_token, accepted)
    _end_walk(b, length, token, accepted, lengths, bonus)


@cuda.jit
def accept_walk_parts_kernel(part_val, part_idx, child_ptr, child_index, tokens, accepted, lengths,
                             bonus):
    """The acceptance walk with the greedy posterior merged on the way, one block per request.

    As :func:`accept_walk_kernel` on ``posterior_argmax_parts``'s posterior, without it: part_val
    float32 [bs * N, P], part_idx int32 [bs * N, P] (node i of request b is row b * N + i), the
    tree and outputs as there. Only the CSR and tokens are staged; at each visited node warp 0
    merges that row's P parts (:func:`_merge_parts`, ~one memory latency a node), so at most
    W rows of parts are read per request instead of all bs * N.
    Dynamic shared memory: walk_shared_bytes(N, posterior=False).
    """
    smem = cuda.shared.array(0, int32)
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    s_ptr, s_child, s_token, _ = _stage_tree(smem, child_ptr, child_index, tokens, None)
    if cuda.threadIdx.x >= WARP_SIZE:
        return
    b = cuda.blockIdx.x
    first_row = b * child_index.shape[1]  # node i of request b is row b * N + i
    node = 0
    length = 1
    while node != NO_INDEX:  # warp 0 walks from the root, merging the visited rows' parts
        token = _merge_parts(part_val, part_idx, first_row + node, cuda.threadIdx.x)
        node, length = _accept_child(b, length, node, token, s_ptr, s_child, s_token, accepted)
    _end_walk(b, length, token, accepted, lengths, bonus)


_ROWS_F32 = float32[:, :, ::1]
register("posterior_argmax", posterior_argmax_kernel,
         ((_ROWS_F32, int32[::1], int32[:, ::1]),),
         "greedy posterior token per tree node: argmax over the vocabulary, one block per row",
         block_threads=MAX_ARGMAX_THREADS)
register("posterior_argmax_parts", posterior_argmax_parts_kernel,
         ((float32[:, ::1], int32[:, ::1], int32[::1], int32[:, ::1]),),
         "greedy posterior token per tree node from the fused lm_head's per-block (max, argmax) "
         "parts, one warp per row", block_threads=MAX_MERGE_THREADS)
register("posterior_sample", posterior_sample_kernel,
         ((_ROWS_F32, int32[::1], float64[::1], uint64[::1], int32[:, ::1], int32[:, ::1]),
          (_ROWS_F32, int32[::1], float64[::1], uint64[::1], int64[:, ::1], int32[:, ::1])),
         "posterior token per tree node: greedy or Gumbel-max on Philox4x32-10, one block per row",
         block_threads=MAX_SAMPLE_THREADS)
register("accept_walk", accept_walk_kernel,
         ((int32[:, ::1],) * 5 + (int32[::1], int32[::1]),),
         "acceptance walk over the child CSR, one block per request (tree staged in shared memory)",
         block_threads=WALK_THREADS)
register("accept_walk_parts", accept_walk_parts_kernel,
         ((float32[:, ::1], int32[:, ::1]) + (int32[:, ::1],) * 4 + (int32[::1], int32[::1]),),
         "acceptance walk that merges the fused lm_head's parts of the visited nodes only, one "
         "block per request (CSR and tokens staged in shared memory)", block_threads=WALK_THREADS)


# --- host-side argument checks (the array checks live in ._args) -----------------------------

def check_threads(threads: Any, name: str = "threads", maximum: int = MAX_WARPS * WARP_SIZE) -> int:
    """A block size: an int multiple of 32 in [32, maximum] (the kernel's registered
    block_threads, which the compile check holds its registers to)."""
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(threads).__name__}")
    if not (WARP_SIZE <= threads <= maximum and threads % WARP_SIZE == 0):
        raise ValueError(f"{name} must be a multiple of {WARP_SIZE} in [32, {maximum}], got {threads}")
    return int(threads)


# --- host wrappers ---------------------------------------------------------------------------

def _check_sizes(sizes: Any, bs: int, n_cap: int) -> Any:
    """sizes int32 [bs]; host values in [1, N]."""
    sizes = check_array(sizes, "sizes", (np.int32,), 1)
    check_shape(sizes, "sizes", (bs,))
    values = host_values(sizes)
    if values is not None and values.size and (values.min() < 1 or values.max() > n_cap):
        raise ValueError(f"sizes must be in [1, {n_cap}] (1 + drafted nodes, at most the capacity)")
    return sizes


def _check_finite_logits(logits: Any, sizes: Any) -> None:
    """Host logits: every real row (i < sizes[b]; all rows when sizes is a device array) is finite."""
    values = host_values(logits)
    if values is None or not values.size:
        return
    bad = ~np.isfinite(values).all(axis=2)  # [bs, N]
    n_real = host_values(sizes)
    if n_real is not None:
        bad &= np.arange(values.shape[1])[None, :] < n_real[:, None]  # padding rows are not read
    if bad.any():
        b, i = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(f"logits must be finite (NaN or infinity in request {b}, node {i})")


def _check_logits_and_out(logits: Any, out: Any) -> tuple[Any, Any]:
    """logits float32 [bs, N, V] with V >= 1; out int32 [bs, N]."""
    logits = check_array(logits, "logits", (np.float32,), 3)
    bs, n_cap, vocab = logits.shape
    if vocab < 1 or vocab > np.iinfo(np.int32).max:
        raise ValueError(f"logits: vocabulary size must be in [1, 2**31 - 1], got {vocab}")
    out = check_array(out, "out", (np.int32,), 2)
    check_shape(out, "out", (bs, n_cap))
    return logits, out


def posterior_argmax(logits: Any, sizes: Any, out: Any, *, stream: Any = 0,
                     threads: int = ARGMAX_THREADS) -> Any:
    """Greedy posterior token of every tree node: ``out[b, i] = argmax_v logits[b, i, v]``.

    Args:
        logits: float32 [bs, N, V], C-contiguous; finite (NumPy logits are checked on the
            host, real rows only when sizes is a NumPy array too; device logits are not).
        sizes: int32 [bs], tree sizes (1 + drafted nodes); rows i >= sizes[b] are not read.
        out: int32 [bs, N], caller-owned; padding rows get -1.
        stream: 0, a numba stream, or a cuda.core Stream / GraphBuilder.
        threads: block size, a multiple of 32 up to MAX_ARGMAX_THREADS (1024).

    Returns:
        ``out``. Ties go to the lowest token id (= ``np.argmax``).

    Raises:
        TypeError / ValueError naming the argument, before any launch.
    """
    logits, out = _check_logits_and_out(logits, out)
    bs, n_cap, _ = logits.shape
    sizes = _check_sizes(sizes, bs, n_cap)
    _check_finite_logits(logits, sizes)
    threads = check_threads(threads, maximum=MAX_ARGMAX_THREADS)
    if bs and n_cap:
        launch(posterior_argmax_kernel, (n_cap, bs), threads, stream, 0, logits, sizes, out)
    return out


def _check_parts(part_val: Any, part_idx: Any) -> tuple[Any, Any]:
    """part_val float32 [rows, P] with P >= 1, part_idx int32 of the same shape."""
    part_val = check_array(part_val, "part_val", (np.float32,), 2)
    rows, n_parts = part_val.shape
    if n_parts < 1:
        raise ValueError(f"part_val must have at least one part per row, got shape {(rows, n_parts)}")
    part_idx = check_array(part_idx, "part_idx", (np.int32,), 2)
    check_shape(part_idx, "part_idx", (rows, n_parts))
    return part_val, part_idx


def posterior_argmax_parts(part_val: Any, part_idx: Any, sizes: Any, out: Any, *,
                           stream: Any = 0, threads: int = MERGE_THREADS) -> Any:
    """Greedy posterior token of every tree node from the fused lm_head's parts.

    ``out[b, i]`` is what :func:`posterior_argmax` gives on the full logits row b * N + i when
    ``part_val`` / ``part_idx`` come from :func:`.linear.linear_argmax` on those rows: the
    largest part value, equal values resolved by the lowest id (the parts of a row hold disjoint
    column ranges, and the (value, id) ranking is order-free), NaN logits skipped, an all-NaN
    row ``NO_INDEX``.

    Args:
        part_val: float32 [bs * N, P], C-contiguous: per row (node i of request b is row
            b * N + i), per column block, the largest logit (P = ``linear.argmax_parts(V)``).
        part_idx: int32 [bs * N, P], C-contiguous: the lowest token id holding it.
        sizes: int32 [bs], tree sizes in [1, N]; rows i >= sizes[b] are not read.
        out: int32 [bs, N], caller-owned; padding rows get -1.
        stream: 0, a numba stream, or a cuda.core Stream / GraphBuilder.
        threads: block size (one row per warp), a multiple of 32 up to MAX_MERGE_THREADS.

    Returns:
        ``out``. Device values are not read on the host (graph-capturable).

    Raises:
        TypeError / ValueError naming the argument, before any launch.
    """
    part_val, part_idx = _check_parts(part_val, part_idx)
    rows = part_val.shape[0]
    out = check_array(out, "out", (np.int32,), 2)
    bs, n_cap = out.shape
    if bs * n_cap != rows:
        raise ValueError(f"out must have shape (bs, N) with bs * N = {rows} (the rows of "
                         f"part_val), got {tuple(out.shape)}")
    sizes = _check_sizes(sizes, bs, n_cap)
    threads = check_threads(threads, maximum=MAX_MERGE_THREADS)
    if rows:
        launch(posterior_argmax_parts_kernel, -(-rows // (threads // WARP_SIZE)), threads, stream,
               0, part_val, part_idx, sizes, out)
    return out


def posterior_sample(logits: Any, sizes: Any, temperatures: Any, seeds: Any, positions: Any,
                     out: Any, *, stream: Any = 0, threads: int = ARGMAX_THREADS) -> Any:
    """Posterior token of every tree node, greedy or sampled per request.

    Request b is greedy when ``temperatures[b] < GREEDY_TEMPERATURE``; otherwise each row is
    Gumbel-max sampled exactly as ``reference.sampling.sample_posterior(logits[b], T, seed,
    positions[b])``: noise keyed by (seed, position, token), never by node index, so sampled
    DDTree reproduces sampled autoregressive decoding token for token.

    Args:
        logits: float32 [bs, N, V], C-contiguous; finite (NumPy logits are checked on the
            host, real rows only when sizes is a NumPy array too; device logits are not).
        sizes: int32 [bs]; rows i >= sizes[b] are not read.
        temperatures: float64 [bs], >= 0.
        seeds: uint64 [bs] (int64 is taken as the same 64 bits).
        positions: int32 or int64 [bs, N], >= 0: node positions past_len + depth (spec §1.3).
        out: int32 [bs, N], caller-owned; padding rows get -1.
        stream: as :func:`posterior_argmax`.
        threads: block size, a multiple of 32 up to MAX_SAMPLE_THREADS (512: the kernel's
            registers do not allow 1024 threads on sm_120).

    Returns:
        ``out``.

    Raises:
        TypeError / ValueError naming the argument, before any launch.
    """
    logits, out = _check_logits_and_out(logits, out)
    bs, n_cap, _ = logits.shape
    sizes = _check_sizes(sizes, bs, n_cap)
    _check_finite_logits(logits, sizes)
    temperatures = check_array(temperatures, "temperatures", (np.float64,), 1)
    check_shape(temperatures, "temperatures", (bs,))
    values = host_values(temperatures)
    if values is not None and not (np.all(np.isfinite(values)) and np.all(values >= 0.0)):
        raise ValueError("temperatures must be finite and >= 0")
    seeds = check_array(seeds, "seeds", (np.uint64, np.int64), 1)
    check_shape(seeds, "seeds", (bs,))
    if np.dtype(seeds.dtype) == np.int64:
        seeds = seeds.view(np.uint64)  # same bits; the kernel keys Philox with (lo, hi) words
    positions = check_array(positions, "positions", (np.int32, np.int64), 2)
    check_shape(positions, "positions", (bs, n_cap))
    values = host_values(positions)
    if values is not None and values.size and values.min() < 0:
        raise ValueError("positions must be >= 0")
    threads = check_threads(threads, maximum=MAX_SAMPLE_THREADS)
    if bs and n_cap:
        launch(posterior_sample_kernel, (n_cap, bs), threads, stream, 0,
               logits, sizes, temperatures, seeds, positions, out)
    return out


def walk_shared_bytes(n_cap: int, *, posterior: bool = True) -> int:
    """Dynamic shared memory of :func:`accept_walk` for capacity N: child_ptr [N + 1],
    child_index, tokens and posterior [N], int32; without the posterior (``posterior=False``)
    for :func:`accept_walk_parts`."""
    return 4 * ((4 if posterior else 3) * n_cap + 1)


def _check_csr(child_ptr: Any, child_index: Any) -> None:
    """Host CSR: child_ptr non-decreasing within [0, N - 1], real child_index entries
    (child_ptr[b, 0] <= j < child_ptr[b, N]) within [1, N). Device values are not read."""
    ptr = host_values(child_ptr)  # [bs, N + 1]
    if ptr is None or not ptr.size:
        return
    n_cap = ptr.shape[1] - 1
    if ptr.min() < 0 or ptr.max() > n_cap - 1 or np.any(np.diff(ptr, axis=1) < 0):
        raise ValueError(f"child_ptr must be non-decreasing within [0, {n_cap - 1}] (CSR offsets)")
    index = host_values(child_index)  # [bs, N]
    if index is None:
        return
    j = np.arange(n_cap)[None, :]
    real = (j >= ptr[:, :1]) & (j < ptr[:, -1:])  # [bs, N] entries inside some child range
    if np.any(real & ((index < 1) | (index >= n_cap))):
        raise ValueError(f"child_index must be in [1, {n_cap}) on real entries "
                         "(child_ptr[b, 0] <= j < child_ptr[b, N])")


def _check_posterior_values(posterior: Any, child_ptr: Any) -> None:
    """Host posterior >= 0 on the real nodes 0 .. E of each tree, E = its edge count
    child_ptr[b, N] - child_ptr[b, 0] (padding nodes follow the real ones and are ignored)."""
    post, ptr = host_values(posterior), host_values(child_ptr)
    if post is None or ptr is None or not post.size:
        return
    n_real = ptr[:, -1] - ptr[:, 0] + 1  # [bs]
    real = np.arange(post.shape[1])[None, :] < n_real[:, None]  # [bs, N]
    if np.any(real & (post < 0)):
        raise ValueError("posterior must be >= 0 on real (non-padding) nodes")


def accept_walk(posterior: Any, child_ptr: Any, child_index: Any, tokens: Any,
                accepted: Any, lengths: Any, bonus: Any, *, stream: Any = 0) -> None:
    """The acceptance walk of every request, bit-exact against ``reference.accept_batch``.

    Args:
        posterior: int32 [bs, N], the target's token at every node (padding rows ignored).
        child_ptr: int32 [bs, N + 1], child_index: int32 [bs, N], tokens: int32 [bs, N]:
            the padded TreeBatch layout (children of p: child_index[b, child_ptr[b, p] :
            child_ptr[b, p + 1]], ascending node index). NumPy values are checked before the
            launch (child_ptr non-decreasing within [0, N - 1]; child_index within [1, N) on
            real entries; posterior >= 0 on the E + 1 real nodes, E = child_ptr[b, N] -
            child_ptr[b, 0], when child_ptr is a NumPy array too). Device values are not
            checked (no sync); malformed ones never index out of bounds: a node's child range
            is clamped to [0, N) and children outside [1, N) are skipped.
        accepted: int32 [bs, W], caller-owned, W >= 1 (use L + 1): accepted node indices,
            root first, padded with -1; at most W nodes are accepted.
        lengths: int32 [bs], caller-owned: number of accepted nodes (>= 1, root included).
        bonus: int32 [bs], caller-owned: the next round's root token.
        stream: 0, a numba stream, or a cuda.core Stream / GraphBuilder.

    Raises:
        TypeError / ValueError naming the argument (dtype, rank, shape, contiguity, host
        values), before any launch, or LaunchConfigError when N is too large for the walk's shared memory (N <= 3071).
    """
    posterior = check_array(posterior, "posterior", (np.int32,), 2)
    bs, n_cap = posterior.shape
    child_ptr = check_array(child_ptr, "child_ptr", (np.int32,), 2)
    check_shape(child_ptr, "child_ptr", (bs, n_cap + 1))
    tree = _check_tree_and_outputs(child_ptr, child_index, tokens, accepted, lengths, bonus)
    if n_cap < 1:
        raise ValueError("posterior must have at least one node per request (the root)")
    _check_csr(child_ptr, tree[0])
    _check_posterior_values(posterior, child_ptr)
    if bs:
        launch(accept_walk_kernel, bs, WALK_THREADS, stream, walk_shared_bytes(n_cap),
               posterior, child_ptr, *tree)


def _check_tree_and_outputs(child_ptr: Any, child_index: Any, tokens: Any, accepted: Any,
                            lengths: Any, bonus: Any) -> tuple[Any, ...]:
    """The walk's arguments after a checked child_ptr [bs, N + 1]: child_index and tokens int32
    [bs, N], accepted int32 [bs, W] with W >= 1, lengths and bonus int32 [bs] (in that order)."""
    bs, n_cap = child_ptr.shape[0], child_ptr.shape[1] - 1
    child_index = check_array(child_index, "child_index", (np.int32,), 2)
    check_shape(child_index, "child_index", (bs, n_cap))
    tokens = check_array(tokens, "tokens", (np.int32,), 2)
    check_shape(tokens, "tokens", (bs, n_cap))
    accepted = check_array(accepted, "accepted", (np.int32,), 2)
    if accepted.shape[0] != bs or accepted.shape[1] < 1:
        raise ValueError(f"accepted must have shape ({bs}, W) with W >= 1, got {tuple(accepted.shape)}")
    lengths = check_array(lengths, "lengths", (np.int32,), 1)
    check_shape(lengths, "lengths", (bs,))
    bonus = check_array(bonus, "bonus", (np.int32,), 1)
    check_shape(bonus, "bonus", (bs,))
    return child_index, tokens, accepted, lengths, bonus


def accept_walk_parts(part_val: Any, part_idx: Any, child_ptr: Any, child_index: Any, tokens: Any,
                      accepted: Any, lengths: Any, bonus: Any, *, stream: Any = 0) -> None:
    """The greedy acceptance walk straight from the fused lm_head's parts, one launch.

    Bit for bit :func:`posterior_argmax_parts` (any sizes) followed by :func:`accept_walk` on its
    posterior, but only the parts of the nodes the walk visits (at most W rows per request) are
    merged and nothing is staged for the others: ties go to the lowest id, NaN parts are
    skipped, an all-NaN row gives ``NO_INDEX``, which matches no child and becomes the bonus.

    Args:
        part_val: float32 [bs * N, P], C-contiguous, P >= 1: per row (node i of request b is row
            b * N + i), per column block, the largest logit (:func:`.linear.linear_argmax`).
        part_idx: int32 [bs * N, P], C-contiguous: the lowest token id holding it.
        child_ptr, child_index, tokens, accepted, lengths, bonus: as :func:`accept_walk` (bs and
            N come from child_ptr [bs, N + 1], N >= 1).
        stream: 0, a numba stream, or a cuda.core Stream / GraphBuilder.

    Checked on the host, before any launch: every argument's dtype, rank, shape and
    contiguity, and NumPy CSR values as :func:`accept_walk` does. Not checked: the part values,
    NumPy or device (any float32 is a valid logit maximum here: NaN parts are skipped, so there
    is no invalid value to reject), and hence the merged posterior, which is the kernel's own
    result (:func:`accept_walk` checks a NumPy posterior >= 0; a merged id that is no child's
    token simply ends the walk as the bonus). Device CSR values are not checked; malformed ones
    never index out of bounds (clamped as in :func:`accept_walk`). Unlike
    :func:`posterior_argmax_parts` there are no sizes: the walk only reaches real nodes of a
    well-formed tree, so padding rows are never read (a malformed device CSR that leads to a
    padding node merges that row's parts, where the two launches would use its -1).

    Raises:
        TypeError / ValueError naming the argument, before any launch, or LaunchConfigError when
        N is too large for the walk's shared memory (N <= 4095).
    """
    part_val, part_idx = _check_parts(part_val, part_idx)
    rows = part_val.shape[0]
    child_ptr = check_array(child_ptr, "child_ptr", (np.int32,), 2)
    bs, n_cap = child_ptr.shape[0], child_ptr.shape[1] - 1
    if n_cap < 1:
        raise ValueError(f"child_ptr must have shape (bs, N + 1) with N >= 1 (the root), "
                         f"got {tuple(child_ptr.shape)}")
    if bs * n_cap != rows:
        raise ValueError(f"child_ptr must have shape (bs, N + 1) with bs * N = {rows} (the rows of "
                         f"part_val), got {tuple(child_ptr.shape)}")
    tree = _check_tree_and_outputs(child_ptr, child_index, tokens, accepted, lengths, bonus)
    _check_csr(child_ptr, tree[0])
    if bs:
        launch(accept_walk_parts_kernel, bs, WALK_THREADS, stream,
               walk_shared_bytes(n_cap, posterior=False), part_val, part_idx, child_ptr, *tree)
