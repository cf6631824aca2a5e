"""Fused log-softmax top-k over the vocabulary (spec §1.2; limits §6, "fused per-chunk top-K + merge").

For each of R rows of drafter logits ``[R, V]`` (float32, or bf16 passed as uint16 bit patterns,
limits §4) this computes ``reference.topk_log_probs``: the k' = min(k, V) largest logits ordered by
logit descending, equal logits by lower token id, and their log-probabilities
``logit - logsumexp(row)``. The logits are read from HBM once.

Algorithm. A row is split into ``n_chunks`` chunks; one block per (chunk, row):

1. *Stream.* Each thread reads four 64-bit words per iteration (16 bf16 or 8 fp32 elements;
   8 scalar words when V is not a multiple of the packing), WARP_SIZE words apart inside its
   warp's contiguous run (coalesced loads at immediate offsets). It keeps an online
   ``(reference, sum of exp(x - reference))`` pair (float32 terms, float64 running sum), the
   batch maximum (for the filter) and the minimum (for the NaN/inf check). The reference lags
   the running max by up to REFERENCE_HEADROOM nats, so the rescale-and-resum path is rare
   per warp, not just per thread. Software pipeline: the next iteration's words are loaded
   before the current ones are processed, so every thread always has 32 bytes in flight,
   across the iteration's barrier.
2. *Filter.* Every element is a 64-bit **composite** ``(order_key(logit) << 32) | (2^32-1 - id)``:
   composites are unique and their unsigned order is exactly the reference order (value
   descending, then id ascending), so ties never need special handling, across chunk boundaries
   included. The block keeps a candidate buffer in shared memory and a threshold T that is a lower
   bound on the chunk's k'-th largest composite; elements below T cannot be in the top k' and are
   dropped with one float compare (on the thread's batch maximum first). Survivors are appended
   with a shared atomic (their word re-read from L1 by a loop over the set bits of a candidate
   mask); when the buffer overflows it is *compacted*: bitonic-sorted, cut to its k' largest,
   and T raised to the k'-th. Overflowing threads keep their candidates (mask bits) and retry,
   so the buffer size is independent of the block size; one block barrier per iteration when
   nothing overflows. Iteration 0 seeds T with the k'-th largest of the threads' first maxima
   (then empties the buffer), so on typical logits only ~k' ln(V / k') elements per row ever
   reach the buffer.
3. *Finish.* With one chunk per row (the plan's choice for large batches) the block sorts its
   buffer and writes values and ids directly. Otherwise it writes its top-k' composites and
   ``(max, sum)`` to the workspace and a merge kernel (one block per row) combines the log-sum-exps
   and runs the same filter over the ``n_chunks * k'`` candidates.

Per-warp buffers (opt-in, ``plan_topk(warp_buffers=True)``; bf16 with k' <= WARP_MAX_K; the f32 and
scalar variants still spill on sm_90 and are not registered). Measured slower than the block kernel
on the H200 (413 vs 214 us, 1024 bf16 rows, k 32): the per-warp thresholds admit ~8x the candidates. The
block-buffer kernel above pays a block barrier per iteration, so each block waits for its
slowest warp's load (H200: ~1.56 TB/s for bf16, 2.76x one read at 1024 rows, k 32). The
``topk_warp_*`` kernels give each warp its own segment of the buffer and its own threshold
(seeded from the k'-th largest of its lanes' first maxima): slots come from a ballot, a full
segment is sorted and cut by the warp alone, and the block meets only once, after the chunk, to
merge the warps' sorted top-k' runs (one bitonic merge). The streaming loop keeps the next
iteration's words in flight (a two-word-set ring); a compaction re-issues those loads instead of
holding them across its sort, and word indices are int32, which keeps the loop at 80 registers
without spills (3 blocks of 256 threads per SM). Each warp must find its own top k', so it sees
~8x more candidates than the block would (~k' ln(n/k') per warp): cheap ballot rounds, mostly
in the first iterations.

Segment mode (the default where k' is small against the chunk, ``plan_topk(segments=...)``). The
block-buffer kernel above spent most of its time outside the arithmetic: on the H200 (960 bf16 rows
of 163840, k 32) ncu counted ~24 issued instructions per element and barrier waits as the largest
stall (3.7 of 11 cycles per issued instruction), from the per-iteration ``syncthreads_or``, the
offers and the compactions. Segment mode drops the filter from the stream: each warp-iteration
(unroll x WARP_SIZE consecutive words) is a *segment*, and the stream keeps only the log-sum-exp
and each segment's maximum (one warp max, a shared store; no block barrier). Then the block finds T
= the k'-th largest segment maximum by a radix select (:func:`_select_kth_key`: four passes of
8-bit digits over the order keys, two for bf16 logits, whose keys' low half follows from the sign;
three barriers a pass; the bitonic sort of all segment maxima it replaced had 45 barrier-separated
layers). k' segments reach T, so the k'-th largest logit is >= T, and every top-k' element is >= T
and lies in a segment whose maximum is >= T (the *flagged* segments). Each warp lists the flagged
segments it streamed (a ballot over its segment maxima) in one shared list; after one barrier entry
e of the list goes to warp e mod n_warps (every warp gets the same number give or take one), which
re-reads its share RESCAN_BATCH at a time with their loads in flight together and offers the
elements >= T to the candidate buffer (``above`` / ``offer`` as above) with no block barrier. If a
push finds the buffer full (only when many elements tie at or above T: constant or few-level rows),
the block empties it and re-reads the flagged segments in the barrier-per-round protocol with
compactions, so ties and constant rows stay exact. A list overflow (more than FLAG_LIST_ENTRIES
flagged segments) takes the same path. With at most RANKED_FINISH_PER_THREAD candidates a thread at
the end (typical rows: k' to 2 k'), each thread of the packed kernels ranks its candidates by
counting the larger ones and writes them to their places, without the sort. Typical rows flag ~k'
segments, i.e. k' x unroll x 32 words re-read (k 32, bf16: 10 % of the row); the plan takes segment
mode only where k' <= (segments per chunk) / SEGMENT_RESCAN_SHARE, and a row of at most
SEGMENT_SINGLE_CHUNK_ITERS block-iterations as one chunk (no merge launch). With more blocks than
one wave of 256-thread blocks (4 per SM), the plan launches MANY_ROWS_THREADS = 128 threads: 8
blocks share an SM, so up to 1056 rows stream in one wave and their latency-bound tails (selection,
re-read, output) overlap once instead of twice. Measured on the H200 (docs/PERFORMANCE.md, run
top-k 3, eeda227): 1024 x 163840 bf16, k 32: 111.1-111.5 us (1.42-1.43 x one read); 960 rows:
108.8-109.2 us (1.49 x; another call of the same session: 111.4); k 8: 97-98 us. Before the list
and the ranked finish, in the same run: 116.9 and 114.1 us; at f80d338 (sorted maxima replaced by
the radix select): 119.2 and 116.1; the first segment mode: 160.7 (960 rows); the block kernel:
206.4. What is left is mostly the stream: the last blocks stop streaming ~90 us in, ~20 us after
the median block.

Cost of the stream: one read of the logits plus ~6 instructions per bf16 element (unpack,
subtract, scale, ex2, add; max and min of two elements at once with ``max/min.bf16x2``). The
exp is ``ex2.approx`` through inline PTX: numba's ``math.exp`` compiles to libdevice's
range-reduced expf even under fastmath (9 instructions with the subtract). Launch bounds cap
the kernels at 64 registers (no spills, checked for sm_90 and sm_120): 4 blocks of 256
threads (or 8 of 128) per SM. Worst case for the block kernel (logits ascending along the row, every
element a new top-k') each element reaches the buffer and the kernel is compaction-bound:
still exact, just slower; in segment mode a constant row flags every segment (a second read).

Precision (the stated tolerance): each exp is ``ex2.approx`` of a float32 argument, summed in
float32 over 16 elements and in float64 beyond; the log-sum-exp is formed in float64. The error of
the log-sum-exp is below ~1e-6 and the final float32 rounding adds one ulp, so
``|value - reference| <= VALUE_ATOL + VALUE_RTOL * |reference|``. Ids are bit-exact. (A NumPy
emulation of this arithmetic, lagged reference included, at V = 163840 on Gaussian (std 2.5, 5,
8), peaked, ramp, offset, uniform, constant and step rows, f32 and bf16, with ex2 perturbed by
+-2^-22, gave log-sum-exp errors <= 2.2e-7; VALUE_ATOL leaves room for the worst-case argument
rounding, see REFERENCE_HEADROOM.) -0.0 ranks as
+0.0, as in the reference's float comparison.

Non-finite logits. The reference rejects NaN/inf. NumPy (host) logits are checked on the host
before any launch, so nothing is written. Device logits cannot be checked without a copy, so each
block detects them in the same pass (a NaN makes the float64 sum NaN, +inf makes it NaN through
inf - inf, -inf shows in the minimum) and the finishing block writes a per-row error flag to the
workspace. That check happens *after* the launches (outputs are already written; those of a flagged
row are unspecified): ``run_topk(check=True)`` reads the flags back (one device-to-host copy, i.e. a
stream sync) and raises ``ValueError`` naming 'logits'; inside CUDA-graph capture pass
``check=False`` (no check at all) and call :func:`check_topk_errors` after the replay.

Public API (FlashInfer-style plan/run split, stack §8): :class:`TopKPlan`, :func:`plan_topk`,
:func:`run_topk`, :func:`check_topk_errors`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from llvmlite import ir
from numba import cuda, float32, float64, int16, int32, int64, types, uint16, uint32, uint64
from numba.core.extending import intrinsic

from sim.install import simulator_active
from sim.launch import launch, launch_bounds

from ._args import check_array, data_address, int_arg
from .pdl import pdl_begin
from .registry import register
from .warp import warp_inclusive_scan_i32, warp_max_f32

__all__ = [
    "TopKPlan", "plan_topk", "run_topk", "check_topk_errors", "VALUE_ATOL", "VALUE_RTOL", "MAX_K", "WARP_MAX_K",
    "WORDS_PER_THREAD",
]

# --- tolerances and limits --------------------------------------------------------------------
VALUE_ATOL = 2e-6  # log-sum-exp error budget (approximate exp, float32 terms)
VALUE_RTOL = 2.5e-7  # ~2 ulp of float32: the reference rounds float64 -> float32 once too
MAX_K = 1024  # largest k' = min(k, V) (issue: "K up to 1024")
MAX_THREADS = 256  # launch bound and static reduction scratch; block sizes are powers of two up to this
MAX_WARPS = MAX_THREADS // 32
MIN_THREADS = 32
WARP_SIZE = 32  # a thread's words in one iteration are WARP_SIZE apart (compile-time load offsets)
MAX_REGISTERS = 64  # per thread in the block-buffer chunk kernel (launch bounds)
WARP_MAX_REGISTERS = 80  # per thread in the per-warp kernel
REGISTER_FILE = 65536  # 32-bit registers per SM (sm_90, sm_120)
DEFAULT_THREADS = 256
MANY_ROWS_THREADS = 128  # segment mode, more blocks than one wave of 256-thread blocks: 8 blocks per SM
MAX_CAPACITY = 4096  # candidate buffer entries: 32 KiB of uint64 (+ 4 KiB static) < 48 KiB (limits §4)
CAPACITY_PER_K = 4  # buffer of ~4 k' entries: each compaction absorbs >= 3 k' new candidates
WORDS_PER_THREAD = 4  # uint64 words each thread loads per iteration (32 B; 8 would spill at 64 registers)
SCALAR_ELEMS_PER_THREAD = 8  # elements per thread per iteration on the one-element-per-load path
DEFAULT_SM_COUNT = 132  # H200; used when no GPU can be asked
BLOCKS_PER_SM = 4  # resident 256-thread blocks per SM at <= 64 registers: one wave = SMs x 4
WARP_BLOCKS_PER_SM = REGISTER_FILE // (MAX_THREADS * WARP_MAX_REGISTERS)  # 3 resident 256-thread blocks (per-warp kernel)
MAX_SEGMENT_SLOTS = 2048  # segment mode: segment maxima per chunk (a power of two; 16 KiB of uint64)
MAX_DYNAMIC_ENTRIES = 5120  # candidates + segment maxima per block: 40 KiB of uint64, < 48 KiB with the static arrays
SEGMENT_RESCAN_SHARE = 4  # segment mode by default where k' <= a chunk's segments / this (<= 1/4 re-read)
SEGMENT_SINGLE_CHUNK_ITERS = 16  # default: one segment-mode chunk per row when a row is at most this many block-iterations
RADIX_BITS = 8  # segment-mode threshold: radix select over 32-bit keys, one byte a pass
RADIX_BINS = 1 << RADIX_BITS
RADIX_MASK = uint64(RADIX_BINS - 1)
BINS_PER_LANE = RADIX_BINS // 32  # warp 0 scans the bins
KEY_BITS = 32
FLAG_LIST_ENTRIES = 1024  # segment mode: flagged segments listed per block (int16; more: ties at T, re-read in rounds)
assert MAX_SEGMENT_SLOTS <= 1 << 15, "flag_list holds segment numbers as int16"
RANKED_FINISH_PER_THREAD = 2  # segment mode: rank (not sort) the final candidates up to this many a thread
RESCAN_BATCH = 2  # segment mode: flagged segments a warp re-reads with their loads in flight together (4 spill)
MIN_CHUNK_ITERS = 2  # a chunk is at least this many block-iterations long (amortises compaction)
FULL_MASK = 0xFFFFFFFF  # every lane of the warp takes part in a vote
WARP_MAX_K = 128  # per-warp candidate buffers up to this k': 8 warps x 4 k' x 8 B <= 32 KiB
CONTIGUOUS = 30  # run_shift of a plain array in _physical (runs longer than any buffer)

# --- composite keys and sentinels ----------------------------------------------------------------
SIGN_BIT = uint32(0x80000000)
ALL_32 = uint32(0xFFFFFFFF)
EXP_BITS_32 = 0x7F800000  # all-ones exponent: inf or NaN
EXP_BITS_64 = 0x7FF0000000000000
ID_MASK = uint64(0xFFFFFFFF)
HIGH_HALF = uint32(0xFFFF0000)  # the bf16 in the high half of a uint32, already in float32 position
SHIFT_32 = uint64(32)
EMPTY = uint64(0)  # no candidate: a real composite has a nonzero key or id field
REJECT_ALL = uint64(0xFFFFFFFFFFFFFFFF)  # threshold for k' = 0: nothing is a candidate
# The kernels use fastmath (ftz, approximate exp), under which the compiler may assume no
# infinities or NaNs; so the sentinels are finite and the NaN/inf check reads bit patterns.
LOWEST = float32(np.finfo(np.float32).min)
HIGHEST = float32(np.finfo(np.float32).max)

_WORD_BYTES = 8  # the packed path reads uint64 words
_ELEM_BITS = {"float32": 32, "bfloat16": 16}
_ELEM_DTYPE = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(np.uint16)}
_NARROW_WORD = {"float32": np.dtype(np.uint32), "bfloat16": np.dtype(np.uint16)}
_EX2_OVERFLOW = 128.0  # 2 ** x > float32 max beyond this
_EXP_OVERFLOW = 88.0  # exp(x) > float32 max beyond this
LOG2E = float32(1.4426950408889634)  # exp(d) = 2 ** (d log2 e); the product is rounded to float32
# A thread's exp reference m lags its running max: it moves up only when a batch max exceeds it
# by more than this many nats. Moving it on every new max ran the second pass and its float64
# exp in most warp-iterations (some lane of 32 nearly always has a new max); with the headroom
# it runs in a thread's first iteration and then rarely. The float32 exp argument (x - m) log2 e
# is then up to ~11.5 instead of <= 0, so its rounding costs up to ~8e-7 relative per term; a
# larger headroom would eat the VALUE_ATOL budget (24 nats: up to ~2.3e-6).
REFERENCE_HEADROOM = float32(8.0)

# --- bit casts and exp: libdevice on the GPU, NumPy in the simulator (which has no libdevice) -----
if simulator_active():

    def _f32_from_bits(bits):
        """float32 whose bit pattern is ``bits`` (uint32)."""
        return np.uint32(bits).view(np.float32)

    def _f32_bits(x):
        """Bit pattern of float32 ``x``."""
        return np.float32(x).view(np.uint32)

    def _f64_bits(x):
        """Bit pattern of float64 ``x``."""
        return np.float64(x).view(np.uint64)

    def _exp_of_diff(x, m):
        """exp(x - m) of float32s as the GPU forms it: 2 ** ((x - m) * LOG2E), each step rounded to
        float32 (inf on overflow, like ex2.approx)."""
        d = np.float32(x - m)
        if d > _EXP_OVERFLOW:  # the product below would overflow float32 too: ex2 gives inf
            return np.float32(np.inf)
        arg = np.float32(d * LOG2E)
        return np.float32(math.pow(2.0, arg)) if arg < _EX2_OVERFLOW else np.float32(np.inf)

    def _bf16x2_pick(a, b, larger):
        """Per 16-bit half of uint32 ``a`` and ``b`` (bf16 bits), the larger / smaller value's bits;
        a NaN half loses to a number (PTX max/min.bf16x2 without .NaN)."""
        out = 0
        for shift in (0, 16):
            ha, hb = (int(a) >> shift) & 0xFFFF, (int(b) >> shift) & 0xFFFF
            xa, xb = (np.uint32(h << 16).view(np.float32) for h in (ha, hb))
            if np.isnan(xa) or (not np.isnan(xb) and (xb > xa if larger else xb < xa)):
                ha = hb
            out |= ha << shift
        return np.uint32(out)

    def _bf16x2_max(a, b):
        """Per-half maximum of two bf16x2 words."""
        return _bf16x2_pick(a, b, True)

    def _bf16x2_min(a, b):
        """Per-half minimum of two bf16x2 words."""
        return _bf16x2_pick(a, b, False)

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def _f32_from_bits(bits):
        """float32 whose bit pattern is ``bits`` (uint32): a register move."""
        return libdevice.int_as_float(int32(bits))

    _f32_bits = libdevice.float_as_int
    _f64_bits = libdevice.double_as_longlong

    @intrinsic
    def _ex2_approx(typingctx, x):
        """2 ** x for float32 ``x``: ``ex2.approx.ftz.f32``, one MUFU.EX2 (max relative error 2^-22)."""
        if x != types.float32:
            return None

        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType()])
            return builder.call(ir.InlineAsm(fnty, "ex2.approx.ftz.f32 $0, $1;", "=f,f"), args)

        return types.float32(types.float32), codegen

    def _bf16x2_intrinsic(op: str):
        """``<op>.bf16x2`` on two uint32 words of two bf16 each (one HMNMX2; a NaN half loses)."""

        @intrinsic
        def bf16x2_op(typingctx, a, b):
            if a != types.uint32 or b != types.uint32:
                return None

            def codegen(context, builder, signature, args):
                fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32), ir.IntType(32)])
                return builder.call(ir.InlineAsm(fnty, f"{op}.bf16x2 $0, $1, $2;", "=r,r,r"), args)

            return types.uint32(types.uint32, types.uint32), codegen

        return bf16x2_op

    _bf16x2_max = _bf16x2_intrinsic("max")
    _bf16x2_min = _bf16x2_intrinsic("min")

    @cuda.jit(device=True, inline=True)
    def _exp_of_diff(x, m):
        """exp(x - m) of float32s: FADD, FMUL, MUFU.EX2. math.exp, even under fastmath, compiles to
        libdevice's range-reduced expf (9 instructions with the subtract: 2.3x this), which made
        the streaming loop issue-bound."""
        return _ex2_approx((x - m) * LOG2E)


# --- device functions -------------------------------------------------------------------------

@cuda.jit(device=True, inline=True)
def _order_key(bits):
    """uint32 key whose unsigned order is the float order of the float32 with bit pattern ``bits``.

    -0.0 maps to the key of +0.0: they compare equal in the reference, so the lower id wins.
    """
    if bits == SIGN_BIT:
        return SIGN_BIT
    if bits & SIGN_BIT:
        return ~bits & ALL_32
    return bits | SIGN_BIT


@cuda.jit(device=True, inline=True)
def _composite(bits, col):
    """uint64 candidate: order key high, ``2^32-1 - col`` low (larger = earlier in top-k order)."""
    return (uint64(_order_key(bits)) << SHIFT_32) | (ID_MASK - uint64(col))


@cuda.jit(device=True, inline=True)
def _composite_value(c):
    """The float32 logit of composite ``c``."""
    key = uint32(c >> SHIFT_32)
    if key & SIGN_BIT:
        return _f32_from_bits(key ^ SIGN_BIT)
    return _f32_from_bits(~key & ALL_32)


@cuda.jit(device=True, inline=True)
def _composite_id(c):
    """The token id of composite ``c``."""
    return int32(ID_MASK - (c & ID_MASK))


@cuda.jit(device=True, inline=True)
def _non_finite_f32(x):
    """True if float32 ``x`` is inf or NaN (from its bits: valid under fastmath)."""
    return (_f32_bits(x) & EXP_BITS_32) == EXP_BITS_32


@cuda.jit(device=True, inline=True)
def _non_finite_f64(x):
    """True if float64 ``x`` is inf or NaN (from its bits: valid under fastmath)."""
    return (_f64_bits(x) & EXP_BITS_64) == EXP_BITS_64


@cuda.jit(device=True, inline=True)
def _exchange_desc(buf, lo, hi):
    """Order ``buf[lo] >= buf[hi]`` (uint64 composites)."""
    a = buf[lo]
    b = buf[hi]
    if a < b:
        buf[lo] = b
        buf[hi] = a


@cuda.jit(device=True, inline=True)
def _layer_pair(i, size, stride):
    """(lo, hi) virtual indices of compare-exchange ``i`` of one layer of the descending sorter.

    All runs are kept descending ("flip" form of the bitonic sorter): the first layer of a merge
    of two runs of ``size // 2`` pairs element t with element size - 1 - t of its block
    (``lo ^ (size - 1)``); the later layers are half-cleaners at ``stride``.
    """
    lo = 2 * i - (i & (stride - 1))  # first index of pair i at this stride
    if 2 * stride == size:
        return lo, lo ^ (size - 1)
    return lo, lo + stride


@cuda.jit(device=True, inline=True)
def _physical(v, run_shift, seg):
    """Buffer index of virtual index ``v``: runs of ``2^run_shift`` entries, ``seg`` entries apart."""
    return (v >> run_shift) * seg + (v & ((1 << run_shift) - 1))


@cuda.jit(device=True)
def _bitonic_sort_desc(buf, n2, sorted_run, run_shift, seg, tid, nt):
    """Sort ``n2`` entries (a power of two) of ``buf`` descending; every thread of the block calls.

    The entries are runs of ``2^run_shift`` consecutive slots, ``seg`` slots apart (``seg =
    2^run_shift``: one contiguous array). Runs of ``sorted_run`` entries (a power of two) are
    already sorted descending: 1 for a full sort, the run length to merge per-warp results.
    """
    size = 2 * sorted_run
    while size <= n2:
        stride = size // 2
        while stride > 0:
            i = tid  # strided while loops: a range() with a runtime step costs a 64-bit division
            while i < n2 // 2:
                lo, hi = _layer_pair(i, size, stride)
                _exchange_desc(buf, _physical(lo, run_shift, seg), _physical(hi, run_shift, seg))
                i += nt
            cuda.syncthreads()  # this compare-exchange layer is complete before the next reads it
            stride //= 2
        size *= 2


@cuda.jit(device=True)
def _warp_sort_desc(buf, seg0, n2, lane):
    """Sort ``buf[seg0 : seg0 + n2]`` (n2 a power of two) descending; the 32 lanes of one warp call."""
    size = 2
    while size <= n2:
        stride = size // 2
        while stride > 0:
            i = lane
            while i < n2 // 2:
                lo, hi = _layer_pair(i, size, stride)
                _exchange_desc(buf, seg0 + lo, seg0 + hi)
                i += WARP_SIZE
            cuda.syncwarp(FULL_MASK)  # this layer's stores are visible to the warp before the next
            stride //= 2
        size *= 2


@cuda.jit(device=True)
def _compact(buf, count, thresh, thresh_val, k, cap, tid, nt):
    """Sort the candidate buffer, keep its k largest and raise the threshold to the k-th.

    ``count[0]`` may exceed ``cap`` (pushes that found the buffer full); those candidates are
    still held by their threads. Afterwards ``buf[:count[0]]`` is sorted descending,
    ``count[0] = min(n, k)``, and ``thresh`` is the k-th largest composite if there were >= k
    (unchanged, i.e. accept everything, otherwise; REJECT_ALL when k = 0).
    """
    n = min(count[0], cap)
    n2 = 1
    while n2 < n:
        n2 *= 2
    cuda.syncthreads()  # every thread has read count before it is rewritten below
    i = n + tid
    while i < n2:
        buf[i] = EMPTY  # padding sorts last
        i += nt
    cuda.syncthreads()  # padding is written before the sort reads it
    _bitonic_sort_desc(buf, n2, 1, CONTIGUOUS, 0, tid, nt)
    if tid == 0:
        count[0] = min(n, k)
        if k == 0:
            thresh[0] = REJECT_ALL
            thresh_val[0] = HIGHEST
        elif n >= k:
            thresh[0] = buf[k - 1]
            thresh_val[0] = _composite_value(buf[k - 1])
    cuda.syncthreads()  # new count and threshold are visible to every thread


@cuda.jit(device=True)
def _select_kth_key(comps, n, k, hist, select, tid, nt, low_bits):
    """The k-th largest (1 <= k <= n) order key ``comps[i] >> 32`` of ``comps[:n]``, on every thread.

    ``low_bits`` (16 for bf16 logits, else 0): the keys' low ``low_bits`` bits are fixed by their
    sign bit (all zeros for a key of a value >= 0, all ones below: ``_order_key`` of a float32 whose
    low half is zero), so the passes stop there and the rest follows from the prefix (2 passes for
    bf16 instead of 4: ~3 us of the H200's 960-row tail, docs/PERFORMANCE.md).

    Radix select, most significant RADIX_BITS first: each pass counts the entries that match the
    key prefix found so far by their next digit (shared atomics), then warp 0 finds the digit
    holding the rank still sought (a scan over the bins, largest digit first). Three barriers a
    pass, against 45 barrier-separated layers for the bitonic sort of 512 entries it replaced,
    which had cost the H200's 960-row top-k ~28 us (docs/PERFORMANCE.md).
    """
    if tid == 0:
        select[0] = uint32(0)
        select[1] = uint32(k)
    lane = tid % WARP_SIZE
    shift = KEY_BITS
    while shift > low_bits:
        shift -= RADIX_BITS
        i = tid
        while i < RADIX_BINS:
            hist[i] = 0
            i += nt
        cuda.syncthreads()  # bins are zero and the last pass's prefix is visible
        high = uint64(select[0]) >> uint64(shift + RADIX_BITS)  # the digits fixed so far
        i = tid
        while i < n:
            key = uint64(comps[i]) >> SHIFT_32
            if key >> uint64(shift + RADIX_BITS) == high:
                cuda.atomic.add(hist, int32((key >> uint64(shift)) & RADIX_MASK), 1)
            i += nt
        cuda.syncthreads()  # the histogram is complete
        if tid < WARP_SIZE:
            top = RADIX_BINS - 1 - lane * BINS_PER_LANE  # this lane's bins, largest digit first
            have = int32(0)
            for b in range(BINS_PER_LANE):
                have += hist[top - b]
            upto = warp_inclusive_scan_i32(have)  # entries whose digit is >= this lane's last bin
            rank = int32(select[1])
            cuda.syncwarp(FULL_MASK)  # every lane has read the rank before one lane rewrites it
            below = upto - have
            if below < rank and rank <= upto:  # exactly one lane holds the rank-th largest digit
                for b in range(BINS_PER_LANE):
                    h = hist[top - b]
                    if below < rank and rank <= below + h:
                        select[0] = select[0] | (uint32(top - b) << uint32(shift))
                        select[1] = uint32(rank - below)
                    below += h
        cuda.syncthreads()  # the new prefix and rank are visible
    key = select[0]
    if low_bits > 0 and key & SIGN_BIT == 0:  # a negative value's key: its low bits are ones
        key |= (uint32(1) << uint32(low_bits)) - uint32(1)
    return key


@cuda.jit(device=True)
def _push(buf, count, cap, c):
    """Append composite ``c`` to the buffer; False when it is full (the caller retries later)."""
    slot = cuda.atomic.add(count, 0, 1)
    if slot < cap:
        buf[slot] = c
        return True
    return False


@cuda.jit(device=True)
def _init_state(count, thresh, thresh_val, tid):
    """Empty buffer, accept-everything threshold."""
    if tid == 0:
        count[0] = 0
        thresh[0] = EMPTY
        thresh_val[0] = LOWEST
    cuda.syncthreads()  # state is initialised before any thread pushes


@cuda.jit(device=True)
def _block_max(v, scratch, tid, nt):
    """Maximum of float64 ``v`` over the block (nt a multiple of 32), on every thread: a warp
    butterfly, then every thread reads the warps' maxima (two barriers instead of a tree's log2 nt)."""
    offset = WARP_SIZE // 2
    while offset > 0:
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, offset))
        offset //= 2
    if tid % WARP_SIZE == 0:
        scratch[tid // WARP_SIZE] = v
    cuda.syncthreads()  # every warp's maximum is stored
    out = scratch[0]
    for w in range(1, nt // WARP_SIZE):
        out = max(out, scratch[w])
    cuda.syncthreads()  # everyone has read the maxima before scratch is reused
    return out


@cuda.jit(device=True)
def _block_sum(v, scratch, tid, nt):
    """Sum of float64 ``v`` over the block (nt a multiple of 32), on every thread, in a fixed order
    (a warp butterfly, then the warps' sums in warp order): deterministic run to run."""
    offset = WARP_SIZE // 2
    while offset > 0:
        v += cuda.shfl_xor_sync(FULL_MASK, v, offset)
        offset //= 2
    if tid % WARP_SIZE == 0:
        scratch[tid // WARP_SIZE] = v
    cuda.syncthreads()  # every warp's sum is stored
    out = scratch[0]
    for w in range(1, nt // WARP_SIZE):
        out += scratch[w]
    cuda.syncthreads()  # everyone has read the sums before scratch is reused
    return out


@cuda.jit(device=True)
def _rescaled(s, m, big_m):
    """``s * exp(m - big_m)`` in float64 (0 for an empty partial: s = 0, m = LOWEST)."""
    return s * math.exp(float64(m) - float64(big_m))


@cuda.jit(device=True)
def _write_row(buf, lse, row, out_values, out_ids, tid, nt):
    """Emit the sorted buffer head as (logit - lse, id) for the first ``out_values.shape[1]`` ranks."""
    r = tid
    while r < out_values.shape[1]:
        c = buf[r]
        out_values[row, r] = float32(float64(_composite_value(c)) - lse)
        out_ids[row, r] = _composite_id(c)
        r += nt


@cuda.jit(device=True)
def _combine_partials(m, s, lo, scratch, tid, nt):
    """(non-finite flag, max, sum of exp(logit - max)) of the block from the threads' partials."""
    # NaN and +inf make the sum NaN (exp(NaN), inf - inf); -inf shows in the minimum.
    bad = _non_finite_f32(lo) or _non_finite_f32(m) or _non_finite_f64(s)
    any_bad = cuda.syncthreads_or(int32(bad))  # barrier: OR of the threads' flags
    big_m = _block_max(float64(m), scratch, tid, nt)
    total = _block_sum(_rescaled(s, m, big_m), scratch, tid, nt)
    return any_bad, big_m, total


@cuda.jit(device=True, inline=True)
def _emit_state(any_bad, big_m, total, row, chunk, cmax, csum, cflag, row_flags, tid):
    """Thread 0 writes the row's non-finite flag (one chunk) or the chunk's (max, sum, flag)."""
    if tid == 0:
        if cuda.gridDim.x == 1:
            row_flags[row] = 1 if any_bad else 0
        else:
            cmax[row, chunk] = float32(big_m)
            csum[row, chunk] = total
            cflag[row, chunk] = 1 if any_bad else 0


@cuda.jit(device=True)
def _emit_sorted(buf, n_real, any_bad, big_m, total, row, chunk, cand, cmax, csum, cflag, out_values, out_ids,
                 row_flags, tid, nt):
    """Emit the chunk's result from ``buf[:n_real]``, sorted descending (its top k' first).

    With one chunk per row the block writes the row's outputs; otherwise the chunk's candidates
    (EMPTY beyond ``n_real``), reference, sum and non-finite flag go to the workspace.
    """
    if cuda.gridDim.x == 1:
        _write_row(buf, big_m + math.log(total), row, out_values, out_ids, tid, nt)
    else:
        r = tid
        while r < cand.shape[2]:
            cand[row, chunk, r] = buf[r] if r < n_real else EMPTY
            r += nt
    _emit_state(any_bad, big_m, total, row, chunk, cmax, csum, cflag, row_flags, tid)


@cuda.jit(device=True)
def _finish_chunk(buf, n_real, scratch, m, s, lo, row, chunk, cand, cmax, csum, cflag, out_values, out_ids,
                  row_flags, tid, nt):
    """Combine the threads' log-sum-exp partials and emit the chunk's result (:func:`_emit_sorted`);
    every thread calls."""
    any_bad, big_m, total = _combine_partials(m, s, lo, scratch, tid, nt)
    _emit_sorted(buf, n_real, any_bad, big_m, total, row, chunk, cand, cmax, csum, cflag, out_values, out_ids,
                 row_flags, tid, nt)


@cuda.jit(device=True)
def _emit_ranked(buf, n, k, any_bad, big_m, total, row, chunk, cand, cmax, csum, cflag, out_values, out_ids,
                 row_flags, tid, nt):
    """:func:`_compact` then :func:`_emit_sorted` without the sort, for a few candidates.

    ``buf[:n]`` holds distinct composites in any order (n <= RANKED_FINISH_PER_THREAD x nt). Each
    thread ranks its candidates by counting the larger ones (n shared reads each, broadcast) and
    writes those of rank < k straight to their place: the same outputs as the sorted buffer's
    head, with no barrier instead of the bitonic sort's log2(n) (log2(n) + 1) / 2 layers (21 at
    64 candidates). On the H200 (960 bf16 rows, k 32) the finish took 2.5 us a block instead of
    5.75 (docs/PERFORMANCE.md, run top-k 3). A row with fewer than k' candidates (possible only
    with non-finite logits, whose outputs are unspecified) keeps its unwritten ranks as they
    were, where the sort wrote padding.
    """
    single = cuda.gridDim.x == 1
    lse = big_m + math.log(total)
    i = tid
    while i < n:
        c = buf[i]
        rank = 0
        for j in range(n):
            if buf[j] > c:
                rank += 1
        if single:
            if rank < out_values.shape[1]:
                out_values[row, rank] = float32(float64(_composite_value(c)) - lse)
                out_ids[row, rank] = _composite_id(c)
        elif rank < k:
            cand[row, chunk, rank] = c
        i += nt
    if not single:
        r = min(n, k) + tid
        while r < cand.shape[2]:
            cand[row, chunk, r] = EMPTY
            r += nt
    _emit_state(any_bad, big_m, total, row, chunk, cmax, csum, cflag, row_flags, tid)


# --- kernels ----------------------------------------------------------------------------------

# Registers: at most 64 per thread, so 4 blocks of 256 threads fit an SM. Uncapped,
# ptxas spends a register per in-flight exp of the unrolled loop (92-184) and halves occupancy.
_BOUNDS = launch_bounds(MAX_THREADS, REGISTER_FILE // (MAX_THREADS * MAX_REGISTERS))
_WARP_BOUNDS = launch_bounds(MAX_THREADS, REGISTER_FILE // (MAX_THREADS * WARP_MAX_REGISTERS))

def _make_chunk_kernel(per_word: int, elem_bits: int, word_type, unroll: int):
    """Chunk kernel for words of ``per_word`` packed elements of ``elem_bits`` bits, ``unroll`` words per thread.

    Launch: grid (n_chunks, rows), block nt (power of two <= MAX_THREADS), dynamic shared memory
    ``cap * 8`` bytes. Arguments::

        words       [R, W] word_type   the logits, W = V / per_word (V % per_word == 0)
        k           int32              k' = min(k, V)
        cap         int32              candidate buffer entries (power of two, >= nt, >= 2 k')
        chunk_words int32              words per chunk (the last chunk may be shorter)
        cand        [R, C, kc] uint64  per-chunk top-k' composites (kc = max(k', 1)), C > 1 only
        cmax        [R, C] float32     per-chunk max logit
        csum        [R, C] float64     per-chunk sum of exp(logit - max)
        cflag       [R, C] int32       per-chunk non-finite flag
        out_values [R, k'] float32, out_ids [R, k'] int32, row_flags [R] int32   (C == 1 only)
    """
    assert unroll * per_word <= 32, "candidate masks have 32 bits"
    elem_mask = (1 << elem_bits) - 1
    widen = uint32(32 - elem_bits)  # a bf16 is the high half of its float32 (limits §4)
    PAIRED_MINMAX = per_word == 4 and elem_bits == 16  # packed bf16: max/min.bf16x2 on word halves
    rescan_words = RESCAN_BATCH * unroll  # segment mode: words of the segments re-read together
    half_bits = uint64(32)
    KEY_LOW_BITS = 32 - elem_bits  # order keys of bf16 values: the low 16 bits follow from the sign
    # the packed kernels rank a few final candidates; the scalar ones (unaligned logits) always sort:
    # with both finishes the bf16 one spilled on sm_120
    RANKED_FINISH = per_word > 1

    @cuda.jit(device=True, inline=True)
    def element_bits(word, e):
        """float32 bit pattern of element ``e`` (a compile-time constant) of ``word``.

        64-bit words are split into 32-bit halves first: one shift or mask per element.
        """
        if per_word == 1:
            return uint32(word) << widen
        half = uint32(word) if e * elem_bits < 32 else uint32(uint64(word) >> half_bits)
        shift = (e * elem_bits) % 32
        return uint32((half >> uint32(shift)) & uint32(elem_mask)) << widen

    @cuda.jit(device=True, inline=True)
    def load_words_at(row_words, ws, w0, base, w_end, check):
        """Issue this thread's loads of one iteration (words base + u WARP_SIZE) into ``ws[w0 + u]``.

        ``check`` is False when every word is in bounds: unpredicated loads, whose addresses the
        compiler strength-reduces (predicated ones made it recompute row x stride per load).
        Otherwise out-of-range words are not read; their slots keep stale bits that the
        partial-iteration code never looks at (it tests every word's position).
        """
        for u in range(unroll):
            j = base + u * WARP_SIZE
            if not check or j < w_end:
                ws[w0 + u] = row_words[uint64(j)]  # unsigned index: no negative-index wraparound code

    @cuda.jit(device=True, inline=True)
    def load_words(row_words, ws, base, w_end, check):
        """:func:`load_words_at` into ``ws[0 : unroll]``."""
        load_words_at(row_words, ws, 0, base, w_end, check)

    @cuda.jit(device=True, inline=True)
    def reduce_words(ws, base, w_end, m, lo, check):
        """(batch max, float32 sum of exp(x - m), min) over this iteration's elements.

        ``check`` is False for full iterations (every word in bounds; the compiler drops the
        tests) and True for the chunk's last, partial iteration.
        """
        bmax = LOWEST
        bsum = float32(0.0)
        if PAIRED_MINMAX and not check:
            # bf16 in full iterations: max and min of two elements per instruction on the packed
            # halves, unpacked once per iteration (the scalar FMNMX pair was 2 of ~7 per element)
            hi2 = uint32(ws[0])
            lo2 = hi2
            for u in range(unroll):
                for half in range(2):
                    if u + half > 0:
                        w32 = uint32(ws[u]) if half == 0 else uint32(uint64(ws[u]) >> half_bits)
                        hi2 = _bf16x2_max(hi2, w32)
                        lo2 = _bf16x2_min(lo2, w32)
                for e in range(per_word):
                    bsum += _exp_of_diff(_f32_from_bits(element_bits(ws[u], e)), m)
            bmax = max(_f32_from_bits(hi2 << widen), _f32_from_bits(hi2 & HIGH_HALF))
            lo = min(lo, min(_f32_from_bits(lo2 << widen), _f32_from_bits(lo2 & HIGH_HALF)))
            return bmax, bsum, lo
        for u in range(unroll):
            if not check or base + u * WARP_SIZE < w_end:
                for e in range(per_word):
                    x = _f32_from_bits(element_bits(ws[u], e))
                    bmax = max(bmax, x)
                    lo = min(lo, x)
                    bsum += _exp_of_diff(x, m)
        return bmax, bsum, lo

    @cuda.jit(device=True, inline=True)
    def sum_words(ws, base, w_end, m, check):
        """float32 sum of exp(x - m) (the rare second pass after the running max rose)."""
        bsum = float32(0.0)
        for u in range(unroll):
            if not check or base + u * WARP_SIZE < w_end:
                for e in range(per_word):
                    bsum += _exp_of_diff(_f32_from_bits(element_bits(ws[u], e)), m)
        return bsum

    @cuda.jit(device=True, inline=True)
    def first_max(ws, base, w_end, bmax, check):
        """Composite of this thread's first element equal to ``bmax`` (EMPTY if it has none)."""
        c = EMPTY
        for u in range(unroll):
            j = base + u * WARP_SIZE
            if not check or j < w_end:
                for e in range(per_word):
                    bits = element_bits(ws[u], e)
                    if c == EMPTY and _f32_from_bits(bits) == bmax:
                        c = _composite(bits, j * per_word + e)
        return c

    @cuda.jit(device=True, inline=True)
    def above_at(ws, w0, base, w_end, t_val, check):
        """Mask of the elements of words ``ws[w0 : w0 + unroll]`` (loaded at ``base``) with logit >= ``t_val``
        (bit u per_word + e)."""
        mask = int64(0)
        for u in range(unroll):
            if not check or base + u * WARP_SIZE < w_end:
                for e in range(per_word):
                    if _f32_from_bits(element_bits(ws[w0 + u], e)) >= t_val:
                        mask |= int64(1) << (u * per_word + e)
        return mask

    @cuda.jit(device=True, inline=True)
    def above(ws, base, w_end, t_val, check):
        """Mask of this iteration's elements with logit >= ``t_val`` (bit u per_word + e)."""
        return above_at(ws, 0, base, w_end, t_val, check)

    @cuda.jit(device=True, inline=True)
    def element_composite(row_words, base, b):
        """Composite of element ``b`` of a candidate mask made at word ``base`` (word ``base + (b //
        per_word) * 32``, element ``b % per_word``): the word is re-read, an L1 hit."""
        u = b // per_word
        e = b - u * per_word
        j = base + u * WARP_SIZE
        word = row_words[uint64(j)]
        bits = uint32((uint64(word) >> uint64(e * elem_bits)) & uint64(elem_mask)) << widen
        return _composite(bits, j * per_word + e)

    @cuda.jit(device=True)
    def offer(row_words, base, t_comp, buf, count, cap, todo):
        """Push the elements of mask ``todo`` whose composite is >= ``t_comp``;
        return the mask of those that found the buffer full (retried after a compaction).

        A data-dependent loop over the set bits that re-reads each candidate's word (an L1 hit:
        the thread loaded it just before). Taking it from the registers instead would need a
        dynamic index (local memory) or an unrolled push per element (registers on the hot path).
        """
        left = int64(0)
        while todo:
            b = cuda.ffs(uint32(todo)) - 1  # lowest set bit (masks have <= 32 bits)
            bit = int64(1) << b
            todo ^= bit
            c = element_composite(row_words, base, b)
            if c >= t_comp and not _push(buf, count, cap, c):
                left |= bit
        return left

    @cuda.jit(device=True, inline=True)
    def chunk_range(words, chunk_words, chunk, nt):
        """(first word, end word, words per block-iteration, end of the full iterations) of a chunk:
        iterations before the last value have every word in bounds."""
        w_begin = chunk * chunk_words
        w_end = min(w_begin + chunk_words, words.shape[1])
        span = unroll * nt
        return w_begin, w_end, span, w_end - (w_end - w_begin) % span

    @cuda.jit(device=True, inline=True)
    def accumulate(ws, base, w_end, check, m, s, lo):
        """Online log-sum-exp over the words in ``ws``; returns (m, s, lo, this batch's max).

        One pass against the reference m; a batch max above m + REFERENCE_HEADROOM (the
        thread's first batch, then rarely) moves m to it and the batch is summed again.
        """
        bmax, bsum, lo = reduce_words(ws, base, w_end, m, lo, check)
        if bmax > m + REFERENCE_HEADROOM:
            s = _rescaled(s, m, bmax)
            m = bmax
            bsum = sum_words(ws, base, w_end, m, check)
        return m, s + float64(bsum), lo, bmax

    @cuda.jit(device=True, inline=True)
    def step(row_words, ws, base, nt, w_end, check, m, s, lo, first_iter, buf, count, thresh, thresh_val,
             k, cap, tid):
        """One iteration on the words in ``ws``: online log-sum-exp, then the threshold filter.

        Returns the updated (m, s, lo). The threshold is read from shared memory (it changes only
        in a compaction, which ends with a barrier) rather than kept in registers. One block
        barrier in the common case (no buffer overflow); every thread of the block calls this.
        """
        m, s, lo, bmax = accumulate(ws, base, w_end, check, m, s, lo)
        if first_iter:
            # Seed: each thread offers its largest element; T becomes their k'-th largest. The
            # buffer is then emptied: the filter below pushes the seeds again with the rest.
            seed = first_max(ws, base, w_end, bmax, check)
            if seed != EMPTY:
                _push(buf, count, cap, seed)  # nt <= cap: always fits
            cuda.syncthreads()  # seeds are in the buffer before the compaction reads them
            _compact(buf, count, thresh, thresh_val, k, cap, tid, nt)
            if tid == 0:
                count[0] = 0
            cuda.syncthreads()  # the emptied buffer is visible before anyone pushes
            load_words(row_words, ws, base, w_end, check)  # once per block: ws need not live across the sort

        pending = int64(0)
        t_val = thresh_val[0]
        if bmax >= t_val:  # rare after the first iterations
            pending = offer(row_words, base, thresh[0], buf, count, cap,
                            above(ws, base, w_end, t_val, check))
        while cuda.syncthreads_or(int32(pending != 0)):  # barrier: did any push find the buffer full?
            _compact(buf, count, thresh, thresh_val, k, cap, tid, nt)  # the buffer is full: cut it
            pending = offer(row_words, base, thresh[0], buf, count, cap, pending)
        return m, s, lo

    @cuda.jit(fastmath=True, **_BOUNDS)
    def chunk_kernel(words, k, cap, chunk_words, cand, cmax, csum, cflag, out_values, out_ids, row_flags):
        buf = cuda.shared.array(0, uint64)  # [cap] candidate composites (dynamic)
        scratch = cuda.shared.array(MAX_THREADS, float64)  # block reductions
        count = cuda.shared.array(1, int32)  # candidates pushed (may overshoot cap)
        thresh = cuda.shared.array(1, uint64)  # composite threshold T
        thresh_val = cuda.shared.array(1, float32)  # logit of T: the cheap first test
        pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
        ws = cuda.local.array(unroll, word_type)  # words being processed (registers: static indices)
        nxt = cuda.local.array(unroll, word_type)  # the next iteration's words, in flight meanwhile

        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        chunk = cuda.blockIdx.x
        row = cuda.blockIdx.y
        w_begin, w_end, span, full_end = chunk_range(words, chunk_words, chunk, nt)
        row_words = words[row]  # [W] this row: keeps the row offset out of the loads
        # Each warp reads a contiguous run of unroll x WARP_SIZE words per iteration, word u of
        # a lane at u x WARP_SIZE: every load is coalesced and the offsets are immediates.
        lane = tid % WARP_SIZE
        off = (tid - lane) * unroll + lane
        _init_state(count, thresh, thresh_val, tid)

        m = LOWEST  # exp reference, <= the running max (finite sentinel, see LOWEST)
        s = 0.0  # running sum of exp(x - m), float64
        lo = HIGHEST  # running min: -inf shows here
        # Software pipeline: the loads of iteration i + 1 are issued before iteration i is
        # processed, so each thread always has one iteration of words in flight (limits §6).
        load_words(row_words, nxt, w_begin + off, w_end, True)
        block_base = w_begin
        while block_base < full_end:  # uniform across the block: every thread runs every iteration
            for u in range(unroll):
                ws[u] = nxt[u]
            base = block_base + off
            first_iter = block_base == w_begin
            block_base += span
            if block_base < full_end:  # uniform: the next iteration is full, no bounds tests
                load_words(row_words, nxt, block_base + off, w_end, False)
            else:
                load_words(row_words, nxt, block_base + off, w_end, True)
            m, s, lo = step(row_words, ws, base, nt, w_end, False, m, s, lo, first_iter,
                            buf, count, thresh, thresh_val, k, cap, tid)
        if block_base < w_end:  # the partial last iteration, already loaded (uniform)
            m, s, lo = step(row_words, nxt, block_base + off, nt, w_end, True, m, s, lo, block_base == w_begin,
                            buf, count, thresh, thresh_val, k, cap, tid)

        _compact(buf, count, thresh, thresh_val, k, cap, tid, nt)
        _finish_chunk(buf, count[0], scratch, m, s, lo, row, chunk, cand, cmax, csum, cflag,
                      out_values, out_ids, row_flags, tid, nt)

    # --- segment mode: stream without a filter, then re-read only the segments that can hold a
    # top-k' element (module doc, "Segment mode").

    @cuda.jit(device=True, inline=True)
    def record_segment(segs, seg, bmax, lane):
        """Store the warp's maximum of this iteration as segment ``seg``'s composite (value, seg)."""
        wmax = warp_max_f32(bmax)
        if lane == 0:
            segs[seg] = _composite(uint32(_f32_bits(wmax)), seg)

    @cuda.jit(fastmath=True, **_BOUNDS)
    def segment_kernel(words, k, cap, chunk_words, cand, cmax, csum, cflag, out_values, out_ids, row_flags):
        buf = cuda.shared.array(0, uint64)  # [cap] candidates, then [n_seg] segment maxima (dynamic)
        scratch = cuda.shared.array(MAX_THREADS, float64)  # block reductions
        count = cuda.shared.array(1, int32)  # candidates pushed (may overshoot cap)
        thresh = cuda.shared.array(1, uint64)  # composite threshold T
        thresh_val = cuda.shared.array(1, float32)  # logit of T
        hist = cuda.shared.array(RADIX_BINS, int32)  # radix-select histogram of the segment maxima
        select = cuda.shared.array(2, uint32)  # radix select: key prefix found, rank left to find
        flag_list = cuda.shared.array(FLAG_LIST_ENTRIES, int16)  # flagged segments, in no particular order
        n_flag = cuda.shared.array(1, int32)  # flagged segments (may exceed FLAG_LIST_ENTRIES)
        pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
        ws = cuda.local.array(unroll, word_type)  # words being processed (registers: static indices)
        nxt = cuda.local.array(unroll, word_type)  # the next iteration's words, in flight meanwhile
        rs = cuda.local.array(rescan_words, word_type)  # re-read segments' words, in flight together
        its = cuda.local.array(RESCAN_BATCH, int32)  # their segment numbers (-1: none)

        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        chunk = cuda.blockIdx.x
        row = cuda.blockIdx.y
        w_begin, w_end, span, full_end = chunk_range(words, chunk_words, chunk, nt)
        row_words = words[row]  # [W]
        lane = tid % WARP_SIZE
        warp = tid // WARP_SIZE
        n_warps = nt // WARP_SIZE
        off = (tid - lane) * unroll + lane  # as chunk_kernel: segment = one warp's words of one iteration
        seg_words = unroll * WARP_SIZE  # segment w + it n_warps starts at word w_begin + (w + it n_warps) seg_words
        n_seg = (w_end - w_begin + span - 1) // span * n_warps
        segs = buf[cap:cap + n_seg]
        if tid == 0:
            n_flag[0] = 0
        _init_state(count, thresh, thresh_val, tid)

        # 1. Stream: log-sum-exp and each segment's maximum; no threshold, no block barrier.
        m = LOWEST
        s = 0.0
        lo = HIGHEST
        load_words(row_words, nxt, w_begin + off, w_end, True)
        block_base = w_begin
        seg = warp
        while block_base < full_end:
            for u in range(unroll):
                ws[u] = nxt[u]
            base = block_base + off
            block_base += span
            if block_base < full_end:
                load_words(row_words, nxt, block_base + off, w_end, False)
            else:
                load_words(row_words, nxt, block_base + off, w_end, True)
            m, s, lo, bmax = accumulate(ws, base, w_end, False, m, s, lo)
            record_segment(segs, seg, bmax, lane)
            seg += n_warps
        if block_base < w_end:  # the partial last iteration, already loaded
            m, s, lo, bmax = accumulate(nxt, block_base + off, w_end, True, m, s, lo)
            record_segment(segs, seg, bmax, lane)
        cuda.syncthreads()  # segment maxima are written before the selection reads them

        # 2. Threshold: T = the k'-th largest segment maximum (a radix select on their order keys).
        # k' segments reach it, so the k'-th largest logit does too: only elements >= T, in
        # segments whose maximum is >= T (the flagged ones), can be in the top k'.
        n_it = n_seg // n_warps  # segment of warp w in iteration it: w + it * n_warps
        if k > n_seg:  # (uniform) every segment is flagged, every element a candidate
            t_key = uint32(0)
            t_val = LOWEST
        else:
            t_key = _select_kth_key(segs, n_seg, max(k, 1), hist, select, tid, nt, KEY_LOW_BITS)
            t_val = _composite_value(uint64(t_key) << SHIFT_32)
        t_comp = uint64(_order_key(uint32(_f32_bits(t_val)))) << SHIFT_32  # smallest composite of value T

        # 3. Re-read the flagged segments, RESCAN_BATCH at a time per warp with their loads in
        # flight together, pushing candidates >= T without a block barrier (the buffer holds them
        # all unless many elements tie at or above T; then see below). Each warp appends the
        # flagged segments it streamed to one list (a ballot over its segment maxima, one shared
        # atomic per 32); then entry e of the list goes to warp e mod n_warps, so every warp
        # re-reads the same number give or take one (its own share of ~k' flagged segments
        # varies by several, and each round is one HBM latency). The list's order varies run to
        # run; the candidates, and so the outputs, do not.
        full = False  # a push of this thread found the buffer full
        t = 0
        while k > 0 and t < n_it:  # uniform per warp: the ballot needs all lanes
            it = t + lane
            hit = it < n_it and uint32(segs[warp + it * n_warps] >> SHIFT_32) >= t_key
            flagged = uint32(cuda.ballot_sync(FULL_MASK, hit))
            first = 0
            if lane == 0 and flagged != 0:
                first = cuda.atomic.add(n_flag, 0, cuda.popc(flagged))
            slot = cuda.shfl_sync(FULL_MASK, first, 0) + cuda.popc(flagged & ((uint32(1) << uint32(lane)) - uint32(1)))
            if hit and slot < FLAG_LIST_ENTRIES:
                flag_list[slot] = warp + it * n_warps
            t += WARP_SIZE
        cuda.syncthreads()  # the list is complete
        n_listed = n_flag[0]
        if n_listed <= FLAG_LIST_ENTRIES:  # (uniform)
            e = int32(warp)
            deal = int32(n_warps)
            while e < n_listed:  # uniform per warp
                for r in range(RESCAN_BATCH):  # take up to RESCAN_BATCH entries and issue all their loads
                    its[r] = -1
                    if e < n_listed:
                        its[r] = flag_list[e]
                        load_words_at(row_words, rs, r * unroll, w_begin + its[r] * seg_words + lane, w_end, True)
                        e += deal
                for r in range(RESCAN_BATCH):
                    if its[r] >= 0:
                        base = w_begin + its[r] * seg_words + lane
                        left = offer(row_words, base, t_comp, buf, count, cap,
                                     above_at(rs, r * unroll, base, w_end, t_val, True))
                        full = full or left != 0
        else:  # (rare: ties at T) the list overflowed: re-read in rounds, below
            full = True
        if cuda.syncthreads_or(int32(full)):  # barrier: (rare) the buffer overflowed: start over, in rounds
            if tid == 0:
                count[0] = 0
                thresh[0] = t_comp
                thresh_val[0] = t_val
            cuda.syncthreads()  # the emptied buffer and the threshold are visible before anyone pushes
            it = 0
            while it < n_it:  # uniform: one segment per warp per round, a compaction when the buffer fills
                pending = int64(0)
                base = w_begin + it * span + off
                if uint32(segs[warp + it * n_warps] >> SHIFT_32) >= t_key:
                    load_words(row_words, ws, base, w_end, True)
                    pending = offer(row_words, base, thresh[0], buf, count, cap,
                                    above(ws, base, w_end, thresh_val[0], True))
                while cuda.syncthreads_or(int32(pending != 0)):  # barrier: did any push find the buffer full?
                    _compact(buf, count, thresh, thresh_val, k, cap, tid, nt)
                    pending = offer(row_words, base, thresh[0], buf, count, cap, pending)
                it += 1
        else:
            if tid == 0:
                thresh[0] = t_comp
                thresh_val[0] = t_val
        n_cand = count[0]  # final (<= cap): every push came before the last barrier
        any_bad, big_m, total = _combine_partials(m, s, lo, scratch, tid, nt)
        if RANKED_FINISH and n_cand <= RANKED_FINISH_PER_THREAD * nt:  # (uniform) typical rows: ~k' to 2 k' candidates
            _emit_ranked(buf, n_cand, k, any_bad, big_m, total, row, chunk, cand, cmax, csum, cflag,
                         out_values, out_ids, row_flags, tid, nt)
        else:
            _compact(buf, count, thresh, thresh_val, k, cap, tid, nt)
            _emit_sorted(buf, count[0], any_bad, big_m, total, row, chunk, cand, cmax, csum, cflag,
                         out_values, out_ids, row_flags, tid, nt)

    # --- per-warp mode: each warp filters into its own segment of the buffer, no block barrier
    # until the chunk is read (limits §6: "keeps K candidates per warp").

    @cuda.jit(device=True)
    def warp_compact(buf, seg0, n, k, t_comp, t_val, lane):
        """Sort the warp's candidates ``buf[seg0 : seg0 + n]`` descending and keep the k largest.

        Returns ``(min(n, k), threshold, its logit)``: the threshold rises to the k-th largest when
        that is above it (EMPTY entries, the seeds of lanes without elements, sort last and never
        raise it). All 32 lanes call with the same n, k and threshold.
        """
        n2 = 1
        while n2 < n:
            n2 *= 2
        i = n + lane
        while i < n2:
            buf[seg0 + i] = EMPTY  # padding sorts last
            i += WARP_SIZE
        cuda.syncwarp(FULL_MASK)  # candidates and padding are stored before the sort reads them
        _warp_sort_desc(buf, seg0, n2, lane)
        if k > 0 and n >= k:
            t = buf[seg0 + k - 1]
            if t > t_comp:
                t_comp = t
                t_val = _composite_value(t)
        cuda.syncwarp(FULL_MASK)  # every lane has read the k-th before the segment is refilled
        return min(n, k), t_comp, t_val

    @cuda.jit(device=True)
    def warp_seed(buf, seg0, bmax, k, t_val, lane):
        """The logit threshold after the warp's first iteration: the k-th largest of the lanes'
        maxima if k <= 32 (k elements are at least that large), else ``t_val`` unchanged.

        A value bound only (the composite threshold stays): elements equal to it still compete.
        Uses the warp's segment as scratch (it is empty before the first offer).
        """
        buf[seg0 + lane] = _composite(_f32_bits(bmax), 0)
        cuda.syncwarp(FULL_MASK)  # every lane's maximum is stored before the sort reads them
        _warp_sort_desc(buf, seg0, WARP_SIZE, lane)
        if 0 < k <= WARP_SIZE:
            t_val = max(t_val, _composite_value(buf[seg0 + k - 1]))
        cuda.syncwarp(FULL_MASK)  # every lane has read it before the segment is refilled
        return t_val

    @cuda.jit(device=True)
    def warp_offer(row_words, base, buf, seg0, seg_cap, lane, n, t_comp, todo):
        """Append the elements of mask ``todo`` whose composite is >= ``t_comp`` to the warp's
        segment (``n`` entries used) until it is full.

        Warp-synchronous rounds: every lane with pending elements offers its lowest one and a
        ballot hands out the slots (no atomics, no block barrier). The element's word is re-read
        (an L1 hit: the lane loaded it just before); taking it from the registers would need a
        dynamic index (local memory). Returns ``(n, todo)``: the elements left when the segment
        filled up (the caller compacts and offers them again).
        """
        below = (uint32(1) << uint32(lane)) - uint32(1)  # the lanes before this one
        while cuda.any_sync(FULL_MASK, todo != 0) and n < seg_cap:
            c = EMPTY
            bit = uint32(0)
            if todo != 0:
                b = cuda.ffs(todo) - 1  # lowest set bit
                bit = uint32(1) << uint32(b)
                c = element_composite(row_words, base, b)
                if c < t_comp:
                    c = EMPTY  # beaten by the threshold (raised since the mask was made)
            votes = uint32(cuda.ballot_sync(FULL_MASK, c != EMPTY))
            slot = n + cuda.popc(votes & below)
            if slot < seg_cap:
                todo &= ~bit  # stored or dropped (bit is 0 for a lane with nothing pending)
                if c != EMPTY:
                    buf[seg0 + slot] = c
            n = min(n + cuda.popc(votes), seg_cap)
        return n, todo

    @cuda.jit(device=True, inline=True)
    def store_state(w_count, w_thresh, warp, lane, n, t_comp):
        """Lane 0 stores the warp's entry count and threshold; all 32 lanes call."""
        cuda.syncwarp(FULL_MASK)  # every lane has read the old state
        if lane == 0:
            w_count[warp] = n
            w_thresh[warp] = t_comp
        cuda.syncwarp(FULL_MASK)  # the new state is visible to the warp

    @cuda.jit(device=True, inline=True)
    def prefetch(row_words, ws, w, w_last):
        """Issue this thread's loads of the full iteration at word ``min(w, w_last)``.

        Unconditional: past the last full iteration the loads repeat it (L1/L2 hits, once per
        chunk); a conditional load made the ring registers merge old and new values, and the
        compiler then spilled them.
        """
        load_words(row_words, ws, min(w, w_last), w_last, False)

    @cuda.jit(device=True, inline=True)
    def warp_step(row_words, ws, base, w_end, check, first, m, s, lo, buf, seg_cap, k, w_count, w_thresh, t_val,
                  nxt, nxt_w, w_last):
        """One iteration of one warp on the words in ``ws``: online log-sum-exp, then the filter.

        Returns the updated ``(m, s, lo, t_val)``. Block-barrier free; the warp votes once per
        iteration whether any lane has an element at or above the threshold. The rare paths
        recompute lane and warp from threadIdx (registers are the streaming loop's limit).

        ``nxt`` holds the next iteration's words (in flight, from word ``nxt_w``; ``nxt_w < 0``
        when there is none). A compaction (a sort: rare) re-issues those loads after it instead
        of keeping them in registers across the sort, which made ptxas spill the streaming loop.
        """
        bmax, bsum, lo = reduce_words(ws, base, w_end, m, lo, check)
        if bmax > m + REFERENCE_HEADROOM:  # the lane's first batch, then rarely
            s = _rescaled(s, m, bmax)
            m = bmax
            bsum = sum_words(ws, base, w_end, m, check)
        s += float64(bsum)
        if first:
            lane = cuda.threadIdx.x % WARP_SIZE
            t_val = warp_seed(buf, (cuda.threadIdx.x // WARP_SIZE) * seg_cap, bmax, k, t_val, lane)
        want = bmax >= t_val
        if cuda.any_sync(FULL_MASK, want):  # uniform; a few times per warp and row (see module doc)
            todo = uint32(above(ws, base, w_end, t_val, check)) if want else uint32(0)
            lane = cuda.threadIdx.x % WARP_SIZE
            warp = cuda.threadIdx.x // WARP_SIZE
            seg0 = warp * seg_cap
            n = w_count[warp]
            t_comp = w_thresh[warp]
            n, todo = warp_offer(row_words, base, buf, seg0, seg_cap, lane, n, t_comp, todo)
            if cuda.any_sync(FULL_MASK, todo != 0):  # the segment is full: cut it, offer the rest (rare)
                while True:
                    n, t_comp, t_val = warp_compact(buf, seg0, n, k, t_comp, t_val, lane)
                    n, todo = warp_offer(row_words, base, buf, seg0, seg_cap, lane, n, t_comp, todo)
                    if not cuda.any_sync(FULL_MASK, todo != 0):
                        break
                if nxt_w >= 0:
                    prefetch(row_words, nxt, nxt_w, w_last)  # the words in flight were not kept across the sort
            store_state(w_count, w_thresh, warp, lane, n, t_comp)
        return m, s, lo, t_val

    @cuda.jit(fastmath=True, **_WARP_BOUNDS)
    def warp_chunk_kernel(words, k, seg_cap, chunk_words, cand, cmax, csum, cflag, out_values, out_ids,
                          row_flags):
        """As ``chunk_kernel`` with per-warp segments of ``seg_cap`` entries (k' <= WARP_MAX_K).

        Dynamic shared memory ``(nt / 32) * seg_cap * 8`` bytes, seg_cap a power of two >= 2 k'
        and >= 32. Iteration i's words sit in ring (i % 2): the next iteration's words are in
        flight while one is processed (32 B per thread with 4 uint64 words).
        """
        buf = cuda.shared.array(0, uint64)  # [n_warps, seg_cap] candidate composites (dynamic)
        scratch = cuda.shared.array(MAX_THREADS, float64)  # block reductions
        w_count = cuda.shared.array(MAX_WARPS, int32)  # entries in each warp's segment
        w_thresh = cuda.shared.array(MAX_WARPS, uint64)  # each warp's composite threshold
        pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
        ring0 = cuda.local.array(unroll, word_type)  # even iterations (registers: static indices)
        ring1 = cuda.local.array(unroll, word_type)  # odd iterations
        tail = cuda.local.array(unroll, word_type)  # the partial last iteration

        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        chunk = cuda.blockIdx.x
        row = cuda.blockIdx.y
        lane = tid % WARP_SIZE
        warp = tid // WARP_SIZE
        seg0 = warp * seg_cap  # this warp's segment
        # Word indices are int32 (a row has < 2^31 words): the streaming loop carries
        # w, w_last, w_end and span in one register each instead of two (it was 3 short, and spilled).
        w_begin = int32(chunk * chunk_words)
        w_end = int32(min(w_begin + chunk_words, words.shape[1]))
        span = int32(unroll * nt)
        n_full = int32((w_end - w_begin) // span)  # iterations with every word in bounds
        w_tail = int32(w_begin + n_full * span)  # the chunk's partial last iteration starts here (+ off)
        row_words = words[row]  # [W] this row
        off = int32((tid - lane) * unroll + lane)  # as chunk_kernel: coalesced, immediate offsets

        m = LOWEST
        s = 0.0
        lo = HIGHEST
        t_val = LOWEST if k > 0 else HIGHEST  # logit of the warp's threshold (uniform)
        store_state(w_count, w_thresh, warp, lane, 0, EMPTY if k > 0 else REJECT_ALL)
        first_word = int32(w_begin + off)
        if n_full > 0:  # uniform
            # One running word index (few registers: the rare paths need them). Past the last
            # full iteration the prefetch repeats it (see prefetch).
            w_last = int32(first_word + (n_full - 1) * span)
            # The first iteration alone: its seed sort runs with no words in flight (once per chunk).
            load_words(row_words, ring0, first_word, w_end, False)
            m, s, lo, t_val = warp_step(row_words, ring0, first_word, w_end, False, True, m, s, lo, buf,
                                        seg_cap, k, w_count, w_thresh, t_val, ring1, int32(-1), w_last)
            w = int32(first_word + span)
            prefetch(row_words, ring0, w, w_last)
            while w <= w_last:  # two iterations per trip: the rings keep static register indices
                w_next = int32(w + span)
                prefetch(row_words, ring1, w_next, w_last)
                m, s, lo, t_val = warp_step(row_words, ring0, w, w_end, False, False, m, s, lo, buf,
                                            seg_cap, k, w_count, w_thresh, t_val, ring1, w_next, w_last)
                w = w_next
                if w <= w_last:
                    w_next = int32(w + span)
                    prefetch(row_words, ring0, w_next, w_last)
                    m, s, lo, t_val = warp_step(row_words, ring1, w, w_end, False, False, m, s, lo, buf,
                                                seg_cap, k, w_count, w_thresh, t_val, ring0, w_next, w_last)
                    w = w_next
        if w_tail < w_end:  # uniform; loaded only now (a chunk whose length is a multiple of span has none)
            w = int32(w_tail + off)
            load_words(row_words, tail, w, w_end, True)
            m, s, lo, t_val = warp_step(row_words, tail, w, w_end, True, n_full == 0,
                                        m, s, lo, buf, seg_cap, k, w_count, w_thresh, t_val, ring0, int32(-1), w_end)

        # Each warp's top k' sorted at the head of its segment, EMPTY up to kp = pow2 >= k'; then
        # one block merge of the n_warps sorted runs puts the chunk's top k' at buf[:k'].
        n, t_comp, t_val = warp_compact(buf, seg0, w_count[warp], k, w_thresh[warp], t_val, lane)
        kp = 1
        run_shift = 0
        while kp < k:
            kp *= 2
            run_shift += 1
        i = n + lane
        while i < kp:
            buf[seg0 + i] = EMPTY  # beyond the warp's top k'
            i += WARP_SIZE
        cuda.syncthreads()  # every warp's run is final before the merge reads it
        _bitonic_sort_desc(buf, (nt // WARP_SIZE) * kp, kp, run_shift, seg_cap, tid, nt)
        _finish_chunk(buf, k, scratch, m, s, lo, row, chunk, cand, cmax, csum, cflag,
                      out_values, out_ids, row_flags, tid, nt)

    return chunk_kernel, warp_chunk_kernel, segment_kernel


@cuda.jit
def merge_kernel(cand, cmax, csum, cflag, k, cap, out_values, out_ids, row_flags):
    """Merge the chunks of each row: one block per row, grid (rows,), dynamic smem ``cap * 8``.

    Combines the chunk log-sum-exps (float64) and selects the k' largest of the
    ``C * kc`` candidate composites with the same threshold filter as the chunk kernel.
    Arguments as in the chunk kernel.
    """
    buf = cuda.shared.array(0, uint64)  # [cap] candidate composites (dynamic)
    scratch = cuda.shared.array(MAX_THREADS, float64)  # block reductions
    count = cuda.shared.array(1, int32)  # candidates pushed (may overshoot cap)
    thresh = cuda.shared.array(1, uint64)  # composite threshold T
    thresh_val = cuda.shared.array(1, float32)  # kept by _compact; the merge needs no value test
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch

    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    row = cuda.blockIdx.x
    n_chunks = cand.shape[1]
    kc = cand.shape[2]
    _init_state(count, thresh, thresh_val, tid)

    m = LOWEST
    bad = 0
    ch = tid
    while ch < n_chunks:
        m = max(m, cmax[row, ch])
        bad |= cflag[row, ch]
        ch += nt
    any_bad = cuda.syncthreads_or(int32(bad))  # barrier: OR of the chunk flags
    big_m = _block_max(float64(m), scratch, tid, nt)
    s = 0.0
    ch = tid
    while ch < n_chunks:
        s += _rescaled(csum[row, ch], cmax[row, ch], big_m)
        ch += nt
    total = _block_sum(s, scratch, tid, nt)

    n_cand = n_chunks * kc
    t_comp = EMPTY
    first_iter = True
    block_base = 0
    while block_base < n_cand:  # uniform across the block
        f = block_base + tid
        block_base += nt
        c = EMPTY
        if f < n_cand:
            c = cand[row, f // kc, f % kc]
        skip = EMPTY
        if first_iter:
            first_iter = False
            if c != EMPTY:
                _push(buf, count, cap, c)  # nt <= cap: always fits
            cuda.syncthreads()  # seeds are in the buffer before the compaction reads them
            _compact(buf, count, thresh, thresh_val, k, cap, tid, nt)
            t_comp = thresh[0]
            skip = c
        pending = int32(1) if c != EMPTY and c >= t_comp and c != skip else int32(0)
        while cuda.syncthreads_or(pending):  # barrier: does any thread still hold a candidate?
            if pending and _push(buf, count, cap, c):
                pending = int32(0)
            cuda.syncthreads()  # pushes are done before count is read
            if count[0] > cap:
                _compact(buf, count, thresh, thresh_val, k, cap, tid, nt)
                t_comp = thresh[0]
                if c < t_comp:
                    pending = int32(0)  # beaten by the raised threshold

    _compact(buf, count, thresh, thresh_val, k, cap, tid, nt)
    _write_row(buf, big_m + math.log(total), row, out_values, out_ids, tid, nt)
    if tid == 0:
        row_flags[row] = 1 if any_bad else 0


# --- registration: the real launch signatures ------------------------------------------------

def _chunk_signature(word_type) -> tuple:
    return (
        word_type[:, ::1], int32, int32, int32, uint64[:, :, ::1], float32[:, ::1], float64[:, ::1],
        int32[:, ::1], float32[:, ::1], int32[:, ::1], int32[::1],
    )


_CHUNK_KERNELS: dict[tuple[str, bool], Any] = {}
_WARP_KERNELS: dict[tuple[str, bool], Any] = {}
_SEGMENT_KERNELS: dict[tuple[str, bool], Any] = {}
for _dtype, _elem_bits in _ELEM_BITS.items():
    for _packed in (True, False):
        _per_word = _WORD_BYTES * 8 // _elem_bits if _packed else 1
        _unroll = WORDS_PER_THREAD if _packed else SCALAR_ELEMS_PER_THREAD
        _word_type = uint64 if _packed else {16: uint16, 32: uint32}[_elem_bits]
        _suffix = f"{'bf16' if _elem_bits == 16 else 'f32'}_{'packed' if _packed else 'scalar'}"
        _loads = f"{'uint64 words of ' + str(_per_word) if _packed else 'one element per'} load"
        _block_kernel, _warp_kernel, _segment_kernel = _make_chunk_kernel(_per_word, _elem_bits, _word_type, _unroll)
        _SEGMENT_KERNELS[_dtype, _packed] = register(
            f"topk_segment_{_suffix}", _segment_kernel, (_chunk_signature(_word_type),),
            f"fused log-softmax top-k, one (chunk, row) per block, unfiltered stream with per-warp segment "
            f"maxima, then the flagged segments re-read; {_dtype} logits read as {_loads}",
        )
        _CHUNK_KERNELS[_dtype, _packed] = register(
            f"topk_chunk_{_suffix}", _block_kernel, (_chunk_signature(_word_type),),
            f"fused log-softmax top-k, one (chunk, row) per block, block candidate buffer, {_dtype} logits "
            f"read as {_loads}",
        )
        if _dtype == "bfloat16" and _packed:  # the f32 and scalar variants still spill on sm_90 (see plan_topk)
            _WARP_KERNELS[_dtype, _packed] = register(
                f"topk_warp_{_suffix}", _warp_kernel, (_chunk_signature(_word_type),),
                f"fused log-softmax top-k, one (chunk, row) per block, per-warp candidate buffers (k' <= "
                f"{WARP_MAX_K}), {_dtype} logits read as {_loads}",
            )

register(
    "topk_merge",
    merge_kernel,
    ((uint64[:, :, ::1], float32[:, ::1], float64[:, ::1], int32[:, ::1], int32, int32,
      float32[:, ::1], int32[:, ::1], int32[::1]),),
    "fused log-softmax top-k: merge per-chunk candidates and log-sum-exps, one row per block",
)


# --- host side --------------------------------------------------------------------------------

@dataclass(frozen=True)
class TopKPlan:
    """Launch layout and caller-owned workspace for one (rows, vocab, k, dtype); see :func:`plan_topk`.

    Attributes:
        rows, vocab, k: the problem (k as requested).
        k_out: k' = min(k, vocab), the width of the outputs.
        dtype: "float32" or "bfloat16" (bf16 logits are passed as uint16 bit patterns).
        threads: block size (power of two).
        capacity: candidate-buffer entries per block (power of two); with per-warp buffers each
            warp owns ``capacity / (threads / 32)`` of them.
        warp_buffers: per-warp candidate buffers (no block barrier while streaming), else one
            block buffer.
        n_chunks: blocks per row; 1 means no merge kernel.
        chunk_elems: vocabulary entries per chunk (a multiple of 4; the last chunk may be shorter).
        cand: uint64 [rows, n_chunks, max(k_out, 1)] per-chunk candidates (device).
        cmax: float32 [rows, n_chunks]; csum: float64 [rows, n_chunks]; cflag: int32 [rows, n_chunks].
        row_flags: int32 [rows], 1 where the row had a NaN or infinite logit (device).
    """

    rows: int
    vocab: int
    k: int
    k_out: int
    dtype: str
    threads: int
    capacity: int
    warp_buffers: bool
    segments: bool
    segment_slots: int
    n_chunks: int
    chunk_elems: int
    cand: Any
    cmax: Any
    csum: Any
    cflag: Any
    row_flags: Any

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory per block (the candidate buffer, then the segment maxima)."""
        return (self.capacity + self.segment_slots) * 8


def _require_pow2(value: Any, name: str, minimum: int, maximum: int) -> int:
    value = int_arg(value, name, minimum, maximum)
    if value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")
    return value


def _dtype_name(dtype: Any) -> str:
    """'float32' or 'bfloat16' from float32 / uint16 (bf16 bits) / their names."""
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
        return "bfloat16"
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float32 or uint16 (bf16 bit patterns), got {dtype!r}") from None
    if dt == np.float32:
        return "float32"
    if dt == np.uint16:
        return "bfloat16"
    raise TypeError(f"dtype must be float32 or uint16 (bf16 bit patterns), got {dt}")


def _sm_count() -> int:
    """Streaming multiprocessors of the current GPU (DEFAULT_SM_COUNT in the simulator)."""
    if simulator_active():
        return DEFAULT_SM_COUNT
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def plan_topk(
    rows: int,
    vocab: int,
    k: int,
    dtype: Any,
    *,
    threads: int | None = None,
    n_chunks: int | None = None,
    capacity: int | None = None,
    warp_buffers: bool | None = None,
    segments: bool | None = None,
) -> TopKPlan:
    """Choose the chunking and allocate the workspace for :func:`run_topk` (once per shape).

    Args:
        rows: R >= 1 rows (batch x positions), at most 65535.
        vocab: V >= 1.
        k: >= 0; k' = min(k, V) must be <= MAX_K (1024).
        dtype: float32, or uint16 / "bfloat16" for bf16 bit patterns.
        threads: block size, a power of two in [32, 256] (the launch bound). Default 256, or
            MANY_ROWS_THREADS in segment mode when the blocks exceed one wave of 256-thread blocks
            (then 8 blocks of 128 threads share an SM and up to 1056 rows stream in one wave:
            H200, 960 bf16 rows, k 32: see docs/PERFORMANCE.md).
        n_chunks: blocks per row (default: as many as one wave of resident blocks holds, each
            chunk at least MIN_CHUNK_ITERS block-iterations long; 1 when rows alone fill a wave).
        capacity: candidate-buffer entries per block, a power of two with 8 * capacity <= 32 KiB:
            >= max(threads, 2 k') for one block buffer (default max(threads, 4 k') capped at
            4096); >= n_warps * max(32, 2 k') for per-warp buffers (default n_warps *
            max(32, 4 k'), i.e. 4 k' per warp).
        warp_buffers: per-warp candidate buffers (bf16 with k' <= WARP_MAX_K only; misaligned bf16
            logits fall back to the block kernel). Default False: on the H200 the per-warp kernel
            took 413 us for 1024 bf16 rows at k 32 against the block kernel's 214 us
            (docs/PERFORMANCE.md), so it stays an opt-in experiment.
        segments: segment mode (module doc): stream without a filter, then re-read the segments
            whose maximum reaches the k'-th largest segment maximum. Default: on where k' is at
            most 1 / SEGMENT_RESCAN_SHARE of a chunk's segments (so at most that share of the
            logits is read twice) and the segment maxima fit MAX_SEGMENT_SLOTS; never with
            per-warp buffers.

    Returns:
        A :class:`TopKPlan` owning device workspace; reuse it for every call of this shape
        (graph-capturable: :func:`run_topk` allocates nothing).

    Raises:
        TypeError / ValueError naming the argument.
    """
    rows = int_arg(rows, "rows", 1, 65535)
    vocab = int_arg(vocab, "vocab", 1, 2**31 - 1)
    k = int_arg(k, "k", 0)
    dtype = _dtype_name(dtype)
    auto_threads = threads is None
    threads = DEFAULT_THREADS if auto_threads else _require_pow2(threads, "threads", MIN_THREADS, MAX_THREADS)
    k_out = min(k, vocab)
    if k_out > MAX_K:
        raise ValueError(f"k: min(k, vocab) must be <= {MAX_K}, got {k_out}")
    requested_chunks, requested_capacity, requested_segments = n_chunks, capacity, segments
    if warp_buffers is None:
        warp_buffers = False
    elif not isinstance(warp_buffers, (bool, np.bool_)):
        raise TypeError(f"warp_buffers must be a bool, got {type(warp_buffers).__name__}")
    elif warp_buffers and k_out > WARP_MAX_K:
        raise ValueError(f"warp_buffers: per-warp buffers need min(k, vocab) <= {WARP_MAX_K}, got {k_out}")
    elif warp_buffers and dtype != "bfloat16":
        raise ValueError("warp_buffers: per-warp buffers are bf16 only (the float32 variant spills on sm_90)")
    n_warps = threads // WARP_SIZE
    if warp_buffers:
        min_capacity = n_warps * max(WARP_SIZE, _next_pow2(2 * k_out))
        default_capacity = n_warps * max(WARP_SIZE, _next_pow2(CAPACITY_PER_K * k_out))
    else:
        min_capacity = max(threads, 2 * k_out, 1)
        default_capacity = max(threads, _next_pow2(CAPACITY_PER_K * max(k_out, 1)))
    if capacity is None:
        capacity = min(MAX_CAPACITY, default_capacity)
    else:
        capacity = _require_pow2(capacity, "capacity", min_capacity, MAX_CAPACITY)
    per_block = WORDS_PER_THREAD * (_WORD_BYTES * 8 // _ELEM_BITS[dtype]) * threads  # elements per block iteration
    max_chunks = -(-vocab // (MIN_CHUNK_ITERS * per_block))
    if n_chunks is None:
        # split rows only as far as one wave of resident blocks holds
        wave = (WARP_BLOCKS_PER_SM if warp_buffers else BLOCKS_PER_SM) * _sm_count()
        n_chunks = max(1, min(wave // rows, max_chunks))
        # ...unless a whole row is short enough for one segment-mode block: no merge launch, no
        # per-chunk seeding (H200, 15 rows x V 32768 fp32, k 32: 22.2 us vs 32.8 us in 8 chunks)
        iters = -(-vocab // per_block)
        if (segments is not False and not warp_buffers and 1 <= k_out and iters <= SEGMENT_SINGLE_CHUNK_ITERS
                and SEGMENT_RESCAN_SHARE * k_out <= iters * n_warps):
            n_chunks = 1
    else:
        n_chunks = int_arg(n_chunks, "n_chunks", 1, vocab)
    chunk_elems = -(-vocab // n_chunks)
    chunk_elems = -(-chunk_elems // 4) * 4  # whole uint64 words for both dtypes
    n_chunks = -(-vocab // chunk_elems)  # rounding may leave fewer, all non-empty
    # segments per chunk: one per warp and block-iteration, packed words or (unaligned logits) scalars
    packed_seg = -(-chunk_elems // per_block) * n_warps
    scalar_seg = -(-chunk_elems // (SCALAR_ELEMS_PER_THREAD * threads)) * n_warps
    slots = _next_pow2(max(packed_seg, scalar_seg))
    fits = slots <= MAX_SEGMENT_SLOTS and capacity + slots <= MAX_DYNAMIC_ENTRIES
    if segments is None:
        segments = not warp_buffers and fits and 1 <= k_out and SEGMENT_RESCAN_SHARE * k_out <= packed_seg
    elif not isinstance(segments, (bool, np.bool_)):
        raise TypeError(f"segments must be a bool, got {type(segments).__name__}")
    elif segments and warp_buffers:
        raise ValueError("segments: segment mode and per-warp buffers exclude each other")
    elif segments and not fits:
        raise ValueError(f"segments: {slots} segment maxima per chunk exceed {MAX_SEGMENT_SLOTS} with capacity "
                         f"{capacity}; use more chunks")
    if auto_threads and segments and rows * n_chunks > BLOCKS_PER_SM * _sm_count():
        return plan_topk(rows, vocab, k, dtype, threads=MANY_ROWS_THREADS, n_chunks=requested_chunks,
                         capacity=requested_capacity, warp_buffers=warp_buffers, segments=requested_segments)
    kc = max(k_out, 1)
    return TopKPlan(
        rows=rows, vocab=vocab, k=k, k_out=k_out, dtype=dtype, threads=threads, capacity=capacity,
        warp_buffers=bool(warp_buffers), segments=bool(segments), segment_slots=slots if segments else 0,
        n_chunks=n_chunks, chunk_elems=chunk_elems,
        cand=cuda.device_array((rows, n_chunks, kc), dtype=np.uint64),
        cmax=cuda.device_array((rows, n_chunks), dtype=np.float32),
        csum=cuda.device_array((rows, n_chunks), dtype=np.float64),
        cflag=cuda.device_array((rows, n_chunks), dtype=np.int32),
        row_flags=cuda.device_array(rows, dtype=np.int32),
    )


_BF16_EXP_MASK = 0x7F80  # bf16 exponent bits: all ones is infinity or NaN


def _check_host_finite(logits: np.ndarray, dtype: str) -> None:
    """Raise ValueError naming 'logits' if a host row holds NaN or infinity (bf16: exponent all ones)."""
    if dtype == "bfloat16":
        bad_rows = ((logits & _BF16_EXP_MASK) == _BF16_EXP_MASK).any(axis=1)  # [R]
    else:
        bad_rows = ~np.isfinite(logits).all(axis=1)  # [R]
    _raise_bad_rows(np.flatnonzero(bad_rows))


def _raise_bad_rows(bad: np.ndarray) -> None:
    """ValueError naming 'logits' listing the first flagged rows, if any."""
    if bad.size:
        raise ValueError(f"logits must be finite (found NaN or infinity in rows {bad[:8].tolist()}"
                         f"{' ...' if bad.size > 8 else ''})")


def run_topk(
    plan: TopKPlan,
    logits: Any,
    out_values: Any,
    out_ids: Any,
    stream: Any = 0,
    *,
    check: bool = True,
) -> None:
    """Fill ``out_values`` / ``out_ids`` with the top-k' log-probabilities of each row of ``logits``.

    Semantics of ``reference.topk_log_probs`` (ids bit-exact; values within
    ``VALUE_ATOL + VALUE_RTOL * |value|``).

    Args:
        plan: from :func:`plan_topk` for this shape and dtype.
        logits: [R, V] float32, or uint16 bf16 bit patterns, C-contiguous: a numba device array
            (graph capture), any CUDA-array-interface object (converted with
            ``cuda.as_cuda_array``, which may sync its stream), or a NumPy array (copied by numba).
        out_values: float32 [R, k'] (written).
        out_ids: int32 [R, k'] (written).
        stream: 0, a numba stream, or a cuda.core Stream / GraphBuilder.
        check: for device logits, read the per-row error flags back after the launches (a stream
            sync) and raise ValueError naming 'logits' if any row had a NaN or infinite logit
            (outputs are then already written). Use False under graph capture: no check.
            NumPy logits are always checked on the host before any launch.

    Raises:
        TypeError / ValueError naming the argument, before any launch (non-finite device logits:
        ValueError after the launches, see ``check``).
    """
    if not isinstance(plan, TopKPlan):
        raise TypeError(f"plan must be a TopKPlan (from plan_topk), got {type(plan).__name__}")
    logits = check_array(logits, "logits", _ELEM_DTYPE[plan.dtype], shape=(plan.rows, plan.vocab))
    out_values = check_array(out_values, "out_values", np.float32, shape=(plan.rows, plan.k_out))
    out_ids = check_array(out_ids, "out_ids", np.int32, shape=(plan.rows, plan.k_out))
    if isinstance(logits, np.ndarray):
        _check_host_finite(logits, plan.dtype)

    per_word = _WORD_BYTES * 8 // _ELEM_BITS[plan.dtype]
    packed = plan.vocab % per_word == 0 and data_address(logits) % _WORD_BYTES == 0
    if packed:
        words, chunk_words = logits.view(np.uint64), plan.chunk_elems // per_word
    else:
        words, chunk_words = logits.view(_NARROW_WORD[plan.dtype]), plan.chunk_elems
    k, cap = np.int32(plan.k_out), np.int32(plan.capacity)
    if plan.warp_buffers and packed:  # unaligned logits: the block kernel (a warp plan's capacity suits it)
        kernel, buffer = _WARP_KERNELS[plan.dtype, packed], np.int32(plan.capacity // (plan.threads // WARP_SIZE))
    elif plan.segments:
        kernel, buffer = _SEGMENT_KERNELS[plan.dtype, packed], cap
    else:
        kernel, buffer = _CHUNK_KERNELS[plan.dtype, packed], cap
    launch(
        kernel, (plan.n_chunks, plan.rows), plan.threads, stream, plan.shared_bytes,
        words, k, buffer, np.int32(chunk_words), plan.cand, plan.cmax, plan.csum, plan.cflag,
        out_values, out_ids, plan.row_flags,
    )
    if plan.n_chunks > 1:
        launch(
            merge_kernel, plan.rows, plan.threads, stream, plan.shared_bytes,
            plan.cand, plan.cmax, plan.csum, plan.cflag, k, cap, out_values, out_ids, plan.row_flags,
        )
    if check:
        check_topk_errors(plan, stream)


def _synchronize(stream: Any) -> None:
    """Wait for ``stream`` (numba: synchronize, cuda.core: sync; 0 / None: copies were synchronous)."""
    if stream is None or (isinstance(stream, int) and stream == 0):
        return
    wait = getattr(stream, "synchronize", None) or getattr(stream, "sync")
    wait()


def check_topk_errors(plan: TopKPlan, stream: Any = 0) -> None:
    """Raise ValueError naming 'logits' if the last run saw a NaN or infinite logit (syncs ``stream``)."""
    flags = plan.row_flags.copy_to_host(stream=stream)
    _synchronize(stream)
    _raise_bad_rows(np.flatnonzero(flags))
