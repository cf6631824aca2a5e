"""The decode-step benchmark's arithmetic (ddtree_numba.bench.decode_step): bytes, rates, report.

The measurement itself needs the GPU (``python -m ddtree_numba.bench.decode_step --preset small``);
a simulated run of even ``tiny`` takes minutes, so here only the pure parts run.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from ddtree_numba.bench import decode_step as ds
from ddtree_numba.config import ModelConfig
from ddtree_numba.engine.decode import GenerateResult
from ddtree_numba.engine.weights import kernel_layouts
from reference.weights import init_weights

TINY = ModelConfig.from_name("tiny")


def test_tiny_step_bytes_match_a_hand_count():
    # tiny: V 512, D 64, 2 layers (1 dense, I 128; 1 MoE, I 32, E 8, k 2, 1 shared, sigmoid bias),
    # H 4, q_lora 32, kv_lora 32, nope 16, rope 8, v 16.
    attention = (32 + 32 + 8) * 64 + 4 * 24 * 32 + 4 * 32 * 16 + 4 * 16 * 32 + 64 * 64  # 15872 per layer
    norms = 2 * (64 + 64 + 32 + 32) + 64  # per layer: input, post-attention, q_a, kv_a; final
    dense = 3 * 128 * 64
    moe = 8 * 64 + 8 + (2 + 1) * 3 * 32 * 64  # gate + bias, 2 routed + 1 shared expert
    lm_head, embed = 512 * 64, 64
    kv = 2 * 11 * (32 + 8)  # 2 layers, 11 rows of latent + rope
    got = ds.step_bytes(TINY, 1, 11)
    assert got["attention"] == 4 * 2 * attention == 4 * 31744
    assert got["norms"] == 4 * norms and got["dense_ffn"] == 4 * dense and got["moe"] == 4 * moe
    assert got["lm_head"] == 4 * lm_head and got["embedding"] == 4 * embed and got["kv"] == 4 * kv
    assert got["total"] == 4 * (2 * attention + norms + dense + moe + lm_head + embed + kv) == 437728


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_step_bytes_equal_the_uploaded_weights_read(batch):
    """Every kernel-layout weight counts once, routed experts by the share read, the embedding
    table by one row per request: an independent count from the arrays the engine uploads."""
    layouts = kernel_layouts(TINY, init_weights(TINY, 0))
    e, k = TINY.n_routed_experts, TINY.n_activated_experts
    read = min(e, batch * k)
    total = layouts["final_norm"].nbytes + layouts["lm_head"].nbytes + batch * layouts["embed"][0].nbytes
    for layer in layouts["layers"]:
        for name, arr in layer.items():
            total += arr.nbytes * read / e if name in ("w13", "w2") and arr.ndim == 3 else arr.nbytes
    got = ds.step_bytes(TINY, batch, 0)
    assert got["kv"] == 0 and got["total"] == pytest.approx(total, rel=0, abs=0)
    assert got["embedding"] == batch * 4 * TINY.hidden_size
    assert ds.step_bytes(TINY, batch, 0, experts=0)["moe"] < got["moe"]


def test_small_step_reads_about_1_45_gb():
    small = ModelConfig.from_name("small")
    got = ds.step_bytes(small, 1, 64)
    assert 1.40e9 < got["total"] < 1.50e9  # the figure the target is stated for
    assert got["lm_head"] == 4 * 32768 * 2048
    with pytest.raises(ValueError, match="experts"):
        ds.step_bytes(small, 1, 64, experts=17)
    with pytest.raises(ValueError, match="batch"):
        ds.step_bytes(small, 0, 64)


def test_mean_kv_rows():
    # prompt 10; steps 1..4 after the prefill attend 12, 13, 14, 15 rows
    assert ds.mean_kv_rows(10, 1, 4) == np.mean([12, 13, 14, 15])
    assert ds.mean_kv_rows(10, 0, 1) == 11


def _result(acceptance: np.ndarray, step_s: list[float], graphs: bool) -> GenerateResult:
    rounds = acceptance.shape[0]
    return GenerateResult(method="ddtree", tokens=[[0] * (1 + int(acceptance[:, b].sum()))
                                                   for b in range(acceptance.shape[1])],
                          prompt_lens=[4] * acceptance.shape[1], forward_passes=1 + rounds, acceptance=acceptance,
                          max_acceptance=16, prefill_s=0.1, decode_s=sum(step_s), stage_s={"verify": step_s[0]},
                          timing="cuda-events", step_s=np.array(step_s), stage_rounds=1 if graphs else rounds,
                          graphs=graphs, capture_s=0.05 if graphs else 0.0, budget=32, block_size=16)


def test_replay_rate_counts_only_replayed_rounds():
    acc = np.array([[5], [16], [10], [3]], dtype=np.int32)
    result = _result(acc, [0.010, 0.002, 0.002, 0.004], graphs=True)
    rate, rounds = ds.replay_rate(result)
    assert rounds == 3 and rate == pytest.approx((16 + 10 + 3) / 0.008)
    assert result.step_median_s == pytest.approx(0.002) and result.stage_per_round_s == {"verify": 0.010}
    eager = _result(acc, [0.010, 0.002, 0.002, 0.004], graphs=False)
    assert ds.replay_rate(eager) == (0.0, 0) and eager.step_median_s == pytest.approx(0.003)
    # The ratio's tau is the replayed rounds' own: the eager first round (5 tokens) is not timed.
    assert result.timed_mean_acceptance == pytest.approx((16 + 10 + 3) / 3)
    assert result.mean_acceptance == pytest.approx((5 + 16 + 10 + 3) / 4)
    assert eager.timed_mean_acceptance == pytest.approx((5 + 16 + 10 + 3) / 4)   # every round timed


def test_speed_ratio_takes_the_timed_rounds_tau_and_the_ar_median():
    from ddtree_numba.engine.decode import speed_ratio

    tree = _result(np.array([[5], [16], [10], [3]], dtype=np.int32), [0.010, 0.002, 0.002, 0.004], graphs=True)
    ar = _result(np.ones((5, 1), dtype=np.int32), [0.009, 0.001, 0.001, 0.003, 0.001], graphs=True)
    assert tree.timed_tokens_per_s == pytest.approx(29 / 0.008) and tree.timed_mean_acceptance == pytest.approx(29 / 3)
    assert ar.step_median_s == pytest.approx(0.001)
    # tokens/s / (tau x AR tokens/s) = timed rounds / (their time x AR tokens/s): 3 / (0.008 x 1000)
    assert speed_ratio(ar, tree) == pytest.approx(0.375)
    assert speed_ratio(ar, _result(np.array([[4]], dtype=np.int32), [0.01], graphs=True)) == 0.0   # no replay


def _points() -> tuple[list[ds.ArPoint], list[ds.TreePoint]]:
    ar = [ds.ArPoint(batch=1, graph_us=700.0, graph_min_us=690.0, eager_us=9000.0, steps=126, bytes=1.45e9,
                     floor_us=337.2, tokens=[[1, 2]]),
          ds.ArPoint(batch=8, graph_us=900.0, graph_min_us=880.0, eager_us=9500.0, steps=126, bytes=1.8e9,
                     floor_us=418.6, tokens=[[1, 2]] * 8)]
    stages = dict.fromkeys(("draft", "topk", "build", "verify", "accept", "compact"), 100.0)
    trees = [ds.TreePoint(accuracy=a, round_us=3000.0, eager_round_us=20000.0, tau=tau, timed_tau=tau,
                          tokens_per_s=tau / 3e-3,
                          ratio=(tau / 3e-3) / (tau * 1 / 700e-6), rounds=9, forward_passes=10, identical=True,
                          stage_us=stages) for a, tau in ((0.9, 8.5), (1.0, 15.0))]
    return ar, trees


def test_report_table_and_hdf5_run(tmp_path):
    import xarray as xr

    ar, trees = _points()
    assert ar[0].fraction == pytest.approx(337.2 / 700.0) and ar[0].tokens_per_s == pytest.approx(1e6 / 700)
    assert ar[1].tokens_per_s == pytest.approx(8e6 / 900)
    text = ds.format_table(ar, trees, 4.3e12, "h200")
    lines = text.splitlines()
    assert "4.30 TB/s" in lines[0] and lines[2].endswith(">= 0.50 MISSED")  # batch 1: 337 / 700 < 0.5
    assert lines[3].endswith("(experts: upper bound)") and "0.482" in lines[2]
    assert all(" 0.233 " in line and "MISSED" in line for line in lines[-2:])  # ratio 700 / 3000
    out = tmp_path / "runs.h5"
    from ddtree_numba.bench.common import write_run

    group = write_run(out, ds.build_dataset(ar, trees, {"profile": "h200"}))
    with xr.open_dataset(out, group=group, engine="h5netcdf") as back:
        assert back.attrs["benchmark"] == "decode_step" and back.attrs["profile"] == "h200"
        np.testing.assert_allclose(back["ar_fraction"].values, [p.fraction for p in ar])
        np.testing.assert_array_equal(back["tree_identical"].values, [1, 1])
        np.testing.assert_allclose(back["tree_timed_tau"].values, [t.timed_tau for t in trees])
        assert list(back["stage"].values) == list(trees[0].stage_us)
        assert back["tree_stage_us"].shape == (2, 6)
    no_tree = ds.build_dataset(ar, [], {})
    assert "tree_tau" not in no_tree and "tree_timed_tau" not in no_tree and list(no_tree["batch"].values) == [1, 8]


def test_bad_arguments_exit_before_any_work():
    for argv in (["--batch", "0"], ["--new-tokens", "2"], ["--accuracy", "1.5"], ["--block", "1"], ["--ring", "1"],
                 ["--temperature", "-1"], ["--temperature", "nan"]):
        with pytest.raises(SystemExit, match="error"):
            ds.main(argv)


def test_pdl_release_choices(capsys):
    """--pdl-release takes kernels.pdl.RELEASE_MODES (early by default), parsed before any work."""
    from ddtree_numba.kernels.pdl import RELEASE_MODES

    assert ds._parser().parse_args([]).pdl_release == "early"
    for mode in RELEASE_MODES:
        assert ds._parser().parse_args(["--pdl", "--pdl-release", mode]).pdl_release == mode
    with pytest.raises(SystemExit) as exc:
        ds._parser().parse_args(["--pdl-release", "never"])
    assert exc.value.code == 2 and "--pdl-release" in capsys.readouterr().err


def test_sampled_run_end_to_end_in_the_simulator(tmp_path, capsys, monkeypatch, request):
    """--temperature: AR and DDTree sample with the same seed (the Gumbel posterior) through the
    whole bench on tiny, the tokens agree (exit status 0) and the run records its temperature
    (and --quads off: the linears' scalar staged-row traffic, and --ring 2: the async weight
    ring's setting, both recorded and restored after the run; tiny's tiles are below the ring's
    8 rows or have no 16-byte steps, so no ring kernel runs here)."""
    import json

    import xarray as xr

    from ddtree_numba.kernels import linear as lin

    for name in ("VECTOR_X_LOADS", "VECTOR_STAGING"):   # restored after the test, the plans rebuilt
        monkeypatch.setattr(lin, name, getattr(lin, name))
    request.addfinalizer(lin._setup.cache_clear)
    request.addfinalizer(functools.partial(lin.set_async_ring, *(lin.ASYNC_RING_STAGES, lin.ASYNC_RING_MIN_ROW_TILE)))
    out = tmp_path / "ds.h5"
    status = ds.main(["--preset", "tiny", "--batch", "1", "--prompt-len", "3", "--new-tokens", "4",
                      "--eager-tokens", "2", "--budget", "3", "--block", "3", "--accuracy", "1.0",
                      "--temperature", "0.8", "--quads", "off", "--ring", "2", "--out", str(out)])
    text = capsys.readouterr().out
    assert status == 0 and "temperature 0.8" in text
    group = text.split(f"wrote {out}:")[1].split()[0]
    with xr.open_dataset(out, group=group, engine="h5netcdf") as back:
        config = json.loads(back.attrs["config"])
        assert config["temperature"] == 0.8 and config["quads"] == "off" and config["ring"] == 2
        assert config["pdl_release"] == "early" and not config["pdl"]   # the default policy, recorded
        assert config["engine_release_early"] is False   # engine.model.PDL_RELEASE_EARLY's default
        # the attention splits recorded with the batches they run at (the defaults: decode on, tree off)
        assert config["decode_split"] == "on (batch <= 1)" and config["tree_split"] == "off"
        assert int(back["tree_identical"].values[0]) == 1
    assert not lin.VECTOR_X_LOADS and not lin.VECTOR_STAGING and lin.ASYNC_RING_STAGES == 2
