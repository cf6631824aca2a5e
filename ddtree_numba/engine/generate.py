"""``ddtree-numba generate``: AR and DDTree generation of the same prompts, side by side.

Builds the target (a preset with seeded random weights, or an HDF5 checkpoint), random prompts,
runs greedy or sampled AR decoding, then DDTree decoding with the oracle drafter (which is given
the AR continuation) or a random-weight DFlash drafter, and prints both: identical tokens,
target forward passes, the acceptance histogram, tokens/s and the time per stage. ``--json``
writes the numbers atomically.

Without a GPU the kernels run on numba-cuda's simulator and the default preset is ``tiny``; on a
GPU it is ``small``, and each step / round after the first is a CUDA-graph replay (``--no-graphs``:
every step eager; stage times then sum every step, with graphs they come from the first, eager
calibration step). ``NUMBA_ENABLE_CUDASIM`` is read once, when numba.cuda is first imported
(stack §1), and importing ``ddtree_numba`` already imports it; so when numba.cuda came up without
the simulator and ``sim.detect`` finds no GPU, the command restarts itself with the variable set.

The lead wires :func:`add_arguments` / :func:`main` into ``ddtree_numba/cli.py``; nothing heavy is
imported until :func:`main` runs, so ``--help`` is instant and never touches CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["DESCRIPTION", "PRESET_DEFAULTS", "add_arguments", "main"]

DESCRIPTION = """\
Generate from random prompts with autoregressive decoding and with DDTree, and compare.

The target is a preset with seeded random weights (or --weights CHECKPOINT). AR runs first; the
oracle drafter then knows the AR continuation and drafts it with the given accuracy and
entropy (a synthetic drafter of known quality); --drafter dflash uses a DFlash drafter with
random weights instead (acceptance ~1: a correctness run). DDTree must reproduce AR token for
token (greedy, or sampled with the same seed); the exit status is 1 if it does not.

Without a GPU the kernels run on the numba-cuda simulator: use the tiny preset and a few tokens
(each simulated target forward takes seconds). On a GPU an untimed first pass of both runs compiles
every kernel (--no-warmup skips it), so the times printed are decoding, not the JIT."""

# Per-preset defaults of the sizes (None on the command line = take these).
PRESET_DEFAULTS: dict[str, dict[str, int]] = {
    "tiny": {"prompt_len": 4, "max_new_tokens": 8, "budget": 4, "block_size": 4},
    "small": {"prompt_len": 64, "max_new_tokens": 128, "budget": 32, "block_size": 16},
}
FALLBACK_DEFAULTS = PRESET_DEFAULTS["small"]
DRAFTERS = ("oracle", "dflash")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _lengths(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"lengths must be >= 1, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``ddtree-numba generate``."""
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    model = parser.add_argument_group("model")
    model.add_argument("--preset", default=None,
                       help="model preset (data/presets): default tiny under the simulator, small on a GPU")
    model.add_argument("--weights", type=Path, default=None,
                       help="HDF5 checkpoint (reference.weights.save_weights); its config replaces --preset's")
    model.add_argument("--attention-split", type=_positive, default=None, metavar="KEYS",
                       help="keys per attention segment, a multiple of the attention chunk (32 for small's "
                            "heads): part of the numerics, shared by AR and DDTree; smaller segments speed an "
                            "AR step over a long prompt and slow a tree's verify over a short one "
                            "(default: 2048, one segment for the presets' short runs)")
    model.add_argument("--products", choices=("cuda-core", "tensor-core"), default="cuda-core",
                       help="kernels of the dense matrix products (w_a, w_q, o_proj, lm_head, dense and "
                            "shared experts): cuda-core (kernels/linear.py, FP32 FMAs) or tensor-core "
                            "(kernels/linear_tc.py, 3xTF32 mma.sync, within 2^-19 of FP32 per product); "
                            "part of the numerics, shared by AR and DDTree; tensor-core timed slower on the H200 at 1 "
                            "and 33 rows (docs/PERFORMANCE.md, run pdl timed; default: cuda-core)")
    model.add_argument("--seed", type=int, default=0,
                       help="seed of the random weights, prompts, drafter and sampling (default: %(default)s)")
    batch = parser.add_argument_group("requests")
    batch.add_argument("--batch", type=_positive, default=None,
                       help="requests (default: 1, or the number of --prompt-lens)")
    batch.add_argument("--prompt-len", type=_positive, default=None,
                       help="prompt length of every request (default per preset: tiny 4, small 64)")
    batch.add_argument("--prompt-lens", type=_lengths, default=None,
                       help="comma-separated prompt length per request (a ragged batch), e.g. 5,9")
    batch.add_argument("--max-new-tokens", type=_positive, default=None,
                       help="tokens generated per request at most (default per preset: tiny 8, small 128)")
    batch.add_argument("--temperature", type=float, default=0.0,
                       help="0: greedy; otherwise Gumbel-max sampling keyed by (seed + request, position)")
    batch.add_argument("--stop", type=int, action="append", default=None,
                       help="stop token id (kept in the output); repeatable")
    tree = parser.add_argument_group("DDTree")
    tree.add_argument("--budget", type=_non_negative, default=None,
                      help="drafted nodes per tree, 0..1024 (default per preset: tiny 4, small 32)")
    tree.add_argument("--block-size", type=_positive, default=None,
                      help="draft block b, L = b - 1 positions per round (default per preset: tiny 4, small 16; "
                           "dflash: the drafter's block)")
    tree.add_argument("--drafter", choices=DRAFTERS, default="oracle",
                      help="oracle (knows the AR continuation) or dflash (random weights) (default: %(default)s)")
    tree.add_argument("--accuracy", type=float, default=0.9,
                      help="oracle: probability that a drafted position ranks the true token first "
                           "(default: %(default)s)")
    tree.add_argument("--entropy", type=float, default=0.5,
                      help="oracle: temperature of its distributions; small = confident (default: %(default)s)")
    tree.add_argument("--no-graphs", action="store_true",
                      help="launch every step / round eagerly instead of replaying a CUDA graph captured "
                           "after the first (graphs are off anyway under the simulator)")
    tree.add_argument("--pdl", action="store_true",
                      help="launch the kernels with programmatic dependent launch (Hopper on): each starts "
                           "while the previous one drains, then waits for its writes; the same tokens; meant to "
                           "close the idle gaps between a step's ~90 kernels; on the H200 a forward 0.5 %% faster "
                           "(docs/PERFORMANCE.md, runs pdl timed and fold; ignored under the simulator)")
    tree.add_argument("--no-warmup", action="store_true",
                      help="on a GPU, skip the untimed first pass of both runs that JIT-compiles every "
                           "kernel (minutes for small); without it the first run's times include compiling")
    out = parser.add_argument_group("output")
    out.add_argument("--json", type=Path, default=None, help="write the numbers to this JSON file (atomically)")
    out.add_argument("--quiet", action="store_true", help="no progress bar")


# --- set-up -------------------------------------------------------------------------------------

def _resolve(args: argparse.Namespace, preset: str) -> dict[str, Any]:
    """The run's sizes: explicit options, else the preset's defaults."""
    defaults = PRESET_DEFAULTS.get(preset, FALLBACK_DEFAULTS)
    if args.prompt_lens is not None:
        lens = list(args.prompt_lens)
        if args.batch is not None and args.batch != len(lens):
            raise ValueError(f"--batch {args.batch} differs from the {len(lens)} --prompt-lens")
        if args.prompt_len is not None:
            raise ValueError("give --prompt-len or --prompt-lens, not both")
    else:
        lens = [args.prompt_len or defaults["prompt_len"]] * (args.batch or 1)
    return {
        "prompt_lens": lens,
        "max_new_tokens": args.max_new_tokens or defaults["max_new_tokens"],
        "budget": defaults["budget"] if args.budget is None else args.budget,
        "block_size": args.block_size,
        "default_block_size": defaults["block_size"],
    }


def _dflash_config(config: Any) -> Any:
    """The DFlash preset built for ``config`` (same hidden size and target layer count)."""
    from reference.dflash import PRESETS, DFlashConfig

    for name in PRESETS:
        candidate = DFlashConfig.from_name(name)
        if candidate.hidden_size == config.hidden_size and candidate.n_target_layers == config.n_layers:
            return candidate
    raise ValueError(f"--drafter dflash: no DFlash preset fits a target with hidden_size {config.hidden_size} "
                     f"and {config.n_layers} layers (presets: {list(PRESETS)})")


class _Progress:
    """A tqdm bar over the tokens of the batch, fed with running totals."""

    def __init__(self, total: int, label: str, quiet: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=label, unit="tok", disable=quiet, leave=False, file=sys.stderr)
        self.done = 0

    def __call__(self, generated: int) -> None:
        self.bar.update(generated - self.done)
        self.done = generated

    def close(self) -> None:
        self.bar.close()


def _format(ar: Any, tree: Any) -> str:
    """The side-by-side report."""
    from ddtree_numba.engine.decode import speed_ratio

    ratio = speed_ratio(ar, tree)

    def hist(result: Any) -> str:
        h = result.histogram
        return " ".join(f"{m}:{int(c)}" for m, c in enumerate(h) if m and c) or "-"

    def mode(result: Any) -> str:
        return "(graph)" if result.graphs else "(eager)"

    rows = [
        ("identical tokens", "yes" if ar.tokens == tree.tokens else "NO", ""),
        ("tokens generated", str(ar.new_tokens), str(tree.new_tokens)),
        ("target forwards", str(ar.forward_passes), str(tree.forward_passes)),
        ("mean acceptance", f"{ar.mean_acceptance:.2f}", f"{tree.mean_acceptance:.2f}"),
        ("acceptance histogram", hist(ar), hist(tree)),
        ("prefill s", f"{ar.prefill_s:.3f}", f"{tree.prefill_s:.3f}"),
        ("decode s", f"{ar.decode_s:.3f}", f"{tree.decode_s:.3f}"),
        ("decode tokens/s", f"{ar.tokens_per_s:.1f}", f"{tree.tokens_per_s:.1f}"),
        ("step ms (median)", f"{1e3 * ar.step_median_s:.3f} {mode(ar)}", f"{1e3 * tree.step_median_s:.3f} {mode(tree)}"),
        ("tokens/s of the timed steps", f"{ar.timed_tokens_per_s:.1f} {mode(ar)}",
         f"{tree.timed_tokens_per_s:.1f} {mode(tree)}"),
        ("tokens/s / (tau x AR), >= 0.5", "",
         "(batch 1 only)" if ratio is None else f"{ratio:.3f}"),
        ("graph capture s", f"{ar.capture_s:.3f}", f"{tree.capture_s:.3f}"),
    ]
    for stage in ("draft", "topk", "build", "verify", "accept", "compact"):
        left = f"{1e3 * ar.stage_per_round_s[stage]:.3f}" if stage in ar.stage_s else ""
        rows.append((f"{stage} ms/step ({tree.timing}, eager)", left, f"{1e3 * tree.stage_per_round_s[stage]:.3f}"))
    label = f"DDTree B={tree.budget} b={tree.block_size}"
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':{width}}  {'AR':>22}  {label:>22}"]
    lines += [f"{name:{width}}  {a:>22}  {d:>22}" for name, a, d in rows]
    if ar.tokens != tree.tokens:
        for b, (x, y) in enumerate(zip(ar.tokens, tree.tokens)):
            if x != y:
                lines.append(f"request {b}: AR {x}\n{'':10}DDTree {y}")
    return "\n".join(lines)


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    from ddtree_numba.atomic import atomic_path

    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(payload, indent=1) + "\n")


def _check_knobs(args: argparse.Namespace) -> None:
    """Values the loops would reject only after the AR run."""
    if not 0.0 <= args.accuracy <= 1.0:
        raise ValueError(f"--accuracy must be in [0, 1], got {args.accuracy}")
    if not args.entropy > 0.0:
        raise ValueError(f"--entropy must be > 0, got {args.entropy}")
    if not args.temperature >= 0.0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")


def _simulated() -> bool:
    """Whether the kernels run on the simulator; without a GPU, restart on it if need be (module docstring)."""
    from sim.detect import gpu_available, simulator_requested
    from sim.install import simulator_active

    if simulator_active():
        return True
    if gpu_available():
        return False
    if simulator_requested() or not os.path.isfile(sys.argv[0]):
        raise RuntimeError("no CUDA GPU found and numba.cuda was imported without the simulator: set "
                           "NUMBA_ENABLE_CUDASIM=1 before anything imports numba")
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.argv])


def _run(args: argparse.Namespace) -> int:
    simulated = _simulated()
    if simulated:
        from sim.scheduler import SWITCH_INTERVAL_S

        sys.setswitchinterval(SWITCH_INTERVAL_S)   # simulated threads block at barriers: switch seldom
    import numpy as np

    from ddtree_numba.config import ModelConfig
    from ddtree_numba.engine.decode import MAX_BUDGET, generate_ar, generate_ddtree, required_kv_capacity, speed_ratio
    from ddtree_numba.engine.drafters import OracleDrafter
    from ddtree_numba.engine.model import TargetModel
    from reference.weights import init_weights, load_weights

    _check_knobs(args)
    if args.weights is not None:
        if args.preset is not None:
            raise ValueError("give --preset or --weights (whose config names the model), not both")
        weights, config = load_weights(args.weights)
        preset = f"checkpoint {args.weights.name}"
    else:
        preset = args.preset or ("tiny" if simulated else "small")
        config = ModelConfig.from_name(preset)
        weights = None  # seeded init once the options are checked
    sizes = _resolve(args, preset)
    lens, n, budget = sizes["prompt_lens"], sizes["max_new_tokens"], sizes["budget"]
    if budget > MAX_BUDGET:
        raise ValueError(f"--budget must be <= {MAX_BUDGET}, got {budget}")
    bs = len(lens)
    dflash_config = _dflash_config(config) if args.drafter == "dflash" else None
    if dflash_config is not None:
        block = dflash_config.block_size
        if sizes["block_size"] not in (None, block):
            raise ValueError(f"--block-size {sizes['block_size']}: the DFlash drafter's block is {block}")
    else:
        block = sizes["block_size"] or sizes["default_block_size"]
    capture = tuple(dflash_config.target_layer_ids) if dflash_config is not None else ()
    if weights is None:
        weights = init_weights(config, args.seed)

    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, config.vocab_size, size=p).tolist() for p in lens]
    split = {} if args.attention_split is None else {"attention_split": args.attention_split}
    model = TargetModel(config, weights, batch_size=bs, kv_capacity=required_kv_capacity(lens, n, budget),
                        max_rows=max(lens), capture_layers=capture, products=args.products, **split)
    graphs = not args.no_graphs and not simulated
    pdl = args.pdl and not simulated
    common = dict(max_new_tokens=n, temperature=args.temperature, seed=args.seed, stop_tokens=args.stop,
                  graphs=graphs, pdl=pdl)
    print(f"ddtree-numba generate: preset {preset} on {'the CUDA simulator' if simulated else 'the GPU'}, "
          f"batch {bs}, prompt lengths {lens}, {n} new tokens, temperature {args.temperature}, "
          f"drafter {args.drafter}, budget {budget}, block size {block}, "
          f"{'CUDA graphs' if graphs else 'eager steps'}{', programmatic launches' if pdl else ''}"
          f"{', --pdl ignored (the simulator runs launches one by one)' if args.pdl and simulated else ''}"
          f"{'' if args.attention_split is None else f', attention segments of {model.attention_split} keys'}"
          f"{'' if args.products == 'cuda-core' else ', products on the tensor cores'}",
          flush=True)

    def run_both(label: str) -> tuple[Any, Any]:
        """AR, then DDTree with a drafter made for it, each with a progress bar."""
        progress = _Progress(bs * n, f"{label}AR", args.quiet)
        try:
            ar = generate_ar(model, prompts, progress=progress, **common)
        finally:
            progress.close()
        if dflash_config is not None:
            from ddtree_numba.engine.dflash import DFlashDrafter

            drafter = DFlashDrafter.random(config, model, bs, args.seed)
        else:
            reference = np.full((bs, n), -1, dtype=np.int64)
            for b, tokens in enumerate(ar.tokens):
                reference[b, :len(tokens)] = tokens
            drafter = OracleDrafter(reference, config.vocab_size, block - 1, accuracy=args.accuracy,
                                    entropy=args.entropy, seed=args.seed)
        progress = _Progress(bs * n, f"{label}DDTree", args.quiet)
        try:
            tree = generate_ddtree(model, drafter, prompts, budget=budget, block_size=block, progress=progress,
                                   **common)
        finally:
            progress.close()
        return ar, tree

    if not simulated and not args.no_warmup:
        # Numba compiles each kernel at its first launch: an untimed pass of the same runs, so the
        # timed ones below measure decoding, not the JIT (the simulator compiles nothing: no pass).
        t_warm = time.perf_counter()
        run_both("compile: ")
        print(f"warm-up pass (JIT compile of every kernel, untimed): {time.perf_counter() - t_warm:.1f} s",
              flush=True)
    ar, tree = run_both("")

    print(_format(ar, tree))
    identical = ar.tokens == tree.tokens
    if args.json is not None:
        _write_json(args.json, {
            "preset": preset, "simulated": simulated, "seed": args.seed, "drafter": args.drafter,
            "accuracy": args.accuracy if args.drafter == "oracle" else None,
            "entropy": args.entropy if args.drafter == "oracle" else None,
            "temperature": args.temperature, "stop_tokens": args.stop or [], "prompts": prompts,
            "max_new_tokens": n, "budget": budget, "block_size": block, "graphs": graphs, "pdl": pdl,
            "attention_split": model.attention_split, "products": model.products, "identical": identical,
            "speed_ratio": speed_ratio(ar, tree),
            "ar": ar.summary(), "ddtree": tree.summary(),
        })
        print(f"wrote {args.json}")
    return 0 if identical else 1


def main(args: argparse.Namespace) -> int:
    """Run ``ddtree-numba generate``; returns the exit status (0 identical, 1 not, 2 bad input)."""
    try:
        return _run(args)
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
