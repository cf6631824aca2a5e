"""Generation loops on the device: autoregressive (AR) and DDTree, with their statistics.

Both loops share the set-up (:class:`_Session`): every buffer is allocated once, at capacity,
before the first step; the prompts are prefilled in one target forward with the causal mask and
the first token is taken from each request's last prompt row. A TargetModel forwards a fixed
number of rows per request, so the prefill, the AR step (1 row) and the tree (1 + B rows) run on
models of those sizes that share the caller's weights and KV cache (:func:`model_with_rows`).
Then

- **AR step** (:func:`generate_ar`): one forward of T = 1 row per request (visibility [[1]]) at
  position past_len, the posterior (argmax, or the Philox Gumbel-max sample keyed by (seed,
  position)), and the commit kernel (append, stop / length checks, past_len += 1).
- **DDTree round** (:func:`generate_ddtree`, spec §1.1): draft logits [bs, L, V] -> fused top-k
  (K = min(B, V)) -> best-first tree build (positions past_len + depth, packed ancestor mask) ->
  one target forward over the 1 + B tree rows -> posterior of every node -> acceptance walk ->
  in-place compaction of every layer's latent and RoPE cache (two launches over
  ``KVCache.stacked``, spec §1.5) and of the drafter's context (``Drafter.commit``, spec §1.6)
  -> commit kernel (append the accepted tokens and the bonus, stop / length checks, past_len +=
  acceptance length, per-round statistics).

Everything stays on the device: each step or round reads its per-step values (past lengths, root
tokens, tree sizes) from device buffers and launches with fixed shapes, so there is no per-request
host work and no device allocation inside the loop. The only host traffic per step is one copy of
a small status array (tokens generated and finished flags, int32 [2, bs]) that decides when to
stop. Requests that finish early (stop token, max_new_tokens) stay in the batch but commit nothing
(budget 0, root token and past length frozen).

CUDA graphs (``graphs=True``, the default; limits §4, stack §4): the first step / round after the
prefill runs eagerly (it compiles and loads every kernel and runs the wrappers' host checks: the
warm-up a capture needs); then the step is captured ONCE into a CUDA graph
(:class:`~ddtree_numba.engine.graphs.StepGraph`, a cuda.core GraphBuilder as the launch stream)
and every later step is one graph launch followed by the status copy, which stays outside the
graph. Under the simulator, which has no graphs, every step runs eagerly through the same code.

Programmatic dependent launch (``pdl=True``, off by default: on the H200 slower with the
release at each block's start, 0.5 % faster with it at the exits, PERFORMANCE runs pdl timed
and fold; :mod:`ddtree_numba.kernels.pdl`):
every kernel of a step begins with ``pdl_begin()`` (or ``pdl_begin_early()``), so under
:func:`sim.launch.programmatic_launches` each is launched while its predecessor drains (a captured
graph keeps the programmatic edges) and waits in hardware for its writes before touching memory;
each releases its successor at its blocks' exits (``engine.model.PDL_RELEASE_EARLY`` off: the
early release before the 1-row gemv and split absorb, which load their first weights before their
wait in the PTX, timed ~10 us slower a 1-row forward on the H200 than none, the exits ~8 us faster,
PERFORMANCE run pdl early timed): the launch gaps of a ~80-kernel step overlap, the arithmetic does
not change.

Exactness (issue 4): the target's rows are batch-invariant and a tree node's attention sees
exactly its root path, so the verify logits of the accepted path are bit-identical to the AR
step's logits at the same position; the posterior noise is keyed by (seed + request, position),
never by node index (reference/sampling.py), so greedy and sampled DDTree reproduce AR token for
token.

Output semantics: the first token comes from the prefill; a request stops after its first stop
token (which is kept) or after ``max_new_tokens`` tokens, whichever comes first (spec §1.1
step 6). Request b samples with seed ``(seed + b) mod 2^64``.

Timing: every step / round is bracketed by two CUDA events (the wall clock under the simulator,
which runs every launch synchronously), read after the step's status copy, which synchronises
anyway: ``GenerateResult.step_s``. Stage times need events between the kernels of a step, which a
replayed graph does not have: without graphs they are summed over every step; with graphs they
come from the one eager, event-timed calibration step (the first), and ``stage_rounds`` says how
many steps they cover. ``decode_s`` is the synchronised wall clock of the steps, the one-off
capture excluded (``capture_s``), the eager calibration step included;
``GenerateResult.timed_tokens_per_s`` and ``timed_mean_acceptance`` cover the replayed steps only
(the steady state), and :func:`speed_ratio` is issue 4's ratio from them.
"""
from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda, float32, int32

from ddtree_numba.engine.drafters import Drafter
from ddtree_numba.engine.graphs import StepGraph
from ddtree_numba.kernels import tree_build
from ddtree_numba.kernels.accept import (GREEDY_TEMPERATURE, MAX_SAMPLE_THREADS, accept_walk, posterior_argmax,
                                         posterior_sample)
from ddtree_numba.kernels.compact import plan_compaction, run_compaction
from ddtree_numba.kernels.pdl import pdl_begin
from ddtree_numba.kernels.registry import register
from ddtree_numba.kernels.topk import plan_topk, run_topk
from reference._checks import require_int, require_real
from reference.tree import pack_visibility
from sim.install import simulator_active
from sim.launch import launch, programmatic_launches

__all__ = [
    "GenerateResult",
    "AR_STAGES",
    "DDTREE_STAGES",
    "MAX_BUDGET",
    "generate_ar",
    "generate_ddtree",
    "model_with_rows",
    "required_kv_capacity",
]

AR_STAGES = ("verify", "accept")
DDTREE_STAGES = ("draft", "topk", "build", "verify", "accept", "compact")
MAX_BUDGET = tree_build.MAX_BUDGET  # 1024 drafted nodes
COMMIT_THREADS = 128  # one thread per request, looping when bs is larger
# Blocks of the posterior kernels on a GPU (one row a block): the greedy argmax at 1024 threads, the
# Gumbel sample at its kernel's most (MAX_SAMPLE_THREADS, 512). H200 graph replays, one row of
# small's 32768 logits (PERFORMANCE run "lane squares"): argmax 7.86 / 6.06 / 5.74 us at 256 / 512 /
# 1024 threads, sample 76.9 / 49.8 at 256 / 512.
POSTERIOR_THREADS = 1024
SAMPLE_THREADS = MAX_SAMPLE_THREADS
TOPK_THREADS = 256  # block of the top-k kernels on a GPU
COMPACT_THREADS = 128  # word columns per block of the compaction
GATHER_THREADS = 256  # threads striding over the vocabulary when copying a logits row
WARP_SIZE = 32
SIM_THREADS = 32  # block size of the round kernels under the simulator (threads are Python threads)
NO_STOP = -1  # filler of the stop-token buffer: never equal to a token id
SEED_MODULUS = 2**64


# --- device kernels ---------------------------------------------------------------------------

@cuda.jit(device=True)
def _is_stop(token, stop_tokens):
    """True if ``token`` is one of ``stop_tokens`` (int32 [n], NO_STOP-padded)."""
    for s in range(stop_tokens.shape[0]):
        if stop_tokens[s] == token:
            return True
    return False


@cuda.jit
def last_row_kernel(logits, prompt_lens, out):
    """out[b, 0, :] = logits[b, prompt_lens[b] - 1, :]: each request's last prompt row.

    logits float32 [bs, P, V], prompt_lens int32 [bs] -> out float32 [bs, 1, V]. Grid (1, bs),
    threads stride over the vocabulary.
    """
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    b = cuda.blockIdx.y
    row = prompt_lens[b] - 1
    for v in range(cuda.threadIdx.x, out.shape[2], cuda.blockDim.x):
        out[b, 0, v] = logits[b, row, v]


@cuda.jit
def prefill_commit_kernel(first, prompt_lens, stop_tokens, max_new, out_tokens, n_gen, done, past_lens, bonus,
                          budgets):
    """After prefill: the first generated token of every request (one thread per request).

    first int32 [bs, 1] (the posterior of the last prompt row), prompt_lens int32 [bs],
    stop_tokens int32 [n], int32 max_new -> out_tokens int32 [bs, max_new] (column 0), n_gen = 1,
    done (stop token or max_new == 1; then budgets = 0), past_lens = prompt_lens (the prompt rows
    are committed), bonus = the token (the next root / AR input).
    """
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    b = cuda.grid(1)
    if b >= bonus.shape[0]:
        return
    token = first[b, 0]
    out_tokens[b, 0] = token
    n_gen[b] = 1
    finished = max_new <= 1 or _is_stop(token, stop_tokens)
    done[b] = 1 if finished else 0
    if finished:
        budgets[b] = 0
    past_lens[b] = prompt_lens[b]
    bonus[b] = token


@cuda.jit
def commit_kernel(tree_tokens, accepted, lengths, new_bonus, stop_tokens, max_new,
                  out_tokens, n_gen, done, past_lens, bonus, budgets, round_lengths, round_counter):
    """Commit one step / round of every unfinished request (one block; thread b per request).

    tree_tokens int32 [bs, N] (node tokens), accepted int32 [bs, W] (accepted node indices, root
    first), lengths int32 [bs] (acceptance length m), new_bonus int32 [bs] (the target's token
    after the last accepted node), stop_tokens int32 [n], int32 max_new. An unfinished request
    appends the accepted nodes' tokens (accepted[1:m]) and the new bonus to out_tokens
    [bs, max_new] at n_gen[b], stopping after a stop token or at max_new (then done[b] = 1 and
    budgets[b] = 0), and commits: past_lens[b] += m (the root's and its accepted descendants'
    rows), bonus[b] = the new bonus. round_lengths[r, b] = m (0 for a request that was already
    done), r = round_counter[0], which then increments.

    A finished request changes nothing else: it keeps a valid root token and, with budget 0,
    root-only trees, whatever its drafter outputs from then on.
    """
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    tid = cuda.threadIdx.x
    bs = bonus.shape[0]
    r = round_counter[0]
    for b in range(tid, bs, cuda.blockDim.x):
        m = 0
        if done[b] == 0:
            m = lengths[b]
            count = n_gen[b]
            finished = False
            j = 1
            while j <= m and not finished:
                token = new_bonus[b] if j == m else tree_tokens[b, accepted[b, j]]
                out_tokens[b, count] = token
                count += 1
                finished = count >= max_new or _is_stop(token, stop_tokens)
                j += 1
            n_gen[b] = count
            past_lens[b] += m
            bonus[b] = new_bonus[b]
            if finished:
                done[b] = 1
                budgets[b] = 0
        if r < round_lengths.shape[0]:
            round_lengths[r, b] = m
    cuda.syncthreads()  # every thread has read round_counter before it advances
    if tid == 0:
        round_counter[0] = r + 1


register("decode_last_row", last_row_kernel,
         ((float32[:, :, ::1], int32[::1], float32[:, :, ::1]),),
         "decode: copy each request's last prompt row of logits (the first token's distribution)",
         block_threads=GATHER_THREADS)
register("decode_prefill_commit", prefill_commit_kernel,
         ((int32[:, ::1], int32[::1], int32[::1], int32, int32[:, ::1], int32[::1], int32[::1],
           int32[::1], int32[::1], int32[::1]),),
         "decode: first generated token of every request (from its last prompt row's posterior)",
         block_threads=COMMIT_THREADS)
register("decode_commit", commit_kernel,
         ((int32[:, ::1], int32[:, ::1], int32[::1], int32[::1], int32[::1], int32, int32[:, ::1],
           int32[::1], int32[::1], int32[::1], int32[::1], int32[::1], int32[:, ::1], int32[::1]),),
         "decode: append accepted tokens + bonus, stop / length checks, advance past_lens, stats",
         block_threads=COMMIT_THREADS)


# --- results --------------------------------------------------------------------------------

@dataclass(frozen=True)
class GenerateResult:
    """What one generate call produced and how fast.

    Attributes:
        method: "ar" or "ddtree".
        tokens: per request, the generated token ids (host ints; the first comes from the prefill).
        prompt_lens: per request, the prompt length.
        forward_passes: target forwards, the prefill included.
        acceptance: int32 [rounds, bs], acceptance length m (root included, 1 for an AR step) of
            each request in each step / round after the prefill; 0 where the request had finished.
        max_acceptance: the largest possible m (1 for AR, block_size for DDTree).
        prefill_s: seconds of the prefill (forward, first token, drafter context).
        decode_s: seconds of the steps / rounds after the prefill (synchronised wall clock, the
            one-off graph capture excluded: see capture_s).
        stage_s: seconds per stage (AR_STAGES or DDTREE_STAGES), summed over the first
            ``stage_rounds`` steps / rounds, which ran eagerly with an event between stages.
        timing: "cuda-events" or "wall-clock" (where stage_s and step_s come from).
        step_s: float64 [rounds], the time of each step / round (events around the eager step or
            the graph launch; the status copy excluded).
        stage_rounds: steps / rounds stage_s covers: all of them without graphs, 1 (the eager
            calibration step) with graphs.
        graphs: whether the steps after the first were CUDA-graph replays (False under the
            simulator, which degrades graphs=True to eager steps).
        capture_s: host seconds spent capturing the graph (0 without).
        pdl: whether the kernels ran with programmatic dependent launch (``pdl=True``: each may
            start while its predecessor drains; False under the simulator, which ignores it).
        budget, block_size: the DDTree settings (None for AR).
    """

    method: str
    tokens: list[list[int]]
    prompt_lens: list[int]
    forward_passes: int
    acceptance: np.ndarray
    max_acceptance: int
    prefill_s: float
    decode_s: float
    stage_s: dict[str, float]
    timing: str
    step_s: np.ndarray
    stage_rounds: int
    graphs: bool
    capture_s: float
    pdl: bool = False
    budget: int | None = None
    block_size: int | None = None

    @property
    def rounds(self) -> int:
        """Steps / rounds after the prefill (= forward_passes - 1)."""
        return int(self.acceptance.shape[0])

    @property
    def new_tokens(self) -> int:
        """Tokens generated over the batch."""
        return sum(len(t) for t in self.tokens)

    @property
    def decode_tokens(self) -> int:
        """Tokens committed by the steps / rounds (the prefill's first tokens excluded)."""
        return sum(max(len(t) - 1, 0) for t in self.tokens)

    @property
    def histogram(self) -> np.ndarray:
        """int64 [max_acceptance + 1]: histogram[m] = (request, round) pairs with acceptance m."""
        return np.bincount(self.acceptance[self.acceptance > 0].ravel(), minlength=self.max_acceptance + 1)

    @property
    def mean_acceptance(self) -> float:
        """Mean acceptance length tau over the (request, round) pairs of unfinished requests."""
        active = self.acceptance[self.acceptance > 0]
        return float(active.mean()) if active.size else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: tokens committed by the steps / rounds per second of decode_s."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def replay_s(self) -> np.ndarray:
        """float64 [rounds - 1]: times of the graph replays (empty without graphs)."""
        return self.step_s[self.stage_rounds:] if self.graphs else self.step_s[:0]

    @property
    def timed_s(self) -> np.ndarray:
        """float64 [timed rounds]: the step times the medians and rates below are taken over: the
        graph replays with graphs (:attr:`replay_s`, the eager calibration step excluded), every
        step without."""
        return self.replay_s if self.graphs else self.step_s

    @property
    def timed_acceptance(self) -> np.ndarray:
        """int32 [timed rounds, bs]: the acceptance rows of the steps / rounds of :attr:`timed_s`."""
        return self.acceptance[self.stage_rounds:] if self.graphs else self.acceptance

    @property
    def timed_mean_acceptance(self) -> float:
        """Mean acceptance length over the timed steps' (request, round) pairs of unfinished
        requests: the tau that goes with :attr:`timed_tokens_per_s`."""
        active = self.timed_acceptance[self.timed_acceptance > 0]
        return float(active.mean()) if active.size else 0.0

    @property
    def timed_tokens_per_s(self) -> float:
        """Steady-state throughput: the timed steps' acceptance lengths (tokens they accepted,
        summed over the batch) over their summed step times. Unlike :attr:`tokens_per_s` it leaves
        out the eager calibration step (with graphs, ~10 ms a small DDTree round) and the host
        loop between steps."""
        total = float(self.timed_s.sum())
        return float(self.timed_acceptance.sum()) / total if total > 0 else 0.0

    @property
    def step_median_s(self) -> float:
        """Median step / round time of the mode that ran: graph replays with graphs (the eager
        calibration step excluded), every eager step without; 0 if there was none."""
        steps = self.timed_s
        return float(np.median(steps)) if steps.size else 0.0

    @property
    def stage_per_round_s(self) -> dict[str, float]:
        """Seconds per stage per eager step / round (stage_s / stage_rounds)."""
        return {k: v / self.stage_rounds if self.stage_rounds else 0.0 for k, v in self.stage_s.items()}

    def summary(self) -> dict[str, Any]:
        """JSON-friendly numbers (tokens included)."""
        return {
            "method": self.method, "budget": self.budget, "block_size": self.block_size,
            "tokens": self.tokens, "prompt_lens": self.prompt_lens,
            "forward_passes": self.forward_passes, "rounds": self.rounds,
            "new_tokens": self.new_tokens, "mean_acceptance": self.mean_acceptance,
            "acceptance_histogram": self.histogram.tolist(),
            "acceptance": self.acceptance.tolist(),
            "prefill_s": self.prefill_s, "decode_s": self.decode_s, "tokens_per_s": self.tokens_per_s,
            "stage_s": dict(self.stage_s), "timing": self.timing, "stage_rounds": self.stage_rounds,
            "graphs": self.graphs, "capture_s": self.capture_s, "pdl": self.pdl, "step_s": self.step_s.tolist(),
            "step_median_s": self.step_median_s, "timed_tokens_per_s": self.timed_tokens_per_s,
            "timed_mean_acceptance": self.timed_mean_acceptance,
        }


# --- stage clock ------------------------------------------------------------------------------

class _StageClock:
    """Per-stage time, summed over steps: CUDA events on a GPU, the wall clock in the simulator.

    Each step calls :meth:`start`, then :meth:`mark` once per stage in a fixed order, then (after
    the step's synchronising status copy) :meth:`collect`. Events are created once and reused.
    """

    def __init__(self, stages: Sequence[str], stream: Any) -> None:
        self.stages = tuple(stages)
        self.totals = dict.fromkeys(self.stages, 0.0)
        self._stream = stream
        self._events = None if simulator_active() else [cuda.event(timing=True) for _ in range(len(stages) + 1)]
        self._walls = [0.0] * (len(stages) + 1)
        self._next = 0

    @property
    def source(self) -> str:
        return "wall-clock" if self._events is None else "cuda-events"

    def _record(self) -> None:
        if self._events is None:
            self._walls[self._next] = time.perf_counter()
        else:
            self._events[self._next].record(stream=self._stream)
        self._next += 1

    def start(self) -> None:
        self._next = 0
        self._record()

    def mark(self, stage: str) -> None:
        """End of ``stage`` (the stages must be marked in their declared order)."""
        if self.stages[self._next - 1] != stage:
            raise RuntimeError(f"stage {stage!r} marked out of order (expected {self.stages[self._next - 1]!r})")
        self._record()

    def collect(self) -> None:
        """Add this step's stage times (call after the stream has synchronised)."""
        for i, stage in enumerate(self.stages):
            if self._events is None:
                self.totals[stage] += self._walls[i + 1] - self._walls[i]
            else:
                self.totals[stage] += cuda.event_elapsed_time(self._events[i], self._events[i + 1]) / 1e3


def _no_mark(stage: str) -> None:
    """The stage mark of a captured step: a replayed graph has no events between its stages."""


class _StepTimer:
    """Time of each whole step: two CUDA events (created once) around it, or the wall clock
    under the simulator; :meth:`collect` after the step's synchronising status copy."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._events = None if simulator_active() else (cuda.event(timing=True), cuda.event(timing=True))
        self._wall = 0.0
        self.times: list[float] = []

    def start(self) -> None:
        if self._events is None:
            self._wall = time.perf_counter()
        else:
            self._events[0].record(stream=self._stream)

    def stop(self) -> None:
        if self._events is None:
            self._wall = time.perf_counter() - self._wall
        else:
            self._events[1].record(stream=self._stream)

    def collect(self) -> None:
        if self._events is None:
            self.times.append(self._wall)
        else:
            self.times.append(cuda.event_elapsed_time(*self._events) / 1e3)


# --- set-up -----------------------------------------------------------------------------------

def _threads(gpu_threads: int) -> int:
    """Block size of a round kernel: ``gpu_threads`` on a GPU, SIM_THREADS in the simulator."""
    return SIM_THREADS if simulator_active() else gpu_threads


def _check_prompts(prompts: Any, batch_size: int, vocab_size: int) -> list[np.ndarray]:
    """``batch_size`` non-empty sequences of ids in [0, V), as int32 arrays."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a sequence of token-id sequences, got {type(prompts).__name__}")
    if len(prompts) != batch_size:
        raise ValueError(f"prompts must hold one prompt per request of the model's batch ({batch_size}), "
                         f"got {len(prompts)}")
    out = []
    for b, prompt in enumerate(prompts):
        arr = np.asarray(prompt)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"prompts[{b}] must be a non-empty 1-D sequence of token ids, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise TypeError(f"prompts[{b}] must hold integers, got {arr.dtype}")
        if arr.min() < 0 or arr.max() >= vocab_size:
            raise ValueError(f"prompts[{b}] must hold ids in [0, {vocab_size})")
        out.append(arr.astype(np.int32))
    return out


def _check_stop_tokens(stop_tokens: Iterable[int] | None, vocab_size: int) -> np.ndarray:
    """int32 [max(n, 1)] of the stop ids, NO_STOP-padded."""
    if isinstance(stop_tokens, (str, bytes)):
        raise TypeError("stop_tokens must be an iterable of token ids, got a string")
    ids = [] if stop_tokens is None else list(stop_tokens)
    for t in ids:
        require_int(t, "stop_tokens", minimum=0, maximum=vocab_size - 1)
    return np.array(ids or [NO_STOP], dtype=np.int32)


_MODEL_ATTRS = ("config", "weights", "batch_size", "kv_capacity", "max_rows", "capture_layers", "stream",
                "cache", "forward")


def _check_model(model: Any) -> None:
    """The TargetModel interface the loops use (duck-typed: a test double may stand in)."""
    for name in _MODEL_ATTRS:
        if not hasattr(model, name):
            raise TypeError(f"model must be a TargetModel (missing {name!r}), got {type(model).__name__}")


# Models derived from a caller's model, keyed by that model: (rows, capture layers) -> model.
_DERIVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_with_rows(model: Any, rows: int, capture_layers: Sequence[int]) -> Any:
    """A target of ``rows`` rows per forward sharing ``model``'s weights and KV cache.

    ``model`` itself when it already has that shape; otherwise one built with the same constructor
    (``cache=model.cache``, ``weights=model.weights``: nothing is uploaded twice) and kept for the
    next call. A prefill model (rows = longest prompt), an AR model (1 row) and a tree model
    (1 + budget rows) thus share one cache; each allocates only its activation buffers. They
    share ``model``'s attention segment size and product kernels too (``attention_split``,
    ``products``: numerics).
    """
    capture = tuple(capture_layers)
    if model.max_rows == rows and tuple(model.capture_layers) == capture:
        return model
    derived = _DERIVED.setdefault(model, {})
    key = (rows, capture)
    if key not in derived:
        numerics = {name: getattr(model, name) for name in ("attention_split", "products") if hasattr(model, name)}
        derived[key] = type(model)(model.config, model.weights, batch_size=model.batch_size,
                                   kv_capacity=model.kv_capacity, max_rows=rows, capture_layers=capture,
                                   stream=model.stream, cache=model.cache, **numerics)
    return derived[key]


def _causal_visibility(prompt_lens: Sequence[int], rows: int) -> np.ndarray:
    """Packed prefill mask uint32 [bs, Tc, ceil(Tc / 32)]: row i < P_b sees rows 0..i, a padding
    row only itself (docs/ARCHITECTURE.md)."""
    index = np.arange(rows)
    causal = index[None, :] <= index[:, None]  # [Tc, Tc]
    live = index[None, :] < np.asarray(prompt_lens)[:, None]  # [bs, Tc]
    vis = np.where(live[:, :, None], causal[None] & live[:, None, :], np.eye(rows, dtype=bool)[None])  # [bs, Tc, Tc]
    return pack_visibility(vis)


def required_kv_capacity(prompt_lens: Sequence[int], max_new_tokens: int, budget: int = 0) -> int:
    """Cache rows per request a generate call needs: longest prompt + max_new_tokens + budget - 1.

    The last step / round starts at past_len <= P + max_new_tokens - 2 and writes 1 + budget rows
    (budget 0 for AR) at positions < past_len + 1 + budget.
    """
    return max(prompt_lens) + max_new_tokens + budget - 1


class _Session:
    """Buffers and steps shared by the AR and DDTree loops (allocated once, before any step).

    Device state per request: status int32 [2, bs] (row 0: tokens generated n_gen, row 1: done),
    out_tokens [bs, max_new], bonus [bs] (next root / AR input), round statistics
    [max_new - 1, bs] with a device round counter, the stop ids, the sampling keys; the prefill
    inputs. ``step_model`` runs the steps / rounds (``step_rows`` rows), ``prefill_model`` the
    prompts; both share ``model``'s weights and cache.
    """

    def __init__(self, model: Any, prompts: Any, *, max_new_tokens: int, temperature: float, seed: int,
                 stop_tokens: Iterable[int] | None, budget: int, step_rows: int,
                 capture_layers: Sequence[int], stream: Any) -> None:
        _check_model(model)
        self.stream = stream
        self.bs = bs = int(model.batch_size)
        self.vocab = int(model.config.vocab_size)
        self.prompts = _check_prompts(prompts, bs, self.vocab)
        self.max_new = require_int(max_new_tokens, "max_new_tokens", minimum=1, maximum=2**31 - 1)
        self.temperature = require_real(temperature, "temperature")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        seed = require_int(seed, "seed", minimum=0, maximum=SEED_MODULUS - 1)
        stop = _check_stop_tokens(stop_tokens, self.vocab)
        self.prompt_lens = [len(p) for p in self.prompts]
        p_max = max(self.prompt_lens)
        need_kv = required_kv_capacity(self.prompt_lens, self.max_new, budget)
        if need_kv > model.kv_capacity:
            raise ValueError(f"max_new_tokens: longest prompt {p_max} + {self.max_new} new tokens + budget {budget} "
                             f"need {need_kv} cache rows per request, the model has kv_capacity {model.kv_capacity}")

        # The caller's model prefills when its rows hold the longest prompt (no extra buffers).
        rows = max(p_max, model.max_rows)
        self.prefill_model = model_with_rows(model, rows, capture_layers)
        max_path = getattr(self.prefill_model, "max_path", p_max)
        if p_max > max_path:
            raise ValueError(f"prompts: the longest prompt ({p_max} tokens) exceeds the attention's longest "
                             f"visible path ({max_path} rows); shorten it")
        self.step_model = model_with_rows(model, step_rows, capture_layers)
        self.past_lens = model.cache.past_lens  # [bs], shared by every derived model
        self.past_lens.copy_to_device(np.zeros(bs, dtype=np.int32), stream=stream)  # the prefill starts empty

        tokens = np.zeros((bs, rows), dtype=np.int32)  # padding rows: token 0 (not cached)
        for b, prompt in enumerate(self.prompts):
            tokens[b, :len(prompt)] = prompt
        # np.tile, not broadcast_to: a broadcast row has stride 0, which a device array keeps
        positions = np.tile(np.arange(rows, dtype=np.int32), (bs, 1))  # [bs, rows]
        self.prefill_tokens = cuda.to_device(tokens, stream=stream)
        self.prefill_positions = cuda.to_device(positions, stream=stream)
        self.prefill_visibility = cuda.to_device(_causal_visibility(self.prompt_lens, rows), stream=stream)
        self.prompt_lens_dev = cuda.to_device(np.array(self.prompt_lens, dtype=np.int32), stream=stream)
        self.ones = cuda.to_device(np.ones(bs, dtype=np.int32), stream=stream)  # [bs] one row per request
        self.last_logits = cuda.device_array((bs, 1, self.vocab), dtype=np.float32, stream=stream)
        self.last_positions = cuda.to_device(np.array(self.prompt_lens, dtype=np.int32)[:, None] - 1, stream=stream)
        self.first_token = cuda.device_array((bs, 1), dtype=np.int32, stream=stream)

        self.status = cuda.to_device(np.zeros((2, bs), dtype=np.int32), stream=stream)  # [2, bs]
        self.n_gen = self.status[0]  # [bs] views: one copy brings both to the host
        self.done = self.status[1]
        self.host_status = cuda.pinned_array((2, bs), dtype=np.int32)
        self.out_tokens = cuda.device_array((bs, self.max_new), dtype=np.int32, stream=stream)
        self.bonus = cuda.device_array(bs, dtype=np.int32, stream=stream)
        self.budgets = cuda.to_device(np.full(bs, budget, dtype=np.int32), stream=stream)  # 0 once done
        self.stop_tokens = cuda.to_device(stop, stream=stream)
        self.round_lengths = cuda.to_device(np.zeros((max(self.max_new - 1, 1), bs), dtype=np.int32), stream=stream)
        self.round_counter = cuda.to_device(np.zeros(1, dtype=np.int32), stream=stream)
        self.greedy = self.temperature < GREEDY_TEMPERATURE
        self.temperatures = cuda.to_device(np.full(bs, self.temperature, dtype=np.float64), stream=stream)
        seeds = np.array([(seed + b) % SEED_MODULUS for b in range(bs)], dtype=np.uint64)
        self.seeds = cuda.to_device(seeds, stream=stream)
        self.forward_passes = 0
        self.posterior_threads = _threads(POSTERIOR_THREADS)
        self.sample_threads = _threads(SAMPLE_THREADS)
        self.commit_threads = min(COMMIT_THREADS, WARP_SIZE * -(-bs // WARP_SIZE))  # the commit: one block

    # -- the pieces of a step (``stream``: the session's, or a GraphBuilder while capturing) --
    def posterior(self, logits: Any, sizes: Any, positions: Any, out: Any, stream: Any) -> None:
        """Greedy argmax, or the Philox Gumbel-max sample keyed by (seed + b, position)."""
        if self.greedy:
            posterior_argmax(logits, sizes, out, stream=stream, threads=self.posterior_threads)
        else:
            posterior_sample(logits, sizes, self.temperatures, self.seeds, positions, out,
                             stream=stream, threads=self.sample_threads)

    def prefill(self) -> Any:
        """Prefill forward + first token + past_lens = prompt lengths; returns the ForwardOut.

        The first token is the posterior of each request's last prompt row at its position
        P - 1, as an AR step would draw it.
        """
        self.forward_passes += 1
        out = self.prefill_model.forward(self.prefill_tokens, self.prefill_positions, self.prompt_lens_dev,
                                         self.prefill_visibility, stream=self.stream)
        launch(last_row_kernel, (1, self.bs), _threads(GATHER_THREADS), self.stream, 0,
               out.logits, self.prompt_lens_dev, self.last_logits)
        self.posterior(self.last_logits, self.ones, self.last_positions, self.first_token, self.stream)
        launch(prefill_commit_kernel, -(-self.bs // self.commit_threads), self.commit_threads, self.stream, 0,
               self.first_token, self.prompt_lens_dev, self.stop_tokens, np.int32(self.max_new),
               self.out_tokens, self.n_gen, self.done, self.past_lens, self.bonus, self.budgets)
        return out

    def commit(self, tree_tokens: Any, accepted: Any, lengths: Any, new_bonus: Any, stream: Any) -> None:
        launch(commit_kernel, 1, self.commit_threads, stream, 0,
               tree_tokens, accepted, lengths, new_bonus, self.stop_tokens, np.int32(self.max_new),
               self.out_tokens, self.n_gen, self.done, self.past_lens, self.bonus, self.budgets,
               self.round_lengths, self.round_counter)

    def sync_status(self) -> tuple[int, bool]:
        """The step's one device-to-host copy: (tokens generated over the batch, all finished)."""
        self.status.copy_to_host(self.host_status, stream=self.stream)
        _synchronize(self.stream)
        return int(self.host_status[0].sum()), bool(self.host_status[1].all())

    def run(self, step: Callable[[Any, Callable[[str], None]], None], stages: Sequence[str],
            progress: Callable[[int], None] | None, begin: Callable[[Any], None] | None = None, *,
            graphs: bool, pdl: bool = False) -> dict[str, Any]:
        """Prefill, then ``step(stream, mark)`` until every request is done.

        ``mark(stage)`` ends a stage (in ``stages`` order; it defaults to a no-op, which is what a
        captured step gets). Without graphs every step runs eagerly with the stage clock. With
        graphs the first step is the eager calibration (stage clock) and the capture's warm-up;
        the step is then captured once and replayed. With ``pdl`` every launch of the call (prefill,
        eager steps, the capture) is programmatic where the kernel waits (:mod:`sim.launch`).

        Returns the timing fields of :class:`GenerateResult` (prefill_s, decode_s, stage_s, timing,
        step_s, stage_rounds, graphs, capture_s, pdl).
        """
        with programmatic_launches(pdl):
            return self._run(step, stages, progress, begin, graphs=graphs) | {"pdl": pdl and not simulator_active()}

    def _run(self, step: Callable[[Any, Callable[[str], None]], None], stages: Sequence[str],
             progress: Callable[[int], None] | None, begin: Callable[[Any], None] | None, *,
             graphs: bool) -> dict[str, Any]:
        clock = _StageClock(stages, self.stream)
        timer = _StepTimer(self.stream)
        graph = StepGraph(step, self.stream, enabled=graphs) if graphs else None
        stage_rounds = 0
        capture_s = 0.0
        t0 = time.perf_counter()
        out = self.prefill()
        if begin is not None:
            begin(out)
        generated, finished = self.sync_status()
        t1 = time.perf_counter()
        if progress is not None:
            progress(generated)
        try:
            for _ in range(self.max_new - 1):  # every step commits >= 1 token per unfinished request
                if finished:
                    break
                eager = graph is None or not graph.warm
                if not eager and graph.uses_graph and not graph.captured:
                    t_capture = time.perf_counter()
                    graph.capture()  # records only: the device state is the calibration step's
                    capture_s += time.perf_counter() - t_capture
                timer.start()
                if eager:
                    clock.start()
                    if graph is None:
                        step(self.stream, clock.mark)
                    else:
                        graph.warm_up(clock.mark)
                else:
                    graph.replay()
                timer.stop()
                self.forward_passes += 1
                generated, finished = self.sync_status()
                if eager:
                    clock.collect()
                    stage_rounds += 1
                timer.collect()
                if progress is not None:
                    progress(generated)
            decode_s = time.perf_counter() - t1 - capture_s
            replayed = graph is not None and graph.captured
        finally:
            if graph is not None:
                graph.close()
        return {"prefill_s": t1 - t0, "decode_s": decode_s, "stage_s": dict(clock.totals), "timing": clock.source,
                "step_s": np.array(timer.times, dtype=np.float64), "stage_rounds": stage_rounds,
                "graphs": replayed, "capture_s": capture_s}

    def result(self, method: str, max_acceptance: int, times: dict[str, Any], **settings: Any) -> GenerateResult:
        """Copy the tokens and statistics to the host (once, after the loop)."""
        out = self.out_tokens.copy_to_host(stream=self.stream)
        rounds = self.round_counter.copy_to_host(stream=self.stream)
        lengths = self.round_lengths.copy_to_host(stream=self.stream)
        _synchronize(self.stream)
        n_gen = self.host_status[0]
        return GenerateResult(
            method=method,
            tokens=[out[b, :n_gen[b]].tolist() for b in range(self.bs)],
            prompt_lens=list(self.prompt_lens),
            forward_passes=self.forward_passes,
            acceptance=lengths[:min(int(rounds[0]), lengths.shape[0])].copy(),
            max_acceptance=max_acceptance, **times, **settings)


def speed_ratio(ar: GenerateResult, tree: GenerateResult) -> float | None:
    """Issue 4's speed ratio, DDTree tokens/s / (tau x AR tokens/s), as ``bench.decode_step``
    measures it: DDTree's rate and tau over its timed rounds (:attr:`GenerateResult.timed_tokens_per_s`,
    :attr:`GenerateResult.timed_mean_acceptance`), the AR rate from its median step (batch /
    :attr:`GenerateResult.step_median_s`). 0 where a run has no timed step. The target is >= 0.5,
    stated for batch 1; None for a batch: requests that finish early stop adding tokens to
    DDTree's rate while AR's counts every request, which would put the ratio below AR step / round."""
    if len(ar.tokens) != 1:
        return None
    tau = tree.timed_mean_acceptance
    ar_rate = len(ar.tokens) / ar.step_median_s if ar.step_median_s > 0 else 0.0
    return tree.timed_tokens_per_s / (tau * ar_rate) if tau > 0 and ar_rate > 0 else 0.0


def _check_flag(value: Any, name: str) -> bool:
    """``value`` as a bool (a bool or a NumPy bool), else TypeError naming ``name``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def _synchronize(stream: Any) -> None:
    """Wait for ``stream`` (0 / None: the copies were synchronous)."""
    if stream is None or (isinstance(stream, int) and stream == 0):
        return
    (getattr(stream, "synchronize", None) or getattr(stream, "sync"))()


# --- AR ---------------------------------------------------------------------------------------

def generate_ar(model: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
                seed: int = 0, stop_tokens: Iterable[int] | None = None, stream: Any = 0,
                progress: Callable[[int], None] | None = None, graphs: bool = True,
                pdl: bool = False) -> GenerateResult:
    """Autoregressive generation: prefill, then one T = 1 target forward per token.

    Args:
        model: a TargetModel with batch_size = len(prompts) and kv_capacity >=
            :func:`required_kv_capacity` (prompt lengths, max_new_tokens). Models with the prefill's
            and the step's row counts are derived from it (:func:`model_with_rows`); its cache is
            overwritten.
        prompts: per request, the prompt token ids (lengths may differ).
        max_new_tokens: >= 1 tokens per request at most.
        temperature: 0 (< 1e-5) for greedy, else Gumbel-max sampling at this temperature.
        seed: int in [0, 2^64); request b samples with seed + b.
        stop_tokens: ids that end a request (kept in its output).
        stream: 0, a numba stream or a cuda.core Stream; every launch, copy and replay goes on it.
        progress: called after the prefill and after each step with the tokens generated so far
            (summed over the batch).
        graphs: capture the step (forward T = 1 -> posterior -> commit) once after the first,
            eager step and replay it (module docstring); False: every step eager. Ignored (eager)
            under the simulator.
        pdl: launch the kernels with programmatic dependent launch (sm_90 on; ``kernels.pdl``):
            each starts while the previous one drains and waits in hardware for its writes. The
            same arithmetic, so the same tokens. Ignored under the simulator.

    Returns:
        :class:`GenerateResult` with method "ar" (acceptance 1 per step).

    Raises:
        TypeError / ValueError naming the argument, before any launch.
    """
    _check_model(model)
    graphs = _check_flag(graphs, "graphs")
    pdl = _check_flag(pdl, "pdl")
    session = _Session(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                       stop_tokens=stop_tokens, budget=0, step_rows=1, capture_layers=model.capture_layers,
                       stream=stream)
    bs = session.bs
    ones = session.ones  # [bs]: one row per request, acceptance length 1
    roots = cuda.to_device(np.zeros((bs, 1), dtype=np.int32), stream=stream)  # accepted = the root only
    visibility = cuda.to_device(np.ones((bs, 1, 1), dtype=np.uint32), stream=stream)  # [[1]]
    posterior = cuda.device_array((bs, 1), dtype=np.int32, stream=stream)
    step_tokens = session.bonus.reshape(bs, 1)  # the last token is the next input ...
    step_positions = session.past_lens.reshape(bs, 1)  # ... at position past_len
    new_tokens = posterior.reshape(bs)

    def step(s: Any, mark: Callable[[str], None] = _no_mark) -> None:
        """One AR step on stream ``s`` (the session's, or the graph builder while capturing)."""
        out = session.step_model.forward(step_tokens, step_positions, ones, visibility, stream=s)
        mark("verify")
        session.posterior(out.logits, ones, step_positions, posterior, s)
        session.commit(step_tokens, roots, ones, new_tokens, s)
        mark("accept")

    times = session.run(step, AR_STAGES, progress, graphs=graphs, pdl=pdl)
    return session.result("ar", 1, times)


# --- DDTree -----------------------------------------------------------------------------------

def _check_drafter(drafter: Any, horizon: int, vocab: int, batch_size: int) -> None:
    """A Drafter whose horizon is block_size - 1 (and whose vocabulary and batch, if it states
    them, are the target's)."""
    if not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must implement the Drafter protocol (horizon, feature_layers, begin, draft, "
                        f"commit), got {type(drafter).__name__}")
    if drafter.horizon != horizon:
        raise ValueError(f"block_size: the drafter drafts {drafter.horizon} positions per round, "
                         f"block_size - 1 = {horizon}")
    drafter_vocab = getattr(drafter, "vocab_size", vocab)
    if drafter_vocab != vocab:
        raise ValueError(f"drafter: vocabulary {drafter_vocab} differs from the target's {vocab}")
    drafter_batch = getattr(drafter, "batch_size", batch_size)
    if drafter_batch != batch_size:
        raise ValueError(f"drafter: batch size {drafter_batch} differs from the model's {batch_size}")


def generate_ddtree(model: Any, drafter: Drafter, prompts: Sequence[Sequence[int]], *, budget: int, block_size: int,
                    max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                    stop_tokens: Iterable[int] | None = None, stream: Any = 0,
                    progress: Callable[[int], None] | None = None, graphs: bool = True,
                pdl: bool = False) -> GenerateResult:
    """DDTree speculative generation: prefill, then one draft-tree round per target forward.

    A round (spec §1.1): the drafter's logits [bs, L, V] (L = block_size - 1) -> top-k with
    K = min(budget, V) -> best-first tree of 1 + budget nodes -> target forward over the tree ->
    posterior per node -> acceptance walk -> compaction of the target cache and the drafter's
    context -> commit of the accepted tokens and the bonus. ``budget = 0`` or ``block_size = 1``
    builds root-only trees: an AR step through the tree path (the drafter is not called).

    Args:
        model: a TargetModel (see :func:`generate_ar`; kv_capacity >= :func:`required_kv_capacity`
            with the budget). Its prefill / round models are derived with the drafter's
            feature layers captured.
        drafter: a :class:`~ddtree_numba.engine.drafters.Drafter` with horizon block_size - 1 and
            the model's batch size.
        prompts, max_new_tokens, temperature, seed, stop_tokens, stream, progress: as :func:`generate_ar`.
        budget: drafted nodes per tree, in [0, 1024].
        block_size: b >= 1 (L = b - 1 drafted positions).
        graphs: capture the whole round (draft -> top-k -> build -> verify -> posterior -> accept ->
            compaction -> drafter commit -> commit) once after the first, eager round and replay
            it; False: every round eager. Ignored (eager) under the simulator.
        pdl: as :func:`generate_ar`.

    Returns:
        :class:`GenerateResult` with method "ddtree"; acceptance lengths in [1, block_size].

    Raises:
        TypeError / ValueError naming the argument, before any launch.
    """
    budget = require_int(budget, "budget", minimum=0, maximum=MAX_BUDGET)
    block_size = require_int(block_size, "block_size", minimum=1, maximum=tree_build.MAX_HORIZON + 1)
    horizon = block_size - 1
    _check_model(model)
    graphs = _check_flag(graphs, "graphs")
    pdl = _check_flag(pdl, "pdl")
    vocab = int(model.config.vocab_size)
    _check_drafter(drafter, horizon, vocab, int(model.batch_size))
    drafting = budget > 0 and horizon > 0
    n_cap = 1 + budget
    session = _Session(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                       stop_tokens=stop_tokens, budget=budget, step_rows=n_cap,
                       capture_layers=drafter.feature_layers, stream=stream)
    bs = session.bs

    # Round buffers, all allocated here. A root-only tree (not drafting) has no draft rows.
    depth = horizon if drafting else 0
    k = min(budget, vocab) if drafting else 0
    top_lp = cuda.device_array((bs, depth, k), dtype=np.float32, stream=stream)  # [bs, L, K]
    top_ids = cuda.device_array((bs, depth, k), dtype=np.int32, stream=stream)
    if drafting:
        topk_plan = plan_topk(bs * depth, vocab, k, np.float32, threads=_threads(TOPK_THREADS))
        top_lp_rows = top_lp.reshape(bs * depth, k)  # [bs * L, K] views for the top-k kernel
        top_ids_rows = top_ids.reshape(bs * depth, k)
    tree_plan = tree_build.plan(bs, depth, k, n_cap, threads=_threads(tree_build.DEFAULT_THREADS))
    tree = tree_build.allocate_outputs(tree_plan, stream=stream)
    walk_bonus = cuda.device_array(bs, dtype=np.int32, stream=stream)  # committed into session.bonus
    posterior = cuda.device_array((bs, n_cap), dtype=np.int32, stream=stream)
    accepted = cuda.device_array((bs, depth + 1), dtype=np.int32, stream=stream)  # W = 1 + max depth
    lengths = cuda.device_array(bs, dtype=np.int32, stream=stream)
    # every layer's latents, then rope keys, as one buffer each: two launches per round
    compaction = plan_compaction(model.cache.stacked(), threads=_threads(COMPACT_THREADS), layered=True)

    def begin(prefill_out: Any) -> None:
        if drafting:
            drafter.begin(prefill_out.features, session.prompt_lens_dev, stream)

    def step(s: Any, mark: Callable[[str], None] = _no_mark) -> None:
        """One round on stream ``s`` (the session's, or the graph builder while capturing)."""
        if drafting:
            logits = drafter.draft(session.bonus, session.past_lens, s)  # [bs, L, V]
            mark("draft")
            run_topk(topk_plan, logits.reshape(bs * depth, vocab), top_lp_rows, top_ids_rows, s, check=False)
            mark("topk")
        else:
            mark("draft")
            mark("topk")
        tree_build.run(tree_plan, top_lp, top_ids, session.budgets, session.past_lens, session.bonus, tree, s)
        mark("build")
        out = session.step_model.forward(tree.tokens, tree.positions, tree.sizes, tree.visibility, stream=s)
        mark("verify")
        session.posterior(out.logits, tree.sizes, tree.positions, posterior, s)
        accept_walk(posterior, tree.child_ptr, tree.child_index, tree.tokens, accepted, lengths, walk_bonus,
                    stream=s)
        mark("accept")
        run_compaction(compaction, session.past_lens, accepted, lengths, stream=s)
        if drafting:
            drafter.commit(out.features, accepted, lengths, s)
        session.commit(tree.tokens, accepted, lengths, walk_bonus, s)
        mark("compact")

    times = session.run(step, DDTREE_STAGES, progress, begin, graphs=graphs, pdl=pdl)
    return session.result("ddtree", block_size, times, budget=budget, block_size=block_size)
