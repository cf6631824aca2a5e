"""End-to-end sweep: AR vs DDTree tokens/s and target forward passes across budgets and oracle accuracies.

The budget trade-off curve of the DDTree paper (its Figure 3) for this engine: for each batch
size, one AR run (greedy) gives the baseline and the target's continuation; then, for each budget
B and oracle accuracy, a DDTree run (greedy, OracleDrafter fed that continuation) over the same
prompts. Reported per run: new tokens per second of wall time (prefill included, after a warm-up
run of the same shape compiled every kernel), target forward passes, mean acceptance length, and
whether the DDTree tokens equal the AR tokens (they must: greedy DDTree is lossless).

    ddtree-numba bench sweep --kernel e2e --out data/bench/sweeps-h200.h5            # small, on a GPU
    ddtree-numba bench sweep --kernel e2e --quick --preset tiny                       # simulator smoke run

Uses the engine's API (ddtree_numba/engine: TargetModel, OracleDrafter, decode.generate_ar /
generate_ddtree), imported lazily; tests pass a fake :class:`Engine`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ddtree_numba.bench.sweep import check_positive_ints, comma_separated

DEFAULT_BUDGETS = (8, 16, 32, 64, 128, 256, 512, 1024)
DEFAULT_ACCURACIES = (0.5, 0.7, 0.9)
FIRST_TOKEN = 3  # prompt ids avoid the low special ids (bos 1, eos 2)


@dataclass(frozen=True)
class E2EGrid:
    """The end-to-end grid: batch x budget x oracle accuracy, one block size."""

    batch: tuple[int, ...] = (1, 8)
    budget: tuple[int, ...] = DEFAULT_BUDGETS
    accuracy: tuple[float, ...] = DEFAULT_ACCURACIES
    block: int = 16
    prompt_len: int = 64
    max_new_tokens: int = 128
    entropy: float = 0.5
    seed: int = 0
    preset: str = "small"

    def __post_init__(self) -> None:
        check_positive_ints(self, ("batch", "budget"))
        if not self.accuracy or any(not 0.0 <= a <= 1.0 for a in self.accuracy):
            raise ValueError(f"accuracy must be a non-empty tuple of values in [0, 1], got {self.accuracy!r}")
        if self.block < 2 or self.prompt_len < 1 or self.max_new_tokens < 1:
            raise ValueError("block must be >= 2, prompt_len and max_new_tokens >= 1")
        if self.entropy <= 0:
            raise ValueError(f"entropy must be > 0, got {self.entropy}")


QUICK = dict(batch=(1,), budget=(8, 64, 512), accuracy=(0.8,), max_new_tokens=64, prompt_len=32)


@dataclass(frozen=True)
class Engine:
    """The engine entry points the sweep calls (contracts in engine-common.md items 3-4).

    - ``make_model(config, weights, batch_size, kv_capacity, max_rows)`` -> a TargetModel
    - ``make_oracle(reference_tokens [bs, n] int, vocab_size, horizon, accuracy, entropy, seed)`` -> a Drafter
    - ``generate_ar(model, prompts, *, max_new_tokens, temperature, seed, stop_tokens)`` -> result
    - ``generate_ddtree(model, drafter, prompts, *, budget, block_size, max_new_tokens, temperature,
      seed, stop_tokens)`` -> result
    A result has ``tokens`` (per request, host sequences), ``forward_passes`` (int),
    ``mean_acceptance`` (tau over the (request, round) pairs), ``decode_tokens`` (tokens after the
    prefill's), ``prefill_s``, ``decode_s`` (the steps after the prefill, capture excluded) and
    ``capture_s`` (the CUDA-graph capture).
    """

    make_model: Callable
    make_oracle: Callable
    generate_ar: Callable
    generate_ddtree: Callable


def engine_api() -> Engine:
    """The real engine (ddtree_numba.engine); a clear error when it is not there yet."""
    try:
        from ddtree_numba.engine.decode import generate_ar, generate_ddtree
        from ddtree_numba.engine.drafters import OracleDrafter
        from ddtree_numba.engine.model import TargetModel
    except ImportError as err:
        raise RuntimeError(f"the e2e sweep needs the engine (ddtree_numba.engine): {err}") from err

    def make_model(config, weights, batch_size, kv_capacity, max_rows):
        return TargetModel(config, weights, batch_size=batch_size, kv_capacity=kv_capacity, max_rows=max_rows)

    def make_oracle(reference_tokens, vocab_size, horizon, accuracy, entropy, seed):
        return OracleDrafter(reference_tokens, vocab_size, horizon, accuracy=accuracy, entropy=entropy, seed=seed)

    return Engine(make_model, make_oracle, generate_ar, generate_ddtree)


def reference_array(tokens: Sequence[Sequence[int]]) -> np.ndarray:
    """int64 [bs, n] from per-request token lists, -1 past a request's end (OracleDrafter's input)."""
    n = max((len(t) for t in tokens), default=0)
    out = np.full((len(tokens), n), -1, np.int64)
    for b, t in enumerate(tokens):
        out[b, :len(t)] = np.asarray(t, np.int64)
    return out


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


# Where a generate call's wall time goes (GenerateResult fields): the per-call fixed costs that
# the wall-time tokens/s includes, beside the decode-only rate.
PARTS = ("prefill_s", "decode_s", "capture_s")


def _metrics(result: Any, wall_s: float) -> dict[str, float]:
    """tokens/s over the wall time, the decode-only rate, forward passes, mean acceptance and the
    wall time's parts (prefill, decode, capture, and the rest: host set-up) of one generate result."""
    tokens = sum(len(t) for t in result.tokens)
    parts = {name: float(getattr(result, name)) for name in PARTS}
    decode_rate = result.decode_tokens / parts["decode_s"] if parts["decode_s"] > 0 else float("nan")
    return {"tokens": float(tokens), "tokens_per_s": tokens / wall_s, "forward_passes": float(result.forward_passes),
            "mean_acceptance": float(result.mean_acceptance), "decode_tokens_per_s": decode_rate,
            **parts, "other_s": wall_s - sum(parts.values())}


def run_e2e(grid: E2EGrid, engine: Engine, config: Any, weights: Any,
            echo: Callable[[str], None] = print) -> Any:
    """The budget trade-off Dataset: dims (batch, budget, accuracy) for DDTree, (batch,) for AR."""
    import xarray as xr

    rng = np.random.default_rng(grid.seed)
    horizon = grid.block - 1
    dims = ("batch", "budget", "accuracy")
    shape = (len(grid.batch), len(grid.budget), len(grid.accuracy))
    timed = ("tokens_per_s", "decode_tokens_per_s") + PARTS + ("other_s",)
    dd = {name: np.full(shape, np.nan) for name in timed + ("forward_passes", "mean_acceptance")}
    matches = np.zeros(shape, np.int8)
    ar = {name: np.full(len(grid.batch), np.nan) for name in timed + ("forward_passes",)}
    common = dict(temperature=0.0, seed=grid.seed, stop_tokens=())
    for bi, batch in enumerate(grid.batch):
        prompts = [rng.integers(FIRST_TOKEN, config.vocab_size - 1, grid.prompt_len).astype(np.int32)
                   for _ in range(batch)]
        model = engine.make_model(config, weights, batch,
                                  grid.prompt_len + grid.max_new_tokens + max(grid.budget) + grid.block + 1,
                                  max(grid.prompt_len, max(grid.budget) + 1))
        engine.generate_ar(model, prompts, max_new_tokens=2, **common)  # warm-up: compile
        res, wall = _timed(lambda: engine.generate_ar(model, prompts, max_new_tokens=grid.max_new_tokens, **common))
        m = _metrics(res, wall)
        for name in ar:
            ar[name][bi] = m[name]
        echo(f"bs {batch:3d} AR: {m['tokens_per_s']:9.1f} tok/s ({m['decode_tokens_per_s']:.1f} decoding), "
             f"{m['forward_passes']:.0f} forwards; prefill {m['prefill_s']:.3f} s, capture {m['capture_s']:.3f} s, "
             f"other {m['other_s']:.3f} s")
        ar_tokens = [list(map(int, t)) for t in res.tokens]
        reference = reference_array(ar_tokens)
        for ki, budget in enumerate(grid.budget):
            for ai, accuracy in enumerate(grid.accuracy):
                drafter = engine.make_oracle(reference, config.vocab_size, horizon, accuracy, grid.entropy, grid.seed)
                if ai == 0:  # warm-up: compile this budget's kernels
                    engine.generate_ddtree(model, drafter, prompts, budget=budget, block_size=grid.block,
                                           max_new_tokens=2 * grid.block, **common)
                res, wall = _timed(lambda: engine.generate_ddtree(
                    model, drafter, prompts, budget=budget, block_size=grid.block,
                    max_new_tokens=grid.max_new_tokens, **common))
                m = _metrics(res, wall)
                for name in dd:
                    dd[name][bi, ki, ai] = m[name]
                matches[bi, ki, ai] = int([list(map(int, t)) for t in res.tokens] == ar_tokens)
                echo(f"bs {batch:3d} B {budget:5d} acc {accuracy:.2f}: {m['tokens_per_s']:9.1f} tok/s "
                     f"({m['decode_tokens_per_s']:.1f} decoding), "
                     f"{m['forward_passes']:.0f} forwards, tau {m['mean_acceptance']:.2f}, "
                     f"{'== AR' if matches[bi, ki, ai] else 'DIFFERS FROM AR'}")
    speedup = dd["tokens_per_s"] / ar["tokens_per_s"][:, None, None]
    data = {
        "tokens_per_s": (dims, dd["tokens_per_s"], {"units": "1/s", "long_name": "DDTree new tokens / wall s"}),
        "forward_passes": (dims, dd["forward_passes"], {"units": "1", "long_name": "DDTree target forwards"}),
        "mean_acceptance": (dims, dd["mean_acceptance"],
                            {"units": "1", "long_name": "mean acceptance length per round (tokens)"}),
        "matches_ar": (dims, matches, {"units": "1", "long_name": "1 = DDTree tokens equal the AR tokens"}),
        "speedup_vs_ar": (dims, speedup, {"units": "1", "long_name": "DDTree tokens/s / AR tokens/s"}),
        "ar_tokens_per_s": (("batch",), ar["tokens_per_s"], {"units": "1/s", "long_name": "AR new tokens / wall s"}),
        "ar_forward_passes": (("batch",), ar["forward_passes"], {"units": "1", "long_name": "AR target forwards"}),
        "decode_speedup_vs_ar": (dims, dd["decode_tokens_per_s"] / ar["decode_tokens_per_s"][:, None, None],
                                 {"units": "1", "long_name": "DDTree / AR decode-only tokens/s (prefill, capture "
                                                             "and host set-up excluded)"}),
    }
    long_names = {"decode_tokens_per_s": ("1/s", "new tokens after the prefill's / decode s (capture excluded)"),
                  "prefill_s": ("s", "prefill seconds"), "decode_s": ("s", "decode seconds (capture excluded)"),
                  "capture_s": ("s", "CUDA-graph capture seconds"),
                  "other_s": ("s", "rest of the call's wall time (host set-up, status copies)")}
    for name, (units, long_name) in long_names.items():
        data[name] = (dims, dd[name], {"units": units, "long_name": f"DDTree {long_name}"})
        data[f"ar_{name}"] = (("batch",), ar[name], {"units": units, "long_name": f"AR {long_name}"})
    coords = {"batch": list(grid.batch), "budget": list(grid.budget), "accuracy": list(grid.accuracy)}
    attrs = {"benchmark": "sweep_e2e", "grid": json.dumps(dataclasses.asdict(grid)), "preset": grid.preset,
             "timing": "time.perf_counter around each generate call (prefill included), after a warm-up run; "
                       "greedy, no stop tokens"}
    return xr.Dataset(data, coords=coords, attrs=attrs)


def add_arguments(group: Any) -> None:
    """The e2e options (``--batch``, ``--budget`` and ``--block`` come from the sweep's parser)."""
    group.add_argument("--preset", default=None, help="model preset (default: small on a GPU, tiny in the simulator)")
    group.add_argument("--accuracy", type=comma_separated(float, "numbers"),
                       help=f"oracle accuracies (default {DEFAULT_ACCURACIES})")
    group.add_argument("--entropy", type=float, help="oracle entropy (default 0.5)")
    group.add_argument("--max-new-tokens", type=int, help="new tokens per request (default 128)")
    group.add_argument("--prompt-len", type=int, help="prompt length (default 64)")
    group.add_argument("--seed", type=int, default=0, help="prompts, weights and oracle seed (default 0)")


def grid_from_args(args: argparse.Namespace, simulated: bool) -> E2EGrid:
    """E2EGrid from the sweep's parsed arguments (``--quick`` shrinks the defaults)."""
    base = E2EGrid(**QUICK) if args.quick else E2EGrid()
    changes: dict[str, Any] = {"seed": args.seed, "preset": args.preset or ("tiny" if simulated else "small")}
    for name in ("batch", "budget", "accuracy", "entropy", "max_new_tokens", "prompt_len"):
        if getattr(args, name, None) is not None:
            changes[name] = getattr(args, name)
    if getattr(args, "block", None):
        changes["block"] = args.block[0]
    return dataclasses.replace(base, **changes)


def main(args: argparse.Namespace, command: list[str] | None = None) -> int:
    """Run the e2e sweep from the sweep's parsed arguments; append the Dataset to ``args.out``."""
    from ddtree_numba.bench.common import write_run
    from ddtree_numba.config import ModelConfig
    from reference.weights import init_weights
    from sim.detect import simulator_requested

    try:
        grid = grid_from_args(args, simulator_requested())
        engine = engine_api()
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    config = ModelConfig.from_name(grid.preset)
    weights = init_weights(config, grid.seed)
    ds = run_e2e(grid, engine, config, weights)
    if args.out:
        print(f"wrote {args.out}:{write_run(args.out, ds, command=command)}")
    return 0
