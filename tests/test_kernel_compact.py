"""In-place KV compaction kernel against reference.compact_batch, bit for bit.

Simulator tests: tiny caches (bs <= 4, S <= 40, row sizes <= 256 B) of several dtypes and word
sizes, overlapping rows across several passes, plans over several buffers, stacked (layered)
buffers against per-buffer compaction, the golden file, the device-side bounds guard and every
argument check. ``gpu`` tests move a 61-layer bf16 cache at
bs 64 on the H200 (skipped under the simulator).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from ddtree_numba.golden import read_all
from ddtree_numba.kernels import accept as ka
from ddtree_numba.kernels import compact as kc
from ddtree_numba.kernels import registry
from reference import accept_batch, build_tree_batch, compact_batch, topk_log_probs

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "golden"


def _random_round(rng, bs: int, n_rows: int, width: int, max_node: int):
    """past_lens int32 [bs], accepted int32 [bs, width] (increasing from 0, -1 padded), lengths."""
    lengths = rng.integers(1, width + 1, bs).astype(np.int32)
    accepted = np.full((bs, width), -1, np.int32)
    past_lens = np.zeros(bs, np.int32)
    for b, m in enumerate(lengths):
        accepted[b, :m] = np.concatenate([[0], np.sort(rng.choice(np.arange(1, max_node), m - 1, replace=False))])
        past_lens[b] = rng.integers(0, n_rows - max_node + 1)
    return past_lens, accepted, lengths


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _random_cache(rng, shape, dtype) -> np.ndarray:
    """Random bits of any dtype (NaN payloads included for floats: moved as bits, never as values)."""
    return rng.integers(0, 256, (*shape, np.dtype(dtype).itemsize), dtype=np.uint8).view(dtype).reshape(shape)


# --- against the reference -------------------------------------------------------------------

@pytest.mark.parametrize("dtype, trailing, word", [
    (np.float32, (7,), 4),  # 28 B rows
    (np.float16, (3,), 2),  # 6 B rows
    (np.float64, (2, 3), 8),  # trailing dims flattened
    (np.uint16, (64,), 8),  # bf16 bits: 128 B rows move as 16 uint64 words
    (np.int8, (5,), 1),
])
def test_compaction_matches_reference(dtype, trailing, word):
    rng = np.random.default_rng(len(trailing) * 10 + np.dtype(dtype).itemsize)
    bs, n_rows = 4, 30
    cache = _random_cache(rng, (bs, n_rows, *trailing), dtype)
    past_lens, accepted, lengths = _random_round(rng, bs, n_rows, 6, 12)
    expected = compact_batch(cache, past_lens, accepted, lengths)
    device = cuda.to_device(cache)
    plan = kc.plan_compaction(device)
    assert plan.word_bytes == (word,)
    kc.run_compaction(plan, past_lens, accepted, lengths)
    assert _same_bits(device.copy_to_host(), expected)


def test_overlapping_rows_over_several_passes():
    """17 accepted rows (3 passes of ROWS_PER_PASS = 8) packed densely: every destination but the
    root's is some later row's source, within and across passes."""
    rng = np.random.default_rng(5)
    bs, n_rows, width = 2, 40, 17
    accepted = np.stack([np.r_[0, np.arange(1, 33, 2)], np.r_[0, 1, 2, np.arange(4, 32, 2)]]).astype(np.int32)
    assert accepted.shape == (bs, width) and kc.ROWS_PER_PASS < width
    past_lens = np.array([3, 6], np.int32)
    lengths = np.array([17, 16], np.int32)
    cache = _random_cache(rng, (bs, n_rows, 8), np.float32)
    expected = compact_batch(cache, past_lens, accepted, lengths)
    kc.compact_kv(cache, past_lens, accepted, lengths, threads=32)  # host array: copied in and out
    assert _same_bits(cache, expected)


def test_noop_rounds_leave_the_cache_untouched():
    """Root only, and a chain accepted node for node (accepted[j] = j): no row moves."""
    rng = np.random.default_rng(6)
    cache = _random_cache(rng, (2, 12, 4), np.float32)
    before = cache.copy()
    accepted = np.array([[0, -1, -1, -1], [0, 1, 2, 3]], np.int32)
    kc.compact_kv(cache, np.array([5, 2], np.int32), accepted, np.array([1, 4], np.int32))
    assert _same_bits(cache, before)


def test_one_plan_several_buffers_several_rounds():
    """Latent, rope and a side buffer (different dtypes, row sizes and S) compacted by one plan,
    reused for two rounds as an engine would."""
    rng = np.random.default_rng(7)
    bs = 3
    host = [_random_cache(rng, (bs, 24, 16), np.float32), _random_cache(rng, (bs, 24, 4), np.float32),
            _random_cache(rng, (bs, 28, 6), np.float16)]
    device = [cuda.to_device(h) for h in host]
    plan = kc.plan_compaction(device, threads=32)
    assert plan.word_bytes == (8, 8, 4) and plan.min_rows == 24 and plan.batch_size == bs
    for _ in range(2):
        past_lens, accepted, lengths = _random_round(rng, bs, 24, 5, 10)
        host = [compact_batch(h, past_lens, accepted, lengths) for h in host]
        kc.run_compaction(plan, cuda.to_device(past_lens), cuda.to_device(accepted), cuda.to_device(lengths))
    for h, d in zip(host, device):
        assert _same_bits(d.copy_to_host(), h)


def _compact_layers_one_by_one(stacks, past_lens, accepted, lengths) -> list[np.ndarray]:
    """Each [G, bs, S, ...] stack compacted as G separate [bs, S, ...] buffers (one plan, G launches each)."""
    device = [cuda.to_device(np.ascontiguousarray(layer)) for stack in stacks for layer in stack]
    kc.run_compaction(kc.plan_compaction(device, threads=32), past_lens, accepted, lengths)
    out, layers = [], iter(device)
    for stack in stacks:
        out.append(np.stack([next(layers).copy_to_host() for _ in range(stack.shape[0])]))
    return out


@pytest.mark.parametrize("case", ["random", "dense", "roots_only"])
def test_layered_compaction_equals_per_buffer(case):
    """Stacks of every layer's latent / rope rows and a 2-byte-word side buffer, compacted in one
    launch each (layered=True), give the bits of per-layer compaction and of compact_batch per layer."""
    rng = np.random.default_rng(11)
    bs, n_rows, width = 4, 40, 17
    stacks = [_random_cache(rng, (3, bs, n_rows, 16), np.float32), _random_cache(rng, (3, bs, n_rows, 4), np.float32),
              _random_cache(rng, (2, bs, n_rows, 3), np.float16)]
    if case == "random":  # a different past_len and acceptance per request
        past_lens, accepted, lengths = _random_round(rng, bs, n_rows, 6, 12)
    elif case == "dense":  # 17 rows over 3 passes, every destination a later row's source
        dense = np.r_[0, np.arange(1, 33, 2)]
        accepted = np.stack([dense, np.r_[0, 1, 2, np.arange(4, 32, 2)], dense, dense]).astype(np.int32)
        past_lens = np.array([3, 6, 0, 7], np.int32)
        lengths = np.array([17, 16, 9, 1], np.int32)
    else:  # the root only: nothing moves
        accepted = np.full((bs, width), -1, np.int32)
        accepted[:, 0] = 0
        past_lens = np.array([0, 5, 39, 12], np.int32)
        lengths = np.ones(bs, np.int32)
    expected = [np.stack([compact_batch(layer, past_lens, accepted, lengths) for layer in stack]) for stack in stacks]
    device = [cuda.to_device(stack) for stack in stacks]
    plan = kc.plan_compaction(device, threads=32, layered=True)
    assert plan.word_bytes == (8, 8, 2) and plan.batch_size == bs and plan.min_rows == n_rows
    assert plan.grids == ((1, bs, 3), (1, bs, 3), (1, bs, 2))
    kc.run_compaction(plan, cuda.to_device(past_lens), cuda.to_device(accepted), cuda.to_device(lengths))
    one_by_one = _compact_layers_one_by_one(stacks, cuda.to_device(past_lens), cuda.to_device(accepted),
                                            cuda.to_device(lengths))
    for d, per_buffer, want in zip(device, one_by_one, expected):
        assert _same_bits(d.copy_to_host(), per_buffer)
        assert _same_bits(per_buffer, want)


def test_layered_single_buffer_and_host_values():
    """One [G, bs, S, ...] array (not a sequence) with host round inputs, value-checked on the host
    against the stack's S."""
    rng = np.random.default_rng(12)
    stack = _random_cache(rng, (5, 2, 12, 7), np.float32)  # 28 B rows: 4-byte words
    past_lens = np.array([2, 0], np.int32)
    accepted = np.array([[0, 3, 4, 9], [0, 1, 5, -1]], np.int32)
    lengths = np.array([4, 3], np.int32)
    expected = np.stack([compact_batch(layer, past_lens, accepted, lengths) for layer in stack])
    plan = kc.plan_compaction(stack, layered=True)
    assert plan.word_bytes == (4,) and plan.grids == ((1, 2, 5),) and plan.min_rows == 12
    with pytest.raises(ValueError, match="accepted"):  # 2 + 10 is outside S = 12
        kc.run_compaction(plan, past_lens, np.array([[0, 3, 4, 10], [0, 1, 5, -1]], np.int32), lengths)
    kc.run_compaction(plan, past_lens, accepted, lengths)
    assert _same_bits(stack, expected)


def test_word_size_follows_row_size_and_alignment():
    assert kc.word_bytes_for(1152, 256) == 8  # Kimi latent + rope row, bf16
    assert kc.word_bytes_for(12, 0) == 4
    assert kc.word_bytes_for(16, 2) == 2  # an unaligned view falls back to narrower words
    assert kc.word_bytes_for(7, 0) == 1
    base = np.zeros(2 * 10 * 8 + 1, np.uint16)
    unaligned = base[1:].reshape(2, 10, 8)  # 16 B rows starting 2 B past an aligned address
    assert unaligned.ctypes.data % 8 == 2  # NumPy allocations are at least 16-byte aligned
    plan = kc.plan_compaction(unaligned)
    assert plan.word_bytes == (2,)
    rng = np.random.default_rng(8)
    unaligned[...] = _random_cache(rng, unaligned.shape, np.uint16)
    past_lens = np.array([1, 0], np.int32)
    accepted = np.array([[0, 3, 4], [0, 2, -1]], np.int32)
    lengths = np.array([3, 2], np.int32)
    expected = compact_batch(unaligned, past_lens, accepted, lengths)
    kc.run_compaction(plan, past_lens, accepted, lengths)
    assert _same_bits(unaligned, expected)


@pytest.mark.parametrize("name", ["single", "overlapping", "noop_all", "noop_root", "batch", "batch_bf16"])
def test_compaction_golden(name):
    case = read_all(GOLDEN / "compact.h5")[name]
    if name.startswith("batch"):
        cache = case.in_cache.values.copy()
        args = (case.in_past_lens.values.astype(np.int32), case.in_accepted.values.astype(np.int32),
                case.in_lengths.values.astype(np.int32))
        expected = case.out_cache.values
    else:
        cache = case.in_cache.values[None].copy()  # one request
        acc = case.in_accepted.values.astype(np.int32)[None]
        args = (np.array([case.in_past_len.values], np.int32), acc, np.array([acc.shape[1]], np.int32))
        expected = case.out_cache.values[None]
    device = cuda.to_device(cache)
    kc.compact_kv(device, *args)
    assert _same_bits(device.copy_to_host(), expected)


def test_walk_then_compaction_on_device():
    """The walk's device outputs feed the compaction directly (no host round trip)."""
    rng = np.random.default_rng(9)
    bs, n_pos, vocab = 2, 3, 6
    lp, ids = topk_log_probs(rng.standard_normal((bs * n_pos, vocab)), 6)
    trees = build_tree_batch(lp.reshape(bs, n_pos, 6), ids.reshape(bs, n_pos, 6), [10, 6], [1, 2])
    post = rng.integers(0, vocab, (bs, trees.capacity)).astype(np.int32)
    for b in range(bs):  # follow the path to the deepest node: the longest acceptance
        node = int(np.argmax(trees.depths[b]))
        while node > 0:
            post[b, trees.parents[b, node]] = trees.tokens[b, node]
            node = int(trees.parents[b, node])
    d_acc = cuda.device_array((bs, n_pos + 1), np.int32)
    d_len = cuda.device_array(bs, np.int32)
    d_bonus = cuda.device_array(bs, np.int32)
    ka.accept_walk(*(cuda.to_device(np.ascontiguousarray(a, np.int32))
                     for a in (post, trees.child_ptr, trees.child_index, trees.tokens)), d_acc, d_len, d_bonus)
    past_lens = np.array([4, 1], np.int32)
    cache = _random_cache(rng, (bs, 4 + trees.capacity, 8), np.float32)
    accepted, lengths, _ = accept_batch(post, trees)
    assert lengths.min() >= 3 and np.any(accepted > np.arange(n_pos + 1))  # rows really move
    expected = compact_batch(cache, past_lens, accepted, lengths)
    device = cuda.to_device(cache)
    kc.compact_kv(device, cuda.to_device(past_lens), d_acc, d_len)
    assert _same_bits(device.copy_to_host(), expected)


def test_device_values_out_of_range_are_skipped_not_read():
    """Device-side values are not checked on the host; rows outside [0, S) are skipped and
    lengths are clamped to M. Under the simulator an index >= S raises IndexError; a negative
    one would wrap around to the end of the request's rows, which the expected cache catches."""
    rng = np.random.default_rng(10)
    cache = _random_cache(rng, (6, 10, 4), np.float32)
    past_lens = np.array([5, 1, -3, 2, 0, 2**31 - 2], np.int32)
    accepted = np.array([[0, 2, 50],  # row 5 + 50 is past the end
                         [0, 1, 3],  # lengths 9 > M = 3
                         [0, 4, 5],  # a negative past_len: the request moves nothing
                         [0, -7, 3],  # source 2 - 7 < 0 is skipped, 2 + 3 -> 2 + 2 moves
                         [0, 1, 2],  # a negative length moves nothing
                         [0, 1, 2]], np.int32)  # past_len + j overflows int32: skipped
    lengths = np.array([3, 9, 3, 3, -2, 3], np.int32)
    device = cuda.to_device(cache)
    kc.compact_kv(device, cuda.to_device(past_lens), cuda.to_device(accepted), cuda.to_device(lengths),
                  threads=32)
    expected = cache.copy()
    expected[0, 6] = cache[0, 7]  # the in-range move of request 0
    expected[1, 3] = cache[1, 4]  # request 1 as if lengths = 3
    expected[3, 4] = cache[3, 5]  # the in-range move of request 3
    assert _same_bits(device.copy_to_host(), expected)


def test_block_size_is_capped_at_the_registered_block_threads():
    for nbytes in kc.WORD_BYTES:
        assert registry.get(f"compact_u{8 * nbytes}").block_threads == kc.MAX_COMPACT_THREADS
    with pytest.raises(ValueError, match="threads"):
        kc.plan_compaction(np.zeros((2, 8, 4), np.float32), threads=kc.MAX_COMPACT_THREADS + 32)


# --- argument checks -------------------------------------------------------------------------

def _round(bs=2, width=3):
    return (np.zeros(bs, np.int32), np.array([[0, 1, 2]] * bs, np.int32)[:, :width], np.ones(bs, np.int32))


@pytest.mark.parametrize("caches, error, name", [
    (np.zeros(8, np.float32), ValueError, "caches"),
    (np.zeros((2, 8, 6), np.float32)[:, :, ::2], ValueError, "caches"),
    ([], ValueError, "caches"),
    ([np.zeros((2, 8, 4), np.float32), np.zeros((3, 8, 4), np.float32)], ValueError, r"caches\[1\]"),
    ([np.zeros((2, 8, 4), np.float32), "rope"], TypeError, r"caches\[1\]"),
    ("cache", TypeError, "caches"),
])
def test_plan_rejects_bad_caches(caches, error, name):
    with pytest.raises(error, match=name):
        kc.plan_compaction(caches)


@pytest.mark.parametrize("caches, layered, error, name", [
    (np.zeros((2, 8, 4), np.float32), 1, TypeError, "layered"),
    (np.zeros((2, 8), np.float32), True, ValueError, "caches"),
    (np.zeros((3, 2, 8, 4), np.float32)[:, :, :, ::2], True, ValueError, "caches"),
    ([np.zeros((3, 2, 8, 4), np.float32), np.zeros((3, 1, 8, 4), np.float32)], True, ValueError, r"caches\[1\]"),
    ([np.zeros((3, 2, 8, 4), np.float32), np.zeros((2, 8), np.float32)], True, ValueError, r"caches\[1\]"),
])
def test_plan_rejects_bad_layered_caches(caches, layered, error, name):
    with pytest.raises(error, match=name):
        kc.plan_compaction(caches, layered=layered)


def test_plan_rejects_bad_threads():
    with pytest.raises(ValueError, match="threads"):
        kc.plan_compaction(np.zeros((2, 8, 4), np.float32), threads=100)


@pytest.mark.parametrize("change, error, name", [
    (dict(past_lens=np.zeros(2, np.int64)), TypeError, "past_lens"),
    (dict(past_lens=np.zeros(3, np.int32)), ValueError, "past_lens"),
    (dict(past_lens=np.array([0, -1], np.int32)), ValueError, "past_lens"),
    (dict(accepted=np.zeros((2, 3), np.uint32)), TypeError, "accepted"),
    (dict(accepted=np.zeros((2, 0), np.int32)), ValueError, "accepted"),
    (dict(accepted=np.zeros((1, 3), np.int32)), ValueError, "accepted"),
    (dict(accepted=np.array([[0, 1, 2], [1, 2, 3]], np.int32), lengths=np.full(2, 3, np.int32)),
     ValueError, "accepted"),
    (dict(accepted=np.array([[0, 2, 2], [0, 1, 2]], np.int32), lengths=np.full(2, 3, np.int32)),
     ValueError, "accepted"),
    (dict(past_lens=np.array([6, 0], np.int32), lengths=np.full(2, 3, np.int32)), ValueError, "accepted"),
    (dict(lengths=np.zeros(2, np.float32)), TypeError, "lengths"),
    (dict(lengths=np.array([0, 1], np.int32)), ValueError, "lengths"),
    (dict(lengths=np.array([4, 1], np.int32)), ValueError, "lengths"),
])
def test_run_rejects_bad_rounds_before_any_work(change, error, name):
    cache = np.arange(2 * 8 * 4, dtype=np.float32).reshape(2, 8, 4)
    plan = kc.plan_compaction(cache)
    past_lens, accepted, lengths = _round()
    args = dict(past_lens=past_lens, accepted=accepted, lengths=lengths) | change
    with pytest.raises(error, match=name):
        kc.run_compaction(plan, **args)
    assert np.array_equal(cache, np.arange(2 * 8 * 4, dtype=np.float32).reshape(2, 8, 4))


def test_run_rejects_a_non_plan():
    with pytest.raises(TypeError, match="plan"):
        kc.run_compaction(np.zeros((2, 8, 4), np.float32), *_round())


# --- H200: real shapes -----------------------------------------------------------------------

KIMI_ROW = 61 * 576  # latent 512 + rope 64 per layer, 61 layers


@pytest.mark.gpu
def test_gpu_61_layer_bf16_cache_bs64():
    """[64, S, 61 * 576] bf16 bits (2.5 GB), B = 512 trees, up to 17 accepted rows per request."""
    rng = np.random.default_rng(201)
    bs, capacity, width = 64, 513, 17
    n_rows = 32 + capacity
    past_lens, accepted, lengths = _random_round(rng, bs, n_rows, width, capacity)
    base = rng.integers(0, 2**16, (n_rows, KIMI_ROW), dtype=np.uint16)
    cache = base[None] ^ np.arange(bs, dtype=np.uint16)[:, None, None]  # [bs, S, D], distinct per request
    expected = compact_batch(cache, past_lens, accepted, lengths)
    device = cuda.to_device(cache)
    kc.compact_kv(device, cuda.to_device(past_lens), cuda.to_device(accepted), cuda.to_device(lengths))
    assert _same_bits(device.copy_to_host(), expected)


@pytest.mark.gpu
def test_gpu_per_layer_buffers_bs64():
    """One plan over per-layer latent / rope buffers and a float32 drafter feature buffer."""
    rng = np.random.default_rng(202)
    bs, capacity, width = 64, 513, 17
    n_rows = 16 + capacity
    host = [_random_cache(rng, (bs, n_rows, 512), np.uint16), _random_cache(rng, (bs, n_rows, 64), np.uint16),
            _random_cache(rng, (bs, n_rows, 6 * 7168 // 8), np.float32)]
    device = [cuda.to_device(h) for h in host]
    plan = kc.plan_compaction(device)
    past_lens, accepted, lengths = _random_round(rng, bs, n_rows, width, capacity)
    kc.run_compaction(plan, cuda.to_device(past_lens), cuda.to_device(accepted), cuda.to_device(lengths))
    for h, d in zip(host, device):
        assert _same_bits(d.copy_to_host(), compact_batch(h, past_lens, accepted, lengths))


@pytest.mark.gpu
def test_gpu_layered_61_layer_cache_bs8():
    """KVCache.stacked()'s layout at Kimi dims: 61 layers of latent [8, S, 512] and rope [8, S, 64]
    bf16 bits, two launches, against compact_batch per layer."""
    rng = np.random.default_rng(203)
    bs, capacity, width = 8, 513, 17
    n_rows = 16 + capacity
    host = [_random_cache(rng, (61, bs, n_rows, 512), np.uint16), _random_cache(rng, (61, bs, n_rows, 64), np.uint16)]
    device = [cuda.to_device(h) for h in host]
    plan = kc.plan_compaction(device, layered=True)
    assert plan.word_bytes == (8, 8) and plan.grids == ((1, bs, 61), (1, bs, 61))  # 128 and 16 words a row
    past_lens, accepted, lengths = _random_round(rng, bs, n_rows, width, capacity)
    kc.run_compaction(plan, cuda.to_device(past_lens), cuda.to_device(accepted), cuda.to_device(lengths))
    for h, d in zip(host, device):
        want = np.stack([compact_batch(layer, past_lens, accepted, lengths) for layer in h])
        assert _same_bits(d.copy_to_host(), want)
