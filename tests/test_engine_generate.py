"""``ddtree-numba generate`` (ddtree_numba.engine.generate): options, a tiny run, the JSON file."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from ddtree_numba.engine import generate


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddtree-numba generate")
    generate.add_arguments(parser)
    return parser


def _run(argv: list[str]) -> int:
    return generate.main(_parser().parse_args(argv))


def test_help_explains_the_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--preset", "--weights", "--prompt-lens", "--max-new-tokens", "--budget", "--block-size",
                   "--drafter", "--accuracy", "--entropy", "--temperature", "--seed", "--json", "{oracle,dflash}",
                   "--no-graphs", "--no-warmup", "--attention-split"):
        assert option in text
    assert "simulator" in text and "must reproduce AR" in text


@pytest.mark.parametrize("argv, message", [
    (["--prompt-len", "3", "--prompt-lens", "2,3"], "not both"),
    (["--batch", "3", "--prompt-lens", "2,3"], "--batch"),
    (["--budget", "1025"], "--budget"),
    (["--drafter", "dflash", "--block-size", "3"], "--block-size"),
    (["--accuracy", "1.5"], "--accuracy"),
    (["--entropy", "0"], "--entropy"),
    (["--preset", "tiny", "--weights", "x.h5"], "--weights"),
    (["--weights", "does-not-exist.h5"], "does not exist"),
    (["--preset", "no-such-preset"], "no-such-preset"),
    (["--attention-split", "24"], "attention_split must be a multiple of the attention chunk (16 keys)"),
])
def test_bad_options_fail_before_any_run(argv, message, capsys):
    assert _run(["--preset", "tiny", *argv] if "--preset" not in argv and "--weights" not in argv else argv) == 2
    assert message in capsys.readouterr().err


def test_bad_option_values_are_rejected_by_the_parser(capsys):
    for argv in (["--batch", "0"], ["--prompt-lens", "2,x"], ["--budget", "-1"], ["--drafter", "eagle"],
                 ["--attention-split", "0"], ["--products", "gpu"]):
        with pytest.raises(SystemExit):
            _parser().parse_args(argv)
    capsys.readouterr()


def test_tiny_run_with_the_dflash_drafter_sampled(capsys):
    pytest.importorskip("ddtree_numba.engine.dflash")
    status = _run(["--preset", "tiny", "--drafter", "dflash", "--batch", "1", "--prompt-len", "2",
                   "--max-new-tokens", "2", "--budget", "3", "--temperature", "0.8", "--seed", "5", "--quiet"])
    text = capsys.readouterr().out
    assert status == 0 and "identical tokens" in text and "yes" in text and "drafter dflash" in text


def test_tiny_run_side_by_side_with_json_after_the_warmup_pass(tmp_path, monkeypatch, capsys):
    """A tiny checkpoint's run, AR and DDTree side by side: its report and its JSON file. On a GPU
    (here: the check that picks the simulator's defaults answering no) an untimed pass of both runs
    compiles every kernel first; the report and the JSON are the second pass, with the counts of
    one run (checked below). --no-warmup is in the help. (One test for both: the warm-up pass is a
    whole run, the report's run a second one; a fresh model's first run is lossless in every
    other run of this file.)"""
    from reference.weights import init_weights, save_weights
    from ddtree_numba.config import ModelConfig

    tiny = ModelConfig.from_name("tiny")
    checkpoint = save_weights(tmp_path / "tiny.h5", init_weights(tiny, 3), tiny)
    runs = []
    import ddtree_numba.engine.decode as decode   # _run imports generate_ar from it at run time
    original = decode.generate_ar

    def counted(*args, **kwargs):
        runs.append("ar")
        return original(*args, **kwargs)

    monkeypatch.setattr(decode, "generate_ar", counted)
    monkeypatch.setattr(generate, "_simulated", lambda: False)
    out = tmp_path / "runs" / "run.json"
    status = _run(["--weights", str(checkpoint), "--batch", "1", "--prompt-len", "2", "--max-new-tokens", "3",
                   "--budget", "2", "--block-size", "3", "--accuracy", "1", "--entropy", "0.3", "--quiet",
                   "--no-graphs", "--json", str(out)])
    text = capsys.readouterr().out
    assert status == 0 and runs == ["ar", "ar"] and "warm-up pass" in text
    assert text.index("warm-up pass") < text.index("identical tokens")   # one report, after the pass
    assert text.count("identical tokens") == 1 and "yes" in text and "target forwards" in text and "verify ms" in text
    assert "step ms (median)" in text and "eager steps" in text
    assert "tokens/s of the timed steps" in text and "tokens/s / (tau x AR), >= 0.5" in text
    data = json.loads(out.read_text())
    assert sorted(p.name for p in out.parent.iterdir()) == ["run.json"]  # atomic: no temp file left
    assert data["identical"] is True and data["preset"] == "checkpoint tiny.h5"
    ar, tree = data["ar"], data["ddtree"]
    assert ar["tokens"] == tree["tokens"] and len(ar["tokens"]) == 1 and len(ar["tokens"][0]) == 3
    assert ar["forward_passes"] == 3 and tree["forward_passes"] == 2  # prefill + one round of 3 tokens
    assert tree["acceptance_histogram"] == [0, 0, 0, 1] and tree["mean_acceptance"] == 3.0
    assert set(tree["stage_s"]) == {"draft", "topk", "build", "verify", "accept", "compact"}
    assert data["budget"] == 2 and data["block_size"] == 3 and data["max_new_tokens"] == 3
    assert data["graphs"] is False and ar["graphs"] is False and ar["stage_rounds"] == ar["rounds"] == 2
    assert len(ar["step_s"]) == 2 and tree["stage_rounds"] == 1
    # Without graphs every step is timed: one round of 3 tokens against AR's median step.
    assert tree["timed_mean_acceptance"] == 3.0 and tree["timed_tokens_per_s"] == pytest.approx(3 / tree["step_s"][0])
    assert data["speed_ratio"] == pytest.approx(float(np.median(ar["step_s"])) / tree["step_s"][0])


@pytest.mark.parametrize("prompt_len, option, fields", [
    (17, ["--attention-split", "16"], {"attention segments of 16 keys": ("attention_split", 16)}),
    # --pdl changes nothing the simulator runs (no programmatic launches): it rides along here
    (3, ["--products", "tensor-core", "--pdl"], {"products on the tensor cores": ("products", "tensor-core"),
                                                 "--pdl ignored": ("pdl", False)}),
], ids=["attention-split", "tensor-core-pdl"])
def test_tiny_run_with_other_numerics_is_lossless(tmp_path, capsys, prompt_len, option, fields):
    """The numerics options, each lossless on tiny, named by the run's header and JSON.
    --attention-split 16 (tiny's attention chunk): a 17-token prompt and the rows after it span two
    segments, so the prefill, the AR steps and the tree verify all run the segment merge (the
    default's 2048-key segment never merges at these sizes). --products tensor-core: the dense
    products through kernels.linear_tc (the simulator's mma model). --pdl: accepted, and recorded
    as off where it cannot apply (the simulator; in the tensor-core run, which it leaves as it is)."""
    out = tmp_path / "run.json"
    status = _run(["--preset", "tiny", "--batch", "1", "--prompt-len", str(prompt_len), "--max-new-tokens", "2",
                   "--budget", "2", "--block-size", "3", "--accuracy", "1", "--quiet", "--no-graphs",
                   *option, "--json", str(out)])
    text = capsys.readouterr().out
    assert status == 0 and all(header in text for header in fields)
    data = json.loads(out.read_text())
    assert data["identical"] is True and all(data[key] == value for key, value in fields.values())
    assert data["ar"]["forward_passes"] == 2 and data["ddtree"]["forward_passes"] == 2  # prefill + one step / round


def test_products_choices_are_the_engines():
    """--products offers engine.model.PRODUCTS (spelled out in the CLIs: --help imports no CUDA)."""
    from ddtree_numba.bench import decode_step
    from ddtree_numba.engine.model import PRODUCTS

    for parser in (_parser(), decode_step._parser()):
        action = next(a for a in parser._actions if a.dest == "products")
        assert tuple(action.choices) == PRODUCTS and action.default == "cuda-core"


def _fake_result(method: str, acceptance: np.ndarray, step_s: list[float]):
    """A finished eager run (no GPU, nothing launched): what generate's report reads."""
    from ddtree_numba.engine.decode import GenerateResult

    rounds, bs = acceptance.shape
    stages = ("verify", "accept") if method == "ar" else ("draft", "topk", "build", "verify", "accept", "compact")
    return GenerateResult(method=method, tokens=[[3] * (1 + int(acceptance[:, b].sum())) for b in range(bs)],
                          prompt_lens=[4] * bs, forward_passes=1 + rounds, acceptance=acceptance,
                          max_acceptance=int(acceptance.max()), prefill_s=0.1, decode_s=sum(step_s),
                          stage_s=dict.fromkeys(stages, 0.001), timing="wall-clock", step_s=np.array(step_s),
                          stage_rounds=rounds, graphs=False, capture_s=0.0,
                          budget=None if method == "ar" else 8, block_size=None if method == "ar" else 4)


@pytest.mark.parametrize("bs", [1, 2])
def test_report_gives_the_speed_ratio_at_batch_1_only(bs):
    """The ratio row is issue 4's batch-1 measure (engine.decode.speed_ratio); in a batch, requests
    that finish early would pull it below AR step / round, so the row says so instead."""
    ar = _fake_result("ar", np.ones((6, bs), np.int32), [0.001] * 6)
    tree = _fake_result("ddtree", np.array([[4] * bs, [3] * bs], np.int32), [0.004, 0.004])
    row = next(line for line in generate._format(ar, tree).splitlines() if line.startswith("tokens/s / (tau x AR)"))
    # every round 4 ms against a 1 ms AR step: 0.25
    from ddtree_numba.engine.decode import speed_ratio

    assert (speed_ratio(ar, tree) is None) == (bs > 1)
    assert row.split()[-1] == "0.250" if bs == 1 else row.endswith("(batch 1 only)")
    timed = next(line for line in generate._format(ar, tree).splitlines() if line.startswith("tokens/s of the timed"))
    assert f"{1000.0 * bs:.1f} (eager)" in timed and f"{7 * bs / 0.008:.1f} (eager)" in timed
