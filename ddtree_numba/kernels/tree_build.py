"""Best-first DDTree build on the GPU: one thread block per request, no host round trip.

Same nodes, in the same order, as ``reference.build_tree`` (spec §1.2): the official heap keyed
``(-w, rank_path)`` is emulated exactly, float64 scores with the official order of operations,
score ties broken by the lexicographic rank path (prefix first).

Frontier (spec §7, "GPU build"). Every heap entry is "the next unpopped child of node q": the
seed is node 0's first child, popping child ``r`` of ``q`` replaces it by sibling ``r + 1`` and
opens slot ``i`` (the new node's first child). So the frontier is one slot per node, never more
than ``1 + budget`` entries. Warp 0 selects; lane ``l`` owns the slots ``q = l (mod 32)``, stored
lane-major in shared memory (``slot_score[l * S + q // 32]``, ``S`` slots per lane).

The loop is built for latency: one warp is all its SM runs, so a round costs its chain of
dependent instructions (measured first version: ~2000-3000 cycles a pop, from 64-bit index
arithmetic, a per-pop rescan, dependent loads after the selection). Now, per pop:

- Each lane holds its best candidate in registers (score, slot, rank | depth; its shared slot
  reads -inf) and the best of its shared slots (``rest``). Both stay exact with O(1) updates;
  only when a lane's best is popped and the sibling replacing it is worse than ``rest`` does
  the lane rescan its slice (an unrolled pass, four max chains), at the top of the next pop.
- Before the warp's choice, each lane computes its best's successors (sibling
  ``(w - lp[d-1, r]) + lp[d-1, r+1]``, first child ``w + lp[d, 0]``; shared-memory reads that
  overlap the shuffles below).
- The holder of the warp's top score: each best maps to an order-preserving 64-bit integer key
  (:func:`_score_key`), two ``redux.sync.max`` (high word, then low word among the lanes at
  the top high word) and a ballot replace the 5-round float64 shuffle butterfly (10 shuffles
  and 5 compares in one dependent chain). Then index shuffles of its score, slot,
  rank | depth and child score. The winner's new best is max(``rest``, sibling); the owner of
  slot ``i`` compares the child with its best. No barrier, no global load (ranks past the lp
  cache excepted), all integers int32 with unsigned indices.
- Exact ties (equal float64 scores) are never decided on the fast path: a pop is taken only when
  the top score is held once in the whole frontier (one ballot bit, and the holder's ``rest``
  differs). Otherwise a slow path compares rank paths by walking parent chains (lane-local,
  then a butterfly across lanes), moves the winning candidate into its lane's registers and
  pops it.

Several pops per round (the serial chain is per round, not per pop), a local best-first run
(:func:`_select_nodes`): after the top candidate p, the round's local candidates are the
runner-up q (the frontier's second best, when one lane alone holds it: one more REDUX and a
ballot) and the pushes of every node popped in the round (sibling and first child, so chains
of first children as well as sibling runs). The best local candidate pops next while it is
strictly above the rest of the frontier (a one-REDUX bound on the high key word with p and q
taken out) and strictly above the other local candidates (the best two kept, the rest folded
into a bound), at most RUN_MAX pops. Lane j records node n+1+j, lane (n+1+j) mod 32 opens its
slot. Modelled on the benchmark's inputs (B 512, L 16): the runner-up doubles the pops per
round of the slowest requests (1.2 -> 2.4 with logit scales 1-4, 1.0 -> 2.05 with 6-8); local
runs without q hardly help there (the frontier's second best is the usual next pop).

Threshold phase (budgets >= BAND_MIN_BUDGET, variants up to S = 16; run ``tree-build`` in
docs/PERFORMANCE.md). The heap's pops are a best-first order, so for a threshold t the nodes
reachable from the seed through nodes scoring >= t are exactly its first pops, provided no score
rises above its predecessor's. Before warp 0 starts, all threads grow that set by attempts at
falling thresholds (a secant on log(nodes) against t, bisection after an attempt that would pass
the budget, which is discarded), each attempt a few barrier-separated rounds, one per depth.
A node's pending children are a sibling run: their recurrence scores are base + lp[r] when those
float64 sums are exact (checked per child with TwoSum), so a binary search finds the run's end
and a lane (short runs) or the warp (long ones) writes it. The set is then sorted by key into pop
order (each entry counts the keys before it; equal scores compare rank paths) and its frontier
goes to warp 0's slots, which pops the last <= BAND_LEFT nodes. An inexact sum, a rising score,
an unsorted row or a run base of -0.0 voids the phase and the heap builds the tree from the
seed. At bs 64, B 512 it takes the build from 248.4 to 111.6 us (H200, docs/PERFORMANCE.md).

After the loop the whole block writes the outputs: per-node arrays, the packed visibility (one
thread per (node, word) walks the node's ancestors down to the word), and the CSR child table
(warp 0 scans the child counts; children are popped in rank order, so child ``r`` of ``p`` is
``child_index[child_ptr[p] + r]``). Padding follows ``reference.TreeBatch``.

Kernel variants: ``S`` (slots per lane) is a compile-time constant so the rescan is straight-line
code; :func:`plan` picks the smallest variant with ``32 * S >= budget`` (node i needs a slot only
while pops follow it), and the shared memory left over caches the first ``kc`` ranks of every
depth's log-probs (global memory, mostly L1 hits, beyond).

Host side (FlashInfer style, stack §8): :func:`plan` fixes the shapes and the launch once per
batch shape, :func:`allocate_outputs` makes caller-owned device buffers, :func:`run` validates
and launches on ``stream`` (graph-capturable: no allocation, no copy, no sync).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from llvmlite import ir
from numba import cuda, float32, float64, int16, int32, int64, types, uint32
from numba.core.extending import intrinsic

from sim.launch import launch

from ._args import check_array, int_arg
from .pdl import pdl_begin
from .registry import register
from .warp import warp_inclusive_scan_i32

__all__ = [
    "MAX_BUDGET", "MAX_NODES", "MAX_HORIZON", "SLOT_CLASSES", "DEFAULT_THREADS",
    "TreeBuildPlan", "TreeBuildOutputs", "tree_build_kernels",
    "plan", "allocate_outputs", "run",
]

WARP_SIZE = 32
LANE_MASK = WARP_SIZE - 1
LANE_BITS = 5  # slot q belongs to lane q & LANE_MASK, at position q >> LANE_BITS of its slice
FULL_MASK = 0xFFFFFFFF
FIRST_BUTTERFLY_OFFSET = WARP_SIZE // 2
NEG_INF = -math.inf  # an empty frontier slot; real scores are finite sums of finite log-probs
WORD_BITS = 32  # packed visibility: bit j % 32 of word j // 32

MAX_BUDGET = 1024  # issue 3: budgets up to 1024 drafted nodes
MAX_NODES = MAX_BUDGET + 1  # root + drafted nodes; the capacity limit of one block
MAX_HORIZON = MAX_BUDGET  # depth <= budget; also keeps >= 1 cached rank per depth
# A candidate's info word: its rank (child r of its slot's node) and its depth.
RANK_MASK = 0xFFFF  # rank <= budget
DEPTH_SHIFT = 16  # depth <= budget + 1 < 2**15
SEED_INFO = 1 << DEPTH_SHIFT  # rank 0, depth 1: node 0's first child (idle lanes use it as a stand-in)
SLOT_MASK = 0xFFFF  # the shuffled slot word: slot <= MAX_NODES in the low bits...
TIE_FLAG = 1 << 16  # ...and this bit when the lane's slice holds its best score twice
CAND_RANK_SHIFT = 16  # slow path: a candidate as one word, slot | rank << 16
# A round pops the warp's top candidate p and then up to RUN_MAX - 1 more nodes, each only when
# provably the heap's next pop (see _select_nodes). <= WARP_SIZE: one lane per node.
RUN_MAX = 16

# Slots per lane of the kernel variants: 32 * S slots serve budgets up to 32 * S (node i's slot
# is only needed while more pops follow, so nodes 0..budget-1). A smaller variant has shorter
# rescans and more lp cache.
SLOT_CLASSES = (2, 4, 8, 16, 32)
SHARED_BYTES = 48 * 1024 - 256  # static shared memory per block, under the 48 KiB default (limits §4)
FILL_UNROLL = 8  # global loads per thread in flight while filling the lp cache
DEFAULT_THREADS = 512  # warp 0 selects; all warps fill the lp cache and write the outputs
MAX_THREADS = 512  # registers (< 128) allow 512; the other warps idle during selection


# --- device functions ------------------------------------------------------------------------

ABS_MASK = 0x7FFFFFFFFFFFFFFF  # float64 bits without the sign
SIGN_BIT = -0x8000000000000000  # float64 sign bit, as int64
LOW_WORD = 0xFFFFFFFF
HIGH_SHIFT = 32


def _redux_intrinsic(ptx_type: str, nb_type: types.Type):
    """``redux.sync.max.<ptx_type>`` over the full warp (sm_80+: one REDUX instruction)."""

    @intrinsic
    def redux_max(typingctx, value):
        if value != nb_type:
            return None
        sig = nb_type(nb_type)

        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32)])
            asm = ir.InlineAsm(fnty, f"redux.sync.max.{ptx_type} $0, $1, 0xffffffff;", "=r,r",
                               side_effect=True)
            return builder.call(asm, args)

        return sig, codegen

    return redux_max


@intrinsic
def _f64_bits_gpu(typingctx, x):
    """The IEEE bits of float64 ``x`` as int64 (a register move)."""
    if x != types.float64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(types.float64), codegen


@intrinsic
def _f64_from_bits_gpu(typingctx, bits):
    """The float64 whose IEEE bits are int64 ``bits`` (a register move)."""
    if bits != types.int64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), codegen


@cuda.jit(device=True)
def _f64_bits_sim(x):
    """Simulator stand-in for the bit cast."""
    return np.array([x], np.float64).view(np.int64)[0]


@cuda.jit(device=True)
def _f64_from_bits_sim(bits):
    """Simulator stand-in for the inverse bit cast."""
    return np.array([bits], np.int64).view(np.float64)[0]


@cuda.jit(device=True)
def _warp_max_s32_sim(v):
    """Simulator stand-in for ``redux.sync.max.s32``: an xor butterfly."""
    v = int32(v)
    offset = FIRST_BUTTERFLY_OFFSET
    while offset > 0:
        other = int32(cuda.shfl_xor_sync(FULL_MASK, v, offset))
        if other > v:
            v = other
        offset //= 2
    return v


@cuda.jit(device=True)
def _warp_max_u32_sim(v):
    """Simulator stand-in for ``redux.sync.max.u32``: an xor butterfly (shuffles take no uint32,
    so the values travel as int64)."""
    w = int64(v)
    offset = FIRST_BUTTERFLY_OFFSET
    while offset > 0:
        other = int64(cuda.shfl_xor_sync(FULL_MASK, w, offset))
        if other > w:
            w = other
        offset //= 2
    return uint32(w)


# The GPU takes the single-instruction forms; the simulator (which cannot run inline PTX) the
# butterflies, with the same results.
if cuda.config.ENABLE_CUDASIM:
    _f64_bits = _f64_bits_sim
    _f64_from_bits = _f64_from_bits_sim
    _warp_max_s32 = _warp_max_s32_sim
    _warp_max_u32 = _warp_max_u32_sim
else:
    _f64_bits = _f64_bits_gpu
    _f64_from_bits = _f64_from_bits_gpu
    _warp_max_s32 = _redux_intrinsic("s32", types.int32)
    _warp_max_u32 = _redux_intrinsic("u32", types.uint32)


@cuda.jit(device=True)
def _score_key(x):
    """Order key of float64 ``x`` (not NaN) as (int32 high word, uint32 low word).

    The signed integer ``bits`` for x >= 0, ``-(bits & ABS_MASK)`` for x < 0: it orders like the
    floats, with -0.0 and +0.0 equal (as they compare), so equal keys are exactly equal scores.
    Compared lexicographically, high word signed, low word unsigned.
    """
    bits = _f64_bits(x)
    if bits < 0:
        bits = -(bits & ABS_MASK)
    return int32(bits >> HIGH_SHIFT), uint32(bits & LOW_WORD)


@cuda.jit(device=True)
def _warp_argmax_key(x):
    """Lane mask of the lanes holding the warp's largest float64 ``x`` (two REDUX + a ballot).

    The high words' maximum first, then the maximum low word among the lanes that reach it.
    """
    hi, lo = _score_key(x)
    hi_max = _warp_max_s32(hi)
    lo_in = uint32(0)
    if hi == hi_max:
        lo_in = lo
    lo_max = _warp_max_u32(lo_in)
    return cuda.ballot_sync(FULL_MASK, hi == hi_max and lo == lo_max)


@cuda.jit(device=True)
def _score_from_key(hi, lo):
    """The inverse of :func:`_score_key`: the float64 of key (int32 ``hi``, uint32 ``lo``)
    (``-0.0`` comes back as ``+0.0``, which compares the same)."""
    key = (int64(hi) << HIGH_SHIFT) | int64(lo)
    if key < 0:  # undo the negation of negative scores
        key = (-key) | SIGN_BIT
    return _f64_from_bits(key)


@cuda.jit(device=True)
def _path_less(pa, ra, pb, rb, node_parent, node_rank, node_depth):
    """Is candidate a's rank path (child ``ra`` of node ``pa``) before candidate b's?

    Python tuple order: lexicographic, a proper prefix first (spec §1.2, heap ties). Both
    candidates are lifted to a common depth, then to their lowest common ancestor; depth <= L.
    """
    da = int32(node_depth[pa])
    db = int32(node_depth[pb])
    b_deeper = db > da
    while da > db:  # a's ancestor at b's depth: node pa is child rank[pa] of parent[pa]
        ra = int32(node_rank[pa])
        pa = int32(node_parent[pa])
        da -= 1
    while db > da:
        rb = int32(node_rank[pb])
        pb = int32(node_parent[pb])
        db -= 1
    while pa != pb:
        ra = int32(node_rank[pa])
        pa = int32(node_parent[pa])
        rb = int32(node_rank[pb])
        pb = int32(node_parent[pb])
    if ra == rb:  # one path is a prefix of the other: the shorter comes first
        return b_deeper
    return ra < rb


@cuda.jit(device=True)
def _first_in_heap_order(cand, node_parent, node_rank, node_depth):
    """The warp's candidate that pops first; ``cand`` = slot | rank << 16 (child ``rank`` of node
    ``slot``), -1 for none. Every lane gets it.

    An xor butterfly: path order is a total order on distinct candidates, so both lanes of a pair
    keep the same one and every lane ends with the first.
    """
    offset = FIRST_BUTTERFLY_OFFSET
    while offset > 0:
        other = cuda.shfl_xor_sync(FULL_MASK, cand, offset)
        if other >= 0 and (cand < 0 or _path_less(other & SLOT_MASK, other >> CAND_RANK_SHIFT,
                                                  cand & SLOT_MASK, cand >> CAND_RANK_SHIFT,
                                                  node_parent, node_rank, node_depth)):
            cand = other
        offset //= 2
    return cand


@cuda.jit(device=True)
def _rescan(slot_score, base, n_slots):
    """Best (score, position j) of ``slot_score[base + j]``, j < n_slots; (-inf, 0) if all empty.

    Called with a compile-time ``n_slots``, so it is straight-line code; four independent max
    chains (j mod 4) keep the dependency chain short. Equal scores: any one of them (ties are
    detected and resolved by the caller, never decided here).
    """
    m0 = NEG_INF
    m1 = NEG_INF
    m2 = NEG_INF
    m3 = NEG_INF
    j0 = int32(0)
    j1 = int32(0)
    j2 = int32(0)
    j3 = int32(0)
    for j in range(0, n_slots, 4):
        v0 = slot_score[uint32(base + j)]
        v1 = slot_score[uint32(base + j + 1)]
        if v0 > m0:
            m0 = v0
            j0 = int32(j)
        if v1 > m1:
            m1 = v1
            j1 = int32(j + 1)
        if j + 2 < n_slots:
            v2 = slot_score[uint32(base + j + 2)]
            v3 = slot_score[uint32(base + j + 3)]
            if v2 > m2:
                m2 = v2
                j2 = int32(j + 2)
            if v3 > m3:
                m3 = v3
                j3 = int32(j + 3)
    if m1 > m0:
        m0 = m1
        j0 = j1
    if m3 > m2:
        m2 = m3
        j2 = j3
    if m2 > m0:
        m0 = m2
        j0 = j2
    return m0, j0


@cuda.jit(device=True)
def _successors(lp, lp_cache, kc, b, n_depth, k, score, info):
    """(sibling, first child) scores of candidate ``info`` (rank | depth << 16) scoring ``score``.

    Heap order of operations: sibling ``(w - lp[d-1, r]) + lp[d-1, r+1]`` (-inf past rank K-1),
    child ``w + lp[d, 0]`` (-inf at depth L). Ranks below ``kc`` come from the shared cache.
    """
    rank = int32(info & RANK_MASK)
    depth = int32(info >> DEPTH_SHIFT)
    row = int32(min(depth, n_depth) - 1)
    last = int32(k - 1)
    here = min(rank, last)  # clamped: read in range, result unused past the end
    after = min(int32(rank + 1), last)
    # Shared-memory reads first and unconditionally, so they issue at the top of the pop.
    lp_first = float64(lp_cache[uint32(min(depth, int32(n_depth - 1)) * kc)])
    lp_here = float64(lp_cache[uint32(row * kc + min(here, int32(kc - 1)))])
    lp_after = float64(lp_cache[uint32(row * kc + min(after, int32(kc - 1)))])
    if after >= kc:  # rare: a rank past the cache (L1 hits mostly, the row is read in order)
        lp_here = float64(lp[uint32(b), uint32(row), uint32(here)])
        lp_after = float64(lp[uint32(b), uint32(row), uint32(after)])
    sibling = NEG_INF
    if rank < last:
        sibling = (score - lp_here) + lp_after
    child = NEG_INF
    if depth < n_depth:
        child = score + lp_first
    return sibling, child


@cuda.jit(device=True)
def _resolve_tie(top, lane, base, n_slots, best, best_slot, best_info,
                 slot_score, slot_info, node_parent, node_rank, node_depth):
    """Slow path: the candidate that pops first among those scoring ``top``; it becomes its lane's best.

    Each lane picks its path-first candidate among its best and its shared slots scoring ``top``,
    then the lanes compare theirs (:func:`_first_in_heap_order`). The winning lane swaps its held
    best for the winner if they differ: the same score, but not always the same bits (+0.0 and
    -0.0 tie), so the winner's own score comes along. Returns (winner slot, best, best_slot,
    best_info).
    """
    cand = int32(-1)
    if best == top:
        cand = int32(best_slot | ((best_info & RANK_MASK) << CAND_RANK_SHIFT))
    for j in range(n_slots):
        if slot_score[uint32(base + j)] == top:
            q = int32(lane + (j << LANE_BITS))
            rank = int32(slot_info[uint32(base + j)] & RANK_MASK)
            if cand < 0 or _path_less(q, rank, cand & SLOT_MASK, cand >> CAND_RANK_SHIFT,
                                      node_parent, node_rank, node_depth):
                cand = int32(q | (rank << CAND_RANK_SHIFT))
    winner = int32(_first_in_heap_order(cand, node_parent, node_rank, node_depth) & SLOT_MASK)
    if lane == (winner & LANE_MASK) and winner != best_slot:
        held = best
        best = slot_score[uint32(base + (winner >> LANE_BITS))]
        slot_score[uint32(base + (best_slot >> LANE_BITS))] = held  # held best back to its slot
        slot_score[uint32(base + (winner >> LANE_BITS))] = NEG_INF
        best_slot = winner
        best_info = int32(slot_info[uint32(base + (winner >> LANE_BITS))])
    return winner, best, best_slot, best_info


@cuda.jit(device=True)
def _warp_max_high(x):
    """The warp's largest high key word of float64 ``x`` (one REDUX): an upper bound that needs
    no low-word pass; ties of the high word are left to the callers' strict compares."""
    hi, lo = _score_key(x)
    return _warp_max_s32(hi)


@cuda.jit(device=True)
def _above_high(hi_max):
    """The smallest float64 whose key's high word exceeds ``hi_max``: ``x >= this`` iff x is
    strictly above every score whose high word is <= ``hi_max``."""
    return _score_from_key(int32(hi_max + 1), uint32(0))


@cuda.jit(device=True)
def _top2_of_three(c_score, c_info, c_slot, c_sib, c_child,
                   s_score, s_info, s_slot, s_sib, s_child,
                   k_score, k_info, k_slot, k_sib, k_child):
    """The two best of candidates c, s, k (score, info, slot, sibling, child) and the third's
    score. Equal scores in any order: the caller only pops a best strictly above the others."""
    if k_score > s_score:  # hi1 >= lo1 among s, k
        h_score, h_info, h_slot, h_sib, h_child = k_score, k_info, k_slot, k_sib, k_child
        l_score, l_info, l_slot, l_sib, l_child = s_score, s_info, s_slot, s_sib, s_child
    else:
        h_score, h_info, h_slot, h_sib, h_child = s_score, s_info, s_slot, s_sib, s_child
        l_score, l_info, l_slot, l_sib, l_child = k_score, k_info, k_slot, k_sib, k_child
    if c_score > h_score:
        return (c_score, c_info, c_slot, c_sib, c_child,
                h_score, h_info, h_slot, h_sib, h_child, l_score)
    if c_score > l_score:
        return (h_score, h_info, h_slot, h_sib, h_child,
                c_score, c_info, c_slot, c_sib, c_child, l_score)
    return (h_score, h_info, h_slot, h_sib, h_child,
            l_score, l_info, l_slot, l_sib, l_child, c_score)


@cuda.jit(device=True)
def _select_nodes(b, lp, lp_cache, kc, budget, scores, n_slots, resume, n_start,
                  slot_score, slot_info, node_parent, node_rank, node_depth):
    """Warp 0: pop up to ``budget`` nodes in heap order; returns (nodes drafted, rounds).

    Fills node_parent/node_rank/node_depth [1..n] and scores[b, 1..n]; slot_info's rank field
    ends as each node's child count. Not ``resume``: expects slot_score = -inf, slot_info = 0,
    the root record and ``n_start`` = 0, and seeds the heap itself. ``resume``: continues after
    the threshold phase (:func:`_grow_by_thresholds`), which recorded nodes 0..n_start in pop
    order and left the official heap's frontier in the lane-major slots.

    Lane state, in registers: its best candidate (score, slot, rank | depth << 16; its shared
    slot reads -inf) and the best of its shared slots (``rest``, position ``rest_j``, info
    ``rest_info``), kept exact by every update in O(1) except one: when the lane's best is popped
    and the sibling replacing it is worse than ``rest``, ``rest`` becomes the best and the new
    ``rest`` needs a rescan of the slice (``stale``), done at the top of the next round by that
    lane alone. Integers are kept int32 and indices unsigned: numba's default int64 arithmetic
    and negative-index checks would lengthen the per-round instruction chain.

    A round (one warp argmax) pops several nodes, a local best-first run:

    - p, the frontier's unique maximum (exact: two REDUX on the 64-bit keys and a ballot).
    - q, the runner-up: the lanes offer their best (p's lane its ``rest``); one REDUX gives the
      top high key word b1; if one lane alone reaches b1 with its best (not p's lane), q is that
      best. The lanes offer again with q's lane on its ``rest``: one REDUX gives b2 >= the high
      word of every frontier entry but p and q (b2 = b1 without a q), and ``thr`` is the
      smallest float64 above high word b2.
    - The local candidates: q and every push of this round's pops (sibling and first child of
      each, with their own successors computed on creation). The best two are kept (``cand``,
      ``carry``), the others only as a bound (``drop``). The best is popped next iff it is
      >= ``thr``, > ``carry`` and > ``drop``, at most min(budget left, RUN_MAX) pops a round.

    Proof of exactness: the official heap after this round's pops holds the frontier without
    p, q (every score < ``thr``), the local candidates not popped (tracked, or <= ``drop``), and
    nothing else; the scores are the official ones (same recurrences, same float64 order of
    operations, :func:`_successors`). A candidate strictly above all of them has the smallest
    key (-w, path) whatever the rank paths, so the heap pops it next. Exact ties never pass the
    strict compares: they stop the run and go through the next round's tie check (-inf entries
    never pass ``thr``). An exact tie for p takes the slow path and pops p alone.

    Node i + j (i = n + 1) is the run's j-th pop, recorded by lane j. Slots change only where a
    pop came from: a popped best (p on its lane, q on its lane) moves on to its next sibling
    (``a_*``), and slot i + j opens on lane (i + j) mod 32 (j < RUN_MAX <= 32: one per lane)
    with node i + j's first child, then moves on as its children are popped (``o_*``).
    """
    n_depth = int32(lp.shape[1])
    k = int32(lp.shape[2])
    lane = int32(cuda.laneid)
    base = int32(lane * n_slots)  # this lane's slice of slot_score / slot_info
    best = NEG_INF
    best_slot = lane  # an idle lane's stand-in: its slots are all -inf, storing -inf is harmless
    best_info = int32(SEED_INFO)
    rest = NEG_INF
    rest_j = int32(0)
    rest_info = int32(0)
    stale = False
    score_row = scores[b]  # [N] float64, hoisted out of the loop
    if resume:  # each lane's best comes out of its slice into registers
        best, j = _rescan(slot_score, base, n_slots)
        if best != NEG_INF:
            best_slot = int32(lane + (j << LANE_BITS))
            best_info = int32(slot_info[uint32(base + j)])
            slot_score[uint32(base + j)] = NEG_INF
        rest, rest_j = _rescan(slot_score, base, n_slots)
        rest_info = int32(slot_info[uint32(base + rest_j)])
    elif lane == 0 and budget > 0:  # seed: rank path (0,), node 0's first child, slot 0
        best = float64(lp_cache[0])
        slot_info[0] = SEED_INFO
    n = int32(n_start)  # drafted nodes recorded so far
    rounds = int32(0)
    while n < budget:
        if stale:
            rest, rest_j = _rescan(slot_score, base, n_slots)
            rest_info = int32(slot_info[uint32(base + rest_j)])  # read now, used after the selection
            stale = False
        cuda.syncwarp()  # converged, and the other lanes' shared writes of the last round visible
        sibling, child = _successors(lp, lp_cache, kc, b, n_depth, k, best, best_info)
        slot_word = best_slot
        if rest == best and best != NEG_INF:  # the lane's slice holds its best score twice
            slot_word |= TIE_FLAG
        holders = _warp_argmax_key(best)
        win = int32(cuda.ffs(holders) - 1)
        top = cuda.shfl_sync(FULL_MASK, best, win)
        slot_word = int32(cuda.shfl_sync(FULL_MASK, slot_word, win))
        info = int32(cuda.shfl_sync(FULL_MASK, best_info, win))  # popped: child `rank` of node p, depth d
        child1 = cuda.shfl_sync(FULL_MASK, child, win)
        sib1 = cuda.shfl_sync(FULL_MASK, sibling, win)
        if top == NEG_INF:  # frontier exhausted (V < budget, spec §1.2)
            break
        rounds += 1
        p = int32(slot_word & SLOT_MASK)
        limit = int32(min(budget - n, RUN_MAX))
        offer = best  # the frontier without p: p's lane offers its slice's best instead
        if lane == win:
            offer = rest
        offer_hi = _score_key(offer)[0]
        b1 = _warp_max_s32(offer_hi)
        q_lanes = cuda.ballot_sync(FULL_MASK, offer_hi == b1)
        q_win = int32(cuda.ffs(q_lanes) - 1)
        has_q = cuda.popc(q_lanes) == 1 and q_win != win
        if has_q and lane == q_win:  # the frontier without p and q
            offer = rest
        b2 = _warp_max_high(offer)
        q_score = cuda.shfl_sync(FULL_MASK, best, q_win)
        q_slot = int32(cuda.shfl_sync(FULL_MASK, best_slot, q_win))
        q_info = int32(cuda.shfl_sync(FULL_MASK, best_info, q_win))
        q_sib = cuda.shfl_sync(FULL_MASK, sibling, q_win)
        q_child = cuda.shfl_sync(FULL_MASK, child, q_win)
        if cuda.popc(holders) > 1 or slot_word & TIE_FLAG != 0:  # an exact tie: slow path
            p, best, best_slot, best_info = _resolve_tie(top, lane, base, n_slots, best, best_slot,
                                                         best_info, slot_score, slot_info, node_parent,
                                                         node_rank, node_depth)
            win = int32(p & LANE_MASK)
            if lane == win:  # its best may have changed: redo the fast path's lane-local work
                sibling, child = _successors(lp, lp_cache, kc, b, n_depth, k, best, best_info)
                rest, rest_j = _rescan(slot_score, base, n_slots)
                rest_info = int32(slot_info[uint32(base + rest_j)])
            top = cuda.shfl_sync(FULL_MASK, best, win)  # the winner's bits (+0.0 ties -0.0)
            info = int32(cuda.shfl_sync(FULL_MASK, best_info, win))
            child1 = cuda.shfl_sync(FULL_MASK, child, win)
            sib1 = cuda.shfl_sync(FULL_MASK, sibling, win)
            limit = int32(1)  # the bounds assumed the other winner: pop p alone
        if not has_q:  # no runner-up candidate (b2 = b1 bounds the frontier without p)
            q_score = NEG_INF
        thr = _above_high(b2)
        i = int32(n + 1)
        slot_lane = int32((lane - i) & LANE_MASK)  # this lane opens slot i + slot_lane
        opened = int32(i + slot_lane)
        # the local run: x is the node being popped, `carry` the second-best local candidate
        x_score, x_info, x_slot, x_sib, x_child = top, info, p, sib1, child1
        c_score, c_info, c_slot, c_sib, c_child = q_score, q_info, q_slot, q_sib, q_child
        drop = NEG_INF
        my_score = top  # the node this lane records (lane j: the j-th pop)
        my_info = info
        my_parent = p
        popped_best = False  # this lane's best (p or q) was popped; a_*: its slot's next candidate
        a_score = best
        a_info = best_info
        o_score = NEG_INF  # slot `opened`, once its node is popped: its next candidate
        o_info = int32(0)
        m = int32(0)
        while True:
            s_info = int32(x_info + 1)  # x's pushes: its next sibling and its first child
            k_info = int32(((x_info >> DEPTH_SHIFT) + 1) << DEPTH_SHIFT)
            k_slot = int32(i + m)
            if lane == m:
                my_score = x_score
                my_info = x_info
                my_parent = x_slot
            if x_slot == best_slot and x_slot < i:  # this lane's best popped (new slots are >= i)
                popped_best = True
                a_score = x_sib
                a_info = s_info
            if x_slot == opened:  # a child of this lane's new node popped
                o_score = x_sib
                o_info = s_info
            if m == slot_lane:  # this lane's new node: its slot opens with its first child
                o_score = x_child
                o_info = k_info
            m += 1
            if m >= limit:
                break
            s_sib, s_child = _successors(lp, lp_cache, kc, b, n_depth, k, x_sib, s_info)
            k_sib, k_child = _successors(lp, lp_cache, kc, b, n_depth, k, x_child, k_info)
            (x_score, x_info, x_slot, x_sib, x_child, c_score, c_info, c_slot, c_sib, c_child,
             third) = _top2_of_three(c_score, c_info, c_slot, c_sib, c_child,
                                     x_sib, s_info, x_slot, s_sib, s_child,
                                     x_child, k_info, k_slot, k_sib, k_child)
            if third > drop:
                drop = third
            if not (x_score >= thr and x_score > c_score and x_score > drop):
                break
        if lane < m:  # node i + lane
            node_parent[uint32(i + lane)] = my_parent
            node_rank[uint32(i + lane)] = my_info & RANK_MASK
            node_depth[uint32(i + lane)] = my_info >> DEPTH_SHIFT
            score_row[uint32(i + lane)] = my_score
        if popped_best:  # its slot moves on to the next sibling; best = max(rest, that sibling)
            slot_info[uint32(base + (best_slot >> LANE_BITS))] = a_info
            if a_score >= rest:  # the sibling stays in registers, the slot reads -inf
                best = a_score
                best_info = a_info
            else:  # the sibling goes to the slot, `rest` comes out of shared memory
                slot_score[uint32(base + (best_slot >> LANE_BITS))] = a_score
                slot_score[uint32(base + rest_j)] = NEG_INF
                best = rest
                best_slot = int32(lane + (rest_j << LANE_BITS))
                best_info = rest_info
                stale = True
        if slot_lane < m and opened < budget:  # slot `opened` opens (its node has a slot)
            slot_info[uint32(base + (opened >> LANE_BITS))] = o_info
            if o_score > best:  # the held best goes to its shared slot and is the new `rest`
                slot_score[uint32(base + (best_slot >> LANE_BITS))] = best
                rest = best
                rest_j = int32(best_slot >> LANE_BITS)
                rest_info = best_info
                best = o_score
                best_slot = opened
                best_info = o_info
            else:
                slot_score[uint32(base + (opened >> LANE_BITS))] = o_score
                if o_score > rest:
                    rest = o_score
                    rest_j = int32(opened >> LANE_BITS)
                    rest_info = o_info
        n = int32(n + m)
    return n, rounds


# --- the threshold phase ---------------------------------------------------------------------
#
# The official heap pops nodes in key order (-w, rank path) as long as every node scores at most
# its predecessor (its parent for a first child, its previous sibling otherwise): then, for any
# threshold t, the nodes reachable from the seed through nodes scoring >= t are exactly the
# heap's first pops, and every frontier entry left scores < t. The threshold phase grows that set
# C with all threads of the block, t lowered attempt by attempt, never past the budget (an
# attempt that would overflow is discarded), sorts C by key into pop order and hands the frontier
# to the warp-0 heap for the last few pops. A node's pending children form a sibling run whose
# scores are base + lp[r] when those float64 sums are exact (:func:`_run_start`): a binary search
# finds the run's end; its lane writes a run of up to LONG_RUN nodes, the warp a longer one. An
# inexact sum, a score above its predecessor (a positive log-prob), an unsorted row or a run base
# of -0.0 (base + lp would give +0.0) voids the phase: the heap starts over from the seed.

BAND_MIN_BUDGET = 64  # smaller budgets go straight to the heap (a few rounds of it are cheaper)
BAND_LEFT = 16  # the threshold phase stops with at most this many pops left to the heap
BAND_MAX_ATTEMPTS = 12  # threshold attempts per request, kept or discarded
BAND_STEP = 1.0  # nats: the second threshold below the first, before the secant has two points
BAND_SLOT_CLASSES = tuple(s for s in SLOT_CLASSES if s <= 16)  # variants with the phase (shared memory)
SORT_UNROLL = 8  # score loads in flight per thread while sorting C into pop order
LONG_RUN = 8  # sibling runs longer than this are written by the whole warp, shorter ones by their lane
ROUND_COUNTERS = 3  # rotating append counters: one barrier per expansion round (see _attempt)
BAND_COUNTERS = ROUND_COUNTERS + 2  # and one round-0 counter per attempt parity


@cuda.jit(device=True)
def _lp_at(lp, lp_cache, kc, b, row, rank):
    """lp[b, row, rank] as float64, from the shared cache for ranks below ``kc``."""
    if rank < kc:
        return float64(lp_cache[uint32(row * kc + rank)])
    return float64(lp[uint32(b), uint32(row), uint32(rank)])


@cuda.jit(device=True)
def _key64(x):
    """:func:`_score_key` as one int64 that orders like the float64 ``x`` (for an atomic max)."""
    hi, lo = _score_key(x)
    return (int64(hi) << HIGH_SHIFT) | int64(lo)


@cuda.jit(device=True)
def _exact_sum(a, b):
    """(fl(a + b), whether it is exact): Knuth's TwoSum error is zero iff no rounding happened."""
    s = a + b
    bb = s - a
    err = (a - (s - bb)) + (b - bb)
    return s, err == 0.0


@cuda.jit(device=True)
def _run_start(lp, lp_cache, kc, b, k, score, rank, depth, tau, max_len):
    """A pending child run of one node: its first candidate is child ``rank`` (depth ``depth``,
    scoring ``score`` >= ``tau``). Returns (n, base, exact): the children rank .. rank + n - 1
    score >= tau (n capped at ``max_len``), and every child r of the run scores
    fl(base + lp[depth - 1, r]) if ``exact``.

    Why: the heap's sibling recurrence (w - lp[r]) + lp[r + 1], started at w = score, is
    base + lp[r] for every r when base = score - lp[rank] and each of those sums is exact
    (then each step's difference is base again, exactly). :func:`_write_run` checks the sums of
    the run and of the child after it; this checks base, which must not be -0.0 either: the
    recurrence's differences are then +0.0 (x - x is +0.0), and -0.0 + -0.0 and +0.0 + -0.0
    are different bits. Log-probs sorted descending make the scores non-increasing, so n comes
    from a binary search instead of a serial walk.
    """
    row = int32(depth - 1)
    base, exact = _exact_sum(score, -_lp_at(lp, lp_cache, kc, b, row, rank))
    lo = int32(1)  # child `rank` scores `score` >= tau
    hi = int32(min(k - rank, max_len))
    while lo < hi:
        mid = int32((lo + hi + 1) >> 1)
        if base + _lp_at(lp, lp_cache, kc, b, row, int32(rank + mid - 1)) >= tau:
            lo = mid
        else:
            hi = int32(mid - 1)
    return lo, base, exact and not (base == 0.0 and _f64_bits(base) < 0)


@cuda.jit(device=True)
def _write_run(start, step, q, rank, depth, n, score, base, first, lp, lp_cache, kc, b, n_depth, k, tau,
               flags, c_score, c_parent, c_rank, c_depth, slot_score, slot_info):
    """C entries first .. first + n - 1 are children rank .. rank + n - 1 of entry q (the first
    scoring ``score``, bit for bit as the slot held it), each with
    its slot open on its first child; this thread writes entries start, start + step, ... (a
    lane alone: 0, 1; a warp: lane, 32). Sets flags[0] if a child's sum is inexact, a score rises
    above its predecessor's or falls below ``tau`` (the run's scores are then not the heap's, or
    the rows are not sorted)."""
    row = int32(depth - 1)
    slot_words = slot_score.shape[0]
    bad = False
    for j in range(start, n, step):
        r = int32(rank + j)
        a = _lp_at(lp, lp_cache, kc, b, row, r)
        x, exact = _exact_sum(base, a)
        if not exact or x < tau or (j > 0 and a > _lp_at(lp, lp_cache, kc, b, row, int32(r - 1))):
            bad = True
        if j == 0:
            x = score
        c = int32(first + j)
        c_score[c] = x
        c_parent[c] = q
        c_rank[c] = r
        c_depth[c] = depth
        if c < slot_words:  # the last node of a full budget has no slot (nothing pops after it)
            child = NEG_INF
            if depth < n_depth:
                child = x + _lp_at(lp, lp_cache, kc, b, depth, int32(0))
                if child > x:
                    bad = True
            slot_score[c] = child
            slot_info[c] = (depth + 1) << DEPTH_SHIFT
    if bad:
        flags[0] = 1


@cuda.jit(device=True)
def _expand_slots(q, active, first, limit, is_old, lp, lp_cache, kc, b, n_depth, k, tau, counters, ci,
                  flags, c_score, c_parent, c_rank, c_depth, slot_score, slot_info, t_score, t_info):
    """Warp: each lane with ``active`` accepts the pending children of entry q that score >=
    ``tau`` (a sibling run) as C entries ``first + idx ...`` (idx reserved from
    ``counters[ci]``, one atomic a run) and moves q's slot past them. Each lane writes its run
    if it is short (all lanes at once: their load latencies overlap); the warp writes the long
    ones together, one after another (:func:`_write_run`).

    A reservation past ``limit`` writes nothing; the counter then ends past ``limit`` and the
    caller discards the attempt (nothing of C below ``first`` has changed). q's new slot goes to
    t_* for entries of C before the attempt (kept only if the attempt is), else straight to its
    slot. flags[0] is set where the run's scores may differ from the heap's (inexact sums).
    """
    lane = int32(cuda.laneid)
    n = int32(0)
    score = NEG_INF
    base = 0.0
    rank = int32(0)
    depth = int32(0)
    idx = int32(0)
    if active:
        info = int32(slot_info[q])
        rank = int32(info & RANK_MASK)
        depth = int32(info >> DEPTH_SHIFT)
        score = slot_score[q]
        n, base, exact = _run_start(lp, lp_cache, kc, b, k, score, rank, depth, tau, int32(limit + 1))
        if not exact:
            flags[0] = 1
        idx = int32(cuda.atomic.add(counters, ci, n))
        if idx + n <= limit:  # q's slot moves on to the child after the run
            nxt = NEG_INF
            r = int32(rank + n)
            if r < k:
                nxt, exact = _exact_sum(base, _lp_at(lp, lp_cache, kc, b, int32(depth - 1), r))
                if not exact or nxt >= tau:
                    flags[0] = 1
            if is_old:
                t_score[q] = nxt
                t_info[q] = r | (depth << DEPTH_SHIFT)
            else:
                slot_score[q] = nxt
                slot_info[q] = r | (depth << DEPTH_SHIFT)
    reserved = active and idx + n <= limit
    if reserved and n <= LONG_RUN:
        _write_run(int32(0), int32(1), q, rank, depth, n, score, base, int32(first + idx), lp, lp_cache,
                   kc, b, n_depth, k, tau, flags, c_score, c_parent, c_rank, c_depth, slot_score, slot_info)
    todo = cuda.ballot_sync(FULL_MASK, reserved and n > LONG_RUN)
    while todo != 0:
        src = int32(cuda.ffs(todo) - 1)
        todo &= todo - 1
        w_q = int32(cuda.shfl_sync(FULL_MASK, q, src))
        w_rank = int32(cuda.shfl_sync(FULL_MASK, rank, src))
        w_depth = int32(cuda.shfl_sync(FULL_MASK, depth, src))
        w_n = int32(cuda.shfl_sync(FULL_MASK, n, src))
        w_idx = int32(cuda.shfl_sync(FULL_MASK, idx, src))
        w_score = cuda.shfl_sync(FULL_MASK, score, src)
        w_base = cuda.shfl_sync(FULL_MASK, base, src)
        _write_run(lane, int32(WARP_SIZE), w_q, w_rank, w_depth, w_n, w_score, w_base, int32(first + w_idx), lp,
                   lp_cache, kc, b, n_depth, k, tau, flags, c_score, c_parent, c_rank, c_depth,
                   slot_score, slot_info)


@cuda.jit(device=True)
def _attempt(tau, n_c, limit, parity, lp, lp_cache, kc, b, n_depth, k, tid, n_threads, counters, flags,
             c_score, c_parent, c_rank, c_depth, slot_score, slot_info, t_score, t_info):
    """All threads: one threshold attempt over C = entries [0, n_c), adding at most ``limit``.
    Returns the entries it would add, > ``limit`` when it overflowed (then nothing is kept), the
    same value in every thread. Expects counters[ROUND_COUNTERS + parity] zeroed behind a barrier.

    Round 0 runs the slots of C's entries scoring >= tau and appends through
    counters[ROUND_COUNTERS + parity]; round j >= 1 the first children (>= tau) of the entries
    round j - 1 added, which lie in one index range, through counters[j % 3]. The counter of
    round j + 1 is zeroed during round j, and its last reader (round j - 2's range, read after
    that round's barrier) is done by then, so each round needs one barrier. Every loop condition
    reads values fixed behind the last barrier, and every warp runs whole (the runs are written
    by warps). Depth grows by one a round: at most L rounds.
    """
    slot_words = slot_score.shape[0]
    for q0 in range(0, n_c, n_threads):
        q = int32(q0 + tid)
        active = q < n_c and q < slot_words
        if active:
            active = slot_score[q] >= tau
        _expand_slots(q, active, n_c, limit, True, lp, lp_cache, kc, b, n_depth, k, tau, counters,
                      ROUND_COUNTERS + parity, flags, c_score, c_parent, c_rank, c_depth, slot_score,
                      slot_info, t_score, t_info)
    if tid == 0:
        counters[1] = 0
    cuda.syncthreads()  # round 0's entries and counter are final
    lo = int32(n_c)
    hi = int32(n_c + counters[ROUND_COUNTERS + parity])
    j = int32(1)
    while hi > lo and hi - n_c <= limit:
        c0 = j % ROUND_COUNTERS
        for q0 in range(lo, hi, n_threads):
            q = int32(q0 + tid)
            active = q < hi and q < slot_words
            if active:
                active = slot_score[q] >= tau
            _expand_slots(q, active, hi, int32(limit - (hi - n_c)), False, lp, lp_cache, kc, b, n_depth,
                          k, tau, counters, c0, flags, c_score, c_parent, c_rank, c_depth, slot_score,
                          slot_info, t_score, t_info)
        if tid == 0:
            counters[(j + 1) % ROUND_COUNTERS] = 0
        cuda.syncthreads()  # round j's entries and counter are final
        lo = hi
        hi = int32(hi + counters[c0])
        j += 1
    return int32(hi - n_c)


@cuda.jit(device=True)
def _next_threshold(tau, top, tau_lo, tau_hi, t_prev, n_prev, n_now, kept, target):
    """The threshold after an attempt at ``tau`` (every thread computes the same float64s).

    Kept: bisect if an attempt has overflowed, else the secant of log(drafted nodes) against
    the threshold through the last two kept attempts, aimed at ``target`` nodes (BAND_STEP
    nats down while there is no second point). Discarded: bisect between the last kept and the
    overflowed threshold. Never above ``top`` (the best pending score: one node at least).
    """
    if kept:
        if tau_lo > NEG_INF:
            nxt = 0.5 * (tau_lo + tau)
        elif n_prev > 0 and n_now > n_prev:
            slope = (math.log(float64(n_now)) - math.log(float64(n_prev))) / (t_prev - tau)
            nxt = tau - (math.log(float64(target)) - math.log(float64(n_now))) / slope
        else:
            nxt = tau - BAND_STEP
    else:
        nxt = 0.5 * (tau + tau_hi)
    return min(nxt, top)


@cuda.jit(device=True)
def _grow_by_thresholds(b, lp, lp_cache, kc, budget, band_left, scores, n_slots, tid, n_threads, counters,
                        flags, top_key, pos, c_score, c_parent, c_rank, c_depth, slot_score,
                        slot_info, t_score, t_info, node_parent, node_rank, node_depth):
    """All threads: the threshold phase. Returns (resume, n_start) for :func:`_select_nodes`.

    Grows C from the root (its slot holds the seed) by attempts at falling thresholds (see the
    section comment) until at most ``band_left`` pops are left, the frontier is empty or
    BAND_MAX_ATTEMPTS ran. Then C's entries go to pop order (key (-w, rank path): each counts
    the entries before it; exact score ties compare rank paths), into node_* and scores[b], and
    their slots into the lane-major frontier: (True, |C| - 1). If a run's scores failed their
    checks (flags[0]), the slots are reset for a heap from the seed: (False, 0).
    Expects slot_score = -inf and slot_info = 0 behind a barrier, and budget >= 1.
    """
    n_depth = int32(lp.shape[1])
    k = int32(lp.shape[2])
    slot_words = slot_score.shape[0]
    seed = float64(lp_cache[0])
    if tid == 0:
        c_score[0] = 0.0
        c_parent[0] = -1
        c_rank[0] = 0
        c_depth[0] = 0
        slot_score[0] = seed
        slot_info[0] = SEED_INFO
        flags[0] = 0
        counters[ROUND_COUNTERS] = 0
        top_key[0] = _key64(NEG_INF)
    cuda.syncthreads()  # C = {root}, its slot, the first attempt's counter
    n_c = int32(1)
    top = seed
    tau = seed
    tau_lo = NEG_INF
    tau_hi = seed
    t_prev = seed
    n_prev = int32(0)
    attempt = int32(0)
    while attempt < BAND_MAX_ATTEMPTS and budget - (n_c - 1) > band_left and top > NEG_INF:
        parity = attempt & 1
        limit = int32(budget - (n_c - 1))
        if tid == 0:  # the next attempt's round-0 counter (last read before the last barrier)
            counters[ROUND_COUNTERS + 1 - parity] = 0
        added = _attempt(tau, n_c, limit, parity, lp, lp_cache, kc, b, n_depth, k, tid, n_threads,
                         counters, flags, c_score, c_parent, c_rank, c_depth, slot_score, slot_info,
                         t_score, t_info)
        kept = added <= limit
        if kept:  # the slots this attempt ran take their new values; the best pending score
            best = _key64(NEG_INF)
            for q in range(tid, min(n_c + added, slot_words), n_threads):
                if q < n_c and slot_score[q] >= tau:
                    slot_score[q] = t_score[q]
                    slot_info[q] = t_info[q]
                best = max(best, _key64(slot_score[q]))
            cuda.atomic.max(top_key, parity, best)
        if tid == 0:  # the next attempt's maximum (its last reader passed this attempt's barriers)
            top_key[1 - parity] = _key64(NEG_INF)
        cuda.syncthreads()  # slots and the best pending score final
        attempt += 1
        if kept:
            n_c = int32(n_c + added)
            hi, lo = top_key[parity] >> HIGH_SHIFT, top_key[parity] & LOW_WORD
            top = _score_from_key(int32(hi), uint32(lo))
            nxt = _next_threshold(tau, top, tau_lo, tau_hi, t_prev, n_prev, n_c - 1, True, budget)
            t_prev = tau
            n_prev = int32(n_c - 1)
            tau_hi = tau
        else:
            if n_prev == 0:  # the seed's own run overflows: the heap does it all
                break
            tau_lo = tau
            nxt = _next_threshold(tau, top, tau_lo, tau_hi, t_prev, n_prev, n_c - 1, False, budget)
        if nxt <= tau_lo:
            break
        tau = nxt

    if flags[0] != 0:  # scores that may not be the heap's, or not falling: start over
        for q in range(tid, slot_words, n_threads):
            slot_score[q] = NEG_INF
            slot_info[q] = 0
        cuda.syncthreads()  # frontier empty again for the seeded heap
        return False, int32(0)

    if tid < SORT_UNROLL:  # NaN past the end: neither above nor equal to any score
        c_score[n_c + tid] = math.nan
    cuda.syncthreads()  # padding in place
    for x in range(tid, n_c, n_threads):  # pop order: the number of entries whose key comes first
        before = int32(0)
        if x > 0:
            sx = c_score[x]
            equal = int32(0)
            for y0 in range(1, n_c, SORT_UNROLL):  # branch-free, SORT_UNROLL broadcast loads in flight
                for u in range(SORT_UNROLL):
                    sy = c_score[uint32(y0 + u)]
                    before += int32(sy > sx)
                    equal += int32(sy == sx)
            if equal > 1:  # exact score ties (x itself is one): rank paths decide, rarely needed
                px = int32(c_parent[x])
                rx = int32(c_rank[x])
                for y in range(1, n_c):
                    if y != x and c_score[y] == sx and _path_less(int32(c_parent[y]), int32(c_rank[y]),
                                                                  px, rx, c_parent, c_rank, c_depth):
                        before += 1
            before += 1
        pos[x] = before
    cuda.syncthreads()  # pop order final
    for x in range(tid, n_c, n_threads):
        p = int32(pos[x])
        parent = int32(-1)
        if x > 0:
            parent = int32(pos[c_parent[x]])
            scores[b, p] = c_score[x]
        node_parent[p] = parent
        node_rank[p] = c_rank[x]
        node_depth[p] = c_depth[x]
        if p < slot_words:
            if x < slot_words:
                t_score[p] = slot_score[x]
                t_info[p] = slot_info[x]
            else:  # entry 32 S of a full budget: added last, so childless (and nothing pops after)
                t_score[p] = NEG_INF
                t_info[p] = 0
    cuda.syncthreads()  # node records and slots in pop order
    for q in range(tid, slot_words, n_threads):
        lm = uint32((q & LANE_MASK) * n_slots + (q >> LANE_BITS))
        if q < n_c:
            slot_score[lm] = t_score[q]
            slot_info[lm] = t_info[q]
        else:
            slot_score[lm] = NEG_INF
            slot_info[lm] = 0
    cuda.syncthreads()  # lane-major frontier ready for warp 0
    return True, int32(n_c - 1)


@cuda.jit(device=True)
def _child_count(q, size, n_slots, slot_info):
    """Children of node q: the rank field of its slot (the next child it would pop).

    The last node has none (nothing was popped after it, and it may have no slot).
    """
    if q >= size - 1:
        return int32(0)
    return int32(slot_info[uint32((q & LANE_MASK) * n_slots + (q >> LANE_BITS))] & RANK_MASK)


@cuda.jit(device=True)
def _child_offsets(size, n_slots, slot_info, child_start):
    """Warp 0: child_start[q] = sum of child counts of nodes < q, for q in 0..size.

    Lane l scans a contiguous chunk; the lane offsets come from a warp scan.
    """
    lane = int32(cuda.laneid)
    chunk = (size + WARP_SIZE - 1) // WARP_SIZE
    first = lane * chunk
    last = min(first + chunk, size)
    local = int32(0)
    for q in range(first, last):
        local += _child_count(q, size, n_slots, slot_info)
    running = int32(warp_inclusive_scan_i32(local) - local)
    for q in range(first, last):
        child_start[q] = running
        running += _child_count(q, size, n_slots, slot_info)
    if lane == 0:
        child_start[size] = size - 1  # every node but the root is somebody's child


@cuda.jit(device=True)
def _lp_flat(lp, b, kc, idx, n_cached):
    """lp[b, idx // kc, idx % kc] for idx < n_cached, else 0 (a lane past the cache's end)."""
    if idx >= n_cached:
        return float32(0.0)
    row = uint32(idx) // uint32(kc)  # unsigned: a 32-bit division, not a 64-bit call
    return lp[uint32(b), row, uint32(idx) - row * uint32(kc)]


@cuda.jit(device=True)
def _fill_lp_cache(lp, b, kc, n_cached, tid, n_threads, lp_cache):
    """lp_cache[d * kc + r] = lp[b, d, r] for r < kc; FILL_UNROLL global loads in flight per thread."""
    staged = cuda.local.array(FILL_UNROLL, float32)  # registers once the loops are unrolled
    for i0 in range(tid, n_cached, FILL_UNROLL * n_threads):
        for u in range(FILL_UNROLL):
            staged[u] = _lp_flat(lp, b, kc, i0 + u * n_threads, n_cached)
        for u in range(FILL_UNROLL):
            if i0 + u * n_threads < n_cached:
                lp_cache[i0 + u * n_threads] = staged[u]


@cuda.jit(device=True)
def _write_outputs(b, size, n_depth, ids, past_lens, root_tokens, tokens, parents, depths, ranks,
                   scores, positions, visibility, node_parent, node_rank, node_depth, tid, n_threads):
    """All threads: per-node rows and the packed visibility of request b (padding past ``size``)."""
    cap = tokens.shape[1]
    n_words = visibility.shape[2]
    past = past_lens[b]
    for i in range(tid, cap, n_threads):
        if i < size:
            d = int32(node_depth[i])
            rank = int32(node_rank[i])
            if i == 0:
                tokens[b, i] = root_tokens[b]
                scores[b, i] = 0.0
            else:
                tokens[b, i] = ids[b, d - 1, rank]
            parents[b, i] = node_parent[i]
            depths[b, i] = d
            ranks[b, i] = rank
            positions[b, i] = past + d
        else:  # padding node (reference TreeBatch)
            tokens[b, i] = -1
            parents[b, i] = -1
            depths[b, i] = 0
            ranks[b, i] = 0
            scores[b, i] = 0.0
            positions[b, i] = past
    for idx in range(tid, cap * n_words, n_threads):
        i = idx // n_words
        word = idx - i * n_words
        low = word * WORD_BITS
        bits = int64(0)
        if i < size:  # ancestors have decreasing indices: stop below the word
            j = int32(i)
            while j >= low:
                if j < low + WORD_BITS:
                    bits |= int64(1) << (j - low)
                j = int32(node_parent[j])
        elif i >= low and i < low + WORD_BITS:  # a padding node sees itself only
            bits = int64(1) << (i - low)
        visibility[b, i, word] = uint32(bits)


# --- kernels ---------------------------------------------------------------------------------

def _band_words(n_slots: int) -> tuple[int, int]:
    """Entries of the threshold phase's node and slot arrays in variant ``n_slots`` (1: none)."""
    if n_slots not in BAND_SLOT_CLASSES:
        return 1, 1
    return WARP_SIZE * n_slots + 1, WARP_SIZE * n_slots


def _lp_cache_words(n_slots: int) -> int:
    """float32 words of lp cache left in SHARED_BYTES by the other arrays of variant ``n_slots``."""
    nodes = WARP_SIZE * n_slots + 1
    band_nodes, band_slots = _band_words(n_slots)
    other = (WARP_SIZE * n_slots * (8 + 4)  # slot_score float64, slot_info int32
             + 3 * 2 * nodes + 2 * (nodes + 1)  # node_parent/rank/depth, child_start (int16)
             + band_nodes * (8 + 4 * 2) + band_slots * (8 + 4)  # c_score, c_*/pos (int16); t_score, t_info
             + 8 * SORT_UNROLL  # c_score's padding
             + 4 + 4 * BAND_COUNTERS + 4 + 8 * 2  # tree_size, counters, flags, top_key
             + 4 * 8 + 8 * 8)  # alignment padding between arrays
    return (SHARED_BYTES - other) // 4 // WARP_SIZE * WARP_SIZE


def _make_kernel(n_slots: int, lp_words: int | None = None, count_rounds: bool = False,
                 band_min_budget: int = BAND_MIN_BUDGET, band_left: int = BAND_LEFT):
    """The tree-build kernel for ``n_slots`` frontier slots per lane (capacity <= 32 * n_slots + 1).

    ``lp_words``: lp cache size (default: all the shared memory left; tests shrink it to reach
    the global-memory path). ``count_rounds``: the diagnostic variant that writes each request's
    number of heap rounds to ``rounds[2 b]`` and the nodes its threshold phase placed to
    ``rounds[2 b + 1]`` (the others never touch ``rounds``). ``band_min_budget``: the smallest
    budget that runs the threshold phase (variants in BAND_SLOT_CLASSES; tests lower it);
    ``band_left``: the pops it leaves to the heap at most.
    """
    slot_words = WARP_SIZE * n_slots
    max_nodes = slot_words + 1
    node_slots = max_nodes + 1  # child_start needs one entry past the last node
    lp_words = _lp_cache_words(n_slots) if lp_words is None else lp_words
    bands = n_slots in BAND_SLOT_CLASSES
    band_nodes, band_slots = _band_words(n_slots)
    score_words = band_nodes + SORT_UNROLL

    @cuda.jit
    def tree_build_kernel(lp, ids, budgets, past_lens, root_tokens,
                          sizes, tokens, parents, depths, ranks, scores, positions,
                          visibility, child_ptr, child_index, rounds):
        """One block per request b: build its draft tree and write every output row b.

        Inputs: lp float32 [bs, L, K], ids int32 [bs, L, K], budgets / past_lens / root_tokens
        int32 [bs]. Outputs (capacity N <= 32 * n_slots + 1): sizes int32 [bs]; tokens, parents,
        depths, ranks, positions int32 [bs, N]; scores float64 [bs, N]; visibility uint32
        [bs, N, ceil(N / 32)]; child_ptr int32 [bs, N + 1]; child_index int32 [bs, N];
        rounds int32 [2 bs] (written by the ``count_rounds`` variant only). Budgets are clamped
        to [0, N - 1].
        """
        slot_score = cuda.shared.array(slot_words, float64)  # [32, S] lane-major frontier scores
        slot_info = cuda.shared.array(slot_words, int32)  # [32, S] rank | depth << 16 per slot
        node_parent = cuda.shared.array(max_nodes, int16)  # [N]
        node_rank = cuda.shared.array(max_nodes, int16)  # [N]
        node_depth = cuda.shared.array(max_nodes, int16)  # [N]
        child_start = cuda.shared.array(node_slots, int16)  # [N + 1] CSR offsets
        lp_cache = cuda.shared.array(lp_words, float32)  # [L, kc] first kc ranks per depth
        tree_size = cuda.shared.array(1, int32)  # n_nodes, from warp 0 to the block
        # the threshold phase: C's entries in the order they were added, then their pop order
        c_score = cuda.shared.array(score_words, float64)  # [N] + NaN padding for the sort
        c_parent = cuda.shared.array(band_nodes, int16)  # [N] an entry of C
        c_rank = cuda.shared.array(band_nodes, int16)  # [N]
        c_depth = cuda.shared.array(band_nodes, int16)  # [N]
        pos = cuda.shared.array(band_nodes, int16)  # [N] pop order of each entry
        t_score = cuda.shared.array(band_slots, float64)  # [32 S] slots: tentative, then pop order
        t_info = cuda.shared.array(band_slots, int32)  # [32 S]
        counters = cuda.shared.array(BAND_COUNTERS, int32)  # append counters (see _attempt)
        flags = cuda.shared.array(1, int32)  # a run failed its checks (see _write_run)
        top_key = cuda.shared.array(2, int64)  # best pending score per attempt parity (_key64)
        pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch

        b = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        n_threads = cuda.blockDim.x
        n_depth = lp.shape[1]
        k = lp.shape[2]
        cap = tokens.shape[1]
        budget = int32(min(max(budgets[b], 0), cap - 1))
        kc = int32(0)
        if n_depth == 0 or k == 0:
            budget = int32(0)
        else:
            kc = int32(min(k, lp_words // n_depth))

        for q in range(tid, slot_words, n_threads):
            slot_score[q] = NEG_INF
            slot_info[q] = 0
        _fill_lp_cache(lp, b, kc, n_depth * kc, tid, n_threads, lp_cache)
        if tid == 0:
            node_parent[0] = -1
            node_rank[0] = 0
            node_depth[0] = 0
        cuda.syncthreads()  # empty frontier, root record and lp cache ready for warp 0

        resume = False
        n_start = int32(0)
        if bands and budget >= band_min_budget:  # `bands` is compile-time: other variants drop it
            resume, n_start = _grow_by_thresholds(
                b, lp, lp_cache, kc, budget, band_left, scores, n_slots, tid, n_threads, counters, flags,
                top_key, pos, c_score, c_parent, c_rank, c_depth, slot_score, slot_info, t_score,
                t_info, node_parent, node_rank, node_depth)
        if tid < WARP_SIZE:
            n, n_rounds = _select_nodes(b, lp, lp_cache, kc, budget, scores, n_slots, resume, n_start,
                                        slot_score, slot_info, node_parent, node_rank, node_depth)
            if tid == 0:
                tree_size[0] = n + 1
                if count_rounds:  # compile-time: the plain kernels drop the counters
                    rounds[2 * b] = n_rounds
                    rounds[2 * b + 1] = n_start
        cuda.syncthreads()  # the tree's topology is final

        size = tree_size[0]
        if tid < WARP_SIZE:
            _child_offsets(size, n_slots, slot_info, child_start)
        if tid == 0:
            sizes[b] = size
        _write_outputs(b, size, n_depth, ids, past_lens, root_tokens, tokens, parents, depths, ranks,
                       scores, positions, visibility, node_parent, node_rank, node_depth, tid, n_threads)
        cuda.syncthreads()  # child_start ready

        for q in range(tid, cap + 1, n_threads):
            child_ptr[b, q] = child_start[min(q, size)]
        for i in range(tid, cap, n_threads):
            if i >= 1 and i < size:
                child_index[b, child_start[node_parent[i]] + node_rank[i]] = i
            if i >= size - 1:  # past the size - 1 real children
                child_index[b, i] = -1

    return tree_build_kernel


_SIGNATURE = (
    float32[:, :, ::1], int32[:, :, ::1], int32[::1], int32[::1], int32[::1],
    int32[::1], int32[:, ::1], int32[:, ::1], int32[:, ::1], int32[:, ::1], float64[:, ::1],
    int32[:, ::1], uint32[:, :, ::1], int32[:, ::1], int32[:, ::1], int32[::1],
)


def _kernel_name(n_slots: int) -> str:
    """Registry name: ``tree_build`` for the full-capacity variant, ``tree_build_s{S}`` otherwise."""
    return "tree_build" if n_slots == SLOT_CLASSES[-1] else f"tree_build_s{n_slots}"


tree_build_kernels = {  # slots per lane -> kernel
    n_slots: register(_kernel_name(n_slots), _make_kernel(n_slots), (_SIGNATURE,),
                      f"best-first DDTree build, one block per request, capacity <= "
                      f"{WARP_SIZE * n_slots + 1}: nodes, positions, visibility, CSR",
                      block_threads=MAX_THREADS)
    for n_slots in SLOT_CLASSES
}
_counting_kernels: dict[int, Any] = {}  # slots per lane -> the count_rounds variant, built on first use


def _counting_kernel(n_slots: int) -> Any:
    """The ``count_rounds`` variant for ``n_slots`` (benchmark diagnostics; not graph-critical)."""
    if n_slots not in _counting_kernels:
        _counting_kernels[n_slots] = _make_kernel(n_slots, count_rounds=True)
    return _counting_kernels[n_slots]


# --- host side -------------------------------------------------------------------------------

@dataclass(frozen=True)
class TreeBuildPlan:
    """Shapes and launch configuration of one batch shape (from :func:`plan`).

    Attributes:
        batch_size: requests bs (one block each).
        horizon: draft positions L (top-k rows per request).
        top_k: candidates K per row.
        capacity: padded node count N = 1 + the largest budget the batch may use (<= 1025).
        threads: threads per block (a multiple of 32; warp 0 selects, all write the outputs).
    """

    batch_size: int
    horizon: int
    top_k: int
    capacity: int
    threads: int

    @property
    def n_words(self) -> int:
        """uint32 words per visibility row, ceil(N / 32)."""
        return -(-self.capacity // WORD_BITS)

    @property
    def slots_per_lane(self) -> int:
        """Frontier slots per lane of the kernel variant used: the smallest with 32 * S >= N - 1."""
        return next(s for s in SLOT_CLASSES if WARP_SIZE * s >= self.capacity - 1)

    @property
    def cached_ranks(self) -> int:
        """Ranks per depth held in shared memory (the rest are read from global memory)."""
        return min(self.top_k, _lp_cache_words(self.slots_per_lane) // self.horizon) if self.horizon else 0

    def output_shapes(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Name -> (shape, dtype) of every output buffer."""
        bs, n = self.batch_size, self.capacity
        i32 = np.dtype(np.int32)
        return {
            "sizes": ((bs,), i32),
            "tokens": ((bs, n), i32),
            "parents": ((bs, n), i32),
            "depths": ((bs, n), i32),
            "ranks": ((bs, n), i32),
            "scores": ((bs, n), np.dtype(np.float64)),
            "positions": ((bs, n), i32),
            "visibility": ((bs, n, self.n_words), np.dtype(np.uint32)),
            "child_ptr": ((bs, n + 1), i32),
            "child_index": ((bs, n), i32),
        }


def plan(batch_size: int, horizon: int, top_k: int, capacity: int, *,
         threads: int = DEFAULT_THREADS) -> TreeBuildPlan:
    """Fix the shapes and the launch for a batch shape (once per batch shape, not per round).

    Args:
        batch_size: bs >= 1.
        horizon: L in [0, MAX_HORIZON] (L = 0 builds root-only trees).
        top_k: K >= 0 (K = 0 builds root-only trees).
        capacity: N in [1, MAX_NODES]; pass 1 + max budget so every round fits one CUDA graph.
        threads: threads per block, a multiple of 32 in [32, MAX_THREADS].

    Raises:
        TypeError / ValueError naming the argument.
    """
    batch_size = int_arg(batch_size, "batch_size", 1)
    horizon = int_arg(horizon, "horizon", 0, MAX_HORIZON)
    top_k = int_arg(top_k, "top_k", 0)
    capacity = int_arg(capacity, "capacity", 1, MAX_NODES)
    threads = int_arg(threads, "threads", WARP_SIZE, MAX_THREADS)
    if threads % WARP_SIZE:
        raise ValueError(f"threads must be a multiple of {WARP_SIZE}, got {threads}")
    return TreeBuildPlan(batch_size, horizon, top_k, capacity, threads)


@dataclass(frozen=True)
class TreeBuildOutputs:
    """Caller-owned output buffers (device arrays; NumPy arrays also work, with copies).

    Shapes and dtypes: see :meth:`TreeBuildPlan.output_shapes`; padding as ``reference.TreeBatch``
    (tokens here are int32), positions = past_len + depth (padding: past_len).
    """

    sizes: Any
    tokens: Any
    parents: Any
    depths: Any
    ranks: Any
    scores: Any
    positions: Any
    visibility: Any
    child_ptr: Any
    child_index: Any

    def to_host(self) -> dict[str, np.ndarray]:
        """Every buffer copied to a NumPy array (synchronises; for tests and tools)."""
        return {f.name: _to_host(getattr(self, f.name)) for f in fields(self)}


def _to_host(array: Any) -> np.ndarray:
    return array if isinstance(array, np.ndarray) else array.copy_to_host()


def allocate_outputs(tree_plan: TreeBuildPlan, stream: Any = 0) -> TreeBuildOutputs:
    """Fresh device buffers for ``tree_plan`` (allocate once, reuse every round)."""
    if not isinstance(tree_plan, TreeBuildPlan):
        raise TypeError(f"tree_plan must be a TreeBuildPlan, got {type(tree_plan).__name__}")
    return TreeBuildOutputs(**{
        name: cuda.device_array(shape, dtype, stream=stream)
        for name, (shape, dtype) in tree_plan.output_shapes().items()
    })


def _check_host_values(lp: Any, ids: Any, budgets: Any, past_lens: Any, roots: Any, capacity: int) -> None:
    """Value checks, done only on NumPy inputs (device inputs would need a copy and a sync)."""
    if isinstance(lp, np.ndarray) and not np.isfinite(lp).all():
        raise ValueError("top_log_probs must be finite (-inf makes the sibling recurrence NaN, spec §1.2)")
    if isinstance(ids, np.ndarray) and ids.size:
        if (ids < 0).any():
            raise ValueError("top_ids must be >= 0")
        if (np.diff(np.sort(ids, axis=-1), axis=-1) == 0).any():
            raise ValueError("top_ids must be unique within each (request, position) row")
    if isinstance(budgets, np.ndarray) and ((budgets < 0) | (budgets > capacity - 1)).any():
        raise ValueError(f"budgets must be in [0, capacity - 1 = {capacity - 1}]")
    if isinstance(past_lens, np.ndarray) and (past_lens < 0).any():
        raise ValueError("past_lens must be >= 0")
    if isinstance(roots, np.ndarray) and (roots < -1).any():
        raise ValueError("root_tokens must be >= -1")


def run(tree_plan: TreeBuildPlan, top_log_probs: Any, top_ids: Any, budgets: Any, past_lens: Any,
        root_tokens: Any, out: TreeBuildOutputs, stream: Any = 0, *, rounds: Any = None) -> TreeBuildOutputs:
    """Build every request's draft tree into ``out`` with one launch.

    Args:
        tree_plan: from :func:`plan`.
        top_log_probs: float32 [bs, L, K], finite, each row sorted as ``reference.topk_log_probs``.
        top_ids: int32 [bs, L, K], >= 0, unique within each row.
        budgets: int32 [bs], in [0, N - 1] (the kernel also clamps to this range).
        past_lens: int32 [bs], >= 0 (positions = past_len + depth).
        root_tokens: int32 [bs], the previous bonus tokens (-1 if unknown).
        out: buffers from :func:`allocate_outputs` (or matching arrays).
        stream: 0 / None, a numba stream, or a cuda.core Stream / GraphBuilder.
        rounds: optional int32 [bs, 2]: runs the diagnostic variant, which also writes each
            request's number of heap rounds (column 0) and the nodes its threshold phase placed
            (column 1; the heap popped the rest, at drafted - placed) / rounds per round).

    Values are checked only for NumPy inputs; device inputs are trusted (no host sync).

    Returns:
        ``out``, filled: node i of request b has parent, depth, rank, token, score, position,
        a visibility row, and children ``child_index[b, child_ptr[b, i]:child_ptr[b, i + 1]]``.
    """
    if not isinstance(tree_plan, TreeBuildPlan):
        raise TypeError(f"tree_plan must be a TreeBuildPlan, got {type(tree_plan).__name__}")
    if not isinstance(out, TreeBuildOutputs):
        raise TypeError(f"out must be a TreeBuildOutputs, got {type(out).__name__}")
    bs, n_depth, k = tree_plan.batch_size, tree_plan.horizon, tree_plan.top_k
    lp = check_array(top_log_probs, "top_log_probs", np.float32, shape=(bs, n_depth, k))
    ids = check_array(top_ids, "top_ids", np.int32, shape=(bs, n_depth, k))
    budgets = check_array(budgets, "budgets", np.int32, shape=(bs,))
    past_lens = check_array(past_lens, "past_lens", np.int32, shape=(bs,))
    roots = check_array(root_tokens, "root_tokens", np.int32, shape=(bs,))
    buffers = [check_array(getattr(out, name), f"out.{name}", dtype, shape=shape)
               for name, (shape, dtype) in tree_plan.output_shapes().items()]
    _check_host_values(lp, ids, budgets, past_lens, roots, tree_plan.capacity)
    if rounds is None:  # the plain kernel never touches its `rounds` argument (an unwritten int32 [bs])
        kernel, counter = tree_build_kernels[tree_plan.slots_per_lane], budgets
    else:
        kernel = _counting_kernel(tree_plan.slots_per_lane)
        counter = check_array(rounds, "rounds", np.int32, shape=(bs, 2)).reshape(2 * bs)  # a view
    launch(kernel, bs, tree_plan.threads, stream, 0, lp, ids, budgets, past_lens, roots, *buffers, counter)
    return out
