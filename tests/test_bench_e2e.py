"""End-to-end sweep (AR vs DDTree) against a fake engine: Dataset structure, the AR continuation
handed to the oracle, and the command-line grid."""
import argparse
from dataclasses import dataclass

import numpy as np
import pytest

from ddtree_numba.bench import e2e, sweep


@dataclass
class FakeResult:
    """The fields of engine.decode.GenerateResult that the e2e sweep reads."""

    tokens: list
    forward_passes: int
    mean_acceptance: float
    prefill_s: float = 0.0
    decode_s: float = 0.0
    capture_s: float = 0.0

    @property
    def decode_tokens(self) -> int:
        return sum(len(t) - 1 for t in self.tokens)


class FakeEngine:
    """AR emits token (sum of the prompt + i) mod V; DDTree reproduces it from the oracle's
    reference and takes fewer forwards the higher the accuracy (tau = 1 + accuracy x L)."""

    vocab = 1000

    def __init__(self, wrong_at: float | None = None):
        self.models, self.oracles, self.calls = [], [], []
        self.wrong_at = wrong_at

    def make_model(self, config, weights, batch_size, kv_capacity, max_rows):
        self.models.append((batch_size, kv_capacity, max_rows))
        return {"batch": batch_size}

    def make_oracle(self, reference, vocab, horizon, accuracy, entropy, seed):
        self.oracles.append((reference.copy(), vocab, horizon, accuracy, entropy, seed))
        return {"reference": reference, "horizon": horizon, "accuracy": accuracy}

    def generate_ar(self, model, prompts, *, max_new_tokens, temperature, seed, stop_tokens):
        assert len(prompts) == model["batch"] and temperature == 0.0 and stop_tokens == ()
        self.calls.append(("ar", max_new_tokens))
        tokens = [[(int(p.sum()) + i) % self.vocab for i in range(max_new_tokens)] for p in prompts]
        return FakeResult(tokens, max_new_tokens + 1, 1.0, 0.0, 1e-3 * max_new_tokens, 0.0)

    def generate_ddtree(self, model, drafter, prompts, *, budget, block_size, max_new_tokens, temperature,
                        seed, stop_tokens):
        self.calls.append(("ddtree", budget, max_new_tokens))
        assert drafter["horizon"] == block_size - 1 and budget <= 1024
        ref = drafter["reference"]
        n = min(max_new_tokens, ref.shape[1])
        tokens = [list(map(int, ref[b, :n])) for b in range(len(prompts))]
        if self.wrong_at is not None and drafter["accuracy"] == self.wrong_at:
            tokens[0][0] += 1
        tau = 1.0 + drafter["accuracy"] * drafter["horizon"]
        rounds = int(np.ceil(n / tau))
        return FakeResult(tokens, rounds + 1, tau, 0.0, 1e-3 * rounds, 0.0)


@dataclass
class FakeConfig:
    vocab_size: int = 1000


GRID = e2e.E2EGrid(batch=(1, 3), budget=(8, 64), accuracy=(0.5, 0.9), block=8, prompt_len=5, max_new_tokens=20)


def test_e2e_dataset_structure_and_values():
    engine = FakeEngine()
    ds = e2e.run_e2e(GRID, engine, FakeConfig(), weights={}, echo=lambda line: None)
    assert ds["tokens_per_s"].dims == ("batch", "budget", "accuracy")
    assert ds["ar_tokens_per_s"].dims == ("batch",)
    assert (ds["matches_ar"] == 1).all()
    assert (ds["tokens_per_s"] > 0).all() and (ds["ar_tokens_per_s"] > 0).all()
    np.testing.assert_allclose(ds["speedup_vs_ar"], ds["tokens_per_s"] / ds["ar_tokens_per_s"])
    np.testing.assert_allclose(ds["mean_acceptance"].sel(accuracy=0.9), 1 + 0.9 * 7)
    assert (ds["forward_passes"].sel(accuracy=0.9) < ds["forward_passes"].sel(accuracy=0.5)).all()
    np.testing.assert_array_equal(ds["ar_forward_passes"], [21, 21])
    # Decode-only rates: (tokens - 1 per request) / decode_s; fewer rounds, faster decode.
    np.testing.assert_allclose(ds["ar_decode_tokens_per_s"], [19 / 0.02, 3 * 19 / 0.02])
    assert (ds["decode_speedup_vs_ar"].sel(accuracy=0.9) > 1).all()
    # other_s = wall - prefill - decode - capture (the fake's decode times are not its wall time)
    assert np.isfinite(ds["other_s"]).all() and ds["capture_s"].dims == ("batch", "budget", "accuracy")
    for name, var in ds.data_vars.items():
        assert var.attrs["units"] and var.attrs["long_name"], name
    assert ds.attrs["benchmark"] == "sweep_e2e"
    # One model per batch, sized for the largest budget; the oracle gets the AR continuation.
    assert engine.models == [(1, 5 + 20 + 64 + 8 + 1, 65), (3, 5 + 20 + 64 + 8 + 1, 65)]
    ref, vocab, horizon, *_ = engine.oracles[-1]
    assert ref.shape == (3, 20) and vocab == 1000 and horizon == 7
    # A warm-up run precedes every timed shape.
    assert engine.calls[:2] == [("ar", 2), ("ar", 20)]
    assert ("ddtree", 64, 16) in engine.calls


def test_e2e_flags_a_run_that_differs_from_ar():
    ds = e2e.run_e2e(GRID, FakeEngine(wrong_at=0.5), FakeConfig(), weights={}, echo=lambda line: None)
    assert (ds["matches_ar"].sel(accuracy=0.5) == 0).all() and (ds["matches_ar"].sel(accuracy=0.9) == 1).all()


def test_reference_array_pads_ragged_requests():
    ref = e2e.reference_array([[5, 6, 7], [8], []])
    np.testing.assert_array_equal(ref, [[5, 6, 7], [8, -1, -1], [-1, -1, -1]])


def test_grid_from_the_sweep_command_line():
    args = sweep.build_parser().parse_args(["--kernel", "e2e", "--quick", "--budget", "8,32", "--block", "8",
                                            "--accuracy", "0.6,1.0", "--max-new-tokens", "40"])
    grid = e2e.grid_from_args(args, simulated=True)
    assert grid.budget == (8, 32) and grid.block == 8 and grid.accuracy == (0.6, 1.0)
    assert grid.max_new_tokens == 40 and grid.preset == "tiny" and grid.batch == e2e.QUICK["batch"]
    grid = e2e.grid_from_args(sweep.build_parser().parse_args(["--kernel", "e2e"]), simulated=False)
    assert grid.preset == "small" and grid.batch == (1, 8) and grid.budget[0] == 8 and grid.budget[-1] == 1024


def test_grid_validation():
    with pytest.raises(ValueError, match="accuracy"):
        e2e.E2EGrid(accuracy=(1.5,))
    with pytest.raises(ValueError, match="budget"):
        e2e.E2EGrid(budget=())


def test_e2e_main_without_the_engine_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(e2e, "engine_api", lambda: (_ for _ in ()).throw(RuntimeError("the e2e sweep needs the engine")))
    args = argparse.Namespace(quick=True, preset="tiny", seed=0, out=None, batch=None, budget=None, block=None,
                              accuracy=None, entropy=None, max_new_tokens=None, prompt_len=None)
    assert e2e.main(args) == 2
    assert "needs the engine" in capsys.readouterr().err
