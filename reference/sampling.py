"""Posterior tokens: greedy, or Gumbel-max on counter-based Philox noise (spec §1.4).

The noise for (position p, token v) depends only on (seed, p, v), never on a node index, so a tree
node on the accepted path draws exactly what autoregressive decoding draws at the same position:
sampled DDTree reproduces sampled AR token for token. Siblings share a position and hence the noise;
each node's draw is still an exact sample from its own softmax, and the walk consults one node per
depth, whose positions are distinct, so the accepted sequence has the AR distribution (lossless).
"""
from __future__ import annotations

import numpy as np

from reference._checks import as_int64, require_array, require_finite, require_int, require_real

PHILOX_M0 = np.uint64(0xD2511F53)  # Random123 multipliers and Weyl key increments
PHILOX_M1 = np.uint64(0xCD9E8D57)
PHILOX_W0 = np.uint64(0x9E3779B9)
PHILOX_W1 = np.uint64(0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)
_PHILOX_MAX_ROUNDS = 16  # Random123 allows up to 16 rounds; 10 is the standard (crush-resistant) count
_WORDS = 4  # Philox4x32 emits four 32-bit words per counter
GREEDY_TEMPERATURE = 1e-5  # below this, argmax (official threshold, spec §1.4)
_UNIT_SCALE = 2.0**-32  # (x + 0.5) * 2^-32 maps a uint32 into the open interval (0, 1)


def _philox_round(c: list[np.ndarray], k0: np.ndarray, k1: np.ndarray) -> list[np.ndarray]:
    """One Philox4x32 round on four uint64 arrays holding 32-bit words."""
    p0 = PHILOX_M0 * c[0]  # a 32x32 -> 64-bit product fits uint64 exactly
    p1 = PHILOX_M1 * c[2]
    hi0, lo0 = p0 >> _SHIFT32, p0 & _MASK32
    hi1, lo1 = p1 >> _SHIFT32, p1 & _MASK32
    return [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]


def philox4x32(counter: np.ndarray, key: np.ndarray, rounds: int = 10) -> np.ndarray:
    """Philox4x32-R (Salmon et al. 2011, Random123), vectorised.

    Args:
        counter: uint32 [..., 4].
        key: uint32 [..., 2]; leading dims broadcast against the counter's.
        rounds: 1..16 (10 is Philox4x32-10).

    Returns:
        uint32 [..., 4] (broadcast leading shape).
    """
    counter = require_array(counter, "counter", "int")
    key = require_array(key, "key", "int")
    if counter.dtype != np.uint32:
        raise TypeError(f"counter must have dtype uint32, got {counter.dtype}")
    if key.dtype != np.uint32:
        raise TypeError(f"key must have dtype uint32, got {key.dtype}")
    if counter.ndim < 1 or counter.shape[-1] != _WORDS:
        raise ValueError(f"counter must have shape [..., 4], got {counter.shape}")
    if key.ndim < 1 or key.shape[-1] != 2:
        raise ValueError(f"key must have shape [..., 2], got {key.shape}")
    rounds = require_int(rounds, "rounds", minimum=1, maximum=_PHILOX_MAX_ROUNDS)
    try:
        lead = np.broadcast_shapes(counter.shape[:-1], key.shape[:-1])
    except ValueError:
        raise ValueError(f"counter and key leading shapes do not broadcast: {counter.shape}, {key.shape}") from None

    c = [np.broadcast_to(counter[..., i], lead).astype(np.uint64) for i in range(_WORDS)]
    k0 = np.broadcast_to(key[..., 0], lead).astype(np.uint64)
    k1 = np.broadcast_to(key[..., 1], lead).astype(np.uint64)
    for r in range(rounds):
        if r > 0:  # the key is bumped between rounds, not before the first
            k0 = (k0 + PHILOX_W0) & _MASK32
            k1 = (k1 + PHILOX_W1) & _MASK32
        c = _philox_round(c, k0, k1)
    return np.stack(c, axis=-1).astype(np.uint32)


def _check_seed(seed) -> int:
    return require_int(seed, "seed", minimum=0, maximum=2**64 - 1)


def _check_positions(positions, n_rows: int | None) -> np.ndarray:
    """int [T] (>= 0) as int64; length n_rows if given."""
    pos = as_int64(require_array(positions, "positions", "int", ndim=1), "positions")
    if n_rows is not None and pos.shape[0] != n_rows:
        raise ValueError(f"positions must have shape ({n_rows},), got {pos.shape}")
    if np.any(pos < 0):
        raise ValueError("positions must be >= 0")
    return pos


def _gumbel(seed: int, positions: np.ndarray, vocab_size: int) -> np.ndarray:
    """Checked-input core of ``gumbel_noise``: float64 [T, V]."""
    n_groups = -(-vocab_size // _WORDS)  # tokens 4g..4g+3 share one Philox call
    p = positions.astype(np.uint64)  # [T]
    counter = np.zeros((positions.shape[0], n_groups, _WORDS), dtype=np.uint32)  # [T, G, 4]
    counter[:, :, 0] = np.arange(n_groups, dtype=np.uint32)[None, :]  # v >> 2
    counter[:, :, 1] = (p & _MASK32).astype(np.uint32)[:, None]
    counter[:, :, 2] = (p >> _SHIFT32).astype(np.uint32)[:, None]
    key = np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint32)  # [2]
    words = philox4x32(counter, key).reshape(positions.shape[0], n_groups * _WORDS)[:, :vocab_size]  # [T, V]
    u = (words.astype(np.float64) + 0.5) * _UNIT_SCALE  # [T, V], in (0, 1)
    return -np.log(-np.log(u))


def gumbel_noise(seed: int, positions: np.ndarray, vocab_size: int) -> np.ndarray:
    """Standard Gumbel noise keyed by (seed, position, token).

    For position p and token v: counter = (v >> 2, p & 0xffffffff, p >> 32, 0),
    key = (seed & 0xffffffff, seed >> 32); x = Philox4x32-10 output word v & 3;
    u = (x + 0.5) * 2**-32; g = -log(-log(u)).

    Args:
        seed: int in [0, 2**64).
        positions: int [T], >= 0.
        vocab_size: int >= 1.

    Returns:
        float64 [T, V] (T x V x 8 bytes: keep V small in tests).
    """
    seed = _check_seed(seed)
    positions = _check_positions(positions, None)
    vocab_size = require_int(vocab_size, "vocab_size", minimum=1)
    return _gumbel(seed, positions, vocab_size)


def sample_posterior(
    logits: np.ndarray, temperature: float, seed: int, positions: np.ndarray | None = None
) -> np.ndarray:
    """The target's token at each row: greedy, or a Gumbel-max sample from softmax(logits / T).

    Greedy (temperature < 1e-5, the official threshold): argmax of the float64 logits, ties to the
    lowest id. Otherwise: argmax over v of ``float64(logits[t, v]) / temperature + g[t, v]`` (ties to
    the lowest id), with g from ``gumbel_noise(seed, positions, V)``; this is an exact sample from
    softmax(logits / temperature).

    Position convention: positions[t] is the position of the row whose logits these are, i.e. the
    position of the token that was fed in to produce them. For a tree node that is
    past_len + depth (its RoPE position, spec §1.3); in autoregressive decoding it is the position of
    the last input token. A node on the accepted path therefore has the same position as the AR step
    that would produce the same next token from the same prefix, so both draw the same noise and the
    same token: sampled DDTree reproduces sampled AR token for token.

    Args:
        logits: [T, V] floating, finite, V >= 1.
        temperature: finite, >= 0.
        seed: int in [0, 2**64); validated even when greedy.
        positions: int [T], >= 0; default arange(T).

    Returns:
        int64 [T] token ids.
    """
    logits = require_array(logits, "logits", "float", ndim=2)
    if logits.shape[1] == 0:
        raise ValueError("logits must have at least one column (vocabulary size V >= 1)")
    require_finite(logits, "logits")
    temperature = require_real(temperature, "temperature")
    if temperature < 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    seed = _check_seed(seed)
    n_rows, vocab_size = logits.shape
    if positions is None:
        positions = np.arange(n_rows, dtype=np.int64)
    positions = _check_positions(positions, n_rows)

    x = logits.astype(np.float64)  # [T, V]
    if temperature < GREEDY_TEMPERATURE:
        return np.argmax(x, axis=1).astype(np.int64)  # first maximum = lowest id
    perturbed = x / temperature + _gumbel(seed, positions, vocab_size)  # [T, V]
    return np.argmax(perturbed, axis=1).astype(np.int64)
