"""The MLA + MoE target forward on the GPU, FP32: one code path for prefill, AR decode and tree verify.

A forward takes ``Tc`` rows per request (``sizes[b]`` of them valid) at explicit RoPE positions with
a packed visibility mask over the new rows (causal for prefill / decode, ancestor-or-self for a
draft tree whose positions are ``past_len + depth``, docs/ARCHITECTURE.md) and attends every
request's ``past_lens[b]`` cached rows plus the new rows it sees, through the tree-verify MLA
kernel (``kernels/verify_attention.py``) in weight-absorbed form (limits §2), exactly as
``reference.model.forward`` does in float64:

    x = embed(tokens)                                                        # [M, D], M = bs * Tc
    per layer:  a = linear(rmsnorm(x), [q_a | kv_a])                          # [M, Qa + C + R]
                q = linear(rmsnorm(a[:, :Qa]), q_b)                           # [M, H, nope + R]
                q_rope = rope(q[..., nope:]);  q_latent = q[..., :nope] @ W_UK[h]   # absorb
                cache rows past_lens[b] + i <- (kv_norm(a[:, Qa:Qa+C]), rope(a[:, Qa+C:]))
                o = verify_attention(q_latent, q_rope, cache, visibility)     # [bs, Tc, H, C]
                x += (o @ W_UV[h]ᵀ) @ wo                                      # [M, D]
                x += ffn(rmsnorm(x))       (dense SwiGLU, or MoE: route, experts, shared, combine)
    logits = linear(rmsnorm(x), lm_head)                                      # [bs, Tc, V]

Batch invariance (issue 4, spec §1.4): every kernel computes a row with a reduction order that
depends only on the model's dims, never on how many rows share the launch, and the attention
kernel's key sequence of a tree node is its root path, so a node's logits are bit-identical to
those of AR steps along the same path. Per-step values (tokens, positions, sizes, past_lens) are
read on the device; every buffer is allocated in ``__init__``, a forward allocates nothing and
copies nothing to the host (graph-capturable, limits §4, §8).

Device-side guards (values the host cannot see): rows ``i >= sizes[b]`` are padding (token 0,
position 0, no cache write; their logits are unspecified); a valid row with a position outside
``[0, kv_capacity)`` and every row of a request with ``past_lens[b] + sizes[b] > kv_capacity`` get
token -1, which the embedding turns into a NaN row, so the error shows in the logits.

Placement: a layer reads only its :class:`~ddtree_numba.engine.weights.LayerWeights`, its
:class:`~ddtree_numba.engine.cache.LayerKV` and the activation buffers (:class:`Activations`), so a
later version can put layers on different GPUs (one Activations per device).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from numba import cuda, float32, int32

from ddtree_numba.config import ModelConfig
from ddtree_numba.engine.cache import KVCache, LayerKV
from ddtree_numba.engine.weights import DenseFfnWeights, DeviceWeights, LayerWeights, MoeWeights
from ddtree_numba.kernels import verify_attention as va
from ddtree_numba.kernels.absorb import absorb, reads_weights_first as absorb_reads_weights_first, \
    supported as absorb_supported
from ddtree_numba.kernels._args import check_array, int_arg
from ddtree_numba.kernels.gemv import expert_gemv, expert_takes, gemv, takes as gemv_takes
from ddtree_numba.kernels.linear import (expert_linear, head_linear, linear, linear_split_k, serial_plan,
                                         split_k_pays, split_k_segments, swiglu_rows)
from ddtree_numba.kernels.linear_tc import allocate_placeholders, linear_tc, partials_shape
from ddtree_numba.kernels.model_ops import (MAX_ROUTE_LOADS, embed, mla_kv_write, mla_q_rope, mla_rope_kv_write,
                                            moe_combine, moe_route, rms_norm, rope_tables, route_grid_loads)
from ddtree_numba.kernels.pdl import pdl_begin
from ddtree_numba.kernels.registry import register
from reference.tree import pack_visibility, unpack_visibility
from sim.launch import launch
from sim.profiles import active_profile

__all__ = [
    "Activations",
    "ForwardOut",
    "PREP_THREADS",
    "PRODUCTS",
    "TargetModel",
    "attention_tile_config",
    "prefill_visibility",
]

PREP_THREADS = 128  # rows per block of the row-preparation kernel
# The dense matrix products (w_a, w_q, o_proj, lm_head, the dense and shared experts' SwiGLU
# products): "cuda-core", kernels.linear (the default; o_proj and the dense down_proj split over K
# where that pays, the same bits), or "tensor-core", kernels.linear_tc (3xTF32 mma.sync, its own
# K segments; slower in small's forward at 1 and 33 rows, PERFORMANCE run pdl timed). Numerics,
# not layout: the models that decode one cache must agree (TargetModel's ``products``). The
# routed experts and the MLA absorbs keep their kernels either way.
PRODUCTS = ("cuda-core", "tensor-core")
COPY_THREADS = 128  # elements per block of the feature copy
SIM_THREADS = 32  # one warp per small kernel under the simulator (threads are Python threads)
# Attention tiles by launch size (nodes x default head tiles, against the device's SMs): fewer
# than a quarter of the SMs (H200: 33) -> DECODE_TILE (an AR step), fewer than two per SM (264)
# -> FEW_NODES_TILE, else the default (64-head) tiles, each block reading the keys once for all
# its heads.
DECODE_NODES_PER_SM = 0.25
FEW_NODES_PER_SM = 2
# The tiles of those two launch sizes: a head count (the chunk layout) or (heads, score_keys[,
# score_rows]), the score-first layout (va.TileConfig.score_keys; score_rows heads per thread in the
# score tile, default 1). Layout, not numerics; bench.forward_ab times them
# (H200, run "attention score-first": an AR forward 1793.2 us with 8-head chunk tiles, 1424.7
# with (2, 128); a 33-row forward 3377.4 with 16-head tiles, 3278.6 with (4, 128); run "score
# rows": a 33-row forward 3151.9 with (4, 128), 2829.8 with (8, 128, 4), 2993.9 with (8, 128, 2);
# run "lane squares", graph replays of the AR step's attention alone (bench.verify_attention, skip
# on): 35.8 us with (2, 128), 31.2 with (2, 256), 36.0 with (1, 256), 34.3 with (4, 256) at 160
# cached rows; 156.2 and 134.4 at 1000).
DECODE_TILE: int | tuple[int, ...] = (2, 256)
FEW_NODES_TILE: int | tuple[int, ...] = (8, 128, 4)
# The attention tiles' L2 prefetch of the next chunk's key rows (va.TileConfig.prefetch_l2): layout,
# not numerics. Off: on the H200 it did not pay (forward_ab, run "attention score-first": an AR
# forward 1889.0 us without, 1890.7 a chunk ahead, 1884.6 the whole segment at the start).
ATTENTION_PREFETCH_L2 = False
# Score-first tiles skip the score FMAs of key tiles past a pass's last key (va.TileConfig
# .skip_dead_keys): layout, not numerics. On: H200, run "skip and tiles" (PERFORMANCE.md): the
# 33-node launch over 160 cached rows 65.0 -> 61.6 us, an AR step's 37.2 -> 36.2 (graph replays of
# the attention alone); forward_ab, a 33-row forward 2373.1 / 2370.2 -> 2360.3 / 2360.0 / 2362.0 us,
# the AR forward within its spread (bench.forward_ab's ``auto-noskip`` switches it off).
ATTENTION_SKIP_DEAD_KEYS = True
# The segment merge of FEW_NODES_TILE launches: (threads per block, heads per block), va.TileConfig's
# merge_threads / merge_heads (layout, not numerics); the other launches keep the config's default.
FEW_NODES_MERGE: tuple[int, int] = (128, 1)
# The FEW_NODES_TILE attention kernel's launch bounds: blocks an SM (va.TileConfig.min_blocks; 0:
# none). Layout, not numerics. 0: the 8-head tile then takes 232 registers, two blocks an SM; 3
# holds it to 168 with a 16-byte spill on sm_90 (bench.forward_ab's ``auto-occ3``, not yet timed).
# It adds warps only to launches of more blocks than 2 an SM hold (trees past 33 nodes, batches):
# a batch-1 B 32 tree's 264 blocks fit 2 an SM already.
FEW_NODES_MIN_BLOCKS = 0
ATTENTION_PREFETCH_CHUNKS = 1  # how far ahead (va.TileConfig.prefetch_chunks); the split / chunk: all at once
STATIC_SMEM_LIMIT = va.STATIC_SHARED_LIMIT  # static shared memory per block: bounds the attention path table
PATH_ENTRY_BYTES = 4  # one int32 per tree node of a query's path (TileConfig.max_path)
# The MLA absorbs (q_nope @ W_UK, o_latent @ W_UVᵀ) in kernels.absorb's segment order: a split
# kernel for an AR step, a tiled one for a tree verify or a prefill, the same bits. Off: the
# earlier path, head_linear (linear()'s lane chains and butterfly; its thread-serial kernel for
# many rows on a GPU), which also serves a config whose shapes kernels.absorb does not take (an N
# not a multiple of 4, K over absorb.MAX_K). Numerics, not layout: AR and verify must agree, so
# one process keeps one setting (bench.forward_ab's COLS other than ``auto-seg*`` time the earlier path).
SEGMENT_ABSORBS = True
# Launches merged, not numerics (the same bits either way; each kernel's own tests compare them):
# the query RoPE and the kv cache write of a layer in one launch (model_ops.mla_rope_kv_write), and
# the MoE layer's RMSNorm inside the routing launch (model_ops.moe_route's x / norm_weight). H200,
# run "merges timed" (bench.forward_ab, one process, two passes; ``auto-unfused`` /
# ``auto-normroute`` switch them): the fused RoPE launch with the merge-free attention took 23.6 us
# off an AR forward (1083.2 -> 1059.6) and 23.5 off a 33-row one; the norm inside the routing added
# 17.5 / 12.9 us (that specialisation sits at the kernel's 128-register launch bound), so it stays off.
# Since run "expert rows" an AR step's routing launch writes its CSR too (model_ops.ROUTE_CSR_INLINE),
# also with the RMSNorm inside (its norm then at model_ops.ROUTE_CSR_NORM_LOADS loads a lane, no
# spill): FUSED_MOE_NORM on, that took +6 us (run "floor", auto-normroute). FUSED_MOE_NORM applies to
# the row layout's routing only (ROUTE_BY_EXPERT off); the expert grid always normalises in its launch.
FUSED_ROPE_KV_WRITE = True
FUSED_MOE_NORM = False
# The MoE layer's RMSNorm, gate, selection (and at one row its CSR) in one launch of a block per
# (expert, row) (model_ops.moe_route given logits and counts: each block reads one gate row and
# the row's last block selects), instead of an RMSNorm launch (one warp) and a routing launch of
# a block per row that reads every gate row (run "floor": 6.8 + 12.5 us an AR layer on the H100).
# Numerics, not layout (its own lane order for the norm and the gate dots): one process keeps one
# setting (bench.forward_ab's ``auto-route1`` times the row layout; FUSED_MOE_NORM applies to that
# layout only). Configs whose hidden size passes model_ops.MAX_ROUTE_LOADS lanes' worth (4096:
# kimi-k2's 7168 spilled on sm_90) keep the row layout. H100, run "grid routing" call 2 (c53c813, one process, two passes, us a forward):
# 1 row 905.2 / 899.8 against 942.9 / 946.9, 33 rows 2143.5 / 2154.4 against 2181.3 / 2178.1; in
# the replayed AR forward the launch costs 11.8 us (graph prefixes) where the two cost 19.2.
ROUTE_BY_EXPERT = True
# One shared expert (its width the routed experts' I) runs as expert E of the routed experts' two
# expert_linear launches: entries J..J+M-1 (row m's at J + m, fixed at allocation), its weights
# stacked after theirs (weights.MoeWeights.w13_all). Two launches fewer a MoE layer, the same bits
# (the expert kernel sums every element in linear's order). Layout, not numerics; with the
# cuda-core products only ("tensor-core" runs the shared expert through linear_tc). H200, run
# "fold" (the launches alone): the shared expert's own two launches 16.7 us at one row and 27.2 at
# 33, against +2.6 / +15.7 inside the routed experts'; run "fold timed" (bench.forward_ab,
# ``auto-unfold`` against the default, one process): 58.0 us off an AR forward, 125.2 off a 33-row one.
FOLD_SHARED_EXPERT = True
# The experts' down projection takes the row tile of M entries an expert (expert_linear's
# max_rows: each row picks an expert once), not of its J entries: one-row tiles in an AR step, as
# the gate | up launch and as run "fold" timed both (4d403ab took 4-row tiles for the AR step's
# 4 entries, 8-row ones for 5 with the shared expert). Layout, not numerics. Run "fold timed"
# (``auto-entrytile`` against the default): 18.4 us off an AR forward, none off a 33-row one.
EXPERT_TILE_BY_ROWS = True
# A 1-row product (an AR step at batch 1) runs kernels.gemv where plan_gemv gives it a layout
# (weights up to gemv.MAX_WEIGHT_BYTES: w_a, w_q, wo, the dense down projection; not the dense
# gate | up or the lm_head): small blocks that load their first weights before the rms,
# x read from L1 / L2 instead of staged. The same bits as linear. Layout, not numerics
# (bench.forward_ab's ``auto-nogemv`` switches it off).
ROW_PRODUCTS = True
# Under programmatic launches (decode's pdl=True), a launch followed by one that reads weights before
# its wait (a gemv, a 1-row split absorb) lets it launch right after its own wait (release_next:
# kernels.pdl.pdl_begin_early); off, every kernel releases at its blocks' exits. A launch argument,
# so a captured graph keeps what was set at its capture (bench.forward_ab's ``/pdl`` turns it on,
# ``/pdlx`` off). Off: run "pdl early timed" (H200, 128f022, small, graph replays, two passes) timed
# the early release at 891.9 / 892.0 us a 1-row forward against 882.1 / 882.3 without PDL and
# 874.0 / 874.3 with every release at the exits (33 rows: 2115.9 / 2114.2, 2121.0 / 2122.1,
# 2112.0 / 2113.4): in gemv's SASS the wait comes before its first weight loads, so the early
# grids' blocks wait idle beside the grid they wait on, as with run pdl timed's release at the start.
PDL_RELEASE_EARLY = False
# An AR step's MoE expert products (k + 1 entries at batch 1, the shared expert folded in) through
# kernels.gemv.expert_gemv: a block row per entry streaming its expert's weights as gemv streams a
# dense product, where expert_linear runs one-row tiles of 8 warps a block (H100, run "expert rows",
# Nsight Compute at f865d0e: the gate | up 15.7 us for 21 MB, the down projection 14.6 us for 10.5
# MB, 40 % and 22 % of the H100's HBM bandwidth). The same bits; layout, not numerics (only with
# ROW_PRODUCTS; bench.forward_ab's ``auto-noexgemv`` switches it off). H100, one process, two
# passes, us an AR forward: 973.9 / 974.0 against 1004.3 / 1006.7 off (call 2, f2a4f51), 970.8 /
# 969.0 against 993.0 / 993.4 (call 3, 5937ead); the 33-row forward does not run it.
EXPERT_ROW_PRODUCTS = True


class ForwardOut(NamedTuple):
    """Device outputs of :meth:`TargetModel.forward` (model-owned, overwritten by the next call)."""

    logits: Any  # [bs, Tc, V] float32
    features: Any | None  # [bs, Tc, len(capture_layers) * D] float32; None without capture layers


# --------------------------------------------------------------------------- device kernels


@cuda.jit
def _prepare_rows_kernel(tokens, positions, sizes, past_lens, tree_capacity, kv_rows, tok_out, pos_out,
                         cache_rows):
    """Per row m = b * Tc + i: the token and position the kernels read, and the flat cache row.

    tokens, positions int32 [M] (flat [bs, Tc]); sizes, past_lens int32 [bs]; int32 Tc, S;
    outputs int32 [M]. cache_rows[m] = b * S + past_lens[b] + i for a valid row, -1 otherwise.
    """
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    m = cuda.grid(1)
    if m >= tokens.shape[0]:
        return
    b = m // tree_capacity
    i = m - b * tree_capacity
    past = past_lens[b]
    size = sizes[b]
    request_ok = past >= 0 and size >= 0 and size <= tree_capacity and past + size <= kv_rows
    tok = -1  # poisons the row (NaN embedding) unless the request and the row are fine
    pos = 0
    row = -1
    if request_ok and i >= size:
        tok = 0  # padding: a harmless token, no cache write
    elif request_ok:
        row = b * kv_rows + past + i
        pos = positions[m]
        tok = tokens[m]
        if pos < 0 or pos >= kv_rows:  # the RoPE tables have kv_rows rows
            tok = -1
            pos = 0
    tok_out[m] = tok
    pos_out[m] = pos
    cache_rows[m] = row


@cuda.jit
def _copy_columns_kernel(src, dst, col0):
    """dst[m, col0 + d] = src[m, d] (grid-stride): src float32 [M, D], dst float32 [M, F], C-contiguous."""
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    n_cols = src.shape[1]
    for idx in range(cuda.grid(1), src.shape[0] * n_cols, cuda.gridsize(1)):
        m = idx // n_cols
        d = idx - m * n_cols
        dst[m, col0 + d] = src[m, d]


def _copy_grid(n: int) -> tuple[int, int]:
    """(blocks, threads) of the feature copy: one element per thread on a GPU; one warp looping
    under the simulator, where every thread is a Python thread."""
    if cuda.config.ENABLE_CUDASIM:
        return 1, SIM_THREADS
    return -(-n // COPY_THREADS), COPY_THREADS


register("engine_prepare_rows", _prepare_rows_kernel,
         [(int32[::1], int32[::1], int32[::1], int32[::1], int32, int32, int32[::1], int32[::1], int32[::1])],
         "target forward: per-row tokens / positions / flat cache rows from sizes and past_lens (device guards)",
         block_threads=PREP_THREADS)
register("engine_copy_columns", _copy_columns_kernel, [(float32[:, ::1], float32[:, ::1], int32)],
         "target forward: copy a layer's hidden states into the captured-feature columns",
         block_threads=COPY_THREADS)


# --------------------------------------------------------------------------- host helpers


def _small_tile_config(latent_dim: int, rope_dim: int, num_heads: int) -> va.TileConfig:
    """A one-warp tiling for dims without a preset (``tiny``: C = 32, R = 8, H = 4): 4 heads per
    tile, chunks of 16 keys, 1 k-group (32 threads: cheap under the simulator)."""
    return va.TileConfig(latent_dim=latent_dim, rope_dim=rope_dim, heads=4, chunk=16,
                         k_slice=math.gcd(math.gcd(latent_dim, rope_dim), 8), k_groups=1, qk_rows=1, qk_keys=2,
                         pv_rows=1, pv_dims=max(latent_dim // 8, 1), v_slice=16, merge_threads=32,
                         merge_heads=math.gcd(num_heads, 4))


def attention_tile_config(config: ModelConfig, max_rows: int, batch_size: int = 1) -> va.TileConfig:
    """The verify-attention specialisation of a model: ``va.default_config`` for Kimi-K2 dims
    (C = 512, R = 64), a one-warp tiling otherwise; ``max_path`` (the longest visible path, which
    only sizes a shared table, not the numerics) raised to ``max_rows`` as far as static shared
    memory allows, so a prefill chunk of ``max_rows`` causal rows fits. Launches with few
    (node, default head tile) pairs get smaller tiles, more blocks: below ``DECODE_NODES_PER_SM``
    per SM (an AR step) ``DECODE_TILE``, below ``FEW_NODES_PER_SM`` (a small tree at batch 1)
    ``FEW_NODES_TILE`` (score-first tiles of 2 heads, and of 8 heads with 4 a score thread; the
    8- and 16-head chunk-layout tiles before them). The tiles are layout, not numerics (same bits, so the AR and tree models still
    agree bit for bit).

    Raises:
        ValueError: no valid tiling for the model's attention dims.
    """
    dl, dr, h = config.kv_lora_rank, config.qk_rope_dim, config.n_heads
    blocks = batch_size * max_rows * (h // math.gcd(h, 64))  # attention blocks with the default tiles
    sms = active_profile().sm_count
    decode = h % 16 == 0 and blocks < DECODE_NODES_PER_SM * sms
    few = h % 16 == 0 and not decode and blocks < FEW_NODES_PER_SM * sms
    tile = DECODE_TILE if decode else FEW_NODES_TILE if few else None
    tile_heads, score_keys, score_rows = (tile + (1,))[:3] if isinstance(tile, tuple) else (tile, 0, 1)
    if (dl, dr) == (512, 64) and h % 16 == 0:   # a preset: a bad tile setting raises (no fallback)
        base = va.default_config(dl, dr, h, tile_heads=tile_heads, score_keys=score_keys,
                                 score_rows=score_rows)
        if few:
            base = dataclasses.replace(base, merge_threads=FEW_NODES_MERGE[0], merge_heads=FEW_NODES_MERGE[1],
                                       min_blocks=FEW_NODES_MIN_BLOCKS)
    else:   # other numerics than the preset's: every launch size must use this one tiling
        base = _small_tile_config(dl, dr, h)
    try:
        base.validate()
    except ValueError as exc:
        raise ValueError(f"config: no verify-attention tiling for kv_lora_rank={dl}, qk_rope_dim={dr}, "
                         f"n_heads={h} ({exc})") from None
    if h % base.heads:
        raise ValueError(f"config: n_heads={h} must be a multiple of the attention tile's {base.heads} heads")
    room = (STATIC_SMEM_LIMIT - base.static_shared_bytes) // PATH_ENTRY_BYTES
    return dataclasses.replace(base, max_path=max(base.max_path, min(max_rows, base.max_path + room)),
                               prefetch_l2=ATTENTION_PREFETCH_L2, prefetch_chunks=ATTENTION_PREFETCH_CHUNKS,
                               skip_dead_keys=ATTENTION_SKIP_DEAD_KEYS and base.score_keys > 0)


def prefill_visibility(sizes: np.ndarray, tree_capacity: int) -> np.ndarray:
    """Packed causal visibility for a prefill / AR chunk (host).

    Args:
        sizes: int [bs], valid rows per request, each in [0, tree_capacity].
        tree_capacity: Tc >= 1.

    Returns:
        uint32 [bs, Tc, ceil(Tc / 32)]: row i < sizes[b] sees rows 0..i; padding rows see only
        themselves (docs/ARCHITECTURE.md).
    """
    tree_capacity = int_arg(tree_capacity, "tree_capacity", 1)
    sizes = np.asarray(sizes)
    if sizes.dtype.kind not in "iu":
        raise TypeError(f"sizes must be integers, got {sizes.dtype}")
    if sizes.ndim != 1:
        raise ValueError(f"sizes must be 1-D, got shape {sizes.shape}")
    if np.any(sizes < 0) or np.any(sizes > tree_capacity):
        raise ValueError(f"sizes must lie in [0, {tree_capacity}]")
    tc = int(tree_capacity)
    rows = np.arange(tc)
    causal = rows[None, :] <= rows[:, None]  # [Tc, Tc]
    live = rows[None, :] < sizes[:, None]  # [bs, Tc]
    vis = np.where(live[:, :, None], causal[None] & live[:, None, :], np.eye(tc, dtype=bool)[None])  # [bs, Tc, Tc]
    return pack_visibility(vis)


# --------------------------------------------------------------------------- buffers


@dataclass(frozen=True)
class Activations:
    """Every per-forward buffer of one device, allocated once at capacity (M = bs * Tc rows,
    J = M * k routed entries). Float32 unless stated; C-contiguous."""

    tokens: Any  # int32 [bs, Tc] staging for host inputs
    positions: Any  # int32 [bs, Tc] staging for host inputs
    sizes: Any  # int32 [bs] staging for host inputs
    visibility: Any  # uint32 [bs, Tc, W] staging for host inputs
    row_tokens: Any  # int32 [M] tokens the embedding reads (padding -> 0, bad rows -> -1)
    row_positions: Any  # int32 [M] RoPE positions (padding / bad -> 0)
    cache_rows: Any  # int32 [M] flat cache row b * S + past_lens[b] + i, -1 for no write
    x: Any  # [M, D] residual stream
    a: Any  # [M, Qa + C + R] q_a | kv_a projections
    q: Any  # [M, H, nope + R] queries
    q_latent: Any  # [bs, Tc, H, C] absorbed queries
    q_rope: Any  # [bs, Tc, H, R] RoPE'd query parts
    attn: Any  # [bs, Tc, H, C] attention output in the latent space
    lse: Any  # [bs, Tc, H] its log-sum-exp (unused downstream)
    workspace: Any  # verify-attention segment partials (plan.workspace_shape)
    heads: Any  # [M, H, v] per-head values
    h13: Any | None  # [M, 2 * I_dense] dense gate | up (None without dense layers)
    xn: Any | None  # [M, D] normed MoE input (None without MoE layers)
    topk_ids: Any | None  # int32 [M, k]
    topk_w: Any | None  # [M, k]
    route_logits: Any | None  # [M, E] the expert grid's gate logits (ROUTE_BY_EXPERT's scratch; else None)
    route_counts: Any | None  # int32 [M] its blocks done a row (zeros between launches; else None)
    # The expert launches' CSR over J = M * k routed entries, then, with the shared expert folded
    # in (FOLD_SHARED_EXPERT), its M entries J..J+M-1 as expert E (Jx = J + M; else Jx = J):
    row_offsets: Any | None  # int32 [E + 2] folded ([E + 1] = Jx, set here), else [E + 1]
    row_index: Any | None  # int32 [Jx] token row of each CSR entry (the shared ones set here)
    entry_index: Any | None  # int32 [Jx] = arange(Jx): the down projection reads its own entry
    slot_of: Any | None  # int32 [M, k] CSR entry of each (row, selected expert)
    e13: Any | None  # [Jx, 2 * I_moe] experts' gate | up
    e_out: Any | None  # [Jx, D] experts' outputs
    s13: Any | None  # [M, 2 * Is] shared gate | up (None without shared experts, or folded)
    s_out: Any | None  # [M, D] shared expert output (folded: the view e_out[J:])
    logits: Any  # [bs, Tc, V]
    features: Any | None  # [bs, Tc, n_capture * D]

    @classmethod
    def allocate(cls, config: ModelConfig, bs: int, tc: int, plan: va.VerifyPlan, n_capture: int,
                 stream: Any = 0, fold_shared: bool = False, route_grid: bool = False) -> Activations:
        """Allocate every buffer (the only allocation of the forward path); ``fold_shared``: the
        shared expert's entries after the routed ones (FOLD_SHARED_EXPERT); ``route_grid``: the
        expert grid's routing scratch (ROUTE_BY_EXPERT)."""
        c = config
        m, k = bs * tc, c.n_activated_experts
        j = m * k
        has_dense = c.n_dense_layers > 0
        has_moe = c.n_dense_layers < c.n_layers
        has_shared = has_moe and c.n_shared_experts > 0
        shared_width = c.n_shared_experts * c.moe_intermediate
        fold_shared = fold_shared and has_shared
        jx = j + m if fold_shared else j
        offsets = np.zeros(c.n_routed_experts + 1 + fold_shared, np.int32)
        offsets[-1] = jx  # the shared expert's end (folded); the routing writes the rest
        rows = np.zeros(jx, np.int32)
        rows[j:] = np.arange(jx - j)  # the shared expert's entry J + r reads row r

        def f32(*shape: int) -> Any:
            return cuda.device_array(shape, dtype=np.float32, stream=stream)

        e_out = f32(jx, c.hidden_size) if has_moe else None

        def i32(*shape: int) -> Any:
            return cuda.device_array(shape, dtype=np.int32, stream=stream)

        return cls(
            tokens=i32(bs, tc), positions=i32(bs, tc), sizes=i32(bs),
            visibility=cuda.device_array((bs, tc, -(-tc // 32)), dtype=np.uint32, stream=stream),
            row_tokens=i32(m), row_positions=i32(m), cache_rows=i32(m),
            x=f32(m, c.hidden_size), a=f32(m, c.q_lora_rank + c.kv_cache_dim),
            q=f32(m, c.n_heads, c.qk_head_dim),
            q_latent=f32(bs, tc, c.n_heads, c.kv_lora_rank), q_rope=f32(bs, tc, c.n_heads, c.qk_rope_dim),
            attn=f32(bs, tc, c.n_heads, c.kv_lora_rank), lse=f32(bs, tc, c.n_heads),
            workspace=plan.allocate_workspace(), heads=f32(m, c.n_heads, c.v_head_dim),
            h13=f32(m, 2 * c.dense_intermediate) if has_dense else None,
            xn=f32(m, c.hidden_size) if has_moe else None,
            topk_ids=i32(m, k) if has_moe else None, topk_w=f32(m, k) if has_moe else None,
            route_logits=f32(m, c.n_routed_experts) if has_moe and route_grid else None,
            route_counts=cuda.to_device(np.zeros(m, np.int32), stream=stream) if has_moe and route_grid else None,
            row_offsets=cuda.to_device(offsets, stream=stream) if has_moe else None,
            row_index=cuda.to_device(rows, stream=stream) if has_moe else None,
            entry_index=cuda.to_device(np.arange(jx, dtype=np.int32), stream=stream) if has_moe else None,
            slot_of=i32(m, k) if has_moe else None,
            e13=f32(jx, 2 * c.moe_intermediate) if has_moe else None,
            e_out=e_out,
            s13=f32(m, 2 * shared_width) if has_shared and not fold_shared else None,
            s_out=e_out[j:] if fold_shared else f32(m, c.hidden_size) if has_shared else None,
            logits=f32(bs, tc, c.vocab_size),
            features=f32(bs, tc, n_capture * c.hidden_size) if n_capture else None,
        )


class _Views(NamedTuple):
    """Reshaped / sliced views of the :class:`Activations` the kernels take (made once; no copies)."""

    a_q: Any | None  # [M, Qa] column slice of a (low-rank q input)
    a_kv: Any  # [M, C + R] column slice of a (kv_a output)
    q2: Any  # [M, H * (nope + R)]
    q_nope: Any  # [M, H, nope] strided view of q
    q_rope: Any  # [M, H, R]
    q_latent: Any  # [M, H, C]
    attn: Any  # [M, H, C]
    heads: Any  # [M, H * v]
    logits: Any  # [M, V]
    features: Any | None  # [M, n_capture * D]
    route_offsets: Any | None  # int32 [E + 1] the routing's CSR offsets (row_offsets[:E + 1])
    route_index: Any | None  # int32 [J] its entries' rows (row_index[:J])
    routed_out: Any | None  # [J, D] the routed experts' outputs (e_out[:J])

    @classmethod
    def of(cls, c: ModelConfig, b: Activations, m: int) -> _Views:
        qa, h = c.q_lora_rank, c.n_heads
        moe, j = b.row_offsets is not None, m * c.n_activated_experts
        return cls(a_q=b.a[:, :qa] if qa else None, a_kv=b.a[:, qa:], q2=b.q.reshape(m, h * c.qk_head_dim),
                   q_nope=b.q[:, :, :c.qk_nope_dim], q_rope=b.q_rope.reshape(m, h, c.qk_rope_dim),
                   q_latent=b.q_latent.reshape(m, h, c.kv_lora_rank), attn=b.attn.reshape(m, h, c.kv_lora_rank),
                   heads=b.heads.reshape(m, h * c.v_head_dim), logits=b.logits.reshape(m, c.vocab_size),
                   features=None if b.features is None else b.features.reshape(m, b.features.shape[2]),
                   route_offsets=b.row_offsets[:c.n_routed_experts + 1] if moe else None,
                   route_index=b.row_index[:j] if moe else None, routed_out=b.e_out[:j] if moe else None)


# --------------------------------------------------------------------------- the model


def _check_capture(capture_layers: Any, n_layers: int) -> tuple[int, ...]:
    """Distinct layer ids in [0, n_layers), in the given order (the feature column order)."""
    if isinstance(capture_layers, (str, bytes)) or not isinstance(capture_layers, Sequence):
        raise TypeError(f"capture_layers must be a sequence of ints, got {type(capture_layers).__name__}")
    ids = tuple(int_arg(v, "capture_layers", 0) for v in capture_layers)
    if any(v >= n_layers for v in ids):
        raise ValueError(f"capture_layers must lie in [0, {n_layers}), got {list(ids)}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"capture_layers must be distinct, got {list(ids)}")
    return ids


def _check_tensor_core_shapes(config: ModelConfig) -> None:
    """ValueError naming ``products`` unless every dense product's K and its input's row stride
    (floats) are multiples of 4 (linear_tc's 16-byte loads); raised before any upload."""
    c = config
    widths = {"hidden_size": c.hidden_size, "n_heads * v_head_dim": c.n_heads * c.v_head_dim,
              "q_lora_rank + kv_lora_rank + qk_rope_dim (the rows of w_a's output)":
                  c.q_lora_rank + c.kv_lora_rank + c.qk_rope_dim}
    if c.q_lora_rank:
        widths["q_lora_rank"] = c.q_lora_rank
    if c.n_dense_layers:
        widths["dense_intermediate"] = c.dense_intermediate
    if c.n_shared_experts and c.n_layers > c.n_dense_layers:
        widths["n_shared_experts * moe_intermediate"] = c.n_shared_experts * c.moe_intermediate
    odd = [f"{name} = {value}" for name, value in widths.items() if value % 4]
    if odd:
        raise ValueError(f"products='tensor-core' needs the products' K and row strides to be multiples of 4 "
                         f"(kernels/linear_tc.py's 16-byte loads); this config has {', '.join(odd)}")


class TargetModel:
    """The target on one GPU: weights, KV cache, activation buffers and the attention plan, all
    made once in ``__init__``; :meth:`forward` only launches.

    Args:
        config: the model.
        weights: HF-named host parameters (``reference.weights``; uploaded here) or a
            :class:`DeviceWeights` of the same config (shared with another model).
        batch_size: requests per forward (bs).
        kv_capacity: cache rows per request (S), <= config.max_seq_len; positions lie in [0, S).
        max_rows: rows per request per forward (Tc): a prefill chunk, 1 for AR, 1 + budget for a tree.
        capture_layers: target layers whose outputs (hidden-state entries l + 1) are returned as
            features, in this order (the DFlash context, spec §2).
        stream: default stream of the uploads and of :meth:`forward`.
        cache: a :class:`KVCache` to share (same config, batch size and capacity), e.g. between a
            prefill model and a round model; default: a new one.
        attention_split: keys per attention segment (``va.plan``'s ``split_size``), a multiple of
            the attention chunk. Part of the numerics: the models that decode one cache must
            share it for DDTree to stay lossless (``decode.model_with_rows`` does). Smaller
            segments give an AR step over a long cache more blocks at the price of a merge
            launch and more blocks for a tree (PERFORMANCE.md, run "merges timed": at 1000
            cached rows 128 keys cut the AR tile's attention launch 2.2x; at 160 rows they
            slow a 33-node launch by 31 %), and a workspace of ``ceil(kv_capacity / split) x
            bs x max_rows x H x (C + 2)`` floats per model. Default: ``va.DEFAULT_SPLIT_SIZE``
            (2048). Read-only after construction (the plan is made here).
        products: the dense products' kernels, one of :data:`PRODUCTS` (numerics: the models of
            one cache must agree, like ``attention_split``). "tensor-core" needs every product's
            K and input row stride a multiple of 4 floats (checked here) and allocates, once,
            its segment workspace: the largest ``linear_tc.partials_shape`` of the model's
            product shapes, S x M x N floats (small's lm_head: 3 x M x V, three times the logits
            buffer, per model: a long prefill model's is the largest), and an [M] rms workspace.
            Default "cuda-core".
    """

    @property
    def attention_split(self) -> int:
        """Keys per attention segment (numerics; fixed at construction, see the class docstring)."""
        return self._attention_split

    @property
    def products(self) -> str:
        """The dense products' kernels, one of :data:`PRODUCTS` (numerics; fixed at construction)."""
        return self._products

    def __init__(self, config: ModelConfig, weights: Mapping[str, np.ndarray] | DeviceWeights, *, batch_size: int,
                 kv_capacity: int, max_rows: int, capture_layers: Sequence[int] = (), stream: Any = 0,
                 cache: KVCache | None = None, attention_split: int = va.DEFAULT_SPLIT_SIZE,
                 products: str = "cuda-core") -> None:
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        self.config = config
        self.batch_size = int_arg(batch_size, "batch_size", 1)
        self.kv_capacity = int_arg(kv_capacity, "kv_capacity", 1)
        if self.kv_capacity > config.max_seq_len:
            raise ValueError(f"kv_capacity must be <= config.max_seq_len = {config.max_seq_len}, "
                             f"got {self.kv_capacity}")
        self.max_rows = int_arg(max_rows, "max_rows", 1)
        self.capture_layers = _check_capture(capture_layers, config.n_layers)
        # Keys per attention segment: numerics, so AR and tree models of one cache must share it
        # (model_with_rows passes it on; a shared cache remembers it); checked, with the attention
        # plan, before any upload.
        split = int_arg(attention_split, "attention_split", 1)
        if cache is not None and getattr(cache, "attention_split", None) not in (None, split):
            raise ValueError(f"attention_split must be the cache's models' {cache.attention_split} "
                             f"(numerics: AR and tree models of one cache must agree), got {split}")
        self._attention_split = split
        if not isinstance(products, str):
            raise TypeError(f"products must be a str, got {type(products).__name__}")
        if products not in PRODUCTS:
            raise ValueError(f"products must be one of {PRODUCTS}, got {products!r}")
        if cache is not None and getattr(cache, "products", None) not in (None, products):
            raise ValueError(f"products must be the cache's models' {cache.products!r} "
                             f"(numerics: AR and tree models of one cache must agree), got {products!r}")
        if products == "tensor-core":
            _check_tensor_core_shapes(config)
        self._products = products
        self.tile_config = attention_tile_config(config, self.max_rows, self.batch_size)
        self.max_path = self.tile_config.max_path  # longest visible path of a row (prefill chunk bound)
        if split % self.tile_config.chunk:
            raise ValueError(f"attention_split must be a multiple of the attention chunk "
                             f"({self.tile_config.chunk} keys), got {split}")
        segments = -(-self.kv_capacity // split)
        if segments > va.GRID_Y_LIMIT:
            raise ValueError(f"attention_split={split} with kv_capacity={self.kv_capacity}: {segments} "
                             f"segments, more than the launch grid's {va.GRID_Y_LIMIT}")
        self.plan = va.plan(self.batch_size, self.max_rows, config.n_heads, self.kv_capacity,
                            latent_dim=config.kv_lora_rank, rope_dim=config.qk_rope_dim, split_size=split,
                            config=self.tile_config)
        self.stream = stream
        if isinstance(weights, DeviceWeights):
            if weights.config != config:
                raise ValueError("weights: DeviceWeights of another config")
            self.weights = weights
        elif isinstance(weights, Mapping):
            self.weights = DeviceWeights.from_host(config, weights, stream=stream)
        else:
            raise TypeError(f"weights must be a mapping of name -> ndarray or DeviceWeights, "
                            f"got {type(weights).__name__}")
        if cache is None:
            cache = KVCache(config, self.batch_size, self.kv_capacity, stream=stream)
        elif not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}")
        elif (cache.config, cache.batch_size, cache.capacity) != (config, self.batch_size, self.kv_capacity):
            raise ValueError("cache: a KVCache of another config, batch_size or capacity")
        self.cache = cache
        cache.attention_split = split   # what every model of this cache must use
        cache.products = products

        cos, sin = rope_tables(config, self.kv_capacity)  # [S, R / 2] each
        self.rope_cos = cuda.to_device(np.ascontiguousarray(cos, dtype=np.float32), stream=stream)
        self.rope_sin = cuda.to_device(np.ascontiguousarray(sin, dtype=np.float32), stream=stream)
        # The shared expert inside the routed experts' launches where every MoE layer stores it
        # stacked after them (one shared expert) and the products are linear's (the same bits).
        moe = [lw.ffn for lw in self.weights.layers if isinstance(lw.ffn, MoeWeights)]
        self._fold_shared = FOLD_SHARED_EXPERT and products == "cuda-core" and bool(moe) \
            and all(f.w13_all is not None for f in moe)
        # The MoE routing's layout (numerics): the expert grid where its lanes hold the hidden size.
        self._route_by_expert = ROUTE_BY_EXPERT and bool(moe) and route_grid_loads(config.hidden_size) <= MAX_ROUTE_LOADS
        self.buffers = Activations.allocate(config, self.batch_size, self.max_rows, self.plan,
                                            len(self.capture_layers), stream, fold_shared=self._fold_shared,
                                            route_grid=self._route_by_expert)
        self._capture_slot = {layer: i for i, layer in enumerate(self.capture_layers)}
        self._views = _Views.of(config, self.buffers, self.batch_size * self.max_rows)
        self._kv_rows = tuple(kv.flat() for kv in self.cache.layers)  # per layer [bs * S, C], [bs * S, R]
        # o_proj and the dense down_proj as per-segment products where that pays for this many rows
        # (linear.split_k_pays; the same bits: linear.linear_split_k); AR steps keep linear().
        m, d, hv, inter = self.batch_size * self.max_rows, config.hidden_size, config.n_heads * config.v_head_dim, \
            config.dense_intermediate
        self._wo_split = self._w2_split = None
        self._tc = self._tensor_core_workspaces(m, stream) if products == "tensor-core" else None
        # The absorbs read their weights k-major: kernels.absorb always (SEGMENT_ABSORBS), else
        # head_linear's thread-serial kernel where it runs (linear.SERIAL_HEADS on, the GPU
        # default, many rows: linear.serial_plan; the same bits as its warp layout).
        self._segment_absorbs = SEGMENT_ABSORBS and absorb_supported(config.qk_nope_dim, config.kv_lora_rank) \
            and absorb_supported(config.kv_lora_rank, config.v_head_dim)
        self._absorb_kn = None
        if self._segment_absorbs or \
                serial_plan(m, config.n_heads, config.kv_lora_rank, config.qk_nope_dim) is not None:
            self._absorb_kn = (self.weights.k_major("w_uk_t", stream=stream),  # per layer [H, nope, C]
                               self.weights.k_major("w_uv", stream=stream))    # per layer [H, C, v]
        if self._tc is None and split_k_pays(m, hv):
            g = split_k_segments(hv)
            self._wo_split = (self.weights.split("w_o", stream=stream),  # per layer [G, D, Hv / G]
                              self.buffers.heads.reshape(m, g, hv // g),  # [M, G, Hv / G]
                              cuda.device_array((m, g, d), np.float32, stream=stream))  # [M, G, D]
        if self._tc is None and self.buffers.h13 is not None and split_k_pays(m, inter):
            g = split_k_segments(inter)
            act = cuda.device_array((m, inter), np.float32, stream=stream)  # [M, I] silu(gate) * up
            self._w2_split = (self.weights.split("w2", stream=stream), act,  # per layer [G, D, I / G]
                              act.reshape(m, g, inter // g),  # [M, G, I / G]
                              cuda.device_array((m, g, d), np.float32, stream=stream))  # [M, G, D]

    def _tensor_core_workspaces(self, m: int, stream: Any) -> tuple[dict, Any]:
        """linear_tc's workspaces for ``m`` rows: ({(N, K): partials view [S, M, N] or None}, inv_rms
        [M]); one flat buffer serves every shape (the products run one after another). Also makes
        linear_tc's device placeholders now, so that no first call allocates (a captured one)."""
        allocate_placeholders()
        shapes = {tuple(self.weights.lm_head.shape)}
        for lw in self.weights.layers:
            a, f = lw.attn, lw.ffn
            shapes |= {tuple(a.w_a.shape), tuple(a.w_q.shape), tuple(a.w_o.shape)}
            if isinstance(f, DenseFfnWeights):
                shapes |= {tuple(f.w13.shape), tuple(f.w2.shape)}
            elif f.shared_w13 is not None:
                shapes |= {tuple(f.shared_w13.shape), tuple(f.shared_w2.shape)}
        need = {shape: partials_shape(m, *shape) for shape in sorted(shapes)}
        flat = cuda.device_array(max([1] + [int(np.prod(p)) for p in need.values() if p[0] > 1]), np.float32,
                                 stream=stream)
        views = {shape: flat[:int(np.prod(p))].reshape(p) if p[0] > 1 else None for shape, p in need.items()}
        return views, cuda.device_array(m, np.float32, stream=stream)

    def _gemv_runs(self, x: Any, w: Any, **prologue: Any) -> bool:
        """Whether :meth:`_product` runs this product through ``gemv`` (a 1-row product with a
        layout, ROW_PRODUCTS), which reads its first weights before its PDL wait."""
        return self._tc is None and ROW_PRODUCTS and gemv_takes(x, w, norm_weight=prologue.get("norm_weight"),
                                                                swiglu=bool(prologue.get("swiglu")))

    def _expert_gemv_runs(self, x13: Any, w13: Any, out13: Any, x2: Any, w2: Any, out2: Any) -> bool:
        """Whether the MoE's two expert launches run through ``expert_gemv`` (EXPERT_ROW_PRODUCTS
        and both take it: an AR step's few entries); else ``expert_linear``. The same bits."""
        return (ROW_PRODUCTS and EXPERT_ROW_PRODUCTS and self.batch_size * self.max_rows == 1
                and expert_takes(x13, w13, out13) and expert_takes(x2, w2, out2, swiglu=True))

    def _release_before_gemv(self, x: Any, w: Any, **prologue: Any) -> bool:
        """release_next for the launch before this product: it runs through ``gemv`` and
        PDL_RELEASE_EARLY is on."""
        return PDL_RELEASE_EARLY and self._gemv_runs(x, w, **prologue)

    def _product(self, x: Any, w: Any, out: Any, stream: Any, *, release_next: bool = False,
                 **prologue: Any) -> None:
        """out = prologue(x) @ w.T (+ residual) through the model's ``products`` kernels: a 1-row
        product (an AR step at batch 1) through ``gemv`` where it has a layout (ROW_PRODUCTS;
        the same bits as ``linear``). ``release_next``: the next launch reads weights before its
        PDL wait (gemv's pdl_begin_early; the other kernels release at their exits)."""
        if self._tc is None:
            if self._gemv_runs(x, w, **prologue):
                gemv(x, w, out, stream=stream, release_next=release_next, **prologue)
            else:
                linear(x, w, out, stream=stream, **prologue)
        else:
            partials, inv_rms = self._tc
            linear_tc(x, w, out, partials=partials[tuple(w.shape)], inv_rms=inv_rms, stream=stream, **prologue)

    # ------------------------------------------------------------------ inputs

    @staticmethod
    def _stage(arr: Any, staging: Any, stream: Any) -> Any:
        """Device arrays as given; host arrays copied into the model's staging buffer (no allocation)."""
        if isinstance(arr, np.ndarray):
            # A fresh copy has canonical strides (a [:, None] view's stride-0 axis confuses copies).
            staging.copy_to_device(arr.copy(), stream=stream)
            return staging
        return arr

    def _check_host_values(self, tokens: Any, positions: Any, sizes: Any, visibility: Any) -> None:
        """Value checks of host (NumPy) inputs against host ``sizes``; with device ``sizes`` nothing
        is known about which rows are valid, and the device guards take over."""
        tc = self.max_rows
        if not isinstance(sizes, np.ndarray):
            return
        if np.any(sizes < 0) or np.any(sizes > tc):
            raise ValueError(f"sizes must lie in [0, {tc}] (max_rows)")
        live = np.arange(tc)[None, :] < sizes[:, None]  # [bs, Tc]
        if isinstance(tokens, np.ndarray) and np.any(live & ((tokens < 0) | (tokens >= self.config.vocab_size))):
            raise ValueError(f"tokens of valid rows must lie in [0, {self.config.vocab_size})")
        if isinstance(positions, np.ndarray) and np.any(live & ((positions < 0) | (positions >= self.kv_capacity))):
            raise ValueError(f"positions of valid rows must lie in [0, {self.kv_capacity}) (kv_capacity)")
        if isinstance(visibility, np.ndarray):
            try:
                vis = unpack_visibility(visibility, tc)  # [bs, Tc, Tc]
            except ValueError as exc:  # bits past column Tc
                raise ValueError(f"visibility: {exc}") from None
            vis &= live[:, None, :]  # over valid columns
            if np.any(live & ~np.diagonal(vis, axis1=1, axis2=2)):
                raise ValueError("visibility: every valid row must see itself (diagonal bit)")
            if np.any(live[:, :, None] & np.triu(vis, k=1)):
                raise ValueError("visibility: row i may only see rows j <= i (parents precede children)")
            if np.any(vis.sum(axis=2) > self.max_path):
                raise ValueError(f"visibility: a row sees more than max_path = {self.max_path} rows; "
                                 "split the prefill into shorter chunks")

    # ------------------------------------------------------------------ forward

    def forward(self, tokens: Any, positions: Any, sizes: Any, visibility: Any, *, stream: Any = None) -> ForwardOut:
        """Run the target on ``Tc`` rows per request; new KV rows go to ``past_lens[b] + i``.

        Args:
            tokens: int32 [bs, Tc] token ids (rows i >= sizes[b] ignored).
            positions: int32 [bs, Tc] RoPE positions in [0, kv_capacity) (tree: past_len + depth).
            sizes: int32 [bs] valid rows per request, in [0, Tc].
            visibility: uint32 [bs, Tc, ceil(Tc / 32)] packed ancestor-or-self rows (causal for
                prefill: :func:`prefill_visibility`).
            Device arrays are used in place; NumPy arrays are value-checked, then copied into the
            model's staging buffers.
            stream: launch stream (default: the model's).

        Returns:
            :class:`ForwardOut` of model-owned device buffers. ``cache.past_lens`` is not advanced.

        Raises:
            TypeError / ValueError naming the argument, before any launch.
        """
        stream = self.stream if stream is None else stream
        bs, tc, b = self.batch_size, self.max_rows, self.buffers
        tokens = check_array(tokens, "tokens", np.int32, shape=(bs, tc))
        positions = check_array(positions, "positions", np.int32, shape=(bs, tc))
        sizes = check_array(sizes, "sizes", np.int32, shape=(bs,))
        visibility = check_array(visibility, "visibility", np.uint32, shape=(bs, tc, -(-tc // 32)))
        self._check_host_values(tokens, positions, sizes, visibility)
        # Host inputs are staged only once every check has passed (nothing half-written).
        tokens = self._stage(tokens, b.tokens, stream)
        positions = self._stage(positions, b.positions, stream)
        sizes = self._stage(sizes, b.sizes, stream)
        visibility = self._stage(visibility, b.visibility, stream)

        m = bs * tc
        threads = SIM_THREADS if cuda.config.ENABLE_CUDASIM else PREP_THREADS
        launch(_prepare_rows_kernel, -(-m // threads), threads, stream, 0, tokens.reshape(m),
               positions.reshape(m), sizes, self.cache.past_lens, np.int32(tc), np.int32(self.kv_capacity),
               b.row_tokens, b.row_positions, b.cache_rows)
        layers = self.weights.layers
        # PDL (kernels.pdl): a kernel releases the next one right after its wait only where that
        # one reads weights before its own wait (a 1-row gemv, a 1-row split absorb); here, each
        # layer's first product (w_a) and the lm_head after the embedding or an FFN that no
        # capture follows.
        firsts = [self._release_before_gemv(b.x, lw.attn.w_a, norm_weight=lw.attn.norm) for lw in layers]
        firsts.append(self._release_before_gemv(b.x, self.weights.lm_head, norm_weight=self.weights.final_norm))
        embed(b.row_tokens, self.weights.embed, b.x, stream=stream, release_next=firsts[0])
        for i, (lw, kv) in enumerate(zip(layers, self.cache.layers)):
            self._attention(lw, kv, sizes, visibility, stream)
            captured = lw.index in self._capture_slot
            self._ffn(lw, stream, release_next=not captured and firsts[i + 1])
            if captured:
                self._capture(lw.index, stream)
        self._product(b.x, self.weights.lm_head, self._views.logits, stream, norm_weight=self.weights.final_norm,
                      eps=self.config.rms_norm_eps)  # [M, V]
        return ForwardOut(logits=b.logits, features=b.features)

    def _release_before_absorb(self, x: Any, w_kn: Any) -> bool:
        """release_next for the launch before this absorb: :meth:`_absorb` launches the 1-row split
        absorb, which reads its first weights before its PDL wait, and PDL_RELEASE_EARLY is on."""
        return PDL_RELEASE_EARLY and self._segment_absorbs and absorb_reads_weights_first(x, w_kn)

    def _absorb(self, x: Any, w: Any, w_kn: Any, out: Any, stream: Any, *, release_next: bool = False) -> None:
        """out[m, h] = x[m, h] @ w[h].T: kernels.absorb (w k-major) with the segment absorbs on,
        else head_linear (w, and w_kn where its many-row kernel takes it). ``release_next``: as
        :meth:`_product`'s (the split absorb's pdl_begin_early)."""
        if self._segment_absorbs:
            absorb(x, w_kn, out, stream=stream, release_next=release_next)
        else:
            head_linear(x, w, out, w_kn=w_kn, stream=stream)

    def _attention(self, lw: LayerWeights, kv: LayerKV, sizes: Any, visibility: Any, stream: Any) -> None:
        """x += wo(W_UV · verify_attention(absorbed q, cache)) for one layer, its new rows cached first."""
        c, b, v, w = self.config, self.buffers, self._views, lw.attn
        eps = c.rms_norm_eps
        uk_kn, uv_kn = (None, None) if self._absorb_kn is None else (kn[lw.index] for kn in self._absorb_kn)
        q_in, q_norm = (v.a_q, w.q_norm) if v.a_q is not None else (b.x, w.norm)
        self._product(b.x, w.w_a, b.a, stream, norm_weight=w.norm, eps=eps,
                      release_next=self._release_before_gemv(q_in, w.w_q, norm_weight=q_norm))  # [M, Qa + C + R]
        self._product(q_in, w.w_q, v.q2, stream, norm_weight=q_norm, eps=eps)  # [M, H * (nope + R)]
        latent_rows, rope_rows = self._kv_rows[lw.index]  # [bs * S, C], [bs * S, R]
        if FUSED_ROPE_KV_WRITE:  # q's RoPE [M, H, R] and the new cache rows in one launch
            mla_rope_kv_write(b.q, v.q_rope, v.a_kv, w.kv_norm, eps, self.rope_cos, self.rope_sin,
                              b.row_positions, b.cache_rows, latent_rows, rope_rows, layout=c.rope_layout,
                              stream=stream, release_next=self._release_before_absorb(v.q_nope, uk_kn))
        else:
            mla_q_rope(b.q, self.rope_cos, self.rope_sin, b.row_positions, v.q_rope, layout=c.rope_layout,
                       stream=stream)  # [M, H, R]
            mla_kv_write(v.a_kv, w.kv_norm, eps, self.rope_cos, self.rope_sin, b.row_positions, b.cache_rows,
                         latent_rows, rope_rows, layout=c.rope_layout, stream=stream)
        self._absorb(v.q_nope, w.w_uk_t, uk_kn, v.q_latent, stream)  # [M, H, C]
        va.run(self.plan, b.q_latent, b.q_rope, kv.latent, kv.k_rope, self.cache.past_lens, sizes, visibility,
               c.softmax_scale, b.attn, b.lse, b.workspace, stream=stream,
               release_next=self._release_before_absorb(v.attn, uv_kn))  # [bs, Tc, H, C]
        self._absorb(v.attn, w.w_uv, uv_kn, b.heads, stream,
                     release_next=self._wo_split is None and self._release_before_gemv(v.heads, w.w_o))  # [M, H, v]
        if self._wo_split is None:
            f = lw.ffn   # the FFN's first launch: the dense gate | up (a product), else the routing
            self._product(v.heads, w.w_o, b.x, stream, residual=b.x,
                          release_next=isinstance(f, DenseFfnWeights) and self._release_before_gemv(
                              b.x, f.w13, norm_weight=f.norm))  # [M, D]
        else:
            w_split, heads, parts = self._wo_split
            linear_split_k(heads, w_split[lw.index], parts, b.x, residual=b.x, stream=stream)  # [M, D]

    def _ffn(self, lw: LayerWeights, stream: Any, *, release_next: bool = False) -> None:
        """x += FFN(rmsnorm(x)): dense SwiGLU, or routed experts + shared expert. ``release_next``:
        the launch after the FFN reads weights before its PDL wait (the next layer's 1-row w_a, or
        the lm_head's)."""
        c, b, f = self.config, self.buffers, lw.ffn
        eps = c.rms_norm_eps
        if isinstance(f, DenseFfnWeights):
            self._product(b.x, f.w13, b.h13, stream, norm_weight=f.norm, eps=eps,
                          release_next=self._w2_split is None and self._release_before_gemv(
                              b.h13, f.w2, swiglu=True))  # [M, 2I]
            if self._w2_split is None:
                self._product(b.h13, f.w2, b.x, stream, swiglu=True, residual=b.x,
                              release_next=release_next)  # [M, D]
            else:
                w_split, act, act_split, parts = self._w2_split
                swiglu_rows(b.h13, act, stream=stream)  # [M, I]
                linear_split_k(act_split, w_split[lw.index], parts, b.x, residual=b.x, stream=stream)  # [M, D]
            return
        assert isinstance(f, MoeWeights)
        v = self._views
        m = self.batch_size * self.max_rows if EXPERT_TILE_BY_ROWS else None   # the most entries an expert holds
        if self._route_by_expert:  # xn = its rms_norm(x) [M, D]: a block per (expert, row), one launch at one row
            moe_route(b.xn, f.gate, f.bias, c, b.topk_ids, b.topk_w, v.route_offsets, v.route_index, b.slot_of,
                      x=b.x, norm_weight=f.norm, eps=eps, logits=b.route_logits, counts=b.route_counts,
                      stream=stream)
        elif FUSED_MOE_NORM:  # xn = rms_norm(x) [M, D], written by the routing launch before its gate reads it
            moe_route(b.xn, f.gate, f.bias, c, b.topk_ids, b.topk_w, v.route_offsets, v.route_index, b.slot_of,
                      x=b.x, norm_weight=f.norm, eps=eps, stream=stream)
        else:
            rms_norm(b.x, f.norm, eps, b.xn, stream=stream)  # [M, D]
            moe_route(b.xn, f.gate, f.bias, c, b.topk_ids, b.topk_w, v.route_offsets, v.route_index, b.slot_of,
                      stream=stream)
        # folded: the shared expert is expert E, entries [J, J + M) (b.s_out = e_out[J:]); Jx = J + M, else J
        w13, w2 = (f.w13_all, f.w2_all) if self._fold_shared else (f.w13, f.w2)
        if self._expert_gemv_runs(b.xn, w13, b.e13, b.e13, w2, b.e_out):  # an AR step: a block row an entry
            expert_gemv(b.xn, w13, b.e13, b.row_offsets, b.row_index, stream=stream)  # [Jx, 2I]
            expert_gemv(b.e13, w2, b.e_out, b.row_offsets, b.entry_index, swiglu=True, stream=stream)  # [Jx, D]
        else:
            expert_linear(b.xn, w13, b.e13, b.row_offsets, b.row_index, stream=stream)  # [Jx, 2I]
            expert_linear(b.e13, w2, b.e_out, b.row_offsets, b.entry_index, swiglu=True, max_rows=m,
                          stream=stream)  # [Jx, D]
        if f.shared_w13 is not None and not self._fold_shared:
            self._product(b.xn, f.shared_w13, b.s13, stream,
                          release_next=self._release_before_gemv(b.s13, f.shared_w2, swiglu=True))  # [M, 2Is]
            self._product(b.s13, f.shared_w2, b.s_out, stream, swiglu=True)  # [M, D]
        moe_combine(b.x, v.routed_out, b.slot_of, b.topk_w, b.s_out, b.x, stream=stream,
                    release_next=release_next)  # [M, D]

    def _capture(self, layer: int, stream: Any) -> None:
        """features[..., slot * D:(slot + 1) * D] = x (hidden-state entry layer + 1)."""
        m, d = self.batch_size * self.max_rows, self.config.hidden_size
        launch(_copy_columns_kernel, *_copy_grid(m * d), stream, 0, self.buffers.x, self._views.features,
               np.int32(self._capture_slot[layer] * d))

    def advance(self, lengths: Any, *, stream: Any = None) -> None:
        """``cache.past_lens += lengths`` on the device (int32 [bs])."""
        self.cache.advance(lengths, stream=self.stream if stream is None else stream)
