"""Tree-verify MLA attention (weight-absorbed, FP32, ragged batch) with batch-invariant numerics.

Every tree query (node ``i`` of request ``b``, head ``h``) attends the request's ``N`` cached rows
(no mask) and the tree rows its visibility row selects (ancestors-or-self), weight-absorbed as in
DeepSeek-V3 ``attn_impl="absorb"`` (limits §2): the score of key ``j`` is
``scale * (q_latent · kv_latent[j] + q_rope · k_rope[j])`` and the values are the latent rows
``kv_latent[j]``. Returns ``out [bs, Tc, H, Dl]`` and the natural-log ``lse [bs, Tc, H]``.

Numerics: one key sequence, one result.
    A query's visible keys form the sequence ``prefix[0:N]`` followed by its visible tree nodes in
    node order, at positions ``N, N+1, ...``. For a tree, node order along a root path is depth
    order (parents precede children, ARCHITECTURE.md), so position ``N + k`` holds the ancestor at
    depth ``k`` (spec §1.3). Each thread block handles ONE tree node (all heads of a head group)
    and stages exactly that node's key sequence, so the kernel never distinguishes prefix from tree
    keys: keys are processed in chunks of ``CHUNK`` positions at multiples of ``CHUNK``, grouped in
    segments of ``split_size`` positions at multiples of ``split_size``; every chunk is reduced in a
    fixed order (online softmax, limits §7), every segment's partial ``(m, l, acc[Dl])`` goes to the
    workspace, and the merge kernel folds the segments in segment order (a node whose keys end
    inside segment 0, ``N + path length < split_size``, gets the merge's arithmetic in its attention
    block, written straight to ``out`` / ``lse``, and the merge skips it: the same operations, so
    the same bits, one launch's work and a workspace round trip less; where every key lies in
    segment 0, ``kv_capacity < split_size``, the blocks of nodes without keys write the merge's
    zeros or NaN too, and :func:`run` launches no merge: ``VerifyPlan.merge_free``). Nothing
    depends on ``T``, the batch or the other queries, so a tree node's output equals, bit for
    bit, a ``T = 1`` call (root only, visibility ``[[1]]``) on the compacted cache of its path:
    DDTree stays exactly lossless (spec §1.4). The invariance holds between calls with the same :class:`TileConfig`
    numerics (``chunk``, ``k_groups``, ``qk_keys``, and ``k_slice`` through the dims a lane
    takes at once, ``gcd(k_slice / k_groups, 4)``) and the same ``split_size``; :func:`plan`
    picks the config from ``(Dl, Dr, H)`` only, never from ``T``, ``N`` or the batch size.

Work layout (limits §3, §7; stack §2-3).
    Grid of the attention kernel: ``(Tc * H / heads, num_splits, bs)``; node index fastest, so the
    blocks that stream one KV segment run together and share it through L2. A block stages a
    ``[heads, k_slice]`` query slice and a ``[chunk, k_slice]`` key slice in shared memory and
    register-tiles ``S = Q Kᵀ`` (``qk_rows x qk_keys`` per thread, the 576 dims split over
    ``k_groups`` lanes in groups of 4 consecutive dims and summed by an xor butterfly; staged rows
    are padded to ``k_slice + 4 * k_groups`` floats so each group is one conflict-free LDS.128:
    8 shared loads per 64 FFMA, where scalar loads made the score GEMM shared-memory bound at
    half the FFMA rate). The online softmax runs in registers on the score tiles: a row's keys
    live on the ``k_groups * chunk / qk_keys`` lanes of its row tile (one warp), so the chunk max
    and sum are xor butterflies (no serial per-row loop, no barrier); running ``m``/``l`` live in
    shared memory by chunk parity. Then ``acc += P V`` with ``V`` staged in ``[v_slice, Dl]``
    slices (``pv_rows x pv_dims`` accumulators per thread, float4 loads of probabilities and
    values) that alternate between the two halves of the staging buffer. Every global load is
    issued one stage ahead into registers (next key slice; first value slice during the last
    key slice; next value slice; the next chunk's first key slice during the last value slice),
    so no barrier waits on global memory. The KV tile is read once per chunk for all heads of
    the tile; scores never leave the chip (``[chunk, heads]`` probabilities in shared memory),
    and the workspace is ``[num_splits, bs, Tc, H, Dl + 2]`` (acc, then m and l). Array indices
    are cast to ``uint64`` (Numba emits no negative-index wraparound for unsigned indices: 4-6
    integer instructions per shared load otherwise) and device helpers are ``inline="always"``
    (``compile_ptx`` without a GPU cannot compile called device functions otherwise).

Score-first layout (``TileConfig.score_keys``, few-node launches: an AR step, a small tree).
    The chunk layout gives a block ``heads / qk_rows * chunk / qk_keys * k_groups`` threads and
    13 staging phases a chunk; with 8-head tiles an AR step of a 64-head model is 8 blocks of 4
    warps, one per SM, each issuing ~57k instructions at 3.2 cycles apiece (Nsight Compute, run
    "attention score-first" in PERFORMANCE.md). The numerics pin only the per-key and per-dim
    order, not which thread runs it, so the score-first kernel scores ``score_keys`` keys of every
    tile head per pass (each thread the chunk layout's dims in its order, k-groups summed by the
    same butterfly), then runs the pass's chunks through the online softmax in chunk order on
    the chunk layout's lanes (one group of ``k_groups * chunk / qk_keys`` lanes a head: the same
    max and sum butterflies), then ``acc = acc * alpha + P V`` chunk by chunk with each thread on
    ``Dl / threads`` adjacent dims of every head. A score thread holds ``qk_rows x qk_keys``
    scores (heads x keys: a 4 x 4 tile takes 8 shared loads per 64 FFMA), the probabilities are
    stored key-major (P·V reads a key's heads as float4s), and query / key slices and value rows
    move as float4s (16-byte aligned arrays, checked in :func:`run`). Tiles of 2 heads with
    256-key passes (an AR step: 32 blocks of 256 threads) or 8 heads with 4 x 4 score tiles and
    128-key passes (a 33-node tree: 264 blocks) give the same bits as the chunk layout.

Inputs that a device-side engine produces (``past_lens``, ``tree_sizes``, ``visibility`` on the
device) cannot be checked on the host without a copy; the kernels guard them instead: a request
whose rows do not fit (``past + size > S``, ``size > Tc``), whose path is longer than
``max_path`` or whose keys reach past the planned segments gets NaN outputs, never a silent
truncation. NumPy inputs are checked on the host before any launch, finiteness of the query and
cache rows the kernels read included (the reference rejects NaN/inf); device values are not.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from llvmlite import ir
from numba import cuda, float32, int32, types, uint32, uint64
from numba.core.extending import intrinsic

from ddtree_numba.kernels._args import check_array, data_address, int_arg, positive_real
from ddtree_numba.kernels.linear import load_f32x4
from ddtree_numba.kernels.pdl import pdl_begin, pdl_begin_early
from ddtree_numba.kernels.registry import register
from sim.install import simulator_active
from sim.launch import launch, launch_bounds
from sim.profiles import PROFILES

__all__ = [
    "DEFAULT_SPLIT_SIZE",
    "Float4Loads",
    "TileConfig",
    "VerifyPlan",
    "default_config",
    "float4_loads",
    "get_kernels",
    "plan",
    "run",
    "verify_attention",
]

FULL_MASK = 0xFFFFFFFF
WARP = 32
NEG_INF = -math.inf

# Keys per split segment (a multiple of every config's chunk). Part of the numerics: keep it fixed
# for a model (tree verify and plain decode must use the same value for bit-identical outputs).
DEFAULT_SPLIT_SIZE = 2048
STATIC_SHARED_LIMIT = 48 * 1024  # static shared memory of a kernel (limits §4)
GRID_Y_LIMIT = 65535  # grid y and z dimensions (segments; requests) (limits §4)
# resident threads an SM holds on the most generous profile (2048 on sm_90, 1536 on sm_120): bounds min_blocks x threads
SM_THREADS = max(p.max_threads_per_sm for p in PROFILES.values())
# A plan whose keys all lie in segment 0 (kv_capacity < split_size) launches no merge
# (VerifyPlan.merge_free): its attention blocks write every output the merge would (one_segment,
# or write_fill for a node with no keys), so the merge would only rewrite the same values. Its
# launch took 2.9 us a layer of an AR step and 5.4 of a 33-node tree (Nsight Compute, run skip and
# tiles). False launches it anyway: the same bits (bench.forward_ab's auto-merge, an A/B).
MERGE_FREE_SHORT_CACHES = True


@dataclass(frozen=True)
class TileConfig:
    """One compile-time specialisation of the kernels.

    ``chunk``, ``k_groups`` and ``qk_keys`` (the lanes a chunk sum is reduced over) fix the order
    of the floating-point operations (with the plan's ``split_size``, and ``k_slice`` through
    ``gcd(k_slice / k_groups, 4)``, the dims a lane takes at once: 4 in every preset); the other
    fields only move work between threads.

    Attributes:
        latent_dim: Dl, the latent (value) width; 512 for DeepSeek-V3 / Kimi K2.
        rope_dim: Dr, the decoupled RoPE width; 64.
        heads: query heads per tile (the tile's rows; one tree node per tile).
        chunk: keys per online-softmax step (positions at multiples of ``chunk``).
        k_slice: q/k dims staged in shared memory per step of the score GEMM.
        k_groups: lanes that split each 576-dim dot product (a power of two <= 32).
        qk_rows, qk_keys: the per-thread register tile of the score GEMM.
        pv_rows, pv_dims: the per-thread accumulator tile of ``P V`` (dims strided).
        v_slice: value rows staged per step of ``P V``.
        max_path: longest visible tree path per query (shared-memory table size).
        merge_threads: threads per block of the segment-merge kernel.
        merge_heads: heads per merge block (a merge block folds ``merge_heads x Dl`` outputs of
            one node; 1 spreads a decode step's merge over H blocks instead of one).
        prefetch_l2: issue ``prefetch.L2`` for every cache line of a chunk's key rows one
            chunk ahead (the first chunk at the start), so the key slices' loads hit L2 (every
            line where rows start at multiples of 128 bytes, as Dl = 512 and Dr = 64 rows do in
            an aligned allocation; otherwise a row's last line may be left out). Built for
            launches with few blocks, on the guess that their key slices wait for HBM; on the
            H200 it did not pay (the AR step's attention was issue-bound, PERFORMANCE.md run
            "attention score-first"), so the engine leaves it off. Layout, not numerics (a
            prefetch changes no value). A no-op in the simulator.
        prefetch_chunks: how many chunks ahead ``prefetch_l2`` runs: the first
            ``prefetch_chunks`` chunks at the start, chunk ``c + prefetch_chunks`` during chunk
            ``c``'s P V (``split_size // chunk`` or more: the whole segment at the start, one
            wait for HBM instead of one a chunk). Layout, not numerics.
        score_keys: 0 for the chunk layout; else a multiple of ``chunk``: the score-first layout
            for launches with few nodes (an AR step), where a block scores ``score_keys`` keys
            of every tile head at once (``heads / qk_rows * score_keys / qk_keys * k_groups``
            threads), then runs the online softmax over the pass's chunks on the chunk layout's
            lanes, then ``P V`` with each thread on ``latent_dim / threads`` dims of every head.
            Layout, not numerics: every score, running max and sum and accumulator sees the
            same float32 operations in the same order (``pv_rows``, ``pv_dims`` and ``v_slice``
            do not shape its work; they are still validated). Its prefetch (``prefetch_l2``)
            covers, at each pass's start, the keys ``prefetch_chunks`` chunks on, a pass long.
        skip_dead_keys: score-first only: a warp whose key tiles j all lie past the pass's last
            key skips their score FMAs (``make_score_slice``), in the last pass of a node's
            segment (a node of 165 keys runs two 128-key passes, the second with 37 live: 5 of
            the 8 warp-passes of a row tile skipped there, ~30 % of the node's score FMAs). The
            count is the warp's most (its lanes run one loop, not two in turn); scores past the
            last key are never read (-inf), so it is layout, not numerics; the live tiles' fmas
            keep their order. ``qk_keys`` <= 4: the score loop is compiled for 1, 2 and 3 live
            tiles besides all (no dynamic index into the register tiles). On in the engine since it
            was timed (``engine.model.ATTENTION_SKIP_DEAD_KEYS``).
        min_blocks: blocks an SM the attention kernel's launch bounds ask for (0: none, so
            ptxas may use up to 255 registers a thread, the block size allowing). The 33-node
            tile (8 heads, 128 threads) compiles to 232 registers without it, two blocks an SM
            (8 warps: latency-bound, 49 % issue, PERFORMANCE run "in-bounds loads"); at 3 ptxas
            holds it to 168 registers with a 16-byte spill (sm_90; the compile check refuses
            spills, so no such kernel is registered). More warps an SM only where the launch has
            more blocks than 2 an SM hold: a batch-1 B 32 tree's 264 working blocks already fit 2
            an SM on 132 SMs, while larger trees and batches (up to 263 nodes take this tile:
            ``engine.model.FEW_NODES_PER_SM``) run several waves. Layout, not numerics: the same
            operations. The engine's ``FEW_NODES_MIN_BLOCKS`` (0) sets it; bench.forward_ab's
            ``auto-occ3`` times 3, not yet run on a GPU.
    """

    latent_dim: int
    rope_dim: int
    heads: int
    chunk: int
    k_slice: int
    k_groups: int
    qk_rows: int
    qk_keys: int
    pv_rows: int
    pv_dims: int
    v_slice: int
    max_path: int = 64
    merge_threads: int = 128
    merge_heads: int = 1
    prefetch_l2: bool = False
    prefetch_chunks: int = 1
    score_keys: int = 0
    skip_dead_keys: bool = False
    min_blocks: int = 0

    @property
    def threads(self) -> int:
        """Threads per attention block (the chunk layout's score and P·V GEMMs use all of them;
        the score-first layout's scores and P·V too, its softmax the first whole warps)."""
        keys = self.score_keys or self.chunk   # keys scored at once
        return (self.heads // self.qk_rows) * (keys // self.qk_keys) * self.k_groups

    @property
    def static_shared_bytes(self) -> int:
        """Static shared memory of the attention kernel, in bytes."""
        if self.score_keys:   # key and query slices, scores, rescales, path, key rows
            return 4 * ((self.score_keys + self.heads) * self.k_row + self.score_keys * self.score_probs_row
                        + self.heads * (self.score_keys // self.chunk) + self.max_path
                        + self.score_keys)
        return 4 * (
            2 * self.buffer_floats
            + self.chunk * self.probs_row
            + 5 * self.heads
            + self.max_path
            + 2 * self.chunk
        )

    @property
    def buffer_floats(self) -> int:
        """Floats of each half of the staging buffer: the first holds query slices ``[heads,
        k_row]``, the second key slices ``[chunk, k_row]``; in ``P V`` they alternate as value
        slices ``[v_slice, latent_dim]`` (double buffering at no extra shared memory)."""
        return max(self.heads * self.k_row, self.chunk * self.k_row,
                   self.v_slice * self.latent_dim)

    @property
    def probs_row(self) -> int:
        """Padded row of the key-major probabilities ``[chunk, heads + 4]``: 16-byte rows (a
        lane's ``pv_rows`` probabilities are one vector load), stores spread over the banks."""
        return self.heads + 4

    @property
    def score_probs_row(self) -> int:
        """Row of the score-first layout's key-major probabilities ``[score_keys, row]``: the
        tile's heads, padded to whole float4s from 4 heads on (P·V reads a key's probabilities of
        every head as vector loads)."""
        return self.heads if self.heads < 4 else -(-self.heads // 4) * 4

    @property
    def k_row(self) -> int:
        """Padded row of a staged q/k slice: ``k_slice + 4 * k_groups`` floats (16-byte rows;
        consecutive key rows start ``k_groups`` float4s apart, so the float4 loads of the 8 lanes
        of a quarter-warp fall in 8 distinct bank groups)."""
        return self.k_slice + 4 * self.k_groups

    def validate(self) -> None:
        """Raise ValueError naming 'config' unless the tiling is consistent."""
        fields = (self.latent_dim, self.rope_dim, self.heads, self.chunk, self.k_slice,
                  self.k_groups, self.qk_rows, self.qk_keys, self.pv_rows, self.pv_dims,
                  self.v_slice, self.max_path, self.merge_threads, self.merge_heads,
                  self.prefetch_chunks)
        score_first = isinstance(self.score_keys, int) and self.score_keys > 0
        checks = [
            (all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in fields),
             "every field must be a positive int"),
            (isinstance(self.prefetch_l2, bool), "prefetch_l2 must be a bool"),
            (isinstance(self.min_blocks, int) and not isinstance(self.min_blocks, bool)
             and 0 <= self.min_blocks * max(1, self.threads) <= SM_THREADS,
             f"min_blocks must be an int >= 0 whose blocks fit an SM's {SM_THREADS} threads"),
            (isinstance(self.skip_dead_keys, bool)
             and (not self.skip_dead_keys or (score_first and self.qk_keys <= 4)),
             "skip_dead_keys must be a bool, and True only with score_keys and qk_keys <= 4"),
            (self.latent_dim % self.k_slice == 0 and self.rope_dim % self.k_slice == 0,
             "k_slice must divide latent_dim and rope_dim"),
            (self.k_slice % self.k_groups == 0, "k_groups must divide k_slice"),
            (self.k_groups & (self.k_groups - 1) == 0 and self.k_groups <= WARP,
             "k_groups must be a power of two <= 32"),
            (self.heads % self.qk_rows == 0 and self.heads % self.pv_rows == 0,
             "qk_rows and pv_rows must divide heads"),
            (self.chunk % self.qk_keys == 0 and self.chunk % self.v_slice == 0,
             "qk_keys and v_slice must divide chunk"),
            (self.latent_dim % self.pv_dims == 0, "pv_dims must divide latent_dim"),
            (score_first or (self.heads // self.pv_rows) * (self.latent_dim // self.pv_dims)
             == self.threads, "the score and P·V layouts must use the same thread count"),
            (isinstance(self.score_keys, int) and not isinstance(self.score_keys, bool)
             and self.score_keys >= 0 and self.chunk > 0 and self.score_keys % self.chunk == 0,
             "score_keys must be 0 or a multiple of chunk"),
            (not score_first or self.heads * self.k_groups * (self.chunk // self.qk_keys) <= self.threads,
             "score_keys: the softmax lanes of every head must fit the block"),
            (self.threads % WARP == 0 and self.threads <= 1024,
             "threads must be a multiple of 32 and <= 1024"),
            (self.heads <= self.threads and self.chunk <= self.threads,
             "heads and chunk must be <= threads"),
            (self.chunk % self.qk_keys == 0
             and (self.chunk // self.qk_keys) & (self.chunk // self.qk_keys - 1) == 0
             and self.k_groups * (self.chunk // self.qk_keys) <= WARP,
             "chunk // qk_keys must be a power of two with k_groups * chunk // qk_keys <= 32 "
             "(a row's keys within one warp)"),
            (self.threads % self.k_slice == 0 or self.k_slice % self.threads == 0,
             "threads and k_slice must divide one another"),
            (self.threads % self.latent_dim == 0 or self.latent_dim % self.threads == 0,
             "threads and latent_dim must divide one another"),
            (self.merge_threads % WARP == 0 and self.merge_threads <= 1024,
             "merge_threads must be a multiple of 32 and <= 1024"),
            (self.static_shared_bytes <= STATIC_SHARED_LIMIT,
             f"static shared memory must be <= {STATIC_SHARED_LIMIT} bytes"),
        ]
        for ok, why in checks:
            if not ok:
                raise ValueError(f"config: {why} ({self})")


def default_config(latent_dim: int, rope_dim: int, num_heads: int, *,
                   tile_heads: int | None = None, score_keys: int = 0, score_rows: int = 1) -> TileConfig:
    """The specialisation :func:`plan` uses for ``(Dl, Dr, H)``; a function of these only.

    Dl = 512, Dr = 64 (DeepSeek-V3, Kimi K2 and their tensor-parallel shards; H a multiple of
    16): tiles of ``gcd(H, 64)`` heads, 256 threads, chunks of 32 keys, 2 k-groups; for 64 heads
    each thread holds 8 x 16 accumulators and a 4 x 4 score tile (247 registers on sm_90, 240 on
    sm_120, no spills, 46.25 KiB static shared memory; a 512-thread tiling with 8 x 8 accumulators
    spills under its 128-register cap). ``tile_heads`` (8, 16, 32 or 64, dividing H) picks smaller
    tiles: H / tile_heads blocks per node, each reading the node's keys (from L2 after the first),
    for launches with few nodes (a decode step: one block per 64 heads leaves the GPU idle).
    ``score_keys`` > 0 picks the score-first layout (``TileConfig.score_keys``) with ``tile_heads``
    of 1, 2, 4, 8 or 16 heads (default 4) and ``score_rows`` heads per thread in the score tile
    (``qk_rows``: 1, 2, 4 or 8, dividing the tile; a 4 x 4 tile takes 8 shared loads per 64 FMAs,
    a 1 x 4 tile 5 per 16); key slices of 64 dims, or 32 where 64 would pass the static shared
    memory limit (16 heads). The tile size and layout are not numerics: chunk, k_groups and
    qk_keys stay, and the dims a lane takes at once (4) too, so every tile gives the same bits.
    Other dims have no preset: pass a :class:`TileConfig`.
    """
    if (latent_dim, rope_dim) == (512, 64) and num_heads % 16 == 0:
        if score_keys:
            heads = 4 if tile_heads is None else tile_heads
            if heads not in (1, 2, 4, 8, 16) or num_heads % heads:
                raise ValueError(f"tile_heads must be 1, 2, 4, 8 or 16 and divide num_heads={num_heads} "
                                 f"with score_keys, got {tile_heads}")
            if score_rows not in (1, 2, 4, 8) or heads % score_rows:
                raise ValueError(f"score_rows must be 1, 2, 4 or 8 and divide tile_heads={heads}, "
                                 f"got {score_rows}")
            config = TileConfig(latent_dim=512, rope_dim=64, heads=heads, chunk=32, k_slice=64, k_groups=2,
                                qk_rows=score_rows, qk_keys=4, pv_rows=1, pv_dims=32, v_slice=8,
                                score_keys=score_keys)
            if config.static_shared_bytes > STATIC_SHARED_LIMIT:   # half the key slice, same bits
                config = dataclasses.replace(config, k_slice=32)
            return config
        heads = math.gcd(num_heads, 64) if tile_heads is None else tile_heads
        if heads not in (8, 16, 32, 64) or num_heads % heads:
            raise ValueError(f"tile_heads must be 8, 16, 32 or 64 and divide num_heads={num_heads}, "
                             f"got {tile_heads}")
        if heads == 8:  # 128 threads: one head row per score thread, 32 value dims per thread
            return TileConfig(latent_dim=512, rope_dim=64, heads=8, chunk=32, k_slice=64, k_groups=2,
                              qk_rows=1, qk_keys=4, pv_rows=1, pv_dims=32, v_slice=8)
        return TileConfig(latent_dim=512, rope_dim=64, heads=heads, chunk=32, k_slice=64,
                          k_groups=2, qk_rows=heads // 16, qk_keys=4, pv_rows=heads // 8,
                          pv_dims=16, v_slice=8)
    raise ValueError(
        f"config: no preset for latent_dim={latent_dim}, rope_dim={rope_dim}, "
        f"num_heads={num_heads}; pass a TileConfig")


class Float4Loads(NamedTuple):
    """Which global loads of a config's attention kernel are float4s (16-byte loads: the arrays
    must start on 16 bytes, checked in :func:`run`). The chunk layout loads scalars only."""

    slices: bool    # score-first query and key slices: q_latent, q_rope, kv_latent, k_rope
    values: bool    # score-first P·V value rows: kv_latent

    @property
    def arrays(self) -> tuple[str, ...]:
        """The :func:`run` arguments read with float4 loads."""
        if self.slices:
            return ("q_latent", "q_rope", "kv_latent", "k_rope")
        return ("kv_latent",) if self.values else ()


def float4_loads(config: TileConfig) -> Float4Loads:
    """The float4 loads of ``config``'s attention kernel (host only; :func:`get_kernels` builds
    its kernel from the same flags). The score-first layout moves query / key slices as float4s
    where ``k_slice``, ``latent_dim`` and ``rope_dim`` are whole float4s (every preset), and value
    rows where a thread's ``ceil(latent_dim / threads)`` P·V dims are."""
    if not config.score_keys:
        return Float4Loads(False, False)
    slices = config.k_slice % 4 == 0 and config.latent_dim % 4 == 0 and config.rope_dim % 4 == 0
    return Float4Loads(slices, -(-config.latent_dim // config.threads) % 4 == 0)


# ----------------------------------------------------------------------------------------------
# Device helpers shared by both kernels (arrays are flat C-order views, see run())
# ----------------------------------------------------------------------------------------------

@cuda.jit(device=True, inline="always")
def _visible_word(visibility, row_base, w, size):
    """Word ``w`` of a visibility row (flat offset row_base) with columns >= size cleared."""
    word = int(visibility[row_base + w])
    lo = w * 32
    if lo + 32 <= size:
        return word
    if lo >= size:
        return 0
    return word & ((1 << (size - lo)) - 1)


@cuda.jit(device=True, inline="always")
def _path_length(visibility, row_base, words, size):
    """Number of tree rows a node sees (its root path length for a tree)."""
    count = 0
    for w in range(words):
        count += cuda.popc(_visible_word(visibility, row_base, w, size))
    return count


@cuda.jit(device=True, inline="always")
def _kv_row(pos, past, path):
    """Cache row holding key position ``pos`` of a node's sequence: the cached rows, then its path
    in node order (``path``: :func:`make_fill_path`'s table)."""
    if pos < past:
        return pos
    return past + path[uint64(pos - past)]


@functools.cache
def make_fill_path(threads: int) -> Any:
    """``fill_path`` for blocks of ``threads`` (device function: the attention kernels' and the tree
    values kernel's table of a node's path)."""
    @cuda.jit(device=True, inline="always")
    def fill_path(visibility, vis_base, size, path, tid):
        """The visible tree nodes in node order: path[rank of j] = j, where the rank of j is the
        number of visible nodes before it."""
        for j in range(tid, size, threads):
            w = j // 32
            word = _visible_word(visibility, vis_base, w, size)
            if (word >> (j % 32)) & 1:
                rank = cuda.popc(word & ((1 << (j % 32)) - 1))
                for v in range(w):
                    rank += cuda.popc(_visible_word(visibility, vis_base, v, size))
                path[uint64(rank)] = j
    return fill_path


@functools.cache
def make_load_row_f32x4(dl: int, dr: int) -> Any:
    """``load_row_f32x4`` for rows of ``dl`` latent and ``dr`` rope dims (device function; the
    attention kernels' and the one-node scores' 16-byte row loads)."""
    DL = dl
    DR = dr

    @cuda.jit(device=True, inline="always")
    def load_row_f32x4(latent, rope, row, col, in_latent, live, regs, base):
        """regs[base : base + 4] = dims col .. col + 3 of flat row ``row``: latent dims where
        ``in_latent`` (``col < DL``; 4 | Dl, so a float4 never straddles latent and rope), else
        rope; zeros unless ``live``. The caller passes the test: P·V's value dims are latent by
        construction, and a constant True leaves the rope path out of its unrolled loop.

        Both addresses are clamped to element 0 where their branch is not taken, so each is
        inside its array whatever runs: the 16-byte load is inline assembly without side
        effects, which LLVM may execute whatever branch guards it, and before 2026-12-02 a rope
        load ran for latent dims at a negative offset (compute-sanitizer on the H200: 16-byte
        reads 1.5 KB before a separately allocated ``q_rope``, an illegal address in
        ``bench.verify_attention`` at 33 nodes and 160 cached rows). The branches stay (a dead
        key loads nothing): one load under a select of the array and index instead took the
        33-node launch from 60.7 to 90.2 us and the AR step's from 32.1 to 59.0 (Nsight Compute,
        PERFORMANCE.md run "in-bounds loads"); the clamps cost 1.9 us each."""
        v0 = float32(0.0)
        v1 = float32(0.0)
        v2 = float32(0.0)
        v3 = float32(0.0)
        lat_at = row * DL + col
        rope_at = row * DR + col - DL
        if not (live and in_latent):
            lat_at = 0
        if not live or in_latent:
            rope_at = 0
        if live:
            if in_latent:
                v0, v1, v2, v3 = load_f32x4(latent, uint64(lat_at))
            else:
                v0, v1, v2, v3 = load_f32x4(rope, uint64(rope_at))
        regs[base] = v0
        regs[base + 1] = v1
        regs[base + 2] = v2
        regs[base + 3] = v3

    return load_row_f32x4


@functools.cache
def make_load_lane(dl: int, dr: int, lane: int) -> Any:
    """``load_lane`` of ``lane`` adjacent dims (1, or 4: one 16-byte load) of a row of ``dl`` latent
    and ``dr`` rope dims (device function: the attention kernels' and the tree scores kernel's
    staging move)."""
    DL = dl
    DR = dr
    LANE = lane
    load_row_f32x4 = make_load_row_f32x4(dl, dr)

    @cuda.jit(device=True, inline="always")
    def load_lane(latent, rope, row, col, in_latent, live, regs, base):
        """regs[base : base + LANE] = dims col .. col + LANE - 1 of flat row ``row`` (latent
        dims where ``in_latent``, else rope); zeros unless ``live``."""
        if LANE == 4:   # compile-time. The per-lane col < DL (not the slice-wide in_latent,
            # the same values) keeps NVVM's unrolling of the staging loop as it was
            load_row_f32x4(latent, rope, row, col, col < DL, live, regs, base)
        else:
            value = float32(0.0)
            if live:
                if in_latent:
                    value = latent[uint64(row * DL + col)]
                else:
                    value = rope[uint64(row * DR + col - DL)]
            regs[base] = value
    return load_lane


@functools.cache
def make_score_slice(rows: int, keys: int, k_slice: int, k_groups: int, vec: int, k_row: int) -> Any:
    """``score_slice`` over a thread's ``rows`` query rows and first ``keys`` key tiles of a staged
    ``k_slice``-dim slice (rows ``k_row`` floats apart; compile-time counts: a config's ``qk_keys``
    for every score, fewer for a pass's dead tail, ``skip_dead_keys``) with ``k_groups`` lanes a
    score taking ``vec`` dims at once (device function: the attention kernels' and the tree scores
    kernel's score chain, one function, so one order)."""
    RM = rows
    KS = k_slice
    KG = k_groups
    VEC = vec
    KSP = k_row

    @cuda.jit(device=True, inline="always")
    def score_slice(bufs, q_off, k_off, key_stride, q_vec, k_vec, s):
        """s[i, j] += the staged slice's dims of q row i · key j (key rows key_stride floats
        apart), j < ``keys``. Lane kg takes dims in groups of VEC at (g * KG + kg) * VEC: the
        VEC loads of a row are adjacent and 16-byte aligned, so they merge into one vector
        load (LDS.128: 8 shared loads per 64 FFMA instead of 32), and the constant-trip inner
        loops unroll to immediate offsets. Each s[i, j] gets its fmas in one order (g, then e)
        whatever ``keys`` is."""
        for g in range(0, KS, KG * VEC):
            for i in range(RM):
                for e in range(VEC):
                    q_vec[i, e] = bufs[uint64(q_off + i * KSP + g + e)]
            for j in range(keys):
                for e in range(VEC):
                    k_vec[j, e] = bufs[uint64(k_off + j * key_stride + g + e)]
            for e in range(VEC):
                for i in range(RM):
                    for j in range(keys):
                        s[i, j] = cuda.fma(q_vec[i, e], k_vec[j, e], s[i, j])
    return score_slice


@functools.cache
def make_sum_k_groups(rows: int, keys: int, k_groups: int) -> Any:
    """``sum_k_groups`` of a ``rows`` x ``keys`` register tile over ``k_groups`` lanes (device
    function: the attention kernels' and the tree scores kernel's butterfly)."""
    BUTTERFLY = k_groups.bit_length() - 1

    @cuda.jit(device=True, inline="always")
    def sum_k_groups(s):
        """Sum the k-groups' partial scores; a+b == b+a, so every lane of a group ends with the
        same bits."""
        for level in range(BUTTERFLY):
            for i in range(rows):
                for j in range(keys):
                    s[i, j] += cuda.shfl_xor_sync(FULL_MASK, s[i, j], k_groups >> (level + 1))
    return sum_k_groups


@functools.cache
def make_chunk_softmax(rc: int, kt_levels: int, k_groups: int) -> Any:
    """The online softmax's step for one chunk on a head's lanes (the score-first kernel and the
    one-node launches: one function, so one order; the chunk layout's ``attention`` runs the same
    operations inline on its 2-D score registers): ``p_key`` [rc] holds the lane's scores and
    ``c_max`` their max; the chunk max and sum are xor butterflies over the key tiles (offsets
    k_groups << level, level < kt_levels). Overwrites p_key with exp(score - m_new); returns
    (m_new, l_run * rescale + chunk sum, rescale)."""
    @cuda.jit(device=True, inline="always")
    def chunk_softmax(p_key, c_max, m_run, l_run):
        for level in range(kt_levels):
            c_max = max(c_max, cuda.shfl_xor_sync(FULL_MASK, c_max, k_groups << level))
        m_new = max(m_run, c_max)
        rescale = math.exp(m_run - m_new)   # exp(-inf) = 0 on the first chunk
        p_sum = float32(0.0)
        for j in range(rc):
            p_key[j] = math.exp(p_key[j] - m_new)
            p_sum += p_key[j]
        for level in range(kt_levels):
            p_sum += cuda.shfl_xor_sync(FULL_MASK, p_sum, k_groups << level)
        return m_new, l_run * rescale + p_sum, rescale
    return chunk_softmax


@cuda.jit(device=True, inline="always")
def _merged(acc, m, l):
    """The merge's output element for one segment: the same operations (w = exp(m - m),
    fma(x, w, 0)), so the same bits."""
    w = math.exp(m - m)
    return cuda.fma(acc, w, float32(0.0)) / cuda.fma(l, w, float32(0.0))


@cuda.jit(device=True, inline="always")
def _merged_lse(m, l):
    """The merge's lse for one segment (same operations, same bits)."""
    return m + math.log(cuda.fma(l, math.exp(m - m), float32(0.0)))


@cuda.jit(device=True, inline="always")
def _request_ok(past, size, kv_rows, tree_capacity):
    """Whether a request's tree rows fit the cache and the tree capacity."""
    return past >= 0 and size >= 0 and size <= tree_capacity and past + size <= kv_rows


if simulator_active():
    @cuda.jit(device=True, inline="always")
    def _prefetch_l2(array, index):
        """No caches to fill: only checks that the line is inside the array."""
        if index >= array.shape[0]:
            raise IndexError(f"prefetch_l2 at {index}, past the array's {array.shape[0]} elements")
else:
    @intrinsic
    def _prefetch_l2(typingctx, array, index):
        """``prefetch.L2`` of the cache line holding ``array[index]`` (a C-contiguous 1-D array):
        the line comes to L2 without a register waiting for it."""
        if not (isinstance(array, types.Array) and array.ndim == 1 and isinstance(index, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, value=args[0])
            ptr = builder.gep(ary.data, [context.cast(builder, args[1], signature.args[1], types.intp)])
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ptr.type]), "prefetch.L2 [$0];", "l",
                               side_effect=True)
            builder.call(asm, [ptr])
            return context.get_dummy_value()

        return types.void(array, index), codegen


# ----------------------------------------------------------------------------------------------
# Kernel factory
# ----------------------------------------------------------------------------------------------

@functools.cache
def get_kernels(config: TileConfig) -> tuple[Any, Any]:
    """The (attention, merge) kernels specialised for ``config`` (compiled lazily, cached).

    Both take flat (1-D, C-order) views of the run() arrays plus their dims as scalars, so the
    index arithmetic is one base offset per block plus compile-time strides.
    """
    config.validate()
    DL = config.latent_dim
    DR = config.rope_dim
    HEADS = config.heads
    CHUNK = config.chunk
    KS = config.k_slice
    KG = config.k_groups
    KSP = config.k_row                  # padded slice row: spreads key rows over the banks
    VEC = math.gcd(KS // KG, 4)         # consecutive dims per lane step (one float4 load)
    RM = config.qk_rows
    RC = config.qk_keys
    PM = config.pv_rows
    PD = config.pv_dims
    CS = config.v_slice
    MAX_PATH = config.max_path
    THREADS = config.threads
    MIN_BLOCKS = config.min_blocks or None   # launch bounds: a block count where the config asks for one
    KEY_TILES = CHUNK // RC             # thread tiles along the keys of a chunk
    DIM_THREADS = DL // PD              # threads along the latent dims in P·V
    N_KSLICES = (DL + DR) // KS
    N_VSLICES = CHUNK // CS
    BUF = config.buffer_floats          # one half of bufs
    TWO_BUFS = 2 * BUF
    PROW = config.probs_row
    PROBS = CHUNK * PROW
    TWO_HEADS = 2 * HEADS
    TWO_CHUNKS = 2 * CHUNK
    KT_LEVELS = KEY_TILES.bit_length() - 1      # xor-butterfly levels over the key tiles
    VV = math.gcd(PD, 4)                # consecutive value dims per lane step (one float4)
    MERGE_THREADS = config.merge_threads
    MERGE_HEADS = config.merge_heads
    PREFETCH = config.prefetch_l2
    PREFETCH_AHEAD = config.prefetch_chunks * CHUNK     # key positions prefetched ahead
    LINE_FLOATS = 32                    # one 128-byte cache line
    DL_LINES = -(-DL // LINE_FLOATS)
    ROW_LINES = DL_LINES + -(-DR // LINE_FLOATS)    # lines of one key row (latent, then rope)
    # Value staging geometry: a row of DL floats is loaded by V_TPR consecutive lanes (q / k
    # slices: slice_io).
    V_TPR = min(THREADS, DL)
    V_ROW_STEP = THREADS // V_TPR
    V_COL_PASSES = DL // V_TPR
    V_ROW_PASSES = -(-CS // V_ROW_STEP)
    V_ROWS_EXACT = CS % V_ROW_STEP == 0         # no row guard needed (compile-time)
    V_REGS = V_ROW_PASSES * V_COL_PASSES
    # Score-first layout (config.score_keys > 0): SB keys scored per pass, then their softmax on
    # the chunk layout's lanes (LANES per head), then P·V over dims tid + i * THREADS.
    SB = max(config.score_keys, CHUNK)
    SCORE_FIRST = config.score_keys > 0
    SF_KEY_TILES = SB // RC             # thread tiles along the keys of a pass
    SF_CHUNKS = SB // CHUNK             # chunks of a pass
    LANES = KG * KEY_TILES              # softmax lanes of one head (the chunk layout's row tile)
    SF_SOFTMAX_THREADS = -(-HEADS * LANES // WARP) * WARP  # whole warps: their shuffles need all lanes
    SF_DIMS = -(-DL // THREADS)         # adjacent latent dims per thread in P·V (each for every head)
    # Float4 moves (16-byte global loads, aligned arrays: run() checks them with the same
    # function): query / key slices where rows and slices are whole float4s (every preset), value
    # rows where a thread's dims of a row are (then THREADS divides DL: they end inside DL).
    SF_STAGE_VEC4, SF_VEC4 = float4_loads(config)
    # value rows loaded before their FMAs: the most that divide CHUNK in <= 64 registers
    SF_VKEYS = max(v for v in range(1, CHUNK + 1) if CHUNK % v == 0 and v * SF_DIMS <= max(64, SF_DIMS))
    SF_PROW = config.score_probs_row    # key-major probabilities [SB, SF_PROW]: a key's heads adjacent
    SF_QBUF = HEADS * KSP
    SF_BUFS = SF_QBUF + SB * KSP
    SF_PROBS = SB * SF_PROW
    SF_ALPHAS = HEADS * SF_CHUNKS
    SKIP_DEAD = config.skip_dead_keys
    chunk_softmax = make_chunk_softmax(RC, KT_LEVELS, KG)

    @cuda.jit(device=True, inline="always")
    def one_segment(seg, seg_end, split):
        """Whether this block's node has all its keys in segment 0, short of its end (past +
        path_len < split: the merge's own test, so exactly one of the two writes out)."""
        return seg == 0 and seg_end < split

    @cuda.jit(device=True, inline="always")
    def write_fill(out, lse, b, node, h0, size, tree_capacity, num_heads, tid):
        """The merge's outputs for a node with no keys to attend (a padding node: zeros; a node
        the guards reject: NaN), written by its attention block wherever every key lies in
        segment 0 (``kv_rows < split``, where ``VerifyPlan.merge_free`` skips the merge; a merge
        launched anyway rewrites the same values at the same places)."""
        fill = float32(0.0) if node >= size else float32(math.nan)
        row = (b * tree_capacity + node) * num_heads + h0      # flat row of (b, node, h0)
        for e in range(tid, HEADS * DL, THREADS):              # the tile's heads are adjacent rows
            out[uint64(row * DL + e)] = fill
        if tid < HEADS:
            lse[uint64(row + tid)] = fill

    merged = _merged
    merged_lse = _merged_lse

    @cuda.jit(device=True, inline="always")
    def block_work(past_lens, tree_sizes, visibility, tree_capacity, num_heads, kv_rows, vis_words,
                   split):
        """This block's (node, first head, segment, request), the request's past and size, the
        node's visibility row and its segment's key positions ``[seg_start, seg_end)``; an empty
        range for a padding node, a bad request, a path past MAX_PATH or an empty segment."""
        head_groups = num_heads // HEADS
        node = cuda.blockIdx.x // head_groups
        h0 = (cuda.blockIdx.x % head_groups) * HEADS
        seg = cuda.blockIdx.y
        b = cuda.blockIdx.z
        past = past_lens[b]
        size = tree_sizes[b]
        vis_base = (b * tree_capacity + node) * vis_words
        seg_start = seg * split
        seg_end = seg_start
        if node < size and _request_ok(past, size, kv_rows, tree_capacity):
            path_len = _path_length(visibility, vis_base, vis_words, size)
            if path_len <= MAX_PATH:
                seg_end = min(seg_start + split, past + path_len)
        return node, h0, seg, b, past, size, vis_base, seg_start, seg_end

    fill_path = make_fill_path(THREADS)

    load_row_f32x4 = make_load_row_f32x4(DL, DR)

    def slice_io(n_keys, k_buf, lane_floats):
        """(load, store, lane, query registers, key registers) of ``[HEADS, KS]`` query and
        ``[n_keys, KS]`` key slices, the keys at ``bufs[k_buf:]`` (compile-time constants: the
        chunk layout stages CHUNK keys, the score-first layout SB).

        A row of KS floats is moved by TPR consecutive lanes, ``lane_floats`` adjacent dims each:
        1 (scalar loads and stores) or 4 (one 16-byte global load: whole-float4 rows and slices,
        aligned arrays, see :func:`float4_loads`). ``lane(tid)`` is a thread's ``(s_row,
        s_col)``: its first staged row and first dim (a multiple of ``lane_floats``).
        """
        assert lane_floats in (1, 4) and KS % lane_floats == 0, lane_floats
        LANE = lane_floats
        TPR = min(THREADS, KS // LANE)          # lanes a row
        ROW_STEP = THREADS // TPR               # rows staged at once
        COL_PASSES = max(1, KS // LANE // TPR)  # a lane's moves a row, COL_STEP floats apart
        COL_STEP = TPR * LANE
        q_row_passes = -(-HEADS // ROW_STEP)
        q_rows_exact = HEADS % ROW_STEP == 0    # no row guard needed (compile-time)
        k_row_passes = -(-n_keys // ROW_STEP)
        k_rows_exact = n_keys % ROW_STEP == 0

        @cuda.jit(device=True, inline="always")
        def lane(tid):
            """This thread's first staged row and first dim."""
            return tid // TPR, (tid % TPR) * LANE

        load_lane = make_load_lane(DL, DR, LANE)

        @cuda.jit(device=True, inline="always")
        def load_qk_slice(q_latent, q_rope, kv_latent, k_rope, q_base, k0, rows, rows_off, s_row,
                          s_col, q_reg, k_reg):
            """Global -> registers: the query and key slices at dim k0.

            q_base: flat row of the tile's first head; rows[rows_off:]: the keys' flat cache
            rows (-1: no key, staged as zeros). A slice never straddles latent and rope (KS
            divides DL and DR).
            """
            in_latent = k0 < DL
            for rp in range(q_row_passes):
                r = s_row + rp * ROW_STEP
                for cp in range(COL_PASSES):
                    load_lane(q_latent, q_rope, q_base + r, k0 + s_col + cp * COL_STEP, in_latent,
                              q_rows_exact or r < HEADS, q_reg, (rp * COL_PASSES + cp) * LANE)
            for rp in range(k_row_passes):
                c = s_row + rp * ROW_STEP
                row = -1
                if k_rows_exact or c < n_keys:
                    row = rows[uint64(rows_off + c)]
                for cp in range(COL_PASSES):
                    load_lane(kv_latent, k_rope, row, k0 + s_col + cp * COL_STEP, in_latent,
                              row >= 0, k_reg, (rp * COL_PASSES + cp) * LANE)

        @cuda.jit(device=True, inline="always")
        def store_qk_slice(bufs, s_row, s_col, q_reg, k_reg):
            """Registers -> shared memory: queries at bufs[0:], keys at bufs[k_buf:] (rows of KSP)."""
            for rp in range(q_row_passes):
                r = s_row + rp * ROW_STEP
                if r < HEADS:
                    for cp in range(COL_PASSES):
                        off = uint64(r * KSP + s_col + cp * COL_STEP)
                        for e in range(LANE):
                            bufs[off + uint64(e)] = q_reg[(rp * COL_PASSES + cp) * LANE + e]
            for rp in range(k_row_passes):
                c = s_row + rp * ROW_STEP
                if c < n_keys:
                    for cp in range(COL_PASSES):
                        off = uint64(k_buf + c * KSP + s_col + cp * COL_STEP)
                        for e in range(LANE):
                            bufs[off + uint64(e)] = k_reg[(rp * COL_PASSES + cp) * LANE + e]

        return (load_qk_slice, store_qk_slice, lane, q_row_passes * COL_PASSES * LANE,
                k_row_passes * COL_PASSES * LANE)

    load_qk_slice, store_qk_slice, stage_lane, Q_REGS, K_REGS = slice_io(CHUNK, BUF, 1)
    sf_load_slice, sf_store_slice, sf_stage_lane, SF_Q_REGS, SF_K_REGS = slice_io(
        SB, SF_QBUF, 4 if SF_STAGE_VEC4 else 1)

    @cuda.jit(device=True, inline="always")
    def score_lane(tid, key_tiles, k_buf):
        """A score thread's k-group, key tile, row tile and its first q / k offsets in bufs (the
        lane's first dim kg * VEC included; keys at bufs[k_buf:])."""
        kg = tid % KG
        key_tile = (tid // KG) % key_tiles
        row_tile = tid // (KG * key_tiles)
        return kg, key_tile, row_tile, row_tile * RM * KSP + kg * VEC, k_buf + key_tile * KSP + kg * VEC

    score_slice = make_score_slice(RM, RC, KS, KG, VEC, KSP)
    # skip_dead_keys: the score loop for 1, 2 or 3 live key tiles (RC <= 4, validated)
    score_slice_1 = make_score_slice(RM, min(1, RC), KS, KG, VEC, KSP)
    score_slice_2 = make_score_slice(RM, min(2, RC), KS, KG, VEC, KSP)
    score_slice_3 = make_score_slice(RM, min(3, RC), KS, KG, VEC, KSP)
    sum_k_groups = make_sum_k_groups(RM, RC, KG)

    @cuda.jit(device=True, inline="always")
    def load_v_slice(kv_latent, rows, rows_off, first, v_row, v_col, v_reg):
        """Global -> registers: latent rows of chunk keys ``first .. first + CS - 1``."""
        for rp in range(V_ROW_PASSES):
            c = v_row + rp * V_ROW_STEP
            row = -1
            if V_ROWS_EXACT or c < CS:
                row = rows[uint64(rows_off + first + c)]
            for cp in range(V_COL_PASSES):
                value = float32(0.0)
                if row >= 0:  # zeros, never stale rows: 0 * NaN would poison acc
                    value = kv_latent[uint64(row * DL + v_col + cp * V_TPR)]
                v_reg[rp * V_COL_PASSES + cp] = value

    @cuda.jit(device=True, inline="always")
    def store_v_slice(bufs, off, v_row, v_col, v_reg):
        """Registers -> shared memory: a ``[CS, DL]`` value slice at bufs[off:]."""
        for rp in range(V_ROW_PASSES):
            c = v_row + rp * V_ROW_STEP
            if V_ROWS_EXACT or c < CS:
                for cp in range(V_COL_PASSES):
                    bufs[uint64(off + c * DL + v_col + cp * V_TPR)] = v_reg[rp * V_COL_PASSES + cp]

    @cuda.jit(device=True, inline="always")
    def prefetch_keys(kv_latent, k_rope, first, end, past, path, kv_base, tid):
        """``prefetch.L2`` of every line of the key rows at positions ``first .. end - 1`` (all
        18 lines of a row: latent, then rope), spread over the block's threads."""
        n_lines = uint32(max(end - first, 0) * ROW_LINES)
        line = uint32(tid)
        while line < n_lines:   # uint32: division by a constant is a multiply
            c = line // uint32(ROW_LINES)
            part = line - c * uint32(ROW_LINES)
            row = kv_base + _kv_row(first + int32(c), past, path)
            line += uint32(THREADS)
            if part < DL_LINES:
                _prefetch_l2(kv_latent, uint64(row * DL + part * LINE_FLOATS))
            else:
                _prefetch_l2(k_rope, uint64(row * DR + (part - DL_LINES) * LINE_FLOATS))

    @cuda.jit(**launch_bounds(THREADS, MIN_BLOCKS))
    def attention(q_latent, q_rope, kv_latent, k_rope, past_lens, tree_sizes, visibility,
                  tree_capacity, num_heads, kv_rows, vis_words, scale, split, workspace, out, lse):
        """One (node, head group, segment): the segment's partial (acc, m, l) -> workspace, or,
        for a node whose keys fit one segment (:func:`one_segment`), the merge's arithmetic on it
        -> out and lse (the same bits; the merge skips the node).

        Flat float32 views of q_latent [bs, Tc, H, Dl], q_rope [bs, Tc, H, Dr],
        kv_latent [bs, S, Dl], k_rope [bs, S, Dr]; past_lens, tree_sizes int32 [bs];
        flat uint32 visibility [bs, Tc, W]; int32 Tc, H, S, W; float32 scale; int32 split;
        flat float32 workspace [n_splits, bs, Tc, H, Dl + 2], out [bs, Tc, H, Dl], lse [bs, Tc, H].
        """
        bufs = cuda.shared.array(TWO_BUFS, float32)   # q|k slices [HEADS|CHUNK, KSP]; 2 v slices
        probs = cuda.shared.array(PROBS, float32)     # [CHUNK, PROW] probabilities, key-major
        alpha = cuda.shared.array(HEADS, float32)     # [HEADS] acc rescale of this chunk
        m_sh = cuda.shared.array(TWO_HEADS, float32)  # [2, HEADS] running max, by chunk parity
        l_sh = cuda.shared.array(TWO_HEADS, float32)  # [2, HEADS] running sum, by chunk parity
        path = cuda.shared.array(MAX_PATH, int32)     # tree node at position past + k
        rows = cuda.shared.array(TWO_CHUNKS, int32)   # [2, CHUNK] flat cache rows, by parity
        pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch

        tid = cuda.threadIdx.x
        node, h0, seg, b, past, size, vis_base, seg_start, seg_end = block_work(
            past_lens, tree_sizes, visibility, tree_capacity, num_heads, kv_rows, vis_words, split)
        if seg_start >= seg_end:   # block-uniform, before any barrier
            if kv_rows < split:    # one segment at most (merge_free): the block writes the node's fill
                write_fill(out, lse, b, node, h0, size, tree_capacity, num_heads, tid)
            return

        fill_path(visibility, vis_base, size, path, tid)
        if tid < HEADS:
            m_sh[tid] = float32(NEG_INF)
            l_sh[tid] = float32(0.0)
        cuda.syncthreads()  # path[] complete before the first chunk's rows

        kv_base = b * kv_rows                                   # flat row of (b, cache row 0)
        if tid < CHUNK:
            row = -1
            if seg_start + tid < seg_end:
                row = kv_base + _kv_row(seg_start + tid, past, path)
            rows[tid] = row
        cuda.syncthreads()  # the first chunk's key rows are known
        if PREFETCH:   # the first PREFETCH_AHEAD keys (path[] is complete)
            prefetch_keys(kv_latent, k_rope, seg_start, min(seg_start + PREFETCH_AHEAD, seg_end),
                          past, path, kv_base, tid)

        q_base = (b * tree_capacity + node) * num_heads + h0   # flat row of (b, node, h0)
        s_row, s_col = stage_lane(tid)
        v_row = tid // V_TPR
        v_col = tid % V_TPR
        # Score GEMM: k-group fastest, then key tile, so the k-group butterfly and the softmax
        # reductions over key tiles stay inside a warp.
        kg, key_tile, row_tile, q_off, k_off = score_lane(tid, KEY_TILES, BUF)
        # P·V: dims fastest (VV consecutive dims per lane: one LDS.128), so value loads are
        # consecutive across lanes; a warp's rows are uniform, so probs loads broadcast.
        dim_lane = tid % DIM_THREADS
        pv_row0 = (tid // DIM_THREADS) * PM

        q_reg = cuda.local.array(Q_REGS, float32)
        k_reg = cuda.local.array(K_REGS, float32)
        v_reg = cuda.local.array(V_REGS, float32)
        s = cuda.local.array((RM, RC), float32)
        q_vec = cuda.local.array((RM, VEC), float32)
        k_vec = cuda.local.array((RC, VEC), float32)
        acc = cuda.local.array((PM, PD), float32)
        p_val = cuda.local.array(PM, float32)
        v_val = cuda.local.array(PD, float32)
        for i in range(PM):
            for j in range(PD):
                acc[i, j] = float32(0.0)

        cur = 0     # chunk parity: rows, m_sh, l_sh of this chunk at [cur]; the next at [1 - cur]
        load_qk_slice(q_latent, q_rope, kv_latent, k_rope, q_base, 0, rows, 0, s_row, s_col,
                      q_reg, k_reg)
        for chunk_start in range(seg_start, seg_end, CHUNK):
            # ---- S = Q Kᵀ over the Dl + Dr dims, KS at a time, next slice prefetched ----
            for i in range(RM):
                for j in range(RC):
                    s[i, j] = float32(0.0)
            for ks in range(N_KSLICES):
                cuda.syncthreads()  # readers of bufs (previous slice / last value slice) done
                store_qk_slice(bufs, s_row, s_col, q_reg, k_reg)
                cuda.syncthreads()  # slice ks staged
                if ks + 1 < N_KSLICES:
                    load_qk_slice(q_latent, q_rope, kv_latent, k_rope, q_base, (ks + 1) * KS,
                                  rows, cur * CHUNK, s_row, s_col, q_reg, k_reg)
                else:   # the chunk's first value slice, in flight during the last score slice
                    load_v_slice(kv_latent, rows, cur * CHUNK, 0, v_row, v_col, v_reg)
                score_slice(bufs, q_off, k_off, KEY_TILES * KSP, q_vec, k_vec, s)
            sum_k_groups(s)

            # ---- online softmax in registers: a row's keys live on the KG * KEY_TILES lanes
            # of its row tile; max and sum are xor butterflies over the key tiles (commutative
            # steps: every lane ends with the same bits). Keys past the segment get p = 0. ----
            n_keys = seg_end - chunk_start
            nxt = 1 - cur
            for i in range(RM):
                row = row_tile * RM + i
                m_old = m_sh[uint64(cur * HEADS + row)]
                c_max = float32(NEG_INF)
                for j in range(RC):
                    score = float32(NEG_INF)
                    if key_tile + j * KEY_TILES < n_keys:
                        score = s[i, j] * scale
                    s[i, j] = score
                    c_max = max(c_max, score)
                for level in range(KT_LEVELS):
                    c_max = max(c_max, cuda.shfl_xor_sync(FULL_MASK, c_max, KG << level))
                m_new = max(m_old, c_max)
                rescale = math.exp(m_old - m_new)   # exp(-inf) = 0 on the first chunk
                p_sum = float32(0.0)
                for j in range(RC):
                    s[i, j] = math.exp(s[i, j] - m_new)
                    p_sum += s[i, j]
                for level in range(KT_LEVELS):
                    p_sum += cuda.shfl_xor_sync(FULL_MASK, p_sum, KG << level)
                if key_tile == 0 and kg == 0:
                    m_sh[uint64(nxt * HEADS + row)] = m_new
                    l_old = l_sh[uint64(cur * HEADS + row)]
                    l_sh[uint64(nxt * HEADS + row)] = l_old * rescale + p_sum
                    alpha[uint64(row)] = rescale
                for j in range(RC):
                    if j % KG == kg:
                        probs[uint64((key_tile + j * KEY_TILES) * PROW + row)] = s[i, j]
            if tid < CHUNK:     # the next chunk's key rows (its buffer's readers are done)
                pos = chunk_start + CHUNK + tid
                row = -1
                if pos < seg_end:
                    row = kv_base + _kv_row(pos, past, path)
                rows[uint64(nxt * CHUNK + tid)] = row
            cuda.syncthreads()  # probs, alpha, next rows ready; score readers of bufs done
            if PREFETCH:   # the key rows PREFETCH_AHEAD on, to L2 during this chunk's P V
                ahead = chunk_start + PREFETCH_AHEAD
                prefetch_keys(kv_latent, k_rope, ahead, min(ahead + CHUNK, seg_end), past, path,
                              kv_base, tid)

            # ---- acc = acc * alpha + P V; value slices alternate between the two halves of
            # bufs, each prefetched into registers one slice ahead ----
            for i in range(PM):
                p_val[i] = alpha[uint64(pv_row0 + i)]
                for j in range(PD):
                    acc[i, j] = acc[i, j] * p_val[i]
            for vs in range(N_VSLICES):
                v_off = BUF * (1 - vs % 2)
                store_v_slice(bufs, v_off, v_row, v_col, v_reg)
                cuda.syncthreads()  # slice vs staged; readers of slice vs - 2 (same half) done
                if vs + 1 < N_VSLICES:
                    load_v_slice(kv_latent, rows, cur * CHUNK, (vs + 1) * CS, v_row, v_col,
                                 v_reg)
                else:   # the next chunk's first score slice, in flight during this one
                    load_qk_slice(q_latent, q_rope, kv_latent, k_rope, q_base, 0, rows,
                                  nxt * CHUNK, s_row, s_col, q_reg, k_reg)
                for c in range(CS):
                    for i in range(PM):
                        p_val[i] = probs[uint64((vs * CS + c) * PROW + pv_row0 + i)]
                    for j in range(PD):
                        v_val[j] = bufs[uint64(v_off + c * DL + dim_lane * VV
                                               + (j // VV) * (DIM_THREADS * VV) + j % VV)]
                    for i in range(PM):
                        for j in range(PD):
                            acc[i, j] = cuda.fma(p_val[i], v_val[j], acc[i, j])
            cur = nxt

        # ---- segment partial -> workspace [seg, b, node, h, :], or (one segment) -> out, lse ----
        batch = past_lens.shape[0]
        ws_row = ((seg * batch + b) * tree_capacity + node) * num_heads + h0
        if one_segment(seg, seg_end, split):   # ws_row is out's row (segment 0)
            for i in range(PM):
                m_fin = m_sh[uint64(cur * HEADS + pv_row0 + i)]
                l_fin = l_sh[uint64(cur * HEADS + pv_row0 + i)]
                for j in range(PD):
                    dim = dim_lane * VV + (j // VV) * (DIM_THREADS * VV) + j % VV
                    out[uint64((ws_row + pv_row0 + i) * DL + dim)] = merged(acc[i, j], m_fin, l_fin)
            if tid < HEADS:
                lse[uint64(ws_row + tid)] = merged_lse(m_sh[uint64(cur * HEADS + tid)],
                                                       l_sh[uint64(cur * HEADS + tid)])
            return
        for i in range(PM):
            for j in range(PD):
                dim = dim_lane * VV + (j // VV) * (DIM_THREADS * VV) + j % VV
                workspace[uint64((ws_row + pv_row0 + i) * (DL + 2) + dim)] = acc[i, j]
        if tid < HEADS:     # the last chunk's writes precede its probs barrier
            workspace[uint64((ws_row + tid) * (DL + 2) + DL)] = m_sh[uint64(cur * HEADS + tid)]
            workspace[uint64((ws_row + tid) * (DL + 2) + DL + 1)] = l_sh[uint64(cur * HEADS + tid)]

    @cuda.jit(**launch_bounds(MERGE_THREADS))
    def merge(past_lens, tree_sizes, visibility, tree_capacity, num_heads, kv_rows, vis_words,
              split, num_splits, workspace, out, lse):
        """One node's head group: fold its segments, in segment order, into out and lse.

        past_lens, tree_sizes int32 [bs]; flat uint32 visibility [bs, Tc, W]; int32 Tc, H, S, W,
        split, n_splits; flat float32 workspace [n_splits, bs, Tc, H, Dl + 2], out [bs, Tc, H,
        Dl], lse [bs, Tc, H]. Grid (Tc * H / MERGE_HEADS, bs): block x = node * groups + group.
        Padding rows get zeros, unguarded requests NaN. The arithmetic of an element does not
        depend on the grouping (merge_heads is layout, not numerics).
        """
        pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
        tid = cuda.threadIdx.x
        groups = num_heads // MERGE_HEADS
        node = cuda.blockIdx.x // groups
        head0 = (cuda.blockIdx.x - node * groups) * MERGE_HEADS
        b = cuda.blockIdx.y
        batch = past_lens.shape[0]
        past = past_lens[b]
        size = tree_sizes[b]
        fill = float32(math.nan)
        n_seg = 0
        if node >= size:
            fill = float32(0.0)
        elif _request_ok(past, size, kv_rows, tree_capacity):
            vis_base = (b * tree_capacity + node) * vis_words
            path_len = _path_length(visibility, vis_base, vis_words, size)
            n_seg = (past + path_len + split - 1) // split
            if path_len > MAX_PATH or n_seg > num_splits:
                n_seg = 0
            elif n_seg > 0 and past + path_len < split:
                return   # one segment: the attention block wrote out and lse (one_segment)
            # n_seg 0 (no keys: a device visibility row without its own bit, no past): NaN
        out_row = (b * tree_capacity + node) * num_heads
        seg_stride = batch * tree_capacity * num_heads    # workspace rows per segment
        for e in range(tid, MERGE_HEADS * DL, MERGE_THREADS):
            h = head0 + e // DL
            d = e % DL
            if n_seg == 0:
                out[(out_row + h) * DL + d] = fill
                if d == 0:
                    lse[out_row + h] = fill
                continue
            ws = (out_row + h) * (DL + 2)      # segment 0's row; segment sg adds sg * stride
            m_max = workspace[ws + DL]
            for sg in range(1, n_seg):
                m_max = max(m_max, workspace[ws + sg * seg_stride * (DL + 2) + DL])
            total = float32(0.0)
            weighted = float32(0.0)
            for sg in range(n_seg):
                row = ws + sg * seg_stride * (DL + 2)
                w = math.exp(workspace[row + DL] - m_max)
                total = cuda.fma(workspace[row + DL + 1], w, total)
                weighted = cuda.fma(workspace[row + d], w, weighted)
            out[(out_row + h) * DL + d] = weighted / total
            if d == 0:
                lse[out_row + h] = m_max + math.log(total)

    @cuda.jit(**launch_bounds(THREADS, MIN_BLOCKS))
    def attention_score_first(q_latent, q_rope, kv_latent, k_rope, past_lens, tree_sizes,
                              visibility, tree_capacity, num_heads, kv_rows, vis_words, scale,
                              split, workspace, out, lse):
        """:func:`attention` for few nodes, the same bits: SB keys of every tile head scored per
        pass (all score threads busy, where the chunk layout has CHUNK keys a pass), then the
        pass's chunks through the online softmax in chunk order on the chunk layout's lanes
        (the same max and sum butterflies), then ``acc = acc * alpha + P V`` chunk by chunk.
        Every (head, key) score, every running (m, l) and every (head, dim) accumulator goes
        through the same float32 operations in the same order as in :func:`attention`.
        Same arguments.
        """
        bufs = cuda.shared.array(SF_BUFS, float32)     # [HEADS, KSP] query | [SB, KSP] key slice
        probs = cuda.shared.array(SF_PROBS, float32)   # [SB, SF_PROW] scores, then probabilities
        alpha = cuda.shared.array(SF_ALPHAS, float32)  # [HEADS, SF_CHUNKS] acc rescale per chunk
        path = cuda.shared.array(MAX_PATH, int32)      # tree node at position past + k
        rows = cuda.shared.array(SB, int32)            # [SB] flat cache rows of the pass (-1: none)
        fin = cuda.shared.array(TWO_HEADS, float32)    # [2, HEADS] final m, then l (one segment)
        pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch

        tid = cuda.threadIdx.x
        node, h0, seg, b, past, size, vis_base, seg_start, seg_end = block_work(
            past_lens, tree_sizes, visibility, tree_capacity, num_heads, kv_rows, vis_words, split)
        if seg_start >= seg_end:   # block-uniform, before any barrier
            if kv_rows < split:    # one segment at most (merge_free): the block writes the node's fill
                write_fill(out, lse, b, node, h0, size, tree_capacity, num_heads, tid)
            return
        fill_path(visibility, vis_base, size, path, tid)
        cuda.syncthreads()  # path[] complete before any key row is looked up
        kv_base = b * kv_rows                                   # flat row of (b, cache row 0)
        if PREFETCH:   # the first PREFETCH_AHEAD keys
            prefetch_keys(kv_latent, k_rope, seg_start, min(seg_start + PREFETCH_AHEAD, seg_end),
                          past, path, kv_base, tid)

        q_base = (b * tree_capacity + node) * num_heads + h0   # flat row of (b, node, h0)
        s_row, s_col = sf_stage_lane(tid)   # float4 lanes where SF_STAGE_VEC4
        # Scores: k-group fastest, then key tile (SF_KEY_TILES over the pass), then row tile.
        kg, key_tile, row_tile, q_off, k_off = score_lane(tid, SF_KEY_TILES, SF_QBUF)
        # skip_dead_keys: the warp's lowest key tile (its first lane's, or 0 where the warp spans
        # two row tiles) decides how many key tiles j the warp scores in a pass (one loop a warp)
        kt_min = ((tid // WARP) * WARP // KG) % SF_KEY_TILES
        if kt_min + WARP // KG > SF_KEY_TILES:
            kt_min = 0
        # Softmax: head tid // LANES on the chunk layout's lanes (k-group fastest, then key tile).
        sm_head = min(tid // LANES, HEADS - 1)   # lanes past the heads shadow the last head
        sm_writer = tid < HEADS * LANES
        sm_kg = tid % KG
        sm_tile = (tid // KG) % KEY_TILES

        q_reg = cuda.local.array(SF_Q_REGS, float32)
        k_reg = cuda.local.array(SF_K_REGS, float32)
        s = cuda.local.array((RM, RC), float32)
        q_vec = cuda.local.array((RM, VEC), float32)
        k_vec = cuda.local.array((RC, VEC), float32)
        p_key = cuda.local.array(RC, float32)
        acc = cuda.local.array((HEADS, SF_DIMS), float32)
        v_val = cuda.local.array((SF_VKEYS, SF_DIMS), float32)   # 2-D: a flat one went to the stack
        p_head = cuda.local.array(HEADS, float32)
        dim0 = tid * SF_DIMS        # this thread's P·V dims: dim0 .. dim0 + SF_DIMS - 1
        for h in range(HEADS):
            for i in range(SF_DIMS):
                acc[h, i] = float32(0.0)
        m_run = float32(NEG_INF)   # running max and sum of head sm_head (softmax lanes)
        l_run = float32(0.0)

        for pass_start in range(seg_start, seg_end, SB):
            cuda.syncthreads()  # the previous pass's P·V readers of rows[] and probs[] are done
            for c in range(tid, SB, THREADS):
                row = -1
                if pass_start + c < seg_end:
                    row = kv_base + _kv_row(pass_start + c, past, path)
                rows[uint64(c)] = row
            if PREFETCH:   # the key rows PREFETCH_AHEAD on, to L2 during this pass
                ahead = pass_start + PREFETCH_AHEAD
                prefetch_keys(kv_latent, k_rope, ahead, min(ahead + SB, seg_end), past, path,
                              kv_base, tid)
            cuda.syncthreads()  # the pass's key rows are known
            n_keys = seg_end - pass_start

            # ---- S = Q Kᵀ for the pass's SB keys, KS dims at a time, next slice prefetched;
            # per score the chunk kernel's dims in its order (lane kg, groups of VEC) ----
            for i in range(RM):
                for j in range(RC):
                    s[i, j] = float32(0.0)
            live_keys = RC   # key tiles j this warp scores: every j with a live key in the warp
            if SKIP_DEAD:
                live_keys = min(RC, (n_keys - kt_min + SF_KEY_TILES - 1) // SF_KEY_TILES)   # n_keys >= 1
            sf_load_slice(q_latent, q_rope, kv_latent, k_rope, q_base, 0, rows, 0, s_row, s_col,
                          q_reg, k_reg)
            for ks in range(N_KSLICES):
                cuda.syncthreads()  # readers of the previous slice are done
                sf_store_slice(bufs, s_row, s_col, q_reg, k_reg)
                cuda.syncthreads()  # slice ks staged
                if ks + 1 < N_KSLICES:
                    sf_load_slice(q_latent, q_rope, kv_latent, k_rope, q_base, (ks + 1) * KS,
                                  rows, 0, s_row, s_col, q_reg, k_reg)
                if SKIP_DEAD and live_keys < RC:   # dead key tiles, whose scores are never read
                    if live_keys == 1:
                        score_slice_1(bufs, q_off, k_off, SF_KEY_TILES * KSP, q_vec, k_vec, s)
                    elif live_keys == 2:
                        score_slice_2(bufs, q_off, k_off, SF_KEY_TILES * KSP, q_vec, k_vec, s)
                    elif live_keys == 3:
                        score_slice_3(bufs, q_off, k_off, SF_KEY_TILES * KSP, q_vec, k_vec, s)
                else:
                    score_slice(bufs, q_off, k_off, SF_KEY_TILES * KSP, q_vec, k_vec, s)
            sum_k_groups(s)   # as in the chunk kernel
            for i in range(RM):
                for j in range(RC):
                    key = key_tile + j * SF_KEY_TILES
                    if j % KG == kg:
                        score = float32(NEG_INF)
                        if key < n_keys:
                            score = s[i, j] * scale
                        probs[uint64(key * SF_PROW + row_tile * RM + i)] = score
            cuda.syncthreads()  # every score of the pass is in probs[]

            # ---- online softmax chunk by chunk: the chunk kernel's lanes and butterflies ----
            if tid < SF_SOFTMAX_THREADS:
                for ci in range(SF_CHUNKS):
                    c0 = ci * CHUNK
                    if c0 < n_keys:
                        c_max = float32(NEG_INF)
                        for j in range(RC):
                            p_key[j] = probs[uint64((c0 + sm_tile + j * KEY_TILES) * SF_PROW + sm_head)]
                            c_max = max(c_max, p_key[j])
                        m_run, l_run, rescale = chunk_softmax(p_key, c_max, m_run, l_run)
                        cuda.syncwarp()  # every lane has read its scores before any overwrites them
                        if sm_writer:
                            if sm_tile == 0 and sm_kg == 0:
                                alpha[uint64(sm_head * SF_CHUNKS + ci)] = rescale
                            for j in range(RC):
                                if j % KG == sm_kg:
                                    probs[uint64((c0 + sm_tile + j * KEY_TILES) * SF_PROW + sm_head)] = p_key[j]
            cuda.syncthreads()  # the pass's probabilities and rescales are in shared memory

            # ---- acc = acc * alpha + P V, chunk by chunk, keys in order; SF_VKEYS value rows
            # loaded before their FMAs, a key's HEADS probabilities adjacent (vector loads) ----
            for ci in range(SF_CHUNKS):
                c0 = ci * CHUNK
                if c0 < n_keys:
                    for h in range(HEADS):
                        rescale = alpha[uint64(h * SF_CHUNKS + ci)]
                        for i in range(SF_DIMS):
                            acc[h, i] = acc[h, i] * rescale
                    for cb in range(0, CHUNK, SF_VKEYS):
                        for c in range(SF_VKEYS):
                            row = rows[uint64(c0 + cb + c)]
                            if SF_VEC4:   # zeros for row -1: 0 * NaN would poison acc
                                for i in range(0, SF_DIMS, 4):   # latent: THREADS divides DL here
                                    load_row_f32x4(kv_latent, k_rope, row, dim0 + i, True, row >= 0,
                                                   v_val[c], i)
                            else:
                                for i in range(SF_DIMS):
                                    value = float32(0.0)
                                    if row >= 0 and dim0 + i < DL:
                                        value = kv_latent[uint64(row * DL + dim0 + i)]
                                    v_val[c, i] = value
                        for c in range(SF_VKEYS):
                            for h in range(HEADS):
                                p_head[h] = probs[uint64((c0 + cb + c) * SF_PROW + h)]
                            for h in range(HEADS):
                                for i in range(SF_DIMS):
                                    acc[h, i] = cuda.fma(p_head[h], v_val[c, i], acc[h, i])

        # ---- segment partial -> workspace [seg, b, node, h, :], or (one segment) -> out, lse ----
        batch = past_lens.shape[0]
        ws_row = ((seg * batch + b) * tree_capacity + node) * num_heads + h0
        if one_segment(seg, seg_end, split):   # block-uniform; ws_row is out's row (segment 0)
            if sm_writer and sm_tile == 0 and sm_kg == 0:
                fin[sm_head] = m_run
                fin[HEADS + sm_head] = l_run
            cuda.syncthreads()  # every head's final (m, l) visible to the P·V threads
            for h in range(HEADS):
                m_fin = fin[h]
                l_fin = fin[HEADS + h]
                for i in range(SF_DIMS):
                    dim = dim0 + i
                    if dim < DL:
                        out[uint64((ws_row + h) * DL + dim)] = merged(acc[h, i], m_fin, l_fin)
            if tid < HEADS:
                lse[uint64(ws_row + tid)] = merged_lse(fin[tid], fin[HEADS + tid])
            return
        for h in range(HEADS):
            for i in range(SF_DIMS):
                dim = dim0 + i
                if dim < DL:
                    workspace[uint64((ws_row + h) * (DL + 2) + dim)] = acc[h, i]
        if sm_writer and sm_tile == 0 and sm_kg == 0:
            workspace[uint64((ws_row + sm_head) * (DL + 2) + DL)] = m_run
            workspace[uint64((ws_row + sm_head) * (DL + 2) + DL + 1)] = l_run

    return (attention_score_first if SCORE_FIRST else attention), merge


# ----------------------------------------------------------------------------------------------
# One-node launches (an AR step): the same bits in two wide launches
# ----------------------------------------------------------------------------------------------

# One-node plans (Tc = 1: an AR step) whose keys all lie in segment 0 run the attention as two
# launches with the same bits (get_decode_kernels; VerifyPlan.decode_split): the score-first
# tile's blocks each read every key row for their heads (32 blocks of 2 heads over 193 keys in
# small's AR step: 29.1 us a launch, run merges timed), where scores over key blocks and P·V over
# dim slices spread the same reads over hundreds of blocks. False: the one-launch kernels.
# H100 (run "row products", bench.verify_attention's inputs, graph replays, us a call, 64 heads):
# 1 request over 160 cached rows 16.8 / 17.3 against 29.2 / 29.1, over 1000 rows 59.2 against
# 133.1; 4 requests over 160 rows 35.9 against 29.3 (the one launch's 128 blocks already fill the
# GPU): so at most DECODE_SPLIT_MAX_BATCH requests.
DECODE_SPLIT = True
DECODE_SPLIT_MAX_BATCH = 1
DECODE_SCORE_THREADS = 256   # score kernel: (heads x keys) pairs x k-groups a block
DECODE_SCORE_HEADS = 16      # heads of a score block (its keys: the threads left)
# A score lane's dim runs (VEC floats each of q and of k) loaded before their fmas: layout, not
# numerics (the fma chain runs the same dims in the same order). small's AR step: 288 dims a lane
# (576 / 2 k-groups) in 288 / (4 x batch) rounds of L1 / L2 loads (Nsight Compute, H100, f865d0e:
# the score launch 14.5 us at 8 runs, 9 rounds, for 0.3 MB of q and keys). Read at
# get_decode_kernels' call (bench.forward_ab's ``auto-dsbN`` / ``auto-dst128*`` set it and the
# block size). 16: H100, run "expert rows" call 4 (5f780c1, one process, two passes, us an AR
# forward): 8 runs 972.0 / 967.0, 16 runs 956.7 / 956.3 (172 registers, no spill), 24 runs 954.6 /
# 958.1 (246), 128-thread blocks 965.0 / 962.5, with 16 runs 967.4 / 968.2; the 33-row forward
# does not run it.
DECODE_SCORE_BATCH = 16
DECODE_PV_DIMS = 64          # latent dims of a P·V block (a thread a dim)
# DECODE_SCORE_HEADS and DECODE_PV_DIMS are read at get_decode_kernels' call too (layout;
# bench.forward_ab's ``auto-dshN`` / ``auto-pvdN``). H100, run "rope slice" call 5 (one process,
# two passes, us an AR forward): 16 heads / 64 dims 950.4 / 947.7; score blocks of 8 heads 947.0
# / 946.6, of 32 947.8 / 950.0; P·V blocks of 32 dims 946.3 / 949.1, of 128 948.1 / 951.7: within
# the noise, the defaults kept.
DECODE_PASS = 256            # keys of a P·V block's probabilities in shared memory at once
# A P·V thread's value chunks in flight (layout, not numerics; read at get_decode_kernels' call).
# 1: a chunk's CHUNK loads, then its fmas, then the next chunk's loads, and the softmax warp loads
# each chunk's scores before that chunk's butterflies. G > 1: the softmax warp loads the pass's
# scores first, and each P·V thread loads its first G chunks' values before the softmax barrier
# (the values do not depend on it) and refills a chunk's slot with chunk + G once its fmas are
# done: the same fmas in the same order, fewer round trips in a row. Why: in a replayed AR forward
# this launch cost 7.87 us for ~0.4 MB (PERFORMANCE.md, run "floor": at 193 keys 7 dependent rounds
# of score loads, then 7 of value loads). 2: H100, run "floor" call 10 (one process, three passes, us
# an AR forward): 942.7 / 940.1 / 942.1 against 952.5 / 948.5 / 947.3 at 1 (same bits; the compile
# check's sm_90 build: 137 registers, no stack; sm_120: 56 registers and the ring in a 256-byte
# stack, no spill). At 4 LLVM leaves the slot loop rolled on sm_90 too (a 512-byte stack), so 2 it
# is; bench.forward_ab's ``auto-pva1`` times the layout before.
DECODE_PV_AHEAD = 2


def decode_geometry(config: TileConfig, num_heads: int, score_threads: int | None = None,
                    score_heads: int | None = None, pv_dims: int | None = None) -> tuple[int, int, int, int, int]:
    """(score heads, score keys, P·V heads, P·V dims, P·V threads) of the two decode launches: a
    score block holds SH heads x SK keys x k_groups threads (about ``score_threads``, default
    DECODE_SCORE_THREADS; SH divides ``score_heads``, default DECODE_SCORE_HEADS); a P·V block SPH
    heads (the softmax lanes of every head in whole warps: 32 // lanes heads a warp) x SPD dims
    (SPD divides ``pv_dims``, default DECODE_PV_DIMS)."""
    score_threads = DECODE_SCORE_THREADS if score_threads is None else score_threads
    score_heads = DECODE_SCORE_HEADS if score_heads is None else score_heads
    pv_dims = DECODE_PV_DIMS if pv_dims is None else pv_dims
    lanes = config.k_groups * (config.chunk // config.qk_keys)
    sh = math.gcd(num_heads, score_heads)
    sk = max(1, score_threads // (sh * config.k_groups))
    sph = math.gcd(num_heads, max(1, WARP // lanes))
    spd = math.gcd(config.latent_dim, pv_dims)
    threads = max(-(-sph * lanes // WARP) * WARP, -(-spd // WARP) * WARP)
    return sh, sk, sph, spd, threads


def get_decode_kernels(config: TileConfig, num_heads: int) -> tuple[Any, Any]:
    """(scores, values) kernels for one-node launches with ``config``'s numerics, bit for bit
    (:func:`_decode_kernels` at the current DECODE_SCORE_THREADS, _HEADS, _BATCH, DECODE_PV_DIMS,
    DECODE_PASS and DECODE_PV_AHEAD: layout, read at the call, so a changed setting builds its own
    kernels)."""
    return _decode_kernels(config, num_heads, DECODE_SCORE_THREADS, DECODE_SCORE_HEADS, DECODE_SCORE_BATCH,
                           DECODE_PV_DIMS, DECODE_PASS, DECODE_PV_AHEAD)


@functools.cache
def _decode_kernels(config: TileConfig, num_heads: int, score_threads: int, score_heads: int,
                    score_batch: int, pv_dims: int, pass_keys: int, pv_ahead: int = 1) -> tuple[Any, Any]:
    """(scores, values) kernels for one-node launches with ``config``'s numerics, bit for bit.

    The numerics (module docstring; :func:`get_kernels`): a score is lane kg's fma chain over the
    dims ``d`` with ``(d mod (KG * VEC)) // VEC == kg`` in ascending order (latent dims, then rope),
    from +0.0, the KG partials summed by the xor butterfly, then times ``scale``; chunks of CHUNK
    keys go through the online softmax on LANES = KG * CHUNK / RC lanes a head (lane kg + KG *
    tile reads keys tile + j * CHUNK / RC, j < RC, in j order; max and sum butterflies at xor
    KG << level); ``acc = acc * alpha`` then one fma a key in key order; one segment's output
    ``merged(acc, m, l)``, ``merged_lse(m, l)``. What differs is only who runs it:

    - scores: grid (key blocks, head groups, requests); a thread pair (KG lanes) per (head, key),
      q and k read straight from global memory (L1 / L2: one request's rows), the scaled score
      stored to the workspace (flat ``[bs, H, S]``);
    - values: grid (head groups, dim slices, requests); the block's first warps rerun the softmax
      of its heads from the stored scores (the same lanes and butterflies), a pass of ``pass_keys``
      keys' probabilities and rescales at a time in shared memory, then each thread one latent dim
      of every head of the block: a chunk's value loads in flight together, then its fmas
      (``pv_ahead`` > 1: the pass's scores loaded first, and ``pv_ahead`` chunks of values in
      flight, the first ones before the softmax barrier).

    Guards as :func:`get_kernels`': a padding node (tree_sizes[b] = 0) gets zeros, a bad request
    NaN (written by the values kernel)."""
    config.validate()
    DL = config.latent_dim
    DR = config.rope_dim
    DK = DL + DR
    CHUNK = config.chunk
    KG = config.k_groups
    RC = config.qk_keys
    VEC = math.gcd(config.k_slice // KG, 4)
    GROUP = KG * VEC                    # dims between a lane's runs of VEC
    KEY_TILES = CHUNK // RC
    LANES = KG * KEY_TILES
    KT_LEVELS = KEY_TILES.bit_length() - 1
    BUTTERFLY = KG.bit_length() - 1
    MAX_PATH = config.max_path
    SH, SK, SPH, SPD, PV_THREADS = decode_geometry(config, num_heads, score_threads, score_heads, pv_dims)
    S_THREADS = SH * SK * KG
    PASS = max(CHUNK, pass_keys // CHUNK * CHUNK)
    PASS_CHUNKS = PASS // CHUNK
    if not isinstance(pv_ahead, int) or isinstance(pv_ahead, bool):
        raise TypeError(f"pv_ahead must be an int, got {type(pv_ahead).__name__}")
    if pv_ahead < 1:
        raise ValueError(f"pv_ahead must be >= 1, got {pv_ahead!r}")
    AHEAD = min(pv_ahead, PASS_CHUNKS)  # value chunks in flight a P·V thread
    SCORES_FIRST = AHEAD > 1            # the softmax warp loads the pass's scores at once
    RING_N = AHEAD * CHUNK              # (array sizes: compile-time names, not expressions)
    PASS_SCORES_N = PASS_CHUNKS * RC
    SOFTMAX_THREADS = SPH * LANES
    F4 = VEC == 4                       # 16-byte q / k loads (run() checks the alignment)
    BATCH = score_batch                 # a lane's dim runs loaded before their fmas
    RUN_REGS = BATCH * VEC              # (array sizes: compile-time names, not expressions)
    PROBS_N = PASS * SPH
    ALPHAS_N = PASS_CHUNKS * SPH
    FIN_N = 2 * SPH
    chunk_softmax = make_chunk_softmax(RC, KT_LEVELS, KG)
    load_row_f32x4 = make_load_row_f32x4(DL, DR)

    @cuda.jit(device=True, inline="always")
    def node_keys(past_lens, tree_sizes, visibility, kv_rows, vis_words, b):
        """(past, size, n_keys): the node's key count past + its path (0: a padding node or a
        request the guards reject, as block_work)."""
        past = past_lens[b]
        size = tree_sizes[b]
        n_keys = 0
        if size > 0 and _request_ok(past, size, kv_rows, 1):
            path_len = _path_length(visibility, b * vis_words, vis_words, size)
            if path_len <= MAX_PATH:
                n_keys = past + path_len
        return past, size, n_keys

    @cuda.jit(device=True, inline="always")
    def load_run(latent, rope, row, d, regs, at):
        """regs[at : at + VEC] = dims d .. d + VEC - 1 of flat row ``row`` (latent, else rope)."""
        if F4:
            load_row_f32x4(latent, rope, row, d, d < DL, True, regs, at)
        else:
            for e in range(VEC):
                if d + e < DL:
                    regs[at + e] = latent[uint64(row * DL + d + e)]
                else:
                    regs[at + e] = rope[uint64(row * DR + d + e - DL)]

    @cuda.jit(**launch_bounds(S_THREADS))
    def decode_scores(q_latent, q_rope, kv_latent, k_rope, past_lens, tree_sizes, visibility,
                      num_heads, kv_rows, vis_words, scale, scores):
        """scores[(b * H + h) * S + key] = the (head, key) score of request b's node, keys below
        its count (blocks past it return at once; a block's dead pairs join the butterfly only)."""
        pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
        b = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        kg = tid % KG
        pair = tid // KG
        key = cuda.blockIdx.x * SK + pair // SH
        h = cuda.blockIdx.y * SH + pair % SH
        past, size, n_keys = node_keys(past_lens, tree_sizes, visibility, kv_rows, vis_words, b)
        if cuda.blockIdx.x * SK >= n_keys:          # block-uniform: no key of this block
            return
        live = key < n_keys                         # (dead pairs stay for the warp's butterfly)
        q_row = b * num_heads + h                   # flat row of (b, node 0, h)
        k_row = b * kv_rows + min(key, n_keys - 1)  # keys 0 .. past - 1, then the node's own row
        q_regs = cuda.local.array(RUN_REGS, float32)
        k_regs = cuda.local.array(RUN_REGS, float32)
        s = float32(0.0)
        for d0 in range(0, DK, BATCH * GROUP):      # BATCH runs in flight, then their fmas
            for r in range(BATCH):
                d = d0 + r * GROUP + kg * VEC
                if live and d < DK:
                    load_run(q_latent, q_rope, q_row, d, q_regs, r * VEC)
                    load_run(kv_latent, k_rope, k_row, d, k_regs, r * VEC)
            for r in range(BATCH):
                if live and d0 + r * GROUP + kg * VEC < DK:
                    for e in range(VEC):
                        s = cuda.fma(q_regs[r * VEC + e], k_regs[r * VEC + e], s)
        for level in range(BUTTERFLY):              # as sum_k_groups
            s += cuda.shfl_xor_sync(FULL_MASK, s, KG >> (level + 1))
        if live and kg == 0:
            scores[uint64((b * num_heads + h) * kv_rows + key)] = s * scale

    @cuda.jit(device=True, inline="always")
    def load_value_chunk(kv_latent, kv_base, first, n_keys, dim, v_val, at):
        """v_val[at : at + CHUNK] = latent dim ``dim`` of keys first .. first + CHUNK - 1, every load
        in flight together; zeros past the keys (0 * NaN would poison acc)."""
        for c in range(CHUNK):
            key = first + c
            value = float32(0.0)
            if key < n_keys:
                value = kv_latent[uint64((kv_base + key) * DL + dim)]
            v_val[at + c] = value

    @cuda.jit(**launch_bounds(PV_THREADS))
    def decode_values(kv_latent, past_lens, tree_sizes, visibility, num_heads, kv_rows, vis_words,
                      scores, out, lse, release_next):
        """out[b, 0, h, d] and lse[b, 0, h] of the block's SPH heads and SPD dims; release_next: 1
        where the next kernel reads weights before its PDL wait (an AR step's value absorb)."""
        probs = cuda.shared.array(PROBS_N, float32)       # [PASS, SPH] probabilities
        alpha = cuda.shared.array(ALPHAS_N, float32)      # [SPH, PASS_CHUNKS] rescales
        fin = cuda.shared.array(FIN_N, float32)           # [2, SPH] final m, then l
        pdl_begin_early(release_next)  # PDL: wait for the previous kernel; release the next one now?
        b = cuda.blockIdx.z
        h0 = cuda.blockIdx.x * SPH
        dim = cuda.blockIdx.y * SPD + cuda.threadIdx.x             # this thread's latent dim
        tid = cuda.threadIdx.x
        past, size, n_keys = node_keys(past_lens, tree_sizes, visibility, kv_rows, vis_words, b)
        out_row = b * num_heads + h0                               # flat row of (b, node 0, h0)
        if n_keys == 0:   # block-uniform: the fill (zeros for a padding node, NaN for a bad one)
            fill = float32(0.0) if size <= 0 else float32(math.nan)   # as write_fill: node 0 >= size
            if tid < SPD:
                for h in range(SPH):
                    out[uint64((out_row + h) * DL + dim)] = fill
            if cuda.blockIdx.y == 0 and tid < SPH:
                lse[uint64(out_row + tid)] = fill
            return
        sm_head = min(tid // LANES, SPH - 1)
        sm_writer = tid < SOFTMAX_THREADS
        sm_kg = tid % KG
        sm_tile = (tid // KG) % KEY_TILES
        s_base = (b * num_heads + h0 + sm_head) * kv_rows          # this lane's head's scores
        p_key = cuda.local.array(RC, float32)
        acc = cuda.local.array(SPH, float32)
        v_val = cuda.local.array(RING_N, float32)         # AHEAD chunks of values, a slot each
        pass_scores = cuda.local.array(PASS_SCORES_N, float32)  # SCORES_FIRST: the pass's scores
        for h in range(SPH):
            acc[h] = float32(0.0)
        m_run = float32(NEG_INF)
        l_run = float32(0.0)
        kv_base = b * kv_rows
        for pass_start in range(0, n_keys, PASS):
            cuda.syncthreads()  # the previous pass's readers of probs[] and alpha[] are done
            if SCORES_FIRST and tid < SPD:   # compile-time; the first chunks' values, before the softmax
                for g in range(AHEAD):
                    load_value_chunk(kv_latent, kv_base, pass_start + g * CHUNK, n_keys, dim, v_val, g * CHUNK)
            if tid < WARP * (-(-SOFTMAX_THREADS // WARP)):   # whole warps: the butterflies
                if SCORES_FIRST:   # compile-time: every score of the pass in flight at once
                    for ci in range(PASS_CHUNKS):
                        for j in range(RC):
                            key = pass_start + ci * CHUNK + sm_tile + j * KEY_TILES
                            score = float32(NEG_INF)
                            if key < n_keys:
                                score = scores[uint64(s_base + key)]
                            pass_scores[ci * RC + j] = score
                for ci in range(PASS_CHUNKS):
                    c0 = pass_start + ci * CHUNK
                    if c0 < n_keys:
                        c_max = float32(NEG_INF)
                        for j in range(RC):
                            key = c0 + sm_tile + j * KEY_TILES
                            score = float32(NEG_INF)
                            if SCORES_FIRST:
                                score = pass_scores[ci * RC + j]
                            elif key < n_keys:
                                score = scores[uint64(s_base + key)]
                            p_key[j] = score
                            c_max = max(c_max, score)
                        m_run, l_run, rescale = chunk_softmax(p_key, c_max, m_run, l_run)
                        if sm_writer:
                            if sm_tile == 0 and sm_kg == 0:
                                alpha[uint64(sm_head * PASS_CHUNKS + ci)] = rescale
                            for j in range(RC):
                                if j % KG == sm_kg:
                                    probs[uint64((ci * CHUNK + sm_tile + j * KEY_TILES) * SPH + sm_head)] = p_key[j]
            cuda.syncthreads()  # the pass's probabilities and rescales are in shared memory
            if tid < SPD:
                for c_first in range(0, PASS_CHUNKS, AHEAD):
                    for g in range(AHEAD):   # slot g holds chunk c_first + g (constant slots: registers)
                        ci = c_first + g
                        c0 = pass_start + ci * CHUNK
                        if ci < PASS_CHUNKS and c0 < n_keys:
                            if not SCORES_FIRST:
                                load_value_chunk(kv_latent, kv_base, c0, n_keys, dim, v_val, 0)
                            for h in range(SPH):
                                acc[h] = acc[h] * alpha[uint64(h * PASS_CHUNKS + ci)]
                            for c in range(CHUNK):
                                for h in range(SPH):
                                    acc[h] = cuda.fma(probs[uint64((ci * CHUNK + c) * SPH + h)], v_val[g * CHUNK + c],
                                                      acc[h])
                            if SCORES_FIRST and ci + AHEAD < PASS_CHUNKS:   # the slot's next chunk: ci + AHEAD
                                load_value_chunk(kv_latent, kv_base, c0 + AHEAD * CHUNK, n_keys, dim, v_val,
                                                 g * CHUNK)
        if sm_writer and sm_tile == 0 and sm_kg == 0:
            fin[sm_head] = m_run
            fin[SPH + sm_head] = l_run
        cuda.syncthreads()  # every head's final (m, l) visible to the P·V threads
        if tid < SPD:
            for h in range(SPH):
                out[uint64((out_row + h) * DL + dim)] = _merged(acc[h], fin[h], fin[SPH + h])
        if cuda.blockIdx.y == 0 and tid < SPH:
            lse[uint64(out_row + tid)] = _merged_lse(fin[tid], fin[SPH + tid])

    return decode_scores, decode_values


# Small trees (2 .. TREE_SPLIT_MAX_NODES nodes, few requests): the same bits in two launches
# ----------------------------------------------------------------------------------------------

# Tree plans whose keys all lie in segment 0 may run the attention as two launches with the same
# bits (get_tree_kernels; VerifyPlan.tree_split): the score-first tile's blocks each stage every
# key row of their node for their 8 heads (a B 32 tree over 192 cached rows: 264 blocks, 2 an SM at
# 224 registers, 54 us a launch on an H100, Nsight Compute at f865d0e), where a request's nodes
# share every prefix key and MLA's heads share every latent row. Scores: one GEMM of the request's
# (node, head) query rows against every cache row it may see (the nodes' own rows included, a few
# scores no node reads), each score the one-launch kernel's fma chain. P·V: a block per node and
# head group that reruns the softmax over the node's key sequence (prefix, then its path) from the
# stored scores and stages each latent row once for all its heads. False, the one launch: on an H100
# the first layout cost +46 us a 33-row forward (PERFORMANCE.md run tree split), the second
# (87b71e3) at parity in a forward (run tree staging; alone, values 36.7 + scores 31.1 us against the one
# launch's 65.0); the third (b2f3754: fixed staging lanes, loads a pass ahead) alone 64.4 / 64.5 us
# against 62.2 / 62.4 (run occ2). The A/B: bench.forward_ab's auto-tree /
# auto-treeone in a forward, bench.verify_attention --tree-split on / off alone.
TREE_SPLIT = False
TREE_SPLIT_MAX_BATCH = 1     # requests (the one launch's blocks fill the GPU sooner with more)
TREE_SPLIT_MAX_NODES = 64    # tree rows a request (the scores' workspace grows with Tc x S)
TREE_SCORE_TILE = 4          # a score thread's register tile: 4 query rows x 4 keys a k-group lane
TREE_SCORE_ROWS = 64         # query rows (node, head) of a score block
TREE_SCORE_KEYS = 32         # cache rows of a score block
TREE_SCORE_MIN_BLOCKS = 2    # blocks an SM both launch bounds ask for, up to 512 threads an SM (sm_90 without: 158
                             # and 164 registers, 1 block an SM)
TREE_PV_HEADS = 32           # heads of a P·V block (each latent row staged once for all of them)
TREE_PV_DIMS = 128           # latent dims of a P·V block (each block reruns its heads' softmax)
TREE_PASS = 32               # key positions of a P·V block's probabilities and value rows at once


def tree_geometry(config: TileConfig, num_heads: int) -> tuple[int, int, int, int, int]:
    """(score rows, score keys, score threads, P·V heads, P·V dims) of the two tree launches at the
    current TREE_SCORE_ROWS, _KEYS, TREE_PV_HEADS and _DIMS (layout, read at the call): a score
    block holds TQ query rows x TK keys in TREE_SCORE_TILE-square thread tiles, k_groups lanes
    each; a P·V block TH heads (dividing ``num_heads``) x SPD latent dims of one node."""
    r = TREE_SCORE_TILE
    tq = max(r, TREE_SCORE_ROWS // r * r)
    tk = max(r, TREE_SCORE_KEYS // r * r)
    th = math.gcd(num_heads, TREE_PV_HEADS)
    spd = math.gcd(config.latent_dim, TREE_PV_DIMS)
    return tq, tk, (tq // r) * (tk // r) * config.k_groups, th, spd


def get_tree_kernels(config: TileConfig, num_heads: int) -> tuple[Any, Any, int]:
    """(scores, values, values threads) kernels for small trees with ``config``'s numerics, bit for
    bit (:func:`_tree_kernels` at the current tree geometry, TREE_SCORE_TILE, TREE_PASS and
    TREE_SCORE_MIN_BLOCKS: layout, read at the call, so a changed setting builds its own kernels)."""
    tq, tk, _, th, spd = tree_geometry(config, num_heads)
    return _tree_kernels(config, tq, tk, th, spd, max(config.chunk, TREE_PASS // config.chunk * config.chunk),
                         TREE_SCORE_MIN_BLOCKS, TREE_SCORE_TILE)


@functools.cache
def _tree_kernels(config: TileConfig, score_rows: int, score_keys: int, pv_heads: int, pv_dims: int,
                  pass_keys: int, score_min_blocks: int, score_tile: int) -> tuple[Any, Any, int]:
    """(scores, values, values threads) for trees with ``config``'s numerics, bit for bit.

    The numerics are the one-node launches' (:func:`_decode_kernels`: a score is lane kg's fma chain
    over its dims from +0.0, the k-groups' xor butterfly, times ``scale``; the chunk softmax on the
    same lanes and butterflies; ``acc * alpha`` then one fma a key in key order; one segment's
    ``merged``), over each node's key sequence of the one-launch kernels (positions ``0 .. past -
    1`` the cached rows, then the node's path in node order). What differs is only who runs it:

    - scores: grid (query-row tiles, key tiles, requests); a request's query rows (node, head) and
      every cache row below ``past + size`` staged a dim slice at a time in shared memory, a
      TREE_SCORE_TILE-square register tile a thread of one k-group, summed over the k-groups by
      the butterfly; the scaled score stored to the workspace (flat ``[bs, Tc, H, S]``, by cache
      row, not position: every node's scores of every tree row, read only for its path);
    - values: grid (node x head groups, dim slices, requests); the block's node's path in shared
      memory, keys in passes of TREE_PASS positions; every thread one softmax lane of ``LANES`` a
      head for the block's heads (in rounds of the block's threads), the pass's probabilities and
      rescales and its value rows' dim slice staged in shared memory; then each thread a square
      of heads x adjacent dims. A pass's scores and value rows are loaded into registers a pass
      ahead (the next pass's loads in flight during this pass's P·V, two barriers a pass).

    Guards as :func:`get_kernels`': a padding node (node >= tree_sizes[b]) gets zeros, a node of a
    request the guards reject or with a path past ``max_path`` NaN (the values kernel writes them;
    the scores kernel skips a rejected request)."""
    config.validate()
    KS = config.k_slice
    KG = config.k_groups
    DL = config.latent_dim
    DR = config.rope_dim
    DK = DL + DR
    CHUNK = config.chunk
    RC = config.qk_keys
    VEC = math.gcd(KS // KG, 4)         # dims a lane takes at once (the numerics' runs)
    KSP = KS + 4 * KG                   # padded staged row (as TileConfig.k_row)
    N_KSLICES = DK // KS
    KEY_TILES = CHUNK // RC
    LANES = KG * KEY_TILES              # softmax lanes of a head
    KT_LEVELS = KEY_TILES.bit_length() - 1
    MAX_PATH = config.max_path
    R = score_tile
    TQ = score_rows
    TK = score_keys
    Q_TILES = TQ // R
    K_TILES = TK // R
    S_THREADS = Q_TILES * K_TILES * KG
    LANE = 4 if KS % 4 == 0 else 1      # floats a staging move (16-byte loads: run() checks alignment)
    ROW_MOVES = KS // LANE
    # staging: a staged row's moves on TPR adjacent lanes, ROW_STEP rows at once, so a thread's row
    # and dim are fixed for the launch (its moves' addresses are the slice's d0 plus constants)
    TPR = min(S_THREADS, ROW_MOVES)     # lanes a staged row
    ROW_STEP = S_THREADS // TPR         # rows staged at once
    COL_PASSES = -(-ROW_MOVES // TPR)   # a lane's moves a row, COL_STEP floats apart
    COL_STEP = TPR * LANE
    COLS_EXACT = ROW_MOVES % TPR == 0   # compile-time: no dim guard
    ALL_LANES = S_THREADS % TPR == 0    # compile-time: every thread stages (else the last few idle)
    Q_PASSES = -(-TQ // ROW_STEP)
    K_PASSES = -(-TK // ROW_STEP)
    STAGE_REGS = (Q_PASSES + K_PASSES) * COL_PASSES * LANE
    S_BUF = (TQ + TK) * KSP
    TH = pv_heads
    SPD = pv_dims
    RH = math.gcd(TH, 4)                # a P·V thread's heads
    RD = math.gcd(SPD, 4)               # ... and adjacent dims
    D_TILES = SPD // RD
    PV_TILES = (TH // RH) * D_TILES
    SM_LANES = TH * LANES
    V_THREADS = max(-(-PV_TILES // WARP) * WARP, WARP)
    SM_ROUNDS = -(-SM_LANES // V_THREADS)   # whole warps a round: the butterflies need every lane
    PASS = pass_keys
    PASS_CHUNKS = PASS // CHUNK
    V_LANE = 4 if SPD % 4 == 0 else 1
    V_MOVES = PASS * SPD // V_LANE
    V_STAGE_N = -(-V_MOVES // V_THREADS)
    V_REGS = V_STAGE_N * V_LANE
    PROBS_N = PASS * TH
    VALS_N = PASS * SPD
    ALPHAS_N = TH * PASS_CHUNKS
    FIN_N = 2 * TH
    V_SHARED = 4 * (PROBS_N + VALS_N + ALPHAS_N + FIN_N + MAX_PATH)
    checks = [(TQ % R == 0 and TK % R == 0, "score rows and keys must be multiples of TREE_SCORE_TILE"),
              (PASS % CHUNK == 0, "a pass must be whole chunks"),
              (S_THREADS <= 1024 and V_THREADS <= 1024, "at most 1024 threads a block"),
              (S_THREADS % WARP == 0 or simulator_active(), "score blocks of whole warps (the k-group butterfly)"),
              (4 * S_BUF <= STATIC_SHARED_LIMIT and V_SHARED <= STATIC_SHARED_LIMIT,
               f"static shared memory <= {STATIC_SHARED_LIMIT} bytes (scores {4 * S_BUF}, values {V_SHARED})")]
    for ok, why in checks:
        if not ok:
            raise ValueError(f"tree geometry: {why} (rows {TQ}, keys {TK}, heads {TH}, dims {SPD}, pass {PASS})")
    chunk_softmax = make_chunk_softmax(RC, KT_LEVELS, KG)
    load_row_f32x4 = make_load_row_f32x4(DL, DR)
    score_slice = make_score_slice(R, R, KS, KG, VEC, KSP)
    sum_k_groups = make_sum_k_groups(R, R, KG)

    load_lane = make_load_lane(DL, DR, LANE)

    def part_io(n_rows: int, row0: int, reg0: int) -> tuple[Any, Any]:
        """(load, store) of one staged part: ``n_rows`` rows (the TQ query rows or the TK key rows)
        at staged row ``row0`` and stage register ``reg0`` (compile-time constants)."""
        PASSES = -(-n_rows // ROW_STEP)
        EXACT = n_rows % ROW_STEP == 0     # compile-time: no row guard

        @cuda.jit(device=True, inline="always")
        def load_part(latent, rope, base, live, d0, s_row, s_col, s_on, stage):
            """Global -> registers: rows s_row + rp * ROW_STEP, dims d0 + s_col + cp * COL_STEP of
            flat rows base + r; rows past ``live`` zeros."""
            for rp in range(PASSES):
                r = s_row + rp * ROW_STEP
                for cp in range(COL_PASSES):
                    c = s_col + cp * COL_STEP
                    ok = s_on and (EXACT or r < n_rows) and (COLS_EXACT or c < KS)
                    load_lane(latent, rope, base + r, d0 + c, d0 + c < DL, ok and r < live, stage,
                              reg0 + (rp * COL_PASSES + cp) * LANE)

        @cuda.jit(device=True, inline="always")
        def store_part(bufs, s_row, s_col, s_on, stage):
            """Registers -> shared memory: part row r at bufs[(row0 + r) * KSP:]."""
            if s_on:
                for rp in range(PASSES):
                    r = s_row + rp * ROW_STEP
                    if EXACT or r < n_rows:
                        for cp in range(COL_PASSES):
                            c = s_col + cp * COL_STEP
                            if COLS_EXACT or c < KS:
                                off = uint64((row0 + r) * KSP + c)
                                for e in range(LANE):
                                    bufs[off + uint64(e)] = stage[reg0 + (rp * COL_PASSES + cp) * LANE + e]
        return load_part, store_part

    load_q, store_q = part_io(TQ, 0, 0)
    load_k, store_k = part_io(TK, TQ, Q_PASSES * COL_PASSES * LANE)

    @cuda.jit(device=True, inline="always")
    def load_slice(q_latent, q_rope, kv_latent, k_rope, q_base, k_base, q_live, k_live, d0, s_row, s_col, s_on,
                   stage):
        """Global -> registers: this thread's moves of the dim slice at d0 (the TQ query rows, then
        the TK key rows); rows past q_live / k_live zeros."""
        load_q(q_latent, q_rope, q_base, q_live, d0, s_row, s_col, s_on, stage)
        load_k(kv_latent, k_rope, k_base, k_live, d0, s_row, s_col, s_on, stage)

    @cuda.jit(device=True, inline="always")
    def store_slice(bufs, s_row, s_col, s_on, stage):
        """Registers -> shared memory: staged row r at bufs[r * KSP:] (query rows, then key rows)."""
        store_q(bufs, s_row, s_col, s_on, stage)
        store_k(bufs, s_row, s_col, s_on, stage)

    @cuda.jit(**launch_bounds(S_THREADS, min(score_min_blocks, 512 // S_THREADS) or None))
    def tree_scores(q_latent, q_rope, kv_latent, k_rope, past_lens, tree_sizes, tree_capacity, num_heads,
                    kv_rows, scale, scores):
        """scores[((b * Tc + node) * H + h) * S + row] = the (node, head) query's score of cache row
        ``row`` for every live node and row < past + size (blocks past them return at once)."""
        bufs = cuda.shared.array(S_BUF, float32)   # [TQ, KSP] query rows | [TK, KSP] key rows: a dim slice
        pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
        tid = cuda.threadIdx.x
        b = cuda.blockIdx.z
        past = past_lens[b]
        size = tree_sizes[b]
        q0 = cuda.blockIdx.x * TQ
        k0 = cuda.blockIdx.y * TK
        if not _request_ok(past, size, kv_rows, tree_capacity):   # block-uniform: the values kernel's NaN
            return
        q_live = size * num_heads - q0     # live query rows (node < size) of the block
        k_live = past + size - k0          # cache rows the request's nodes may see
        if q_live <= 0 or k_live <= 0:
            return
        q_base = b * tree_capacity * num_heads + q0    # flat query row of the block's first
        k_base = b * kv_rows + k0                      # flat cache row of its first key
        kg = tid % KG
        key_tile = (tid // KG) % K_TILES
        row_tile = tid // (KG * K_TILES)
        q_off = row_tile * R * KSP + kg * VEC          # keys key_tile + j * K_TILES: conflict-free LDS.128
        k_off = TQ * KSP + key_tile * KSP + kg * VEC
        s_row = tid // TPR                # this thread's staged rows and dims
        s_col = (tid % TPR) * LANE
        s_on = ALL_LANES or s_row < ROW_STEP
        stage = cuda.local.array(STAGE_REGS, float32)
        s = cuda.local.array((R, R), float32)
        q_vec = cuda.local.array((R, VEC), float32)
        k_vec = cuda.local.array((R, VEC), float32)
        for i in range(R):
            for j in range(R):
                s[i, j] = float32(0.0)
        load_slice(q_latent, q_rope, kv_latent, k_rope, q_base, k_base, q_live, k_live, 0, s_row, s_col, s_on,
                   stage)
        for ks in range(N_KSLICES):
            cuda.syncthreads()  # readers of the previous slice are done
            store_slice(bufs, s_row, s_col, s_on, stage)
            cuda.syncthreads()  # slice ks staged
            if ks + 1 < N_KSLICES:   # the next slice's loads in flight during these fmas
                load_slice(q_latent, q_rope, kv_latent, k_rope, q_base, k_base, q_live, k_live, (ks + 1) * KS,
                           s_row, s_col, s_on, stage)
            score_slice(bufs, q_off, k_off, K_TILES * KSP, q_vec, k_vec, s)   # the one-launch kernels' chain
        sum_k_groups(s)
        for i in range(R):
            r = row_tile * R + i
            for j in range(R):
                c = key_tile + j * K_TILES
                if j % KG == kg and r < q_live and c < k_live:
                    scores[uint64((q_base + r) * kv_rows + k0 + c)] = s[i, j] * scale

    fill_path = make_fill_path(V_THREADS)

    @cuda.jit(device=True, inline="always")
    def key_row(pos, past, n_keys, path):
        """The cache row of key position ``pos`` of a node's sequence (the cached rows, then its
        path in node order); -1 past its keys."""
        row = -1
        if pos < n_keys:
            row = _kv_row(pos, past, path)
        return row

    @cuda.jit(device=True, inline="always")
    def load_pass(kv_latent, scores, kv_base, out_row, kv_rows, past, n_keys, path, d0, pass_start, tid, sm_tile,
                  v_regs, pass_scores):
        """Global -> registers: the pass's value rows' dim slice (zeros past the keys: 0 * NaN would
        poison acc) and every score of the pass's softmax rounds (-inf past the keys), all in flight
        at once."""
        for n in range(V_STAGE_N):
            e = tid + n * V_THREADS
            row = -1
            if e < V_MOVES:
                row = key_row(pass_start + e // (SPD // V_LANE), past, n_keys, path)
            if V_LANE == 4:
                load_row_f32x4(kv_latent, kv_latent, kv_base + row, d0 + (e % (SPD // 4)) * 4, True, row >= 0,
                               v_regs, n * V_LANE)
            else:
                value = float32(0.0)
                if row >= 0:
                    value = kv_latent[uint64((kv_base + row) * DL + d0 + e % SPD)]
                v_regs[n * V_LANE] = value
        for r in range(SM_ROUNDS):
            head = min((tid + r * V_THREADS) // LANES, TH - 1)   # lanes past the heads shadow the last
            s_base = (out_row + head) * kv_rows                   # this lane's head's scores, by cache row
            for ci in range(PASS_CHUNKS):
                for j in range(RC):
                    row = key_row(pass_start + ci * CHUNK + sm_tile + j * KEY_TILES, past, n_keys, path)
                    score = float32(NEG_INF)
                    if row >= 0:
                        score = scores[uint64(s_base + row)]
                    pass_scores[r, ci, j] = score

    @cuda.jit(**launch_bounds(V_THREADS, min(score_min_blocks, 512 // V_THREADS) or None))
    def tree_values(kv_latent, past_lens, tree_sizes, visibility, tree_capacity, num_heads, kv_rows,
                    vis_words, scores, out, lse, release_next):
        """out[b, node, h, d] and lse[b, node, h] of the block's node, TH heads and SPD dims;
        release_next: 1 where the next kernel reads weights before its PDL wait."""
        probs = cuda.shared.array(PROBS_N, float32)    # [PASS, TH] probabilities, key-major
        vals = cuda.shared.array(VALS_N, float32)      # [PASS, SPD] the pass's value rows' dim slice
        alpha = cuda.shared.array(ALPHAS_N, float32)   # [TH, PASS_CHUNKS] rescales
        fin = cuda.shared.array(FIN_N, float32)        # [2, TH] final m, then l
        path = cuda.shared.array(MAX_PATH, int32)      # tree node at position past + k
        pdl_begin_early(release_next)  # PDL: wait for the previous kernel; release the next one now?
        tid = cuda.threadIdx.x
        b = cuda.blockIdx.z
        head_groups = num_heads // TH
        node = cuda.blockIdx.x // head_groups
        h0 = (cuda.blockIdx.x % head_groups) * TH
        d0 = cuda.blockIdx.y * SPD
        past = past_lens[b]
        size = tree_sizes[b]
        vis_base = (b * tree_capacity + node) * vis_words
        n_keys = 0
        if node < size and _request_ok(past, size, kv_rows, tree_capacity):
            path_len = _path_length(visibility, vis_base, vis_words, size)
            if path_len <= MAX_PATH:
                n_keys = past + path_len
        out_row = (b * tree_capacity + node) * num_heads + h0   # flat row of (b, node, h0)
        if n_keys == 0:   # block-uniform: the fill (zeros for a padding node, NaN for a bad one)
            fill = float32(0.0) if node >= size else float32(math.nan)   # as write_fill
            for e in range(tid, TH * SPD, V_THREADS):
                out[uint64((out_row + e // SPD) * DL + d0 + e % SPD)] = fill
            if cuda.blockIdx.y == 0:
                for h in range(tid, TH, V_THREADS):
                    lse[uint64(out_row + h)] = fill
            return
        fill_path(visibility, vis_base, size, path, tid)
        # P·V: heads ph .. ph + RH - 1 and dims pd .. pd + RD - 1 of the slice (threads past the tiles idle)
        pv_live = tid < PV_TILES
        ph = min(tid // D_TILES, TH // RH - 1) * RH
        pd = (tid % D_TILES) * RD
        # softmax: lane tid + r * V_THREADS of round r is head (lane // LANES)'s lane (k-group fastest)
        sm_kg = tid % KG
        sm_tile = (tid // KG) % KEY_TILES
        acc = cuda.local.array((RH, RD), float32)
        p_vec = cuda.local.array(RH, float32)
        v_vec = cuda.local.array(RD, float32)
        v_regs = cuda.local.array(V_REGS, float32)
        pass_scores = cuda.local.array((SM_ROUNDS, PASS_CHUNKS, RC), float32)
        p_key = cuda.local.array(RC, float32)
        m_run = cuda.local.array(SM_ROUNDS, float32)
        l_run = cuda.local.array(SM_ROUNDS, float32)
        for i in range(RH):
            for j in range(RD):
                acc[i, j] = float32(0.0)
        for r in range(SM_ROUNDS):
            m_run[r] = float32(NEG_INF)
            l_run[r] = float32(0.0)
        kv_base = b * kv_rows
        cuda.syncthreads()  # path[] complete
        load_pass(kv_latent, scores, kv_base, out_row, kv_rows, past, n_keys, path, d0, 0, tid, sm_tile, v_regs,
                  pass_scores)
        for pass_start in range(0, n_keys, PASS):
            # v_regs / pass_scores hold this pass's value rows and scores (loaded a pass ahead)
            for r in range(SM_ROUNDS):
                lane = tid + r * V_THREADS
                head = min(lane // LANES, TH - 1)
                for ci in range(PASS_CHUNKS):
                    c0 = ci * CHUNK
                    if pass_start + c0 < n_keys:         # block-uniform
                        c_max = float32(NEG_INF)
                        for j in range(RC):
                            p_key[j] = pass_scores[r, ci, j]
                            c_max = max(c_max, p_key[j])
                        m_new, l_new, rescale = chunk_softmax(p_key, c_max, m_run[r], l_run[r])
                        m_run[r] = m_new
                        l_run[r] = l_new
                        if lane < SM_LANES:
                            if sm_tile == 0 and sm_kg == 0:
                                alpha[uint64(head * PASS_CHUNKS + ci)] = rescale
                            for j in range(RC):
                                if j % KG == sm_kg:
                                    probs[uint64((c0 + sm_tile + j * KEY_TILES) * TH + head)] = p_key[j]
            for n in range(V_STAGE_N):
                e = tid + n * V_THREADS
                if e < V_MOVES:
                    at = uint64(e * V_LANE)   # [PASS, SPD] row-major: move e holds floats e * V_LANE ..
                    for q in range(V_LANE):
                        vals[at + uint64(q)] = v_regs[n * V_LANE + q]
            if pass_start + PASS < n_keys:   # the next pass's loads in flight during this P·V
                load_pass(kv_latent, scores, kv_base, out_row, kv_rows, past, n_keys, path, d0, pass_start + PASS,
                          tid, sm_tile, v_regs, pass_scores)
            cuda.syncthreads()  # the pass's probabilities, rescales and value rows are in shared memory
            if pv_live:
                for ci in range(PASS_CHUNKS):
                    c0 = ci * CHUNK
                    if pass_start + c0 < n_keys:
                        for i in range(RH):
                            rescale = alpha[uint64((ph + i) * PASS_CHUNKS + ci)]
                            for j in range(RD):
                                acc[i, j] = acc[i, j] * rescale
                        for c in range(c0, c0 + CHUNK):
                            for i in range(RH):
                                p_vec[i] = probs[uint64(c * TH + ph + i)]
                            for j in range(RD):
                                v_vec[j] = vals[uint64(c * SPD + pd + j)]
                            for i in range(RH):
                                for j in range(RD):
                                    acc[i, j] = cuda.fma(p_vec[i], v_vec[j], acc[i, j])
            cuda.syncthreads()  # this pass's readers of probs[], alpha[] and vals[] are done
        for r in range(SM_ROUNDS):
            lane = tid + r * V_THREADS
            if lane < SM_LANES and sm_tile == 0 and sm_kg == 0:
                fin[lane // LANES] = m_run[r]
                fin[TH + lane // LANES] = l_run[r]
        cuda.syncthreads()  # every head's final (m, l) visible to the P·V threads
        if pv_live:
            for i in range(RH):
                for j in range(RD):
                    out[uint64((out_row + ph + i) * DL + d0 + pd + j)] = _merged(acc[i, j], fin[ph + i],
                                                                             fin[TH + ph + i])
        if cuda.blockIdx.y == 0:
            for h in range(tid, TH, V_THREADS):
                lse[uint64(out_row + h)] = _merged_lse(fin[h], fin[TH + h])

    return tree_scores, tree_values, V_THREADS

# ----------------------------------------------------------------------------------------------
# Host side: plan once per batch shape, run per step
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class VerifyPlan:
    """Work layout for one batch shape (FlashInfer-style ``plan``; no tree data in it).

    Attributes:
        config: the kernel specialisation.
        batch_size, tree_capacity, num_heads, kv_capacity: bs, Tc, H, S of the arrays.
        split_size: keys per segment (part of the numerics, see module docstring).
        num_splits: segments covered, ``ceil(max_kv_len / split_size)``.
    """

    config: TileConfig
    batch_size: int
    tree_capacity: int
    num_heads: int
    kv_capacity: int
    split_size: int
    num_splits: int

    @property
    def decode_split(self) -> bool:
        """:func:`run` launches the one-node kernels (:func:`get_decode_kernels`, DECODE_SPLIT):
        one node a request (an AR step), at most DECODE_SPLIT_MAX_BATCH requests, and every key in
        segment 0 (:attr:`merge_free`)."""
        return (DECODE_SPLIT and self.tree_capacity == 1 and self.batch_size <= DECODE_SPLIT_MAX_BATCH
                and self.merge_free)

    @property
    def tree_split(self) -> bool:
        """:func:`run` launches the small-tree kernels (:func:`get_tree_kernels`, TREE_SPLIT): a tree
        capacity of 2 .. TREE_SPLIT_MAX_NODES rows, at most TREE_SPLIT_MAX_BATCH requests, and every
        key in segment 0 (:attr:`merge_free`)."""
        return (TREE_SPLIT and 1 < self.tree_capacity <= TREE_SPLIT_MAX_NODES
                and self.batch_size <= TREE_SPLIT_MAX_BATCH and self.merge_free)

    @property
    def workspace_shape(self) -> tuple[int, int, int, int, int]:
        """``[num_splits, bs, Tc, H, Dl + 2]`` float32: segment acc, then m and l; with
        :attr:`decode_split` or :attr:`tree_split` at least ``ceil(S / (Dl + 2))`` along the first
        axis, the room of the scores (flat ``[bs, Tc, H, S]``)."""
        first = self.num_splits
        if self.decode_split or self.tree_split:
            first = max(first, -(-self.kv_capacity // (self.config.latent_dim + 2)))
        return (first, self.batch_size, self.tree_capacity, self.num_heads, self.config.latent_dim + 2)

    @property
    def attention_grid(self) -> tuple[int, int, int]:
        return (self.tree_capacity * (self.num_heads // self.config.heads), self.num_splits,
                self.batch_size)

    @property
    def merge_free(self) -> bool:
        """:func:`run` launches no merge: every key of every request lies in segment 0
        (``kv_capacity < split_size``; the kernels' guards hold ``past + size <= kv_capacity``),
        so the attention blocks write every output (MERGE_FREE_SHORT_CACHES)."""
        return MERGE_FREE_SHORT_CACHES and self.kv_capacity < self.split_size

    @property
    def merge_grid(self) -> tuple[int, int]:
        return (self.tree_capacity * (self.num_heads // self.config.merge_heads), self.batch_size)

    def launches(self, aligned: bool = True) -> str:
        """What :func:`run` launches under the module's current settings: the small-tree pair
        (``"tree-split"``), the one-node pair (``"decode-split"``), the tile's one launch (``"one"``),
        or that launch and the segment merge (``"one+merge"``). ``aligned``: q and kv arrays on
        16-byte boundaries (both pairs stage with 16-byte loads; the one-node pair needs them only
        where its lanes' slices are whole quads)."""
        if self.tree_split and aligned:
            return "tree-split"
        if self.decode_split and (aligned or math.gcd(self.config.k_slice // self.config.k_groups, 4) != 4):
            return "decode-split"
        return "one" if self.merge_free else "one+merge"

    def allocate_workspace(self) -> Any:
        """A device workspace of :attr:`workspace_shape` (allocate once, reuse every step)."""
        return cuda.device_array(self.workspace_shape, dtype=np.float32)


def plan(batch_size: int, tree_capacity: int, num_heads: int, kv_capacity: int, *,
         latent_dim: int = 512, rope_dim: int = 64, max_kv_len: int | None = None,
         split_size: int = DEFAULT_SPLIT_SIZE, config: TileConfig | None = None) -> VerifyPlan:
    """Compute the work layout for a batch shape (host only, once per shape).

    Args:
        batch_size, tree_capacity, num_heads, kv_capacity: bs, Tc, H and S of the run arrays.
        latent_dim, rope_dim: Dl and Dr (select the default config).
        max_kv_len: bound on ``past_len + path length`` of any query (default ``kv_capacity``);
            keys past ``ceil(max_kv_len / split_size) * split_size`` are not covered (NaN out).
        split_size: keys per segment, a multiple of ``config.chunk``; fixed per model.
        config: the specialisation; default :func:`default_config` of ``(Dl, Dr, H)``.
    """
    batch_size = int_arg(batch_size, "batch_size")
    tree_capacity = int_arg(tree_capacity, "tree_capacity")
    num_heads = int_arg(num_heads, "num_heads")
    kv_capacity = int_arg(kv_capacity, "kv_capacity")
    latent_dim = int_arg(latent_dim, "latent_dim")
    rope_dim = int_arg(rope_dim, "rope_dim")
    split_size = int_arg(split_size, "split_size")
    max_kv_len = kv_capacity if max_kv_len is None else int_arg(max_kv_len, "max_kv_len")
    if config is None:
        config = default_config(latent_dim, rope_dim, num_heads)
    elif not isinstance(config, TileConfig):
        raise TypeError(f"config must be a TileConfig, got {type(config).__name__}")
    config.validate()
    if (config.latent_dim, config.rope_dim) != (latent_dim, rope_dim):
        raise ValueError(f"config: dims ({config.latent_dim}, {config.rope_dim}) differ from "
                         f"latent_dim, rope_dim = ({latent_dim}, {rope_dim})")
    if num_heads % config.heads or num_heads % config.merge_heads:
        raise ValueError(f"num_heads must be a multiple of config.heads={config.heads} and of "
                         f"config.merge_heads={config.merge_heads}, got {num_heads}")
    if split_size % config.chunk:
        raise ValueError(f"split_size must be a multiple of config.chunk={config.chunk}, "
                         f"got {split_size}")
    if max_kv_len > kv_capacity:
        raise ValueError(f"max_kv_len must be <= kv_capacity={kv_capacity}, got {max_kv_len}")
    num_splits = -(-max_kv_len // split_size)
    if num_splits > GRID_Y_LIMIT or batch_size > GRID_Y_LIMIT:
        raise ValueError(f"split_size too small: {num_splits} segments (batch_size "
                         f"{batch_size}) exceed the grid limit {GRID_Y_LIMIT}")
    return VerifyPlan(config, batch_size, tree_capacity, num_heads, kv_capacity, split_size,
                      num_splits)


def _check_host_values(p: VerifyPlan, past_lens: np.ndarray, tree_sizes: np.ndarray,
                       visibility: np.ndarray) -> None:
    """Value checks possible on host arrays (device arrays are guarded in the kernels)."""
    tc = p.tree_capacity
    if isinstance(tree_sizes, np.ndarray) and np.any((tree_sizes < 0) | (tree_sizes > tc)):
        raise ValueError(f"tree_sizes must lie in [0, {tc}] (0: an idle slot)")
    if isinstance(past_lens, np.ndarray) and np.any(past_lens < 0):
        raise ValueError("past_lens must be >= 0")
    if not (isinstance(past_lens, np.ndarray) and isinstance(tree_sizes, np.ndarray)):
        return
    if np.any(past_lens.astype(np.int64) + tree_sizes > p.kv_capacity):
        raise ValueError(f"past_lens + tree_sizes must be <= kv rows {p.kv_capacity}")
    if not isinstance(visibility, np.ndarray):
        return
    cols = np.arange(tc)
    bits = (visibility[:, :, cols // 32] >> (cols % 32).astype(np.uint32)) & 1  # [bs, Tc, Tc]
    live = cols[None, :] < tree_sizes[:, None]                                 # [bs, Tc]
    bits = bits.astype(bool) & live[:, None, :]
    if np.any(~np.diagonal(bits, axis1=1, axis2=2) & live):
        raise ValueError("visibility: every live row must see itself (diagonal bit)")
    path = np.where(live, bits.sum(axis=2), 0)                                 # [bs, Tc]
    if np.any(path > p.config.max_path):
        raise ValueError(f"visibility: a row sees more than max_path={p.config.max_path} nodes")
    if np.any(past_lens[:, None] + path > p.num_splits * p.split_size):
        raise ValueError(f"past_lens: keys beyond the planned {p.num_splits} segments of "
                         f"{p.split_size}; plan with a larger max_kv_len")


def _check_host_finite(arrays: dict[str, Any], past_lens: Any, tree_sizes: Any) -> None:
    """NumPy q / kv arrays are finite on the rows the kernels read: query rows i < tree_sizes[b],
    cache rows j < past_lens[b] + tree_sizes[b] (whole arrays when past_lens or tree_sizes is a
    device array). Run after :func:`_check_host_values`, which bounds those lengths."""
    known = isinstance(past_lens, np.ndarray) and isinstance(tree_sizes, np.ndarray)
    for name, arr in arrays.items():
        if not isinstance(arr, np.ndarray) or not arr.size:
            continue
        rows = arr.reshape(arr.shape[0], arr.shape[1], -1)                  # [bs, Tc or S, *]
        bad = ~np.isfinite(rows).all(axis=2)                                # [bs, Tc or S]
        if known:  # unread rows may hold anything (stale cache, padding)
            is_query = name.startswith("q_")
            n_read = tree_sizes if is_query else past_lens.astype(np.int64) + tree_sizes
            bad &= np.arange(arr.shape[1])[None, :] < n_read[:, None]
        if bad.any():
            b, i = (int(v) for v in np.argwhere(bad)[0])
            raise ValueError(f"{name} must be finite (NaN or infinity in request {b}, row {i})")


def run(p: VerifyPlan, q_latent: Any, q_rope: Any, kv_latent: Any, k_rope: Any,
        past_lens: Any, tree_sizes: Any, visibility: Any, scale: float, out: Any, lse: Any,
        workspace: Any, stream: Any = 0, *, release_next: bool = False) -> None:
    """Launch tree-verify attention into caller-owned ``out``, ``lse`` and ``workspace``.

    Args:
        p: the :func:`plan` for these shapes.
        q_latent: float32 [bs, Tc, H, Dl]; q_rope: float32 [bs, Tc, H, Dr].
        kv_latent: float32 [bs, S, Dl]; k_rope: float32 [bs, S, Dr]; rows ``past_lens[b] ..
            past_lens[b] + tree_sizes[b] - 1`` hold request b's tree nodes in node order.
        past_lens, tree_sizes: int32 [bs]; visibility: uint32 [bs, Tc, ceil(Tc/32)] (packed
            ancestor-or-self rows, ARCHITECTURE.md).
        All arrays: NumPy, numba device, or ``__cuda_array_interface__`` objects (wrapped with
        ``cuda.as_cuda_array``, no copy). NumPy q / kv arrays must be finite on the rows read.
        scale: softmax scale (> 0, finite).
        out: float32 [bs, Tc, H, Dl]; lse: float32 [bs, Tc, H]; zeros in padding rows.
        workspace: float32 ``p.workspace_shape``.
        stream: 0, a numba stream, a cuda.core Stream, or a cuda.core GraphBuilder (a capture:
            the engine's step graphs, ``bench.verify_attention --graph``).
        release_next: the next kernel of the stream reads weights before its PDL wait (an AR
            step's split value absorb): the two-launch paths' values launch lets it launch right
            after its own wait (``kernels.pdl.pdl_begin_early``); the other launches ignore it.

    Raises:
        TypeError / ValueError naming the argument, before any launch.
    """
    if not isinstance(p, VerifyPlan):
        raise TypeError(f"p must be a VerifyPlan, got {type(p).__name__}")
    cfg = p.config
    bs, tc, h, s = p.batch_size, p.tree_capacity, p.num_heads, p.kv_capacity
    q_latent = check_array(q_latent, "q_latent", np.float32, shape=(bs, tc, h, cfg.latent_dim))
    q_rope = check_array(q_rope, "q_rope", np.float32, shape=(bs, tc, h, cfg.rope_dim))
    kv_latent = check_array(kv_latent, "kv_latent", np.float32, shape=(bs, s, cfg.latent_dim))
    k_rope = check_array(k_rope, "k_rope", np.float32, shape=(bs, s, cfg.rope_dim))
    past_lens = check_array(past_lens, "past_lens", np.int32, shape=(bs,))
    tree_sizes = check_array(tree_sizes, "tree_sizes", np.int32, shape=(bs,))
    visibility = check_array(visibility, "visibility", np.uint32, shape=(bs, tc, -(-tc // 32)))
    out = check_array(out, "out", np.float32, shape=(bs, tc, h, cfg.latent_dim))
    lse = check_array(lse, "lse", np.float32, shape=(bs, tc, h))
    workspace = check_array(workspace, "workspace", np.float32, shape=p.workspace_shape)
    scale = positive_real(scale, "scale")
    float4_arrays = float4_loads(cfg).arrays   # 16-byte loads need 16-byte aligned arrays
    for name, arr in (("q_latent", q_latent), ("q_rope", q_rope), ("kv_latent", kv_latent),
                      ("k_rope", k_rope)):
        if name in float4_arrays and data_address(arr) % 16:
            raise ValueError(f"{name} must start on a 16-byte boundary for the score-first "
                             f"tiles' float4 loads (config.score_keys), got address "
                             f"{data_address(arr):#x}")
    _check_host_values(p, past_lens, tree_sizes, visibility)
    _check_host_finite(dict(q_latent=q_latent, q_rope=q_rope, kv_latent=kv_latent, k_rope=k_rope),
                       past_lens, tree_sizes)

    flat = [_flat(a) for a in (q_latent, q_rope, kv_latent, k_rope, visibility, workspace, out,
                               lse)]
    q_lat, q_rp, kv_lat, k_rp, vis, ws, out_flat, lse_flat = flat
    aligned = all(data_address(a) % 16 == 0 for a in (q_latent, q_rope, kv_latent, k_rope))
    launches = p.launches(aligned)
    if launches == "tree-split":
        scores, values, v_threads = get_tree_kernels(cfg, h)
        tq, tk, s_threads, th, spd = tree_geometry(cfg, h)
        launch(scores, (-(-(tc * h) // tq), -(-s // tk), bs), s_threads, stream, 0, q_lat, q_rp, kv_lat, k_rp,
               past_lens, tree_sizes, np.int32(tc), np.int32(h), np.int32(s), scale, ws)
        launch(values, (tc * (h // th), cfg.latent_dim // spd, bs), v_threads, stream, 0, kv_lat, past_lens,
               tree_sizes, vis, np.int32(tc), np.int32(h), np.int32(s), np.int32(-(-tc // 32)), ws, out_flat,
               lse_flat, np.int32(1 if release_next else 0))
        return
    if launches == "decode-split":
        scores, values = get_decode_kernels(cfg, h)
        sh, sk, sph, spd, pv_threads = decode_geometry(cfg, h)
        words = np.int32(-(-tc // 32))
        launch(scores, (-(-s // sk), h // sh, bs), sh * sk * cfg.k_groups, stream, 0, q_lat, q_rp, kv_lat,
               k_rp, past_lens, tree_sizes, vis, np.int32(h), np.int32(s), words, scale, ws)
        launch(values, (h // sph, cfg.latent_dim // spd, bs), pv_threads, stream, 0, kv_lat, past_lens,
               tree_sizes, vis, np.int32(h), np.int32(s), words, ws, out_flat, lse_flat,
               np.int32(1 if release_next else 0))
        return
    attention, merge = get_kernels(cfg)
    dims = (np.int32(tc), np.int32(h), np.int32(s), np.int32(-(-tc // 32)))
    launch(attention, p.attention_grid, cfg.threads, stream, 0, q_lat, q_rp, kv_lat, k_rp,
           past_lens, tree_sizes, vis, *dims, scale, np.int32(p.split_size), ws, out_flat, lse_flat)
    if launches == "one+merge":
        launch(merge, p.merge_grid, cfg.merge_threads, stream, 0, past_lens, tree_sizes, vis, *dims,
               np.int32(p.split_size), np.int32(p.num_splits), ws, out_flat, lse_flat)


def _flat(arr: Any) -> Any:
    """A 1-D view of a C-contiguous host or device array (no copy)."""
    return arr.reshape(-1) if isinstance(arr, np.ndarray) else arr.reshape(arr.size)


def verify_attention(q_latent: np.ndarray, q_rope: np.ndarray, kv_latent: np.ndarray,
                     k_rope: np.ndarray, past_lens: np.ndarray, tree_sizes: np.ndarray,
                     visibility: np.ndarray, scale: float, *,
                     split_size: int = DEFAULT_SPLIT_SIZE, config: TileConfig | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Convenience: plan, allocate and run on host arrays; returns ``(out, lse)`` (NumPy).

    Same arguments as :func:`run` (NumPy arrays); ``max_kv_len`` is the cache capacity S.
    """
    for name, arr, ndim in (("q_latent", q_latent, 4), ("q_rope", q_rope, 4),
                            ("kv_latent", kv_latent, 3), ("k_rope", k_rope, 3)):
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array, got {type(arr).__name__}")
        if arr.ndim != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    bs, tc, h, dl = q_latent.shape
    p = plan(bs, tc, h, kv_latent.shape[1], latent_dim=dl, rope_dim=q_rope.shape[3],
             split_size=split_size, config=config)
    out = np.zeros((bs, tc, h, dl), dtype=np.float32)
    lse = np.zeros((bs, tc, h), dtype=np.float32)
    workspace = np.zeros(p.workspace_shape, dtype=np.float32)
    run(p, q_latent, q_rope, kv_latent, k_rope, past_lens, tree_sizes, visibility, scale, out,
        lse, workspace)
    return out, lse


# The Kimi K2 specialisation (H = 64, Dl = 512, Dr = 64), for the sm_90 / sm_120 compile check.
KIMI_K2_CONFIG = default_config(512, 64, 64)
_DIMS = (int32, int32, int32, int32)     # Tc, H, S, W
_ATTENTION_SIG = (float32[::1], float32[::1], float32[::1], float32[::1], int32[::1], int32[::1],
                  uint32[::1], *_DIMS, float32, int32, float32[::1], float32[::1], float32[::1])
_MERGE_SIG = (int32[::1], int32[::1], uint32[::1], *_DIMS, int32, int32, float32[::1],
              float32[::1], float32[::1])
# The chunk-layout few-node tilings (the engine's decode and small-tree tiles before the score-first
# ones; bench and test baselines).
KIMI_K2_DECODE_CONFIG = default_config(512, 64, 64, tile_heads=8)
KIMI_K2_SMALL_TREE_CONFIG = default_config(512, 64, 64, tile_heads=16)
# prefetch_chunks that covers a whole default segment at the start (32-key chunks in every preset)
SEGMENT_PREFETCH_CHUNKS = DEFAULT_SPLIT_SIZE // KIMI_K2_CONFIG.chunk
# The score-first tilings the engine uses (model.DECODE_TILE, model.FEW_NODES_TILE), before the
# dead-key skip (the engine's tiles have it: the _SKIP configs below, model.ATTENTION_SKIP_DEAD_KEYS).
KIMI_K2_SCORE_FIRST_CONFIG = default_config(512, 64, 64, tile_heads=2, score_keys=128)
KIMI_K2_SCORE_FIRST_TREE_CONFIG = default_config(512, 64, 64, tile_heads=8, score_keys=128, score_rows=4)
# ... with the dead-key skip (TileConfig.skip_dead_keys; the engine's tiles: engine.model.ATTENTION_SKIP_DEAD_KEYS)
KIMI_K2_SCORE_FIRST_SKIP_CONFIG = dataclasses.replace(KIMI_K2_SCORE_FIRST_CONFIG, skip_dead_keys=True)
KIMI_K2_SCORE_FIRST_TREE_SKIP_CONFIG = dataclasses.replace(KIMI_K2_SCORE_FIRST_TREE_CONFIG, skip_dead_keys=True)
# The AR step's tile since run "lane squares" (model.DECODE_TILE): 2 heads, 256 keys a pass (256
# threads; 32-dim key slices within the static limit, two P·V dims a thread), with the skip.
KIMI_K2_SCORE_FIRST_DECODE_SKIP_CONFIG = dataclasses.replace(
    default_config(512, 64, 64, tile_heads=2, score_keys=256), skip_dead_keys=True)
for _name, _config, _what in (
        ("verify_attention_mla", KIMI_K2_CONFIG, "segment partials (Kimi K2: H=64, Dl=512, Dr=64)"),
        ("verify_attention_mla_8_heads", KIMI_K2_DECODE_CONFIG, "8-head tiles for launches with few nodes (decode)"),
        ("verify_attention_mla_8_heads_prefetch", dataclasses.replace(
            KIMI_K2_DECODE_CONFIG, prefetch_l2=True, prefetch_chunks=SEGMENT_PREFETCH_CHUNKS),
         "8-head tiles, the segment's key rows prefetched to L2 at the start (opt-in, TileConfig.prefetch_l2)"),
        ("verify_attention_mla_16_heads", KIMI_K2_SMALL_TREE_CONFIG, "16-head tiles for small trees"),
        ("verify_attention_mla_score_first", KIMI_K2_SCORE_FIRST_CONFIG,
         "score-first layout, 2-head tiles, 128 keys a pass"),
        ("verify_attention_mla_score_first_8_heads", KIMI_K2_SCORE_FIRST_TREE_CONFIG,
         "score-first layout, 8-head tiles (4 x 4 score tiles), 128 keys a pass (small trees)"),
        ("verify_attention_mla_score_first_skip", KIMI_K2_SCORE_FIRST_SKIP_CONFIG,
         "score-first 2-head tiles skipping dead key tiles (TileConfig.skip_dead_keys)"),
        ("verify_attention_mla_score_first_256_skip", KIMI_K2_SCORE_FIRST_DECODE_SKIP_CONFIG,
         "score-first 2-head tiles, 256 keys a pass, skipping dead key tiles (decode steps)"),
        ("verify_attention_mla_score_first_8_heads_skip", KIMI_K2_SCORE_FIRST_TREE_SKIP_CONFIG,
         "score-first 8-head tiles skipping dead key tiles (small trees, TileConfig.skip_dead_keys)")):
    register(_name, get_kernels(_config)[0], [_ATTENTION_SIG], f"tree-verify MLA attention, {_what}",
             block_threads=_config.threads)
_DECODE_SCORES_SIG = (float32[::1], float32[::1], float32[::1], float32[::1], int32[::1], int32[::1],
                      uint32[::1], int32, int32, int32, float32, float32[::1])
_DECODE_VALUES_SIG = (float32[::1], int32[::1], int32[::1], uint32[::1], int32, int32, int32, float32[::1],
                      float32[::1], float32[::1], int32)
_decode = get_decode_kernels(KIMI_K2_SCORE_FIRST_DECODE_SKIP_CONFIG, 64)
_decode_geometry = decode_geometry(KIMI_K2_SCORE_FIRST_DECODE_SKIP_CONFIG, 64)
register("verify_attention_decode_scores", _decode[0], [_DECODE_SCORES_SIG],
         "one-node MLA attention (an AR step), its scores over key blocks (Kimi K2 heads and dims)",
         block_threads=_decode_geometry[0] * _decode_geometry[1] * KIMI_K2_SCORE_FIRST_DECODE_SKIP_CONFIG.k_groups)
register("verify_attention_decode_values", _decode[1], [_DECODE_VALUES_SIG],
         "one-node MLA attention (an AR step), softmax and P·V over dim slices (Kimi K2 heads and dims)",
         block_threads=_decode_geometry[4])
_TREE_SCORES_SIG = (float32[::1], float32[::1], float32[::1], float32[::1], int32[::1], int32[::1], int32, int32,
                    int32, float32, float32[::1])
_TREE_VALUES_SIG = (float32[::1], int32[::1], int32[::1], uint32[::1], int32, int32, int32, int32, float32[::1],
                    float32[::1], float32[::1], int32)
_tree = get_tree_kernels(KIMI_K2_SCORE_FIRST_TREE_SKIP_CONFIG, 64)
register("verify_attention_tree_scores", _tree[0], [_TREE_SCORES_SIG],
         "small-tree MLA attention (a B 32 verify), its scores as one GEMM of query rows x cache rows (Kimi K2 "
         "heads and dims)", block_threads=tree_geometry(KIMI_K2_SCORE_FIRST_TREE_SKIP_CONFIG, 64)[2])
register("verify_attention_tree_values", _tree[1], [_TREE_VALUES_SIG],
         "small-tree MLA attention, softmax over a node's keys and P·V, latent rows staged once for its heads "
         "(Kimi K2 heads and dims)", block_threads=_tree[2])
register("verify_attention_merge", get_kernels(KIMI_K2_CONFIG)[1], [_MERGE_SIG],
         "tree-verify MLA attention, ordered merge of segment partials (Kimi K2)",
         block_threads=KIMI_K2_CONFIG.merge_threads)
