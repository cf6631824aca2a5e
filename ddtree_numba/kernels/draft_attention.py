"""DFlash drafter kernels: non-causal GQA block attention (plan / run) and its input kernels (spec §2).

Attention. Every block query (row r of request b's block, head h) attends, with no mask, to the
request's ``cache_lens[b]`` cached context rows and then to all ``T`` block rows, through key /
value head ``h // (H / Hkv)``, scale ``head_dim^-1/2``. Numerics: a query's keys form ONE
sequence (cache rows, then block rows); it is reduced in chunks of ``chunk`` keys at multiples of
``chunk`` with an online softmax (running max and sum, limits §7), each chunk's scores and
``P V`` sums in ascending key order. Nothing depends on the other queries, requests or the grid,
so a request's output is bit-identical whatever shares the launch, and deterministic run to run.

Work layout: grid ``(Hkv * n_tiles, bs)``; a block takes one key/value head of one request and a
tile of ``queries`` of its ``T * G`` queries (G = H / Hkv query heads per key/value head; the
tile's queries read the same keys). Per chunk: stage K (rows padded by one float, so the lanes of
a warp reading one dim of 32 keys hit 32 banks) and V in shared memory, one score per thread
(``[queries, chunk]``), the softmax update by one thread per query, then ``acc += P V`` with a
``queries * head_dim / threads`` register tile per thread. The drafter's attention is a small
part of a round (a few thousand keys, 16-64 queries per head group), so the kernel favours a
fixed, simple order over split-K parallelism.

Input kernels (one thread per head vector or per copied float; all device-guarded):

- :func:`block_embed`: the block ``[bonus, mask × (T - 1)]`` embedded with the target's table;
  NaN rows when the round's ``start`` disagrees with the drafter's context length (a caller bug)
  or a token id is out of range;
- :func:`norm_rope`: q_norm / k_norm (RMSNorm over head_dim) and NeoX RoPE of the block's Q and K,
  in place, at positions ``start[b] + r``;
- :func:`context_kv_write`: k_norm + RoPE of new context rows for all draft layers at once
  (context K / V depend only on c, spec §2), written to each layer's cache at ``base[b] + i``;
- :func:`gather_rows`: rows of a [bs, N, F] buffer by index (verify features of accepted nodes,
  spec §1.6; the block's last rows before the lm_head);
- :func:`context_lengths`: ``cache_lens = base + counts`` (-1 when over capacity: poisons the
  next draft into NaN instead of a silent truncation).

Host wrappers check types and shapes (and values of NumPy inputs) before any launch; device
values are guarded on the device. None copies device data to the host (graph-capturable).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda, float32, int32

from ddtree_numba.kernels._args import check_array, check_shape, host_values, int_arg, positive_real
from ddtree_numba.kernels.pdl import pdl_begin
from ddtree_numba.kernels.registry import register
from sim.launch import launch

__all__ = [
    "AttentionConfig",
    "DraftAttentionPlan",
    "default_config",
    "get_attention_kernel",
    "plan",
    "run",
    "draft_attention",
    "block_embed",
    "norm_rope",
    "context_kv_write",
    "gather_rows",
    "context_lengths",
    "HELPER_THREADS",
]

WARP = 32
HELPER_THREADS = 128  # block size of the input kernels on a GPU
SIM_HELPER_THREADS = 32  # the simulator runs each thread as a Python thread
NAN32 = float32(math.nan)
NEG_INF32 = float32(-math.inf)


def _helper_threads() -> int:
    return SIM_HELPER_THREADS if cuda.config.ENABLE_CUDASIM else HELPER_THREADS


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionConfig:
    """One compile-time specialisation of the attention kernel.

    ``head_dim`` and ``chunk`` fix the order of the floating-point operations; ``queries`` and
    ``threads`` only move work between blocks and threads.

    Attributes:
        head_dim: per-head width.
        queries: queries per block (a tile of one key/value head's T * G queries).
        chunk: keys per online-softmax step.
        threads: threads per block; divides queries * head_dim and queries * chunk.
    """

    head_dim: int
    queries: int
    chunk: int
    threads: int

    @property
    def acc_per_thread(self) -> int:
        """Output values (query, dim) each thread accumulates."""
        return self.queries * self.head_dim // self.threads

    @property
    def static_shared_bytes(self) -> int:
        """Q tile, padded K chunk, V chunk, probabilities, running max / sum / rescale."""
        return 4 * (self.queries * self.head_dim + self.chunk * (self.head_dim + 1)
                    + self.chunk * self.head_dim + self.queries * self.chunk + 3 * self.queries)

    def validate(self) -> None:
        """Raise ValueError naming 'config' unless the tiling is consistent and fits 48 KiB."""
        fields = (self.head_dim, self.queries, self.chunk, self.threads)
        checks = [
            (all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in fields),
             "every field must be a positive int"),
            (self.threads % WARP == 0 and self.threads <= 1024, "threads must be a multiple of 32 and <= 1024"),
            (self.queries <= self.threads, "queries must be <= threads (one softmax thread per query)"),
            ((self.queries * self.head_dim) % self.threads == 0, "threads must divide queries * head_dim"),
            ((self.queries * self.chunk) % self.threads == 0, "threads must divide queries * chunk"),
            (self.static_shared_bytes <= 48 * 1024, "shared memory must fit the 48 KiB default (limits §4)"),
        ]
        for ok, why in checks:
            if not ok:
                raise ValueError(f"config: {why} ({self})")


def default_config(head_dim: int) -> AttentionConfig:
    """The specialisation :func:`plan` uses for ``head_dim`` (a function of it only).

    head_dim <= 32 (the simulator's tiny drafter): 32 threads, chunks of 16 keys; larger
    (Qwen3's 128): 128 threads, chunks of 32 keys, 8 queries per block (42 KiB shared memory).
    """
    if head_dim <= 32:
        return AttentionConfig(head_dim=head_dim, queries=8, chunk=16, threads=32)
    return AttentionConfig(head_dim=head_dim, queries=8, chunk=32, threads=128)


@functools.cache
def get_attention_kernel(config: AttentionConfig) -> Any:
    """The attention kernel specialised for ``config`` (compiled lazily, cached)."""
    config.validate()
    HD = config.head_dim
    HDP = HD + 1  # padded K row: a warp reading one dim of 32 keys touches 32 banks
    QT = config.queries
    CHUNK = config.chunk
    THREADS = config.threads
    ACC = config.acc_per_thread
    SCORES = QT * CHUNK // THREADS
    Q_FLOATS = QT * HD  # shared-array sizes must be plain constants, not expressions
    K_FLOATS = CHUNK * HDP
    V_FLOATS = CHUNK * HD
    P_FLOATS = QT * CHUNK

    @cuda.jit
    def attention(q, kv_block, cache_k, cache_v, cache_lens, scale, out):
        """q [bs, T, H, HD], kv_block [bs, T, 2, Hkv, HD] (k, v), cache_k / cache_v [bs, S, Hkv, HD],
        cache_lens int32 [bs], scale float32 -> out [bs, T, H, HD]. Grid (Hkv * n_tiles, bs)."""
        sh_q = cuda.shared.array(Q_FLOATS, float32)  # [QT, HD] the tile's queries
        sh_k = cuda.shared.array(K_FLOATS, float32)  # [CHUNK, HD + 1] keys of the chunk
        sh_v = cuda.shared.array(V_FLOATS, float32)  # [CHUNK, HD] values of the chunk
        sh_p = cuda.shared.array(P_FLOATS, float32)  # [QT, CHUNK] scores, then probabilities
        sh_m = cuda.shared.array(QT, float32)  # running max per query
        sh_l = cuda.shared.array(QT, float32)  # running sum per query
        sh_alpha = cuda.shared.array(QT, float32)  # rescale of the accumulators for this chunk
        pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
        acc = cuda.local.array(ACC, float32)

        tid = cuda.threadIdx.x
        b = cuda.blockIdx.y
        t_rows = q.shape[1]
        n_heads = q.shape[2]
        n_kv = cache_k.shape[2]
        group = n_heads // n_kv
        n_query = t_rows * group
        n_tiles = (n_query + QT - 1) // QT
        g = cuda.blockIdx.x // n_tiles
        q0 = (cuda.blockIdx.x % n_tiles) * QT
        n_cache = cache_lens[b]
        valid = n_cache >= 0 and n_cache <= cache_k.shape[1]
        if not valid:
            n_cache = 0  # still run the loop shape; outputs become NaN below
        n_keys = n_cache + t_rows

        for e in range(tid, Q_FLOATS, THREADS):  # stage the tile's queries (zeros past the last)
            qi = e // HD
            qg = q0 + qi
            sh_q[e] = q[b, qg // group, g * group + qg % group, e % HD] if qg < n_query else float32(0.0)
        if tid < QT:
            sh_m[tid] = NEG_INF32
            sh_l[tid] = float32(0.0)
        for k in range(ACC):
            acc[k] = float32(0.0)

        for c0 in range(0, n_keys, CHUNK):
            cuda.syncthreads()  # the previous chunk's P·V reads are done before K / V / P are replaced
            for e in range(tid, V_FLOATS, THREADS):
                j = e // HD
                d = e % HD
                p = c0 + j
                kval = float32(0.0)
                vval = float32(0.0)
                if p < n_cache:
                    kval = cache_k[b, p, g, d]
                    vval = cache_v[b, p, g, d]
                elif p < n_keys:
                    kval = kv_block[b, p - n_cache, 0, g, d]
                    vval = kv_block[b, p - n_cache, 1, g, d]
                sh_k[j * HDP + d] = kval
                sh_v[e] = vval
            cuda.syncthreads()  # the chunk's keys and values are staged
            for s in range(SCORES):
                e = tid + s * THREADS
                qi = e // CHUNK
                j = e % CHUNK
                dot = float32(0.0)
                for d in range(HD):
                    dot += sh_q[qi * HD + d] * sh_k[j * HDP + d]
                sh_p[e] = dot * scale if c0 + j < n_keys else NEG_INF32
            cuda.syncthreads()  # every score of the chunk is written
            if tid < QT:
                m_old = sh_m[tid]
                m_new = m_old
                for j in range(CHUNK):
                    m_new = max(m_new, sh_p[tid * CHUNK + j])
                alpha = math.exp(m_old - m_new)  # 0 on the first chunk (m_old = -inf, m_new finite)
                total = sh_l[tid] * alpha
                for j in range(CHUNK):
                    pj = math.exp(sh_p[tid * CHUNK + j] - m_new)
                    sh_p[tid * CHUNK + j] = pj
                    total += pj
                sh_m[tid] = m_new
                sh_l[tid] = total
                sh_alpha[tid] = alpha
            cuda.syncthreads()  # probabilities and rescale factors are ready
            for k in range(ACC):
                e = tid + k * THREADS
                qi = e // HD
                d = e % HD
                a = acc[k] * sh_alpha[qi]
                for j in range(CHUNK):
                    a += sh_p[qi * CHUNK + j] * sh_v[j * HD + d]
                acc[k] = a

        for k in range(ACC):  # sh_l is final: the last barrier followed its last update
            e = tid + k * THREADS
            qi = e // HD
            qg = q0 + qi
            if qg < n_query:
                value = acc[k] / sh_l[qi] if valid else NAN32
                out[b, qg // group, g * group + qg % group, e % HD] = value

    return attention


@dataclass(frozen=True)
class DraftAttentionPlan:
    """Launch layout for one batch shape (host only; no per-step data in it).

    Attributes:
        config: the kernel specialisation.
        batch_size, block_rows, n_heads, n_kv_heads, kv_capacity: bs, T, H, Hkv, S of the arrays.
        n_tiles: query tiles per key/value head, ceil(T * H / Hkv / config.queries).
    """

    config: AttentionConfig
    batch_size: int
    block_rows: int
    n_heads: int
    n_kv_heads: int
    kv_capacity: int
    n_tiles: int

    @property
    def grid(self) -> tuple[int, int]:
        return (self.n_kv_heads * self.n_tiles, self.batch_size)


def plan(batch_size: int, block_rows: int, n_heads: int, n_kv_heads: int, head_dim: int, kv_capacity: int,
         *, config: AttentionConfig | None = None) -> DraftAttentionPlan:
    """Work layout of the block attention (host only, once per shape).

    Args:
        batch_size, block_rows, n_heads, n_kv_heads, head_dim: bs, T, H, Hkv, hd (Hkv divides H).
        kv_capacity: S, rows of the context cache per request (>= 0).
        config: the specialisation; default :func:`default_config` of ``head_dim``.
    """
    batch_size = int_arg(batch_size, "batch_size")
    block_rows = int_arg(block_rows, "block_rows")
    n_heads = int_arg(n_heads, "n_heads")
    n_kv_heads = int_arg(n_kv_heads, "n_kv_heads")
    head_dim = int_arg(head_dim, "head_dim")
    kv_capacity = int_arg(kv_capacity, "kv_capacity", 0)
    if n_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads must divide n_heads = {n_heads}, got {n_kv_heads}")
    if config is None:
        config = default_config(head_dim)
    elif not isinstance(config, AttentionConfig):
        raise TypeError(f"config must be an AttentionConfig, got {type(config).__name__}")
    config.validate()
    if config.head_dim != head_dim:
        raise ValueError(f"config: head_dim {config.head_dim} differs from head_dim = {head_dim}")
    n_tiles = -(-block_rows * (n_heads // n_kv_heads) // config.queries)
    if batch_size > 65535:
        raise ValueError(f"batch_size must be <= 65535 (grid y), got {batch_size}")
    return DraftAttentionPlan(config, batch_size, block_rows, n_heads, n_kv_heads, kv_capacity, n_tiles)


def _finite(arr: Any, name: str) -> None:
    """NumPy float inputs must be finite (the reference rejects NaN / inf); device arrays are not read."""
    values = host_values(arr)
    if values is not None and not np.all(np.isfinite(values)):
        raise ValueError(f"{name} must be finite (found NaN or infinity)")


def run(p: DraftAttentionPlan, q: Any, kv_block: Any, cache_k: Any, cache_v: Any, cache_lens: Any,
        scale: float, out: Any, *, stream: Any = 0) -> None:
    """Launch the block attention into caller-owned ``out``.

    Args:
        p: the :func:`plan` for these shapes.
        q: float32 [bs, T, H, hd], the block's queries (normed, RoPE'd).
        kv_block: float32 [bs, T, 2, Hkv, hd], the block's keys (normed, RoPE'd) and values.
        cache_k, cache_v: float32 [bs, S, Hkv, hd], context rows 0 .. cache_lens[b] - 1 of request b.
        cache_lens: int32 [bs] in [0, S] (device values outside give NaN outputs for that request).
        scale: softmax scale, finite and > 0 (head_dim^-1/2).
        out: float32 [bs, T, H, hd].
        stream: 0, a numba stream or a cuda.core Stream / GraphBuilder.

    Raises:
        TypeError / ValueError naming the argument, before any launch.
    """
    if not isinstance(p, DraftAttentionPlan):
        raise TypeError(f"p must be a DraftAttentionPlan, got {type(p).__name__}")
    bs, t, h, hkv, s, hd = p.batch_size, p.block_rows, p.n_heads, p.n_kv_heads, p.kv_capacity, p.config.head_dim
    q = check_array(q, "q", np.float32, shape=(bs, t, h, hd))
    kv_block = check_array(kv_block, "kv_block", np.float32, shape=(bs, t, 2, hkv, hd))
    cache_k = check_array(cache_k, "cache_k", np.float32, shape=(bs, s, hkv, hd))
    cache_v = check_array(cache_v, "cache_v", np.float32, shape=(bs, s, hkv, hd))
    cache_lens = check_array(cache_lens, "cache_lens", np.int32, shape=(bs,))
    out = check_array(out, "out", np.float32, shape=(bs, t, h, hd))
    scale = positive_real(scale, "scale")
    lens = host_values(cache_lens)
    if lens is not None and np.any((lens < 0) | (lens > s)):
        raise ValueError(f"cache_lens must lie in [0, {s}]")
    for name, arr in (("q", q), ("kv_block", kv_block)):
        _finite(arr, name)
    for name, arr in (("cache_k", cache_k), ("cache_v", cache_v)):  # only the rows read
        values = host_values(arr)
        if values is not None and lens is not None:
            for b in range(bs):
                if not np.all(np.isfinite(values[b, :lens[b]])):
                    raise ValueError(f"{name} must be finite on the cached rows (request {b})")
    launch(get_attention_kernel(p.config), p.grid, p.config.threads, stream, 0,
           q, kv_block, cache_k, cache_v, cache_lens, scale, out)


def draft_attention(q: np.ndarray, kv_block: np.ndarray, cache_k: np.ndarray, cache_v: np.ndarray,
                    cache_lens: np.ndarray, scale: float, *, config: AttentionConfig | None = None) -> np.ndarray:
    """Convenience: plan, allocate and run on NumPy arrays; returns ``out`` [bs, T, H, hd] (NumPy)."""
    for name, arr, ndim in (("q", q, 4), ("kv_block", kv_block, 5), ("cache_k", cache_k, 4)):
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array, got {type(arr).__name__}")
        if arr.ndim != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    bs, t, h, hd = q.shape
    p = plan(bs, t, h, kv_block.shape[3], hd, cache_k.shape[1], config=config)
    out = np.zeros(q.shape, dtype=np.float32)
    run(p, q, kv_block, cache_k, cache_v, cache_lens, scale, out)
    return out


# ----------------------------------------------------------------------------------------------
# Input kernels
# ----------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def _norm_rope_vec(x, weight, cos, sin, pos, eps):
    """In place on one head vector x [hd]: RMSNorm with ``weight`` [hd], then NeoX RoPE at row
    ``pos`` of the cos / sin tables [P, hd / 2]; a position outside the tables gives NaN."""
    hd = x.shape[0]
    half = hd // 2
    if pos < 0 or pos >= cos.shape[0]:
        for d in range(hd):
            x[d] = NAN32
        return
    ss = float32(0.0)
    for d in range(hd):
        ss += x[d] * x[d]
    inv = float32(1.0) / math.sqrt(ss / float32(hd) + eps)
    for i in range(half):  # both halves of a pair are read before either is written
        a = x[i] * inv * weight[i]
        c = x[i + half] * inv * weight[i + half]
        x[i] = a * cos[pos, i] - c * sin[pos, i]
        x[i + half] = a * sin[pos, i] + c * cos[pos, i]


@cuda.jit
def _norm_rope_kernel(q, kv_block, q_weight, k_weight, cos, sin, start, eps):
    """q [bs, T, H, hd] and the keys of kv_block [bs, T, 2, Hkv, hd], in place: head norm + RoPE at
    position start[b] + r. One thread per (row, head) vector; grid (ceil(T * (H + Hkv) / threads), bs)."""
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    b = cuda.blockIdx.y
    e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    t_rows, n_heads, n_kv = q.shape[1], q.shape[2], kv_block.shape[3]
    per_row = n_heads + n_kv
    if e >= t_rows * per_row:
        return
    r = e // per_row
    head = e % per_row
    pos = start[b] + r
    if head < n_heads:
        _norm_rope_vec(q[b, r, head], q_weight, cos, sin, pos, eps)
    else:
        _norm_rope_vec(kv_block[b, r, 0, head - n_heads], k_weight, cos, sin, pos, eps)


@cuda.jit
def _context_kv_kernel(kv_ctx, k_weight, cos, sin, base, counts, cache_k, cache_v, eps):
    """New context rows -> every layer's cache. kv_ctx [bs, R, n_layers, 2, Hkv, hd] (k, v of each
    layer, in place), k_weight [n_layers, hd], base / counts int32 [bs]; row i < counts[b] goes to
    cache row base[b] + i (skipped at or past S) at position base[b] + i. cache_k / cache_v
    [n_layers, bs, S, Hkv, hd]. One thread per (row, layer, head); grid (ceil(R * n_layers * Hkv / threads), bs)."""
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    b = cuda.blockIdx.y
    e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    n_rows, n_layers, n_kv, hd = kv_ctx.shape[1], kv_ctx.shape[2], kv_ctx.shape[4], kv_ctx.shape[5]
    if e >= n_rows * n_layers * n_kv:
        return
    i = e // (n_layers * n_kv)
    layer = (e // n_kv) % n_layers
    g = e % n_kv
    row = base[b] + i
    if i >= counts[b] or base[b] < 0 or row >= cache_k.shape[2]:
        return
    key = kv_ctx[b, i, layer, 0, g]
    _norm_rope_vec(key, k_weight[layer], cos, sin, row, eps)
    for d in range(hd):
        cache_k[layer, b, row, g, d] = key[d]
        cache_v[layer, b, row, g, d] = kv_ctx[b, i, layer, 1, g, d]


@cuda.jit
def _block_embed_kernel(table, bonus, start, cache_lens, mask_token, out):
    """out [bs, T, D] = table rows of [bonus[b], mask × (T - 1)]; NaN rows when a token is out of
    range or start[b] != cache_lens[b] (the context and the round disagree). Grid (ceil(D / threads), T, bs)."""
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    d = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    r = cuda.blockIdx.y
    b = cuda.blockIdx.z
    if d >= out.shape[2]:
        return
    token = bonus[b] if r == 0 else mask_token
    ok = token >= 0 and token < table.shape[0] and cache_lens[b] >= 0 and start[b] == cache_lens[b]
    out[b, r, d] = table[token, d] if ok else NAN32


@cuda.jit
def _gather_rows_kernel(src, index, counts, dst, counts_out):
    """dst[b, j] = src[b, index[b, j]] for j < counts[b] (NaN row for an index outside [0, N));
    counts_out[b] = counts[b], or -1 (nothing copied) when counts[b] is outside [0, min(J, W)].
    Grid (ceil(F / threads), J, bs)."""
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    f = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    j = cuda.blockIdx.y
    b = cuda.blockIdx.z
    n = counts[b]
    ok = n >= 0 and n <= dst.shape[1] and n <= index.shape[1]
    if f == 0 and j == 0:
        counts_out[b] = n if ok else -1
    if f >= dst.shape[2] or not ok or j >= n:
        return
    i = index[b, j]
    dst[b, j, f] = src[b, i, f] if i >= 0 and i < src.shape[1] else NAN32


@cuda.jit
def _context_lengths_kernel(cache_lens, base, counts, capacity, clear):
    """cache_lens[b] = base[b] + counts[b], or -1 (poison) when negative or over ``capacity``;
    counts[b] = 0 when ``clear``. One thread per request (cache_lens may alias base)."""
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    b = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if b >= cache_lens.shape[0]:
        return
    start = base[b]
    n = counts[b]
    total = start + n
    cache_lens[b] = total if start >= 0 and n >= 0 and total <= capacity else -1
    if clear != 0:
        counts[b] = 0


# ----------------------------------------------------------------------------------------------
# Host wrappers of the input kernels
# ----------------------------------------------------------------------------------------------

def _rope_tables(cos: Any, sin: Any, head_dim: int) -> tuple[Any, Any]:
    cos = check_array(cos, "cos", np.float32, 2)
    if cos.shape[1] != head_dim // 2 or cos.shape[0] < 1:
        raise ValueError(f"cos must have shape (P, {head_dim // 2}) with P >= 1, got {tuple(cos.shape)}")
    sin = check_array(sin, "sin", np.float32, shape=tuple(cos.shape))
    return cos, sin


def _grid_1d(n: int, threads: int) -> int:
    return max(1, -(-n // threads))


def norm_rope(q: Any, kv_block: Any, q_weight: Any, k_weight: Any, cos: Any, sin: Any, start: Any, eps: float,
              *, stream: Any = 0) -> None:
    """q_norm / k_norm and NeoX RoPE of the block's queries and keys, in place.

    Args:
        q: float32 [bs, T, H, hd]; kv_block: float32 [bs, T, 2, Hkv, hd] (only the keys change).
        q_weight, k_weight: float32 [hd]; cos, sin: float32 [P, hd / 2] (row = position).
        start: int32 [bs]; row r of request b sits at position start[b] + r (outside [0, P): NaN).
        eps: RMSNorm epsilon.
    """
    q = check_array(q, "q", np.float32, 4)
    bs, t, h, hd = q.shape
    kv_block = check_array(kv_block, "kv_block", np.float32, 5)
    if tuple(kv_block.shape[:3]) != (bs, t, 2) or kv_block.shape[4] != hd:
        raise ValueError(f"kv_block must have shape ({bs}, {t}, 2, Hkv, {hd}), got {tuple(kv_block.shape)}")
    q_weight = check_array(q_weight, "q_weight", np.float32, shape=(hd,))
    k_weight = check_array(k_weight, "k_weight", np.float32, shape=(hd,))
    cos, sin = _rope_tables(cos, sin, hd)
    start = check_array(start, "start", np.int32, shape=(bs,))
    eps = positive_real(eps, "eps")
    values = host_values(start)
    if values is not None and np.any((values < 0) | (values.astype(np.int64) + t > cos.shape[0])):
        raise ValueError(f"start: positions start .. start + {t - 1} must lie in [0, {cos.shape[0]})")
    threads = _helper_threads()
    launch(_norm_rope_kernel, (_grid_1d(t * (h + kv_block.shape[3]), threads), bs), threads, stream, 0,
           q, kv_block, q_weight, k_weight, cos, sin, start, eps)


def context_kv_write(kv_ctx: Any, k_weight: Any, cos: Any, sin: Any, base: Any, counts: Any, cache_k: Any,
                     cache_v: Any, eps: float, *, stream: Any = 0) -> None:
    """k_norm + RoPE of new context rows of every draft layer, written into the layers' caches.

    Args:
        kv_ctx: float32 [bs, R, n_layers, 2, Hkv, hd], the context rows' K / V projections (the keys
            are normed and rotated in place).
        k_weight: float32 [n_layers, hd]; cos, sin: float32 [P, hd / 2].
        base, counts: int32 [bs]: rows i < counts[b] go to cache row and position base[b] + i
            (rows at or past S are dropped; the engine's context_lengths poisons such a request).
        cache_k, cache_v: float32 [n_layers, bs, S, Hkv, hd].
        eps: RMSNorm epsilon.
    """
    kv_ctx = check_array(kv_ctx, "kv_ctx", np.float32, 6)
    bs, n_rows, n_layers, two, hkv, hd = kv_ctx.shape
    if two != 2:
        raise ValueError(f"kv_ctx must have shape (bs, R, n_layers, 2, Hkv, hd), got {tuple(kv_ctx.shape)}")
    k_weight = check_array(k_weight, "k_weight", np.float32, shape=(n_layers, hd))
    cos, sin = _rope_tables(cos, sin, hd)
    base = check_array(base, "base", np.int32, shape=(bs,))
    counts = check_array(counts, "counts", np.int32, shape=(bs,))
    cache_k = check_array(cache_k, "cache_k", np.float32, 5)
    s = cache_k.shape[2]
    check_shape(cache_k, "cache_k", (n_layers, bs, s, hkv, hd))
    cache_v = check_array(cache_v, "cache_v", np.float32, shape=(n_layers, bs, s, hkv, hd))
    eps = positive_real(eps, "eps")
    b_host, n_host = host_values(base), host_values(counts)
    if n_host is not None and np.any((n_host < 0) | (n_host > n_rows)):
        raise ValueError(f"counts must lie in [0, {n_rows}]")
    if b_host is not None and np.any(b_host < 0):
        raise ValueError("base must be >= 0")
    if b_host is not None and n_host is not None and np.any(b_host.astype(np.int64) + n_host > min(s, cos.shape[0])):
        raise ValueError(f"base + counts must be <= min(S, P) = {min(s, cos.shape[0])}")
    threads = _helper_threads()
    launch(_context_kv_kernel, (_grid_1d(n_rows * n_layers * hkv, threads), bs), threads, stream, 0,
           kv_ctx, k_weight, cos, sin, base, counts, cache_k, cache_v, eps)


def block_embed(table: Any, bonus: Any, start: Any, cache_lens: Any, mask_token: int, out: Any,
                *, stream: Any = 0) -> None:
    """The block [bonus, mask × (T - 1)] of every request, embedded: out float32 [bs, T, D].

    Args:
        table: float32 [V, D] (the target's embedding); bonus, start, cache_lens: int32 [bs];
            mask_token: int in [0, V). A request with start[b] != cache_lens[b] or a bonus
            outside [0, V) gets NaN rows (checked on the host for NumPy inputs).
    """
    table = check_array(table, "table", np.float32, 2)
    out = check_array(out, "out", np.float32, 3)
    bs, t, d = out.shape
    if table.shape[1] != d:
        raise ValueError(f"table must have shape (V, {d}), got {tuple(table.shape)}")
    bonus = check_array(bonus, "bonus", np.int32, shape=(bs,))
    start = check_array(start, "start", np.int32, shape=(bs,))
    cache_lens = check_array(cache_lens, "cache_lens", np.int32, shape=(bs,))
    mask_token = int_arg(mask_token, "mask_token", 0)
    vocab = table.shape[0]
    if mask_token >= vocab:
        raise ValueError(f"mask_token must be < V = {vocab}, got {mask_token}")
    b_host, s_host, c_host = host_values(bonus), host_values(start), host_values(cache_lens)
    if b_host is not None and np.any((b_host < 0) | (b_host >= vocab)):
        raise ValueError(f"bonus must lie in [0, {vocab})")
    if s_host is not None and c_host is not None and np.any(s_host != c_host):
        raise ValueError("start must equal cache_lens (the committed length is the context length)")
    threads = _helper_threads()
    launch(_block_embed_kernel, (_grid_1d(d, threads), t, bs), threads, stream, 0,
           table, bonus, start, cache_lens, np.int32(mask_token), out)


def gather_rows(src: Any, index: Any, counts: Any, dst: Any, counts_out: Any, *, stream: Any = 0) -> None:
    """dst[b, j] = src[b, index[b, j]] for j < counts[b]; counts_out[b] = counts[b] (-1 if outside [0, J]).

    Args:
        src: float32 [bs, N, F]; index: int32 [bs, W], W >= 1 (entries past counts[b] unread);
        counts, counts_out: int32 [bs]; dst: float32 [bs, J, F] (rows j >= counts[b] untouched).
        counts[b] must lie in [0, min(J, W)] and an index in [0, N) (checked on the host for NumPy
        inputs; on the device a bad count gives counts_out -1, a bad index a NaN row).
    """
    src = check_array(src, "src", np.float32, 3)
    dst = check_array(dst, "dst", np.float32, 3)
    bs, n, f = src.shape
    j_cap = dst.shape[1]
    if dst.shape[0] != bs or dst.shape[2] != f:
        raise ValueError(f"dst must have shape ({bs}, J, {f}), got {tuple(dst.shape)}")
    index = check_array(index, "index", np.int32, 2)
    if index.shape[0] != bs or index.shape[1] < 1:
        raise ValueError(f"index must have shape ({bs}, W) with W >= 1, got {tuple(index.shape)}")
    counts = check_array(counts, "counts", np.int32, shape=(bs,))
    counts_out = check_array(counts_out, "counts_out", np.int32, shape=(bs,))
    i_host, n_host = host_values(index), host_values(counts)
    limit = min(j_cap, index.shape[1])
    if n_host is not None and np.any((n_host < 0) | (n_host > limit)):
        raise ValueError(f"counts must lie in [0, {limit}] (rows of dst and entries of index)")
    if i_host is not None and n_host is not None:
        for b in range(bs):
            rows = i_host[b, :n_host[b]]
            if np.any((rows < 0) | (rows >= n)):
                raise ValueError(f"index[{b}] must lie in [0, {n}) on its first counts[{b}] entries")
    if f and j_cap:
        threads = _helper_threads()
        launch(_gather_rows_kernel, (_grid_1d(f, threads), j_cap, bs), threads, stream, 0,
               src, index, counts, dst, counts_out)


def context_lengths(cache_lens: Any, base: Any, counts: Any, capacity: int, *, clear: bool,
                    stream: Any = 0) -> None:
    """cache_lens = base + counts (-1 when over ``capacity`` or negative); counts zeroed if ``clear``.

    cache_lens, base, counts: int32 [bs] (cache_lens may be base itself).
    """
    cache_lens = check_array(cache_lens, "cache_lens", np.int32, 1)
    bs = cache_lens.shape[0]
    base = check_array(base, "base", np.int32, shape=(bs,))
    counts = check_array(counts, "counts", np.int32, shape=(bs,))
    capacity = int_arg(capacity, "capacity", 0)
    if not isinstance(clear, (bool, np.bool_)):
        raise TypeError(f"clear must be a bool, got {type(clear).__name__}")
    threads = _helper_threads()
    launch(_context_lengths_kernel, _grid_1d(bs, threads), threads, stream, 0,
           cache_lens, base, counts, np.int32(capacity), np.int32(bool(clear)))


# ----------------------------------------------------------------------------------------------
# Compile-check registration (real signatures)
# ----------------------------------------------------------------------------------------------

QWEN3_CONFIG = default_config(128)  # dflash-small / Qwen3 heads
_F4 = float32[:, :, :, ::1]
register("draft_attention", get_attention_kernel(QWEN3_CONFIG),
         [(_F4, float32[:, :, :, :, ::1], _F4, _F4, int32[::1], float32, _F4)],
         "DFlash block attention: non-causal GQA over cached context + block, online softmax (hd=128)",
         block_threads=QWEN3_CONFIG.threads)
register("draft_norm_rope", _norm_rope_kernel,
         [(_F4, float32[:, :, :, :, ::1], float32[::1], float32[::1], float32[:, ::1], float32[:, ::1],
           int32[::1], float32)],
         "DFlash block q_norm / k_norm + NeoX RoPE, in place", block_threads=HELPER_THREADS)
register("draft_context_kv", _context_kv_kernel,
         [(float32[:, :, :, :, :, ::1], float32[:, ::1], float32[:, ::1], float32[:, ::1], int32[::1], int32[::1],
           float32[:, :, :, :, ::1], float32[:, :, :, :, ::1], float32)],
         "DFlash context rows: k_norm + RoPE for every draft layer, written to the caches",
         block_threads=HELPER_THREADS)
register("draft_block_embed", _block_embed_kernel,
         [(float32[:, ::1], int32[::1], int32[::1], int32[::1], int32, float32[:, :, ::1])],
         "DFlash block [bonus, mask...] embedding with the round guard", block_threads=HELPER_THREADS)
register("draft_gather_rows", _gather_rows_kernel,
         [(float32[:, :, ::1], int32[:, ::1], int32[::1], float32[:, :, ::1], int32[::1])],
         "rows of a [bs, N, F] buffer by index (accepted-node context carry)", block_threads=HELPER_THREADS)
register("draft_context_lengths", _context_lengths_kernel,
         [(int32[::1], int32[::1], int32[::1], int32, int32)],
         "DFlash context length update with the capacity poison", block_threads=HELPER_THREADS)
