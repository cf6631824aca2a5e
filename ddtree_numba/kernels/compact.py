"""KV-cache compaction after acceptance, in place, for a whole batch in one launch per buffer.

Row ``past_len + accepted[j]`` of request b moves to row ``past_len + j`` (spec §1.5), for the
latent cache, the rope cache and any per-token side buffer (e.g. drafter context features):
bit-exact against ``reference.compact_batch``.

Layout: a buffer is a C-contiguous [bs, S, ...] array of any dtype, or a stack of G such
buffers [G, bs, S, ...] (``layered=True``: e.g. every layer's latent cache as one array, which
moves in one launch instead of G; every group moves the same rows, ``reference.compact_batch``
applied to each). Rows are moved as raw bits, viewed as [G, bs, S, D_words] (G = 1 for a plain
buffer) of the widest unsigned word (8, 4, 2 or 1 bytes) that divides the row size and the
buffer's address, so a bf16 row of 576 values moves as 144 uint64 words.
Grid (ceil(D_words / threads), bs, G): each thread owns one word column of one (group, request).

In-place safety, without a barrier: a column belongs to exactly one thread (groups are disjoint
memory), so no two threads ever touch the same word. Within its column a thread copies in
passes of ROWS_PER_PASS rows, loading every source of the pass before storing any.
accepted[0] = 0 and accepted strictly increases, so accepted[j] >= j: a pass starting at row j0
reads rows >= past_len + j0, while all earlier passes wrote rows < past_len + j0, and inside a
pass all loads precede the stores. Rows with accepted[j] = j (the root at least) are neither
read nor written.

:func:`plan_compaction` builds the word views once (the caches' addresses and shapes are fixed
for an engine's lifetime); :func:`run_compaction` only launches (graph-capturable).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda, int32, int64, uint8, uint16, uint32, uint64

from sim.launch import launch

from ._args import as_kernel_array, check_array, check_shape, data_address, host_values, is_c_contiguous
from .accept import check_threads
from .pdl import pdl_begin
from .registry import register

__all__ = [
    "COMPACT_KERNELS",
    "COMPACT_THREADS",
    "MAX_COMPACT_THREADS",
    "ROWS_PER_PASS",
    "CompactionPlan",
    "plan_compaction",
    "run_compaction",
    "compact_kv",
    "word_bytes_for",
]

COMPACT_THREADS = 128  # word columns per block
MAX_COMPACT_THREADS = 1024  # largest block plan_compaction accepts (30-40 registers: it fits)
ROWS_PER_PASS = 8  # loads in flight per thread before its stores
WORD_BYTES = (8, 4, 2, 1)  # widest first
_WORD_DTYPES = {8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}


@cuda.jit(device=True)
def _moves(src, dst, n_rows):
    """Row src must be copied to row dst: a real move, both rows inside [0, S) (dst >= 0: the
    kernel has returned on a negative past_len; a negative row would wrap around in numba
    indexing, or reach before the buffer)."""
    return src != dst and src >= 0 and src < n_rows and dst < n_rows


def _make_compact_kernel(word: Any) -> Any:
    """The compaction kernel for cache words of numba type ``word`` (a local array needs a
    compile-time dtype, hence one kernel per word size)."""

    @cuda.jit
    def compact_kernel(cache, past_lens, accepted, lengths):
        """cache [G, bs, S, D] words, in place; past_lens int32 [bs], accepted int32 [bs, M]
        (accepted node indices, -1 padded), lengths int32 [bs]. Grid (ceil(D / blockDim), bs, G):
        group g = blockIdx.z moves the same rows as every other group.

        Rows that would fall outside [0, S) are skipped (the host checks host-side values;
        device-side values are trusted but never indexed out of bounds: a request with a
        negative past_len moves nothing, negative node indices are skipped); lengths[b] is
        clamped to M (a negative length moves nothing).
        """
        pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
        staged = cuda.local.array(ROWS_PER_PASS, word)  # registers once the pass is unrolled
        b = cuda.blockIdx.y
        g = cuda.blockIdx.z
        col = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        past = int64(past_lens[b])  # int64 sums: past_len + node index cannot wrap
        if col >= cache.shape[3] or past < 0:  # a negative past_len (invalid) moves nothing
            return
        n_rows = cache.shape[2]
        length = min(lengths[b], accepted.shape[1])
        for first in range(0, length, ROWS_PER_PASS):
            for k in range(ROWS_PER_PASS):  # every source of the pass is read ...
                j = first + k
                if j < length and _moves(past + accepted[b, j], past + j, n_rows):
                    staged[k] = cache[g, b, past + accepted[b, j], col]
            for k in range(ROWS_PER_PASS):  # ... before any destination is written
                j = first + k
                if j < length and _moves(past + accepted[b, j], past + j, n_rows):
                    cache[g, b, past + j, col] = staged[k]

    return compact_kernel


def _signature(word: Any) -> tuple:
    return (word[:, :, :, ::1], int32[::1], int32[:, ::1], int32[::1])


COMPACT_KERNELS = {
    nbytes: register(f"compact_u{8 * nbytes}", _make_compact_kernel(word), (_signature(word),),
                     f"in-place KV compaction of accepted tree rows, {nbytes}-byte words, "
                     "one thread per (group, request, word column)", block_threads=MAX_COMPACT_THREADS)
    for nbytes, word in ((8, uint64), (4, uint32), (2, uint16), (1, uint8))
}


@dataclass(frozen=True)
class CompactionPlan:
    """Word views of the buffers to compact and their launch shapes (from :func:`plan_compaction`).

    Attributes:
        views: per buffer, a [G, bs, S, D_words] unsigned view of the same memory (G = 1 for a
            plain [bs, S, ...] buffer).
        word_bytes: per buffer, the word size (8, 4, 2 or 1).
        grids: per buffer, the launch grid (ceil(D_words / threads), bs, G).
        threads: the block size.
        batch_size: bs, shared by every buffer.
        min_rows: the smallest S over the buffers (host-side value checks use it).
    """

    views: tuple[Any, ...]
    word_bytes: tuple[int, ...]
    grids: tuple[tuple[int, int, int], ...]
    threads: int
    batch_size: int
    min_rows: int


def word_bytes_for(row_bytes: int, address: int) -> int:
    """The widest word size that divides both the row size and the address."""
    for nbytes in WORD_BYTES:
        if row_bytes % nbytes == 0 and address % nbytes == 0:
            return nbytes
    return 1


def _word_view(cache: Any, name: str, layered: bool) -> tuple[Any, int]:
    """A [G, bs, S, D_words] unsigned-word view of a C-contiguous [G, bs, S, ...] buffer
    (``layered``) or [bs, S, ...] one (G = 1)."""
    cache = as_kernel_array(cache, name)
    lead, layout = (3, "[G, bs, S, ...] (layered=True)") if layered else (2, "[bs, S, ...]")
    if len(cache.shape) < lead:
        raise ValueError(f"{name} must have at least {lead} dimensions {layout}, got shape {tuple(cache.shape)}")
    if not is_c_contiguous(cache):
        raise ValueError(f"{name} must be C-contiguous (compaction moves whole rows in place)")
    groups, bs, n_rows = cache.shape[:3] if layered else (1, *cache.shape[:2])
    row_bytes = int(np.prod(cache.shape[lead:], dtype=np.int64)) * np.dtype(cache.dtype).itemsize
    nbytes = word_bytes_for(row_bytes, data_address(cache)) if row_bytes else 1
    rows = cache.reshape(groups, bs, n_rows, row_bytes // np.dtype(cache.dtype).itemsize)  # [G, bs, S, D]
    return rows.view(_WORD_DTYPES[nbytes]), nbytes


def plan_compaction(caches: Any, *, threads: int = COMPACT_THREADS, layered: bool = False) -> CompactionPlan:
    """Plan the in-place compaction of one buffer or a sequence of buffers.

    Args:
        caches: a C-contiguous [bs, S, ...] array (NumPy, numba device array, or anything with
            ``__cuda_array_interface__``) of any dtype, or a sequence of them sharing bs
            (S and the trailing shape may differ): the latent cache [bs, S, 512], the rope
            cache [bs, S, 64], a 61-layer cache [bs, S, 61 * 576], a side buffer, ...
        threads: block size, a multiple of 32 up to 1024.
        layered: every buffer is a stack [G, bs, S, ...] of G caches (e.g. ``KVCache.stacked()``:
            [n_layers, bs, S, C] and [n_layers, bs, S, R]), compacted in one launch as G
            [bs, S, ...] buffers would be; G may differ between buffers, bs may not.

    Returns:
        A CompactionPlan; keep it and call :func:`run_compaction` every round.

    Raises:
        TypeError / ValueError naming ``caches`` (or ``caches[i]``), ``threads`` or ``layered``.
    """
    threads = check_threads(threads, maximum=MAX_COMPACT_THREADS)
    if not isinstance(layered, (bool, np.bool_)):
        raise TypeError(f"layered must be a bool, got {type(layered).__name__}")
    layered = bool(layered)
    single = not isinstance(caches, Sequence)
    buffers = [caches] if single else list(caches)
    if not buffers:
        raise ValueError("caches must hold at least one buffer")
    views, words, grids = [], [], []
    for i, cache in enumerate(buffers):
        name = "caches" if single else f"caches[{i}]"
        view, nbytes = _word_view(cache, name, layered)
        if views and view.shape[1] != views[0].shape[1]:
            raise ValueError(f"{name} has batch size {view.shape[1]}, caches[0] has {views[0].shape[1]}")
        views.append(view)
        words.append(nbytes)
        grids.append((-(-view.shape[3] // threads), view.shape[1], view.shape[0]))
    return CompactionPlan(tuple(views), tuple(words), tuple(grids), threads,
                          int(views[0].shape[1]), int(min(v.shape[2] for v in views)))


def _check_round(plan: CompactionPlan, past_lens: Any, accepted: Any, lengths: Any) -> tuple[Any, Any, Any]:
    """Types and shapes of one round's inputs; their values too when they are on the host."""
    bs = plan.batch_size
    past_lens = check_array(past_lens, "past_lens", (np.int32,), 1)
    check_shape(past_lens, "past_lens", (bs,))
    accepted = check_array(accepted, "accepted", (np.int32,), 2)
    if accepted.shape[0] != bs or accepted.shape[1] < 1:
        raise ValueError(f"accepted must have shape ({bs}, M) with M >= 1, got {tuple(accepted.shape)}")
    lengths = check_array(lengths, "lengths", (np.int32,), 1)
    check_shape(lengths, "lengths", (bs,))
    p, a, n = host_values(past_lens), host_values(accepted), host_values(lengths)
    if p is not None and np.any(p < 0):
        raise ValueError("past_lens must be >= 0")
    if n is not None and (np.any(n < 1) or np.any(n > accepted.shape[1])):
        raise ValueError(f"lengths must be in [1, {accepted.shape[1]}]")
    if a is not None and n is not None:
        for b in range(bs):
            acc = a[b, :n[b]].astype(np.int64)  # [m]
            if acc[0] != 0 or np.any(np.diff(acc) <= 0):
                raise ValueError(f"accepted[{b}] must start at 0 (the root) and strictly increase")
            if p is not None and p[b] + acc[-1] >= plan.min_rows:
                raise ValueError(f"accepted[{b}]: row past_lens + accepted = {p[b] + acc[-1]} is "
                                 f"outside the cache (S = {plan.min_rows})")
    return past_lens, accepted, lengths


def run_compaction(plan: CompactionPlan, past_lens: Any, accepted: Any, lengths: Any, *,
                   stream: Any = 0) -> None:
    """Compact every planned buffer in place: one launch per buffer (a layered one included), no
    host sync.

    Args:
        plan: from :func:`plan_compaction`.
        past_lens: int32 [bs], rows before each request's tree.
        accepted: int32 [bs, M], accepted node indices, root first, -1 padded (the walk's output).
        lengths: int32 [bs] in [1, M].
        stream: 0, a numba stream, or a cuda.core Stream / GraphBuilder.

    Host (NumPy) inputs are value-checked like ``reference.compact_batch``; device inputs are
    not read on the host (no sync) and rows outside the cache are skipped on the device.
    """
    if not isinstance(plan, CompactionPlan):
        raise TypeError(f"plan must be a CompactionPlan, got {type(plan).__name__}")
    past_lens, accepted, lengths = _check_round(plan, past_lens, accepted, lengths)
    for view, nbytes, grid in zip(plan.views, plan.word_bytes, plan.grids):
        if view.shape[3] and plan.batch_size and view.shape[0]:  # an empty grid axis: nothing to move
            launch(COMPACT_KERNELS[nbytes], grid, plan.threads, stream, 0,
                   view, past_lens, accepted, lengths)


def compact_kv(caches: Any, past_lens: Any, accepted: Any, lengths: Any, *, stream: Any = 0,
               threads: int = COMPACT_THREADS, layered: bool = False) -> None:
    """Plan and run in one call (see :func:`plan_compaction`, :func:`run_compaction`)."""
    run_compaction(plan_compaction(caches, threads=threads, layered=layered), past_lens, accepted, lengths,
                   stream=stream)
