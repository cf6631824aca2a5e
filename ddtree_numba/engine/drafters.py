"""Drafters: the interface the DDTree loop drafts through, and the oracle drafter.

A drafter proposes, for every request of a batch, per-position distributions over the next
``horizon = block_size - 1`` tokens after the round's root (the bonus token at position ``start``):
row j of its logits [bs, L, V] is the distribution of the token at position ``start + j + 1``
(tree depth j + 1, spec §1.1 step 1). The loop turns them into a tree (top-k, build), verifies
it, and tells the drafter which nodes were accepted so it can carry their context (spec §1.6).

:class:`OracleDrafter` knows the target's continuation (e.g. the tokens an AR run produced) and
emits distributions with a tunable accuracy and entropy: a synthetic drafter whose acceptance
rate is known in advance, for tests and for the forward-pass / speed measurements. Its logits are
written on the device by one kernel per round from Philox noise keyed by (seed, request,
position), so a round is deterministic and batch-invariant; :func:`oracle_logits_reference` is
the NumPy definition the kernel is tested against. Every logit is a pure function of (request,
depth, token), so the kernel splits each row's vocabulary over several blocks
(:func:`oracle_parts`): at batch 1 a row-per-block grid would leave most of the GPU idle.

Oracle distribution of row (b, j), position p = start[b] + j + 1, generated index
g = p - prompt_lens[b]:

- truth = reference_tokens[b, g] if 0 <= g < n and that entry is >= 0, else unknown;
- a decision draw u in (0, 1): with probability ``accuracy`` (u < accuracy) the top token is the
  truth, otherwise a uniformly drawn wrong token (truth + 1 + w mod (V - 1)) mod V; when the truth
  is unknown the top token is w mod V;
- scores: standard normal noise n(v) (Box-Muller on Philox words, |n| < 6.77) for every token,
  and TOP_SCORE = 7 for the top token, so it is strictly the largest;
- logits = float32(score / entropy): ``entropy`` is the temperature of the oracle's belief
  (small: nearly one-hot on its top token; ~1: the top token keeps ~1/(1 + V e^-6.3) of the mass).
"""
from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

import numpy as np
from numba import cuda, float32, float64, int32, int64, uint64

from ddtree_numba.kernels.accept import _philox4x32_10
from ddtree_numba.kernels.pdl import pdl_begin
from ddtree_numba.kernels.registry import register
from reference._checks import require_array, require_int, require_real
from reference.sampling import philox4x32
from sim.install import simulator_active
from sim.launch import launch

__all__ = [
    "Drafter", "OracleDrafter", "oracle_logits_kernel", "oracle_logits_reference",
    "TOP_SCORE", "ORACLE_THREADS", "oracle_parts",
]

TOP_SCORE = 7.0  # above every Box-Muller normal from 32-bit words: sqrt(-2 ln 2^-33) ~= 6.77
ORACLE_THREADS = 128  # threads per (request, depth) row on a GPU
SIM_THREADS = 32  # the simulator runs each thread as a Python thread: keep blocks small
PHILOX_WORDS = 4  # tokens 4g..4g+3 share one Philox call (two Box-Muller pairs)
GROUPS_PER_THREAD = 4  # Philox groups per thread per block: enough blocks to fill the GPU at batch 1
MAX_PARTS = 65535  # gridDim.z limit
UNIT_SCALE = 2.0**-32  # (w + 0.5) * 2^-32 maps a uint32 into (0, 1)
TWO_PI = 2.0 * math.pi
MASK32 = np.uint64(0xFFFFFFFF)
SHIFT32 = np.uint64(32)
ZERO64 = np.uint64(0)
# Counter word 3 separates the streams of a request: 2b for the noise, 2b + 1 for the decision.
NOISE_STREAM = 0
DECISION_STREAM = 1


@runtime_checkable
class Drafter(Protocol):
    """What the DDTree loop (:func:`ddtree_numba.engine.decode.generate_ddtree`) needs of a drafter.

    All arrays are numba device arrays; every method only enqueues work on ``stream`` (no host
    sync, no device allocation: buffers are allocated by the constructor, at capacity).

    Attributes:
        horizon: L = block_size - 1, the positions drafted per round.
        feature_layers: target layers whose outputs the drafter consumes (the target model must
            capture them, in this order); () for a drafter that needs no target features.
    """

    horizon: int
    feature_layers: tuple[int, ...]

    def begin(self, features: Any, prompt_lens: Any, stream: Any = 0) -> None:
        """Take the prompt context after prefill.

        features: float32 [bs, P, F] (F = len(feature_layers) * hidden; rows >= prompt_lens[b]
        are padding); prompt_lens: int32 [bs].
        """

    def draft(self, bonus: Any, start: Any, stream: Any = 0) -> Any:
        """Draft logits float32 [bs, L, V] for positions start + 1 .. start + L.

        bonus: int32 [bs], the round's root token; start: int32 [bs], the committed length =
        the root's position. Returns a buffer owned by the drafter (overwritten next round).
        """

    def commit(self, features: Any, accepted: Any, lengths: Any, stream: Any = 0) -> None:
        """Carry the verify features of the accepted nodes into the drafter's context.

        features: float32 [bs, N, F] of the verified tree; accepted: int32 [bs, W] node indices
        (root first, -1 padded); lengths: int32 [bs]. Called before the target's past_lens
        advance by ``lengths`` (past_lens still holds each request's round start).
        """


# --- device functions ------------------------------------------------------------------------

@cuda.jit(device=True)
def _unit(word):
    """A uint32 Philox word (held in a uint64) mapped into the open interval (0, 1), float64."""
    return (float64(word) + 0.5) * UNIT_SCALE


@cuda.jit(device=True)
def _box_muller(w_radius, w_angle):
    """Two standard normals from two Philox words (float64)."""
    radius = math.sqrt(-2.0 * math.log(_unit(w_radius)))
    angle = TWO_PI * _unit(w_angle)
    return radius * math.cos(angle), radius * math.sin(angle)


@cuda.jit(device=True)
def _top_token(ref, prompt_lens, b, position, c1, c2, k0, k1, accuracy, vocab):
    """The token the oracle ranks first in row (b, position): the truth with probability
    ``accuracy``, else a drawn wrong token; a drawn token when the truth is unknown."""
    g = position - int64(prompt_lens[b])
    truth = int64(-1)
    if g >= 0 and g < ref.shape[1]:
        truth = int64(ref[b, g])
    words = _philox4x32_10(ZERO64, c1, c2, uint64(2 * b + DECISION_STREAM), k0, k1)
    if truth < 0 or truth >= vocab:
        return int32(words[1] % uint64(vocab))
    if vocab == 1 or _unit(words[0]) < accuracy:
        return int32(truth)
    return int32((truth + 1 + int64(words[1] % uint64(vocab - 1))) % vocab)


@cuda.jit
def oracle_logits_kernel(ref, prompt_lens, start, seed, accuracy, inv_entropy, groups_per_part, out):
    """Oracle draft logits of every (request, depth) row.

    ref int32 [bs, n] (the target's continuation, -1 where unknown), prompt_lens int32 [bs],
    start int32 [bs] (the root's position), seed uint64, accuracy float64 in [0, 1],
    inv_entropy float64 (1 / entropy), groups_per_part int32 >= 1 -> out float32 [bs, L, V].
    Grid (L, bs, parts): block (j, b, p) writes the tokens of Philox groups
    [p * groups_per_part, (p + 1) * groups_per_part) of row (b, j), PHILOX_WORDS tokens per
    group (one Philox call each); each block recomputes the row's top token (one Philox call).
    """
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    j = cuda.blockIdx.x
    b = cuda.blockIdx.y
    part = cuda.blockIdx.z
    tid = cuda.threadIdx.x
    vocab = out.shape[2]
    position = int64(start[b]) + j + 1
    pos = uint64(position)
    c1 = pos & MASK32
    c2 = pos >> SHIFT32
    k0 = seed & MASK32
    k1 = seed >> SHIFT32
    top = _top_token(ref, prompt_lens, b, position, c1, c2, k0, k1, accuracy, vocab)
    top_logit = float32(TOP_SCORE * inv_entropy)
    noise_stream = uint64(2 * b + NOISE_STREAM)
    n_groups = (vocab + PHILOX_WORDS - 1) // PHILOX_WORDS
    first_group = int64(part) * groups_per_part
    end_group = min(first_group + groups_per_part, n_groups)
    group = first_group + tid
    while group < end_group:
        words = _philox4x32_10(uint64(group), c1, c2, noise_stream, k0, k1)
        n0, n1 = _box_muller(words[0], words[1])
        n2, n3 = _box_muller(words[2], words[3])
        first = group * PHILOX_WORDS
        for w in range(PHILOX_WORDS):
            v = first + w
            if v < vocab:
                noise = n0 if w == 0 else (n1 if w == 1 else (n2 if w == 2 else n3))
                out[b, j, v] = top_logit if v == top else float32(noise * inv_entropy)
        group += cuda.blockDim.x


register("oracle_logits", oracle_logits_kernel,
         ((int32[:, ::1], int32[::1], int32[::1], uint64, float64, float64, int32, float32[:, :, ::1]),),
         "oracle drafter: per-(request, depth) draft logits from Philox noise, truth on top "
         "with the given accuracy; each row's vocabulary split over grid z", block_threads=ORACLE_THREADS)


def oracle_parts(vocab_size: int, threads: int) -> tuple[int, int]:
    """(parts, groups_per_part): how :class:`OracleDrafter` splits a row's Philox groups over
    grid z: GROUPS_PER_THREAD groups per thread, fewer parts when that would exceed MAX_PARTS;
    every part holds at least one group, the last one the remainder."""
    vocab_size = require_int(vocab_size, "vocab_size", minimum=1, maximum=2**31 - 1)
    threads = require_int(threads, "threads", minimum=1, maximum=1024)
    n_groups = -(-vocab_size // PHILOX_WORDS)
    per_part = max(threads * GROUPS_PER_THREAD, -(-n_groups // MAX_PARTS))
    return -(-n_groups // per_part), per_part


# --- NumPy reference -------------------------------------------------------------------------

def _unit_np(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.float64) + 0.5) * UNIT_SCALE


def _philox_rows(positions: np.ndarray, streams: np.ndarray, groups: np.ndarray, seed: int) -> np.ndarray:
    """uint32 [..., 4] Philox4x32-10 words for counters (group, position lo, position hi, stream)."""
    shape = np.broadcast_shapes(positions.shape, streams.shape, groups.shape)
    pos = np.broadcast_to(positions, shape).astype(np.uint64)
    counter = np.empty(shape + (4,), dtype=np.uint32)
    counter[..., 0] = np.broadcast_to(groups, shape)
    counter[..., 1] = (pos & MASK32).astype(np.uint32)
    counter[..., 2] = (pos >> SHIFT32).astype(np.uint32)
    counter[..., 3] = np.broadcast_to(streams, shape)
    key = np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint32)
    return philox4x32(counter, key)


def oracle_logits_reference(reference_tokens: np.ndarray, prompt_lens: np.ndarray, start: np.ndarray,
                            horizon: int, vocab_size: int, *, accuracy: float, entropy: float,
                            seed: int) -> np.ndarray:
    """The oracle's draft logits, computed in NumPy (the definition the kernel follows).

    Args:
        reference_tokens: int [bs, n], the target's continuation (-1 where unknown).
        prompt_lens: int [bs]; start: int [bs], each request's root position.
        horizon: L >= 0; vocab_size: V >= 1.
        accuracy, entropy, seed: as :class:`OracleDrafter`.

    Returns:
        float32 [bs, L, V].
    """
    ref = _check_reference(reference_tokens, vocab_size)
    bs = ref.shape[0]
    prompt_lens = require_array(prompt_lens, "prompt_lens", "int", ndim=1).astype(np.int64)
    start = require_array(start, "start", "int", ndim=1).astype(np.int64)
    if prompt_lens.shape != (bs,) or start.shape != (bs,):
        raise ValueError(f"prompt_lens and start must have shape ({bs},)")
    accuracy, inv_entropy, seed = _check_knobs(accuracy, entropy, seed)
    horizon = require_int(horizon, "horizon", minimum=0)

    b = np.arange(bs, dtype=np.int64)[:, None]  # [bs, 1]
    position = start[:, None] + np.arange(1, horizon + 1, dtype=np.int64)[None, :]  # [bs, L]
    g = position - prompt_lens[:, None]  # [bs, L]
    inside = (g >= 0) & (g < ref.shape[1])
    truth = np.where(inside, ref[b, np.clip(g, 0, max(ref.shape[1] - 1, 0))] if ref.shape[1] else -1, -1)
    decision = _philox_rows(position, (2 * b + DECISION_STREAM).astype(np.uint32),
                            np.zeros(1, np.uint32), seed).astype(np.uint64)  # [bs, L, 4]
    known = truth >= 0
    correct = (vocab_size == 1) | (_unit_np(decision[..., 0]) < accuracy)
    wrong = (truth + 1 + (decision[..., 1] % np.uint64(max(vocab_size - 1, 1))).astype(np.int64)) % vocab_size
    drawn = (decision[..., 1] % np.uint64(vocab_size)).astype(np.int64)
    top = np.where(known, np.where(correct, truth, wrong), drawn)  # [bs, L]

    n_groups = -(-vocab_size // PHILOX_WORDS)
    groups = np.arange(n_groups, dtype=np.uint32)[None, None, :]  # [1, 1, G]
    words = _philox_rows(position[:, :, None], (2 * b + NOISE_STREAM).astype(np.uint32)[:, :, None],
                         groups, seed)  # [bs, L, G, 4]
    radius_a = np.sqrt(-2.0 * np.log(_unit_np(words[..., 0])))
    angle_a = TWO_PI * _unit_np(words[..., 1])
    radius_b = np.sqrt(-2.0 * np.log(_unit_np(words[..., 2])))
    angle_b = TWO_PI * _unit_np(words[..., 3])
    noise = np.stack([radius_a * np.cos(angle_a), radius_a * np.sin(angle_a),
                      radius_b * np.cos(angle_b), radius_b * np.sin(angle_b)], axis=-1)  # [bs, L, G, 4]
    logits = (noise.reshape(bs, horizon, n_groups * PHILOX_WORDS)[:, :, :vocab_size] * inv_entropy).astype(np.float32)
    rows = np.nonzero(np.ones((bs, horizon), dtype=bool))
    logits[rows[0], rows[1], top[rows]] = np.float32(TOP_SCORE * inv_entropy)
    return logits


# --- host side -------------------------------------------------------------------------------

def _check_reference(reference_tokens: Any, vocab_size: int) -> np.ndarray:
    """int [bs, n] with values in [-1, V), as int64."""
    vocab_size = require_int(vocab_size, "vocab_size", minimum=1, maximum=2**31 - 1)
    ref = require_array(reference_tokens, "reference_tokens", "int", ndim=2)
    if ref.shape[0] < 1:
        raise ValueError("reference_tokens must have at least one request (row)")
    ref = ref.astype(np.int64)
    if ref.size and (ref.min() < -1 or ref.max() >= vocab_size):
        raise ValueError(f"reference_tokens must be in [-1, {vocab_size}) (-1: unknown)")
    return ref


def _check_knobs(accuracy: Any, entropy: Any, seed: Any) -> tuple[float, float, int]:
    """(accuracy in [0, 1], 1 / entropy with entropy > 0, seed in [0, 2^64))."""
    accuracy = require_real(accuracy, "accuracy")
    if not 0.0 <= accuracy <= 1.0:
        raise ValueError(f"accuracy must be in [0, 1], got {accuracy}")
    entropy = require_real(entropy, "entropy")
    if entropy <= 0.0:
        raise ValueError(f"entropy must be > 0, got {entropy}")
    seed = require_int(seed, "seed", minimum=0, maximum=2**64 - 1)
    return accuracy, 1.0 / entropy, seed


def _check_batch_vector(x: Any, name: str, bs: int) -> Any:
    """An int32 [bs] device or host array (checked by shape and dtype only: no copy)."""
    if not (isinstance(x, np.ndarray) or cuda.devicearray.is_cuda_ndarray(x)):
        raise TypeError(f"{name} must be a NumPy array or a CUDA device array, got {type(x).__name__}")
    if np.dtype(x.dtype) != np.int32:
        raise TypeError(f"{name} must have dtype int32, got {np.dtype(x.dtype)}")
    if tuple(x.shape) != (bs,):
        raise ValueError(f"{name} must have shape ({bs},), got {tuple(x.shape)}")
    return x


class OracleDrafter:
    """A drafter that knows the target's continuation (see the module docstring for its logits).

    Args:
        reference_tokens: int [bs, n] host array: request b's generated tokens (index 0 = the
            first token after its prompt), -1 where unknown (past its end). Uploaded once.
        vocab_size: V, the target's vocabulary.
        horizon: L = block_size - 1 >= 0.
        accuracy: probability in [0, 1] that a row's top token is the truth.
        entropy: > 0, the temperature of the oracle's distribution.
        seed: int in [0, 2^64), keys every draw with (request, position).
        threads: block size (default ORACLE_THREADS on a GPU, SIM_THREADS in the simulator).

    Attributes:
        parts: blocks per (request, depth) row, from :func:`oracle_parts` (vocab, threads).

    Device buffers (allocated once): the reference, prompt lengths, logits [bs, L, V].
    """

    feature_layers: tuple[int, ...] = ()

    def __init__(self, reference_tokens: Any, vocab_size: int, horizon: int, *, accuracy: float = 1.0,
                 entropy: float = 0.5, seed: int = 0, threads: int | None = None) -> None:
        ref = _check_reference(reference_tokens, vocab_size)
        self.horizon = require_int(horizon, "horizon", minimum=0)
        self.accuracy, self._inv_entropy, self.seed = _check_knobs(accuracy, entropy, seed)
        self.entropy = float(entropy)
        if threads is None:
            threads = SIM_THREADS if simulator_active() else ORACLE_THREADS
        self.threads = require_int(threads, "threads", minimum=32, maximum=1024)
        self.vocab_size = int(vocab_size)
        self.batch_size = ref.shape[0]
        padded = np.full((self.batch_size, max(ref.shape[1], 1)), -1, dtype=np.int32)  # [bs, n]
        padded[:, :ref.shape[1]] = ref
        self._ref = cuda.to_device(padded)
        self._prompt_lens = cuda.to_device(np.zeros(self.batch_size, dtype=np.int32))
        self._logits = cuda.device_array((self.batch_size, self.horizon, self.vocab_size), dtype=np.float32)
        self.parts, self._groups_per_part = oracle_parts(self.vocab_size, self.threads)

    def begin(self, features: Any, prompt_lens: Any, stream: Any = 0) -> None:
        """Record the prompt lengths (the features are not needed)."""
        prompt_lens = _check_batch_vector(prompt_lens, "prompt_lens", self.batch_size)
        self._prompt_lens.copy_to_device(prompt_lens, stream=stream)

    def draft(self, bonus: Any, start: Any, stream: Any = 0) -> Any:
        """Oracle logits float32 [bs, L, V] for positions start + 1 .. start + L (one launch of
        L x bs x parts blocks)."""
        _check_batch_vector(bonus, "bonus", self.batch_size)
        start = _check_batch_vector(start, "start", self.batch_size)
        if self.horizon:
            launch(oracle_logits_kernel, (self.horizon, self.batch_size, self.parts), self.threads, stream, 0,
                   self._ref, self._prompt_lens, start, np.uint64(self.seed), np.float64(self.accuracy),
                   np.float64(self._inv_entropy), np.int32(self._groups_per_part), self._logits)
        return self._logits

    def commit(self, features: Any, accepted: Any, lengths: Any, stream: Any = 0) -> None:
        """Nothing to carry: the oracle has no context beyond the positions it is asked for."""
