"""reference/sampling.py: Philox known answers, Gumbel-max sampling, and sampled DDTree == sampled AR."""
from __future__ import annotations

import numpy as np
import pytest

from reference.accept import accept
from reference.sampling import gumbel_noise, philox4x32, sample_posterior
from reference.tree import build_tree

U32 = np.uint32
KNOWN_ANSWERS = [  # Random123 kat_vectors, philox4x32_10
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize(("counter", "key", "expected"), KNOWN_ANSWERS)
def test_philox_known_answers(counter, key, expected) -> None:
    out = philox4x32(np.array(counter, dtype=U32), np.array(key, dtype=U32))
    assert out.dtype == U32
    assert out.tolist() == list(expected)


def test_philox_vectorised_and_broadcast() -> None:
    counters = np.array([c for c, _, _ in KNOWN_ANSWERS], dtype=U32)  # [3, 4]
    keys = np.array([k for _, k, _ in KNOWN_ANSWERS], dtype=U32)  # [3, 2]
    out = philox4x32(counters, keys)
    assert out.tolist() == [list(e) for _, _, e in KNOWN_ANSWERS]
    grid = philox4x32(counters[:, None, :], keys[None, :, :])  # [3, 3, 4]
    for i in range(3):
        for j in range(3):
            np.testing.assert_array_equal(grid[i, j], philox4x32(counters[i], keys[j]))
    assert not np.array_equal(philox4x32(counters[0], keys[0], rounds=7), out[0])


def _gumbel_scalar(seed: int, p: int, v: int) -> float:
    """One element from the spec's formula, one Philox call per element."""
    counter = np.array([v >> 2, p & 0xFFFFFFFF, p >> 32, 0], dtype=U32)
    key = np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=U32)
    x = int(philox4x32(counter, key)[v & 3])
    return -np.log(-np.log((x + 0.5) * 2.0**-32))


def test_gumbel_noise_formula() -> None:
    seed = 0x1234_5678_9ABC_DEF0
    positions = np.array([0, 1, 77, 2**32 + 5, 2**40 + 3])
    g = gumbel_noise(seed, positions, 11)
    assert g.shape == (5, 11) and g.dtype == np.float64 and np.all(np.isfinite(g))
    for t, p in enumerate(positions):
        for v in range(11):
            assert g[t, v] == _gumbel_scalar(seed, int(p), v)


def test_gumbel_noise_distribution() -> None:
    g = gumbel_noise(3, np.arange(400), 64).ravel()
    assert abs(g.mean() - np.euler_gamma) < 0.02 and abs(g.var() - np.pi**2 / 6) < 0.06


def test_greedy_is_argmax_lowest_id() -> None:
    rng = np.random.default_rng(0)
    logits = np.round(rng.normal(size=(50, 9)), 1)  # rounding makes ties common
    want = np.array([np.flatnonzero(row == row.max())[0] for row in logits])
    for temperature in (0.0, 9.9e-6):
        out = sample_posterior(logits, temperature, seed=5)
        assert out.dtype == np.int64
        np.testing.assert_array_equal(out, want)


def test_deterministic_and_seed_sensitive() -> None:
    logits = np.zeros((200, 16), dtype=np.float32)
    a = sample_posterior(logits, 1.0, seed=1)
    np.testing.assert_array_equal(a, sample_posterior(logits, 1.0, seed=1))
    assert not np.array_equal(a, sample_posterior(logits, 1.0, seed=2))
    assert not np.array_equal(a, sample_posterior(logits, 1.0, seed=1 + 2**32))  # high seed word used
    assert not np.array_equal(a, sample_posterior(logits, 1.0, seed=1, positions=np.arange(200) + 2**32))


def test_keyed_by_position_not_row() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(30, 12))
    positions = rng.permutation(1000)[:30]
    full = sample_posterior(logits, 0.8, seed=9, positions=positions)
    order = rng.permutation(30)
    np.testing.assert_array_equal(sample_posterior(logits[order], 0.8, seed=9, positions=positions[order]), full[order])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_empirical_distribution_matches_softmax(temperature: float) -> None:
    logits = np.array([1.0, 0.0, -0.5, 2.0, 0.3])
    n = 20000
    draws = sample_posterior(np.tile(logits, (n, 1)), temperature, seed=123, positions=np.arange(n) * 3 + 7)
    counts = np.bincount(draws, minlength=logits.size)
    p = np.exp(logits / temperature - np.logaddexp.reduce(logits / temperature))
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 18.47  # chi-square, 4 degrees of freedom, p = 0.001


def _model_logits(sequence: tuple[int, ...], vocab: int) -> np.ndarray:
    """A deterministic toy 'target model': next-token logits as a function of the whole prefix."""
    return np.random.default_rng(abs(hash(sequence)) % 2**63).normal(0.0, 1.5, vocab)


def test_sampled_tree_reproduces_sampled_ar() -> None:
    """A DDTree round (posteriors at positions past_len + depth) emits the same tokens as AR sampling."""
    rng = np.random.default_rng(2)
    vocab, temperature = 4, 0.9
    for case in range(60):
        seed = int(rng.integers(0, 2**64, dtype=np.uint64))
        prefix = tuple(int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 6))))
        root = int(rng.integers(0, vocab))
        past_len = len(prefix)
        n_positions, k = int(rng.integers(1, 5)), int(rng.integers(1, vocab + 1))
        lp = -np.sort(-np.log(rng.dirichlet(np.ones(vocab), n_positions)), axis=1)[:, :k]
        ids = np.argsort(rng.random((n_positions, vocab)), axis=1)[:, :k]
        tree = build_tree(lp, ids, int(rng.integers(0, 30)), root_token=root)

        node_seq = [prefix + (root,)]  # the input sequence ending at each node
        for i in range(1, tree.n_nodes):
            node_seq.append(node_seq[tree.parents[i]] + (int(tree.tokens[i]),))
        tree_logits = np.stack([_model_logits(s, vocab) for s in node_seq])  # [n_nodes, V]
        post = sample_posterior(tree_logits, temperature, seed, positions=past_len + tree.depths.astype(np.int64))
        result = accept(post, tree)
        emitted = [int(tree.tokens[i]) for i in result.accepted[1:]] + [result.bonus]

        sequence = prefix + (root,)
        ar = []
        for _ in range(len(emitted)):
            row = _model_logits(sequence, vocab)[None, :]
            token = int(sample_posterior(row, temperature, seed, positions=np.array([len(sequence) - 1]))[0])
            ar.append(token)
            sequence += (token,)
        assert ar == emitted, f"case {case}"


_LOGITS = np.zeros((2, 3))
_ERRORS = {
    "counter_dtype": (lambda: philox4x32(np.zeros(4, dtype=np.int64), np.zeros(2, dtype=U32)), TypeError, "counter"),
    "counter_shape": (lambda: philox4x32(np.zeros(3, dtype=U32), np.zeros(2, dtype=U32)), ValueError, "counter"),
    "key_dtype": (lambda: philox4x32(np.zeros(4, dtype=U32), np.zeros(2)), TypeError, "key"),
    "key_shape": (lambda: philox4x32(np.zeros(4, dtype=U32), np.zeros(3, dtype=U32)), ValueError, "key"),
    "key_broadcast": (lambda: philox4x32(np.zeros((3, 4), dtype=U32), np.zeros((2, 2), dtype=U32)), ValueError, "key"),
    "rounds_zero": (lambda: philox4x32(np.zeros(4, dtype=U32), np.zeros(2, dtype=U32), rounds=0), ValueError, "rounds"),
    "rounds_type": (lambda: philox4x32(np.zeros(4, dtype=U32), np.zeros(2, dtype=U32), rounds=10.0),
                    TypeError, "rounds"),
    "gumbel_seed_big": (lambda: gumbel_noise(2**64, np.arange(2), 3), ValueError, "seed"),
    "gumbel_seed_negative": (lambda: gumbel_noise(-1, np.arange(2), 3), ValueError, "seed"),
    "gumbel_positions_dtype": (lambda: gumbel_noise(0, np.zeros(2), 3), TypeError, "positions"),
    "gumbel_positions_negative": (lambda: gumbel_noise(0, np.array([-1]), 3), ValueError, "positions"),
    "gumbel_vocab": (lambda: gumbel_noise(0, np.arange(2), 0), ValueError, "vocab_size"),
    "sample_logits_dtype": (lambda: sample_posterior(np.zeros((2, 3), dtype=np.int32), 1.0, 0), TypeError, "logits"),
    "sample_logits_1d": (lambda: sample_posterior(np.zeros(3), 1.0, 0), ValueError, "logits"),
    "sample_logits_nan": (lambda: sample_posterior(np.full((2, 3), np.nan), 1.0, 0), ValueError, "logits"),
    "sample_logits_empty_vocab": (lambda: sample_posterior(np.zeros((2, 0)), 1.0, 0), ValueError, "logits"),
    "sample_temperature_negative": (lambda: sample_posterior(_LOGITS, -0.1, 0), ValueError, "temperature"),
    "sample_temperature_inf": (lambda: sample_posterior(_LOGITS, float("inf"), 0), ValueError, "temperature"),
    "sample_temperature_type": (lambda: sample_posterior(_LOGITS, None, 0), TypeError, "temperature"),
    "sample_seed_big": (lambda: sample_posterior(_LOGITS, 0.0, 2**64), ValueError, "seed"),
    "sample_seed_type": (lambda: sample_posterior(_LOGITS, 1.0, 1.5), TypeError, "seed"),
    "sample_positions_shape": (lambda: sample_posterior(_LOGITS, 1.0, 0, positions=np.arange(3)), ValueError,
                               "positions"),
    "sample_positions_negative": (lambda: sample_posterior(_LOGITS, 1.0, 0, positions=np.array([0, -2])), ValueError,
                                  "positions"),
}


@pytest.mark.parametrize("case", sorted(_ERRORS))
def test_validation(case: str) -> None:
    call, error, name = _ERRORS[case]
    with pytest.raises(error, match=rf"\b{name}\b"):
        call()
