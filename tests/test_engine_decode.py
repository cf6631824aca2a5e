"""AR and DDTree generation loops (ddtree_numba.engine.decode) and the oracle drafter.

Under the simulator most loop tests run against ``ToyTarget``, a stand-in with the TargetModel
interface whose logits are a hash of the exact multiset of (token, position) pairs a row sees
(its cache rows below past_len plus the visible new rows), so any slip in positions, visibility,
cache writes or compaction changes the tokens; its continuation is also computed on the host
(``toy_generate``), which stands in for the slow simulated AR run. The real ``tiny`` target
(~40 launches, seconds per simulated forward) runs end to end with both drafters in
tests/test_engine_generate.py; the breadth over seeds, budgets, block sizes and batches on the
real model is in the GPU tests (``small``) at the end of this file.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections import namedtuple

import numpy as np
import pytest
from numba import cuda, int64

from ddtree_numba.config import ModelConfig
from ddtree_numba.engine import decode
from ddtree_numba.engine.cache import KVCache
from ddtree_numba.engine.decode import GenerateResult, generate_ar, generate_ddtree, required_kv_capacity
from ddtree_numba.engine.drafters import (PHILOX_WORDS, TOP_SCORE, Drafter, OracleDrafter, oracle_logits_kernel,
                                          oracle_logits_reference, oracle_parts)
from ddtree_numba.engine.graphs import GraphCaptureError, StepGraph
from reference.sampling import sample_posterior
from sim.install import simulator_active
from sim.launch import launch

SIMULATED = simulator_active()

# --- the toy target ---------------------------------------------------------------------------

MASK32 = 0xFFFFFFFF
TOKEN_MUL = 0x2C1B3C6D  # odd multipliers below 2^31: products of 32-bit values stay below 2^63
POS_MUL = 40503
SALT_MUL = 97
MIX_MUL = 0x297A2D39
FINAL_MUL_A = 0x7FEB352D
FINAL_MUL_B = 0x68E31DA5
LOGIT_SCALE = 8.0  # logits uniform in [-4, 4): peaked enough to sample, flat enough to vary
TOY_VOCAB = 64
ToyOut = namedtuple("ToyOut", "logits features")


@cuda.jit(device=True)
def _mix(token, position, salt):
    """32-bit hash of one (token, position) pair."""
    x = (int64(token) * TOKEN_MUL + int64(position) * POS_MUL + int64(salt) * SALT_MUL + 12345) & MASK32
    x = (x * MIX_MUL) & MASK32
    return x ^ (x >> 15)


@cuda.jit(device=True)
def _logit(h, v):
    """The toy logit of token v after a context hashing to h."""
    x = (h ^ ((int64(v) * TOKEN_MUL) & MASK32)) & MASK32
    x = (x * FINAL_MUL_A) & MASK32
    x = x ^ (x >> 13)
    x = (x * FINAL_MUL_B) & MASK32
    x = x ^ (x >> 16)
    return (x * 2.0**-32 - 0.5) * LOGIT_SCALE


@cuda.jit
def toy_forward_kernel(tokens, positions, sizes, visibility, past_lens, salt, cache, logits):
    """One thread per request: row i < sizes[b] gets logits of hash(cache rows [0, past) + visible
    new rows), then writes (token, position) to cache row past + i (channels 0 and 1)."""
    b = cuda.grid(1)
    if b >= sizes.shape[0]:
        return
    past = past_lens[b]
    base = int64(0)
    for r in range(past):
        base = (base + _mix(int64(cache[b, r, 0]), int64(cache[b, r, 1]), salt)) & MASK32
    for i in range(sizes[b]):
        h = base
        for j in range(sizes[b]):
            if (visibility[b, i, j // 32] >> (j % 32)) & 1:
                h = (h + _mix(tokens[b, j], positions[b, j], salt)) & MASK32
        for v in range(logits.shape[2]):
            logits[b, i, v] = _logit(h, v)
    for i in range(sizes[b]):  # after every row has read the cache
        cache[b, past + i, 0] = tokens[b, i]
        cache[b, past + i, 1] = positions[b, i]


class ToyTarget:
    """The TargetModel interface (constructor included, so decode can derive row variants)."""

    def __init__(self, config, weights, *, batch_size, kv_capacity, max_rows, capture_layers=(), stream=0,
                 cache=None):
        if capture_layers:
            raise ValueError("capture_layers: the toy target has no features")
        self.config, self.weights, self.stream = config, weights, stream
        self.batch_size, self.kv_capacity, self.max_rows = batch_size, kv_capacity, max_rows
        self.capture_layers = ()
        self.cache = cache if cache is not None else KVCache(config, batch_size, kv_capacity, stream=stream)
        self.logits = cuda.device_array((batch_size, max_rows, config.vocab_size), np.float32)

    def forward(self, tokens, positions, sizes, visibility, *, stream=None):
        bs, tc = self.batch_size, self.max_rows
        assert tokens.shape == positions.shape == (bs, tc) and sizes.shape == (bs,)
        assert visibility.shape == (bs, tc, -(-tc // 32))
        launch(toy_forward_kernel, 1, bs, stream or 0, 0, tokens, positions, sizes, visibility,
               self.cache.past_lens, np.int64(self.weights["salt"]), self.cache.layers[0].latent, self.logits)
        return ToyOut(self.logits, None)


def _mix_host(token: int, position: int, salt: int) -> int:
    x = (token * TOKEN_MUL + position * POS_MUL + salt * SALT_MUL + 12345) & MASK32
    x = (x * MIX_MUL) & MASK32
    return x ^ (x >> 15)


def toy_logits(context: list[tuple[int, int]], salt: int) -> np.ndarray:
    """float32 [V]: the toy's logits after ``context`` (token, position) pairs, on the host."""
    h = sum(_mix_host(t, p, salt) for t, p in context) & MASK32
    x = (h ^ ((np.arange(TOY_VOCAB, dtype=np.int64) * TOKEN_MUL) & MASK32)) & MASK32
    x = (x * FINAL_MUL_A) & MASK32
    x ^= x >> 13
    x = (x * FINAL_MUL_B) & MASK32
    x ^= x >> 16
    return ((x * 2.0**-32 - 0.5) * LOGIT_SCALE).astype(np.float32)


def toy_generate(prompt, salt: int, n: int, *, temperature: float = 0.0, seed: int = 0,
                 stop=()) -> list[int]:
    """The toy's AR continuation on the host (the loops' semantics: stop token kept)."""
    context = [(int(t), i) for i, t in enumerate(prompt)]
    position = len(prompt) - 1  # the row whose logits are read
    out: list[int] = []
    while len(out) < n:
        logits = toy_logits(context, salt)[None]
        token = int(sample_posterior(logits, temperature, seed, np.array([position]))[0])
        out.append(token)
        if token in stop:
            break
        position += 1
        context.append((token, position))
    return out


TOY_CONFIG = dataclasses.replace(ModelConfig.from_name("tiny"), vocab_size=TOY_VOCAB, mask_token_id=TOY_VOCAB - 1)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13]]  # ragged


def toy_model(salt: int, batch_size: int = 2, kv_capacity: int = 64) -> ToyTarget:
    return ToyTarget(TOY_CONFIG, {"salt": salt}, batch_size=batch_size, kv_capacity=kv_capacity, max_rows=1)


def reference_matrix(tokens: list[list[int]], width: int) -> np.ndarray:
    """int [bs, width] of per-request continuations, -1 padded (an OracleDrafter's input)."""
    ref = np.full((len(tokens), width), -1, dtype=np.int64)
    for b, t in enumerate(tokens):
        ref[b, :len(t)] = t[:width]
    return ref


def check_statistics(result: GenerateResult, block_size: int) -> None:
    """Properties every result has: shapes, ranges, counts consistent with the tokens."""
    acc = result.acceptance
    assert result.forward_passes == 1 + result.rounds
    assert acc.shape == (result.rounds, len(result.tokens))
    assert acc.min(initial=1) >= 0 and acc.max(initial=1) <= block_size
    for b, tokens in enumerate(result.tokens):
        committed = int(acc[:, b].sum())
        active = acc[:, b] > 0
        # a request is active in a prefix of rounds; the last may overshoot a stop / max_new
        assert np.all(active[:active.sum()])
        assert len(tokens) - 1 <= committed < len(tokens) - 1 + block_size
    hist = result.histogram
    assert hist.shape == (block_size + 1,) and hist[0] == 0 and hist.sum() == (acc > 0).sum()
    assert set(result.stage_s) == set(decode.DDTREE_STAGES if result.method == "ddtree" else decode.AR_STAGES)
    assert all(v >= 0 for v in result.stage_s.values()) and result.decode_s >= 0
    assert result.step_s.shape == (result.rounds,) and np.all(result.step_s >= 0) and result.capture_s >= 0
    assert result.stage_rounds in (min(result.rounds, 1), result.rounds)  # calibration step, or every step
    if result.graphs:
        assert result.stage_rounds == 1 and result.replay_s.size == result.rounds - 1 and result.capture_s > 0
    else:
        assert result.replay_s.size == 0


# --- oracle drafter ---------------------------------------------------------------------------

@pytest.mark.parametrize("vocab, horizon, seed", [(37, 3, 2**63 + 5), (8, 1, 0)])
def test_oracle_kernel_matches_reference(vocab, horizon, seed):
    rng = np.random.default_rng(vocab)
    ref = rng.integers(0, vocab, size=(3, 9))
    ref[1, 5:] = -1  # a request whose continuation is partly unknown
    prompt_lens = np.array([3, 5, 1], dtype=np.int32)
    start = np.array([3, 8, 12], dtype=np.int32)  # request 2 drafts past its reference
    drafter = OracleDrafter(ref, vocab, horizon, accuracy=0.6, entropy=0.7, seed=seed)
    drafter.begin(None, cuda.to_device(prompt_lens))
    got = drafter.draft(cuda.to_device(np.zeros(3, np.int32)), cuda.to_device(start)).copy_to_host()
    want = oracle_logits_reference(ref, prompt_lens, start, horizon, vocab, accuracy=0.6, entropy=0.7, seed=seed)
    assert got.shape == (3, horizon, vocab) and got.dtype == np.float32
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert isinstance(drafter, Drafter) and drafter.feature_layers == ()


def test_oracle_kernel_split_vocabulary():
    # 32 threads x 4 groups per block: 1290 tokens = 323 groups (the last of 2 tokens) in
    # 3 parts of 128, 128 and 67 groups; the rows must not depend on the split
    vocab, horizon, seed = 1290, 2, 11
    assert oracle_parts(vocab, 32) == (3, 128)
    rng = np.random.default_rng(5)
    ref = rng.integers(0, vocab, size=(3, 6))
    prompt_lens = np.array([2, 4, 1], dtype=np.int32)
    start = np.array([1, 5, 9], dtype=np.int32)  # request 2 drafts past its reference: a drawn top
    drafter = OracleDrafter(ref, vocab, horizon, accuracy=0.5, entropy=0.6, seed=seed, threads=32)
    assert drafter.parts == 3
    drafter.begin(None, cuda.to_device(prompt_lens))
    d_start = cuda.to_device(start)
    got = drafter.draft(cuda.to_device(np.zeros(3, np.int32)), d_start).copy_to_host()
    whole = cuda.device_array_like(got)
    n_groups = -(-vocab // PHILOX_WORDS)
    launch(oracle_logits_kernel, (horizon, 3, 1), 32, 0, 0, drafter._ref, drafter._prompt_lens, d_start,
           np.uint64(seed), np.float64(0.5), np.float64(1 / 0.6), np.int32(n_groups), whole)
    np.testing.assert_array_equal(got, whole.copy_to_host())  # bit for bit: only the work moved
    want = oracle_logits_reference(ref, prompt_lens, start, horizon, vocab, accuracy=0.5, entropy=0.6, seed=seed)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_oracle_parts():
    assert oracle_parts(1, 128) == (1, 512)
    assert oracle_parts(32768, 128) == (16, 512)  # the small preset: 15 x 16 blocks at batch 1
    parts, per_part = oracle_parts(2**31 - 1, 32)  # capped at grid z's 65535
    assert parts <= 65535 and (parts - 1) * per_part < -(-(2**31 - 1) // PHILOX_WORDS) <= parts * per_part
    with pytest.raises(ValueError, match="vocab_size"):
        oracle_parts(0, 32)
    with pytest.raises(TypeError, match="threads"):
        oracle_parts(64, 32.0)


def test_oracle_reference_distribution():
    bs, n, vocab, horizon = 64, 40, 50, 8
    rng = np.random.default_rng(1)
    ref = rng.integers(0, vocab, size=(bs, n))
    prompt_lens = rng.integers(1, 10, size=bs)
    start = prompt_lens - 1 + rng.integers(0, n - horizon, size=bs)  # every drafted position is known
    truth = np.stack([ref[b, start[b] + 1 - prompt_lens[b]:start[b] + 1 - prompt_lens[b] + horizon]
                      for b in range(bs)])  # [bs, L]
    for accuracy in (0.0, 0.3, 0.9, 1.0):
        logits = oracle_logits_reference(ref, prompt_lens, start, horizon, vocab, accuracy=accuracy,
                                         entropy=0.5, seed=7)
        top = logits.argmax(-1)
        # the top token is strictly the largest, at TOP_SCORE / entropy
        assert np.all(np.sort(logits, -1)[..., -2] < logits.max(-1))
        np.testing.assert_allclose(logits.max(-1), TOP_SCORE / 0.5, rtol=1e-6)
        hits = (top == truth).mean()
        sd = np.sqrt(accuracy * (1 - accuracy) / top.size)
        assert abs(hits - accuracy) <= 4 * sd + 1e-12
    # entropy is a temperature: same draws, logits scaled by 1 / entropy
    a = oracle_logits_reference(ref, prompt_lens, start, horizon, vocab, accuracy=0.5, entropy=1.0, seed=3)
    b = oracle_logits_reference(ref, prompt_lens, start, horizon, vocab, accuracy=0.5, entropy=0.25, seed=3)
    np.testing.assert_allclose(b, 4 * a, rtol=1e-6, atol=1e-5)
    # unknown truth (past the reference): a drawn top token, deterministic in the seed
    far = start + n
    c = oracle_logits_reference(ref, prompt_lens, far, horizon, vocab, accuracy=1.0, entropy=0.5, seed=3)
    d = oracle_logits_reference(ref, prompt_lens, far, horizon, vocab, accuracy=1.0, entropy=0.5, seed=3)
    np.testing.assert_array_equal(c, d)
    assert len(np.unique(c.argmax(-1))) > 1


def test_oracle_argument_errors():
    ref = np.zeros((2, 4), dtype=np.int64)
    with pytest.raises(ValueError, match="accuracy"):
        OracleDrafter(ref, 8, 3, accuracy=1.5)
    with pytest.raises(ValueError, match="entropy"):
        OracleDrafter(ref, 8, 3, entropy=0.0)
    with pytest.raises(ValueError, match="reference_tokens"):
        OracleDrafter(ref + 8, 8, 3)
    with pytest.raises(TypeError, match="reference_tokens"):
        OracleDrafter(ref.astype(np.float32), 8, 3)
    with pytest.raises(ValueError, match="seed"):
        OracleDrafter(ref, 8, 3, seed=-1)
    drafter = OracleDrafter(ref, 8, 3)
    with pytest.raises(ValueError, match="start"):
        drafter.draft(cuda.to_device(np.zeros(2, np.int32)), cuda.to_device(np.zeros(3, np.int32)))
    with pytest.raises(TypeError, match="prompt_lens"):
        drafter.begin(None, np.zeros(2, np.int64))


# --- loops on the toy target ------------------------------------------------------------------

def test_ar_matches_host_reference():
    salt, n = 3, 7
    result = generate_ar(toy_model(salt), PROMPTS, max_new_tokens=n)
    assert result.tokens == [toy_generate(p, salt, n) for p in PROMPTS]
    assert result.method == "ar" and result.forward_passes == n and result.prompt_lens == [3, 5]
    assert np.all(result.acceptance == 1) and result.acceptance.shape == (n - 1, 2)
    check_statistics(result, 1)


@pytest.mark.parametrize("budget, block_size, salt, accuracy, n", [(0, 2, 0, 0.7, 7), (1, 2, 1, 0.7, 7),
                                                                 (4, 4, 2, 0.7, 7), (16, 4, 3, 0.9, 5)])
def test_ddtree_greedy_equals_ar(budget, block_size, salt, accuracy, n):
    want = [toy_generate(p, salt, n) for p in PROMPTS]
    drafter = OracleDrafter(reference_matrix(want, n), TOY_VOCAB, block_size - 1, accuracy=accuracy, entropy=0.5,
                            seed=salt)
    result = generate_ddtree(toy_model(salt), drafter, PROMPTS, budget=budget, block_size=block_size,
                             max_new_tokens=n)
    assert result.tokens == want
    assert result.method == "ddtree" and (result.budget, result.block_size) == (budget, block_size)
    check_statistics(result, block_size)
    if budget == 0:
        assert result.forward_passes == n and np.all(result.acceptance == 1)


def test_sampled_ddtree_equals_sampled_ar():
    salt, n, temperature, seed = 5, 6, 0.8, 11
    want = [toy_generate(p, salt, n, temperature=temperature, seed=seed + b) for b, p in enumerate(PROMPTS)]
    greedy = [toy_generate(p, salt, n) for p in PROMPTS]
    assert want != greedy  # the sample differs from the greedy path
    model = toy_model(salt)
    ar = generate_ar(model, PROMPTS, max_new_tokens=n, temperature=temperature, seed=seed)
    assert ar.tokens == want
    drafter = OracleDrafter(reference_matrix(want, n), TOY_VOCAB, 3, accuracy=0.8, entropy=0.5, seed=1)
    tree = generate_ddtree(model, drafter, PROMPTS, budget=6, block_size=4, max_new_tokens=n,
                           temperature=temperature, seed=seed)
    assert tree.tokens == want
    check_statistics(tree, 4)


def test_accurate_oracle_needs_five_times_fewer_forwards():
    salt, n, block = 7, 17, 8  # prefill + 2 rounds of 8 tokens
    prompt = [[4, 2]]
    want = [toy_generate(prompt[0], salt, n)]
    drafter = OracleDrafter(reference_matrix(want, n), TOY_VOCAB, block - 1, accuracy=1.0, entropy=0.2, seed=0)
    result = generate_ddtree(toy_model(salt, batch_size=1), drafter, prompt, budget=block, block_size=block,
                             max_new_tokens=n)
    assert result.tokens == want
    assert 5 * result.forward_passes <= n  # AR takes n forwards (prefill included)
    assert np.all(result.acceptance[:-1] == block) and result.mean_acceptance > block - 1


def test_stop_tokens_and_max_new_tokens():
    salt, n = 9, 8
    want = [toy_generate(p, salt, n) for p in PROMPTS]
    k = next(i for i in range(2, n) if want[0][i] not in want[0][:i] and want[0][i] not in want[1])
    stop = [want[0][k]]
    expected = [want[0][:k + 1], want[1]]  # request 0 stops at its stop token, request 1 at max_new
    drafter = OracleDrafter(reference_matrix(want, n), TOY_VOCAB, 3, accuracy=1.0, entropy=0.3, seed=2)
    model = toy_model(salt)
    tree = generate_ddtree(model, drafter, PROMPTS, budget=4, block_size=4, max_new_tokens=n, stop_tokens=stop)
    assert tree.tokens == expected
    check_statistics(tree, 4)
    short = generate_ar(model, PROMPTS, max_new_tokens=3, stop_tokens=stop)
    assert short.tokens == [w[:3] for w in want]
    first = generate_ddtree(model, drafter, PROMPTS, budget=4, block_size=4, max_new_tokens=1)
    assert first.tokens == [[w[0]] for w in want] and first.forward_passes == 1 and first.rounds == 0
    stopped = generate_ar(model, PROMPTS, max_new_tokens=n, stop_tokens=[w[0] for w in want])
    assert stopped.tokens == [[w[0]] for w in want] and stopped.forward_passes == 1


@contextlib.contextmanager
def _no_allocation(monkeypatch, calls: list[str]):
    """Record (and fail) every device / pinned allocation and implicit host-to-device transfer."""
    def forbid(name):
        def fail(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} called inside the generation loop")
        return fail

    with monkeypatch.context() as patch:
        for name in ("device_array", "device_array_like", "to_device", "pinned_array", "mapped_array",
                     "managed_array"):
            if hasattr(cuda, name):
                patch.setattr(cuda, name, forbid(f"cuda.{name}"))
        if SIMULATED:
            from numba.cuda.simulator.kernel import FakeCUDAKernel
            call = FakeCUDAKernel.__call__

            def checked(self, *args):
                if not self._device and any(isinstance(a, np.ndarray) and a.ndim > 0 for a in args):
                    calls.append(f"host array passed to {self.fn.__name__}")
                    raise AssertionError(f"host array passed to {self.fn.__name__} (implicit transfer)")
                return call(self, *args)
            patch.setattr(FakeCUDAKernel, "__call__", checked)
        else:
            from numba.cuda.cudadrv.driver import Context
            for name in ("memalloc", "memhostalloc", "mempin"):
                patch.setattr(Context, name, forbid(f"Context.{name}"))
        yield


def _guard_loop(monkeypatch, calls: list[str]) -> None:
    """Set-up runs freely; the prefill and every step / round run under :func:`_no_allocation`."""
    run = decode._Session.run

    def guarded(self, *args, **kwargs):
        with _no_allocation(monkeypatch, calls):
            return run(self, *args, **kwargs)
    monkeypatch.setattr(decode._Session, "run", guarded)


def test_no_device_allocation_inside_the_loop(monkeypatch):
    salt, n = 4, 4
    want = [toy_generate(p, salt, n, temperature=0.5, seed=b) for b, p in enumerate(PROMPTS)]
    drafter = OracleDrafter(reference_matrix(want, n), TOY_VOCAB, 2, accuracy=0.8, seed=1)
    model = toy_model(salt)
    calls: list[str] = []
    _guard_loop(monkeypatch, calls)
    tree = generate_ddtree(model, drafter, PROMPTS, budget=3, block_size=3, max_new_tokens=n, temperature=0.5)
    ar = generate_ar(model, PROMPTS, max_new_tokens=2)
    assert calls == [] and tree.rounds >= 1 and ar.rounds == 1
    assert tree.tokens == want
    with pytest.raises(AssertionError, match="inside the generation loop"):  # the guard does catch one
        with _no_allocation(monkeypatch, []):
            cuda.device_array(4, np.int32)


# --- CUDA graphs ------------------------------------------------------------------------------

@cuda.jit
def _add_kernel(counter, amount):
    """counter[i] += amount[i] (one thread per element)."""
    i = cuda.grid(1)
    if i < counter.shape[0]:
        counter[i] += amount[i]


def test_step_graph_replays_the_step():
    """Warm-up, then replays: the device sees every step once; Python runs the step each time
    under the simulator, and only for the warm-up and the capture with graphs."""
    counter = cuda.to_device(np.zeros(4, np.int32))
    amount = cuda.to_device(np.arange(1, 5, dtype=np.int32))
    calls = []

    def step(stream, tag="captured"):
        calls.append(tag)
        launch(_add_kernel, 1, 32, stream, 0, counter, amount)

    with StepGraph(step, 0) as graph:
        assert graph.uses_graph is not SIMULATED and not graph.warm and not graph.captured
        graph.warm_up("eager")
        assert graph.warm and calls == ["eager"]
        for _ in range(3):
            graph.replay()
        assert graph.replays == 3 and graph.captured is not SIMULATED
    assert not graph.captured  # closed
    np.testing.assert_array_equal(counter.copy_to_host(), 4 * np.arange(1, 5))
    assert calls == ["eager"] + (["captured"] * 3 if SIMULATED else ["captured"])

    disabled = StepGraph(step, 0, enabled=False)
    disabled()  # the first call warms up, later calls replay
    disabled()
    assert not disabled.uses_graph and not disabled.captured and disabled.replays == 1
    np.testing.assert_array_equal(counter.copy_to_host(), 6 * np.arange(1, 5))
    with pytest.raises(TypeError, match="fn"):
        StepGraph(None)
    with pytest.raises(ValueError, match="mode"):
        StepGraph(step, mode="loose")
    with pytest.raises(TypeError, match="enabled"):
        StepGraph(step, enabled=1)


def test_graphs_flag_gives_the_same_tokens():
    """graphs=True (calibration step, then the replay path; eager under the simulator) and
    graphs=False produce the same sampled tokens and consistent statistics (greedy graphs=True
    runs are the default of every other loop test)."""
    salt, n, temperature = 6, 5, 0.7
    want = [toy_generate(p, salt, n, temperature=temperature, seed=3 + b) for b, p in enumerate(PROMPTS)]
    model = toy_model(salt)
    results = {}
    for graphs in (True, False):
        ar = generate_ar(model, PROMPTS, max_new_tokens=n, temperature=temperature, seed=3, graphs=graphs)
        drafter = OracleDrafter(reference_matrix(want, n), TOY_VOCAB, 2, accuracy=0.6, entropy=0.5, seed=4)
        tree = generate_ddtree(model, drafter, PROMPTS, budget=3, block_size=3, max_new_tokens=n,
                               temperature=temperature, seed=3, graphs=graphs)
        for result in (ar, tree):
            assert result.tokens == want
            check_statistics(result, result.max_acceptance)
            assert result.graphs is (graphs and not SIMULATED)
            assert result.stage_rounds == (1 if graphs else result.rounds)
            summary = result.summary()
            assert summary["graphs"] == result.graphs and len(summary["step_s"]) == result.rounds
        results[graphs] = tree
    np.testing.assert_array_equal(results[True].acceptance, results[False].acceptance)
    assert results[True].forward_passes == results[False].forward_passes


def test_argument_errors():
    model = toy_model(0, kv_capacity=16)
    drafter = OracleDrafter(np.zeros((2, 4), np.int64), TOY_VOCAB, 3)
    ok = dict(budget=4, block_size=4, max_new_tokens=4)
    with pytest.raises(ValueError, match="budget"):
        generate_ddtree(model, drafter, PROMPTS, **{**ok, "budget": 1025})
    with pytest.raises(ValueError, match="block_size"):
        generate_ddtree(model, drafter, PROMPTS, **{**ok, "block_size": 5})
    with pytest.raises(TypeError, match="drafter"):
        generate_ddtree(model, object(), PROMPTS, **ok)
    with pytest.raises(ValueError, match="drafter: batch size"):
        generate_ddtree(model, OracleDrafter(np.zeros((3, 4), np.int64), TOY_VOCAB, 3), PROMPTS, **ok)
    with pytest.raises(ValueError, match="drafter: vocabulary"):
        generate_ddtree(model, OracleDrafter(np.zeros((2, 4), np.int64), TOY_VOCAB + 1, 3), PROMPTS, **ok)
    with pytest.raises(ValueError, match="prompts"):
        generate_ddtree(model, drafter, PROMPTS[:1], **ok)
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        generate_ar(model, [[1, 2], [3, TOY_VOCAB]], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        generate_ar(model, [[], [3]], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_ddtree(model, drafter, PROMPTS, **{**ok, "max_new_tokens": 12})  # 5 + 12 + 4 - 1 > 16
    assert required_kv_capacity([3, 5], 12, 4) == 20
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_ar(model, PROMPTS, max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        generate_ar(model, PROMPTS, max_new_tokens=2, temperature=-1.0)
    with pytest.raises(ValueError, match="stop_tokens"):
        generate_ar(model, PROMPTS, max_new_tokens=2, stop_tokens=[TOY_VOCAB])
    with pytest.raises(TypeError, match="model"):
        generate_ar(object(), PROMPTS, max_new_tokens=2)
    with pytest.raises(TypeError, match="graphs"):
        generate_ar(model, PROMPTS, max_new_tokens=2, graphs="yes")
    with pytest.raises(TypeError, match="graphs"):
        generate_ddtree(model, drafter, PROMPTS, **ok, graphs=None)
    with pytest.raises(TypeError, match="pdl"):
        generate_ar(model, PROMPTS, max_new_tokens=2, pdl="yes")
    with pytest.raises(TypeError, match="pdl"):
        generate_ddtree(model, drafter, PROMPTS, **ok, pdl=1)


def test_pdl_flag_gives_the_same_tokens():
    """pdl=True: the same tokens and statistics (the simulator runs every launch to completion,
    so it reports pdl False); the flag is in the summary."""
    salt, n = 7, 5
    want = [toy_generate(p, salt, n) for p in PROMPTS]
    model = toy_model(salt)
    for pdl in (True, False):
        ar = generate_ar(model, PROMPTS, max_new_tokens=n, pdl=pdl)
        drafter = OracleDrafter(reference_matrix(want, n), TOY_VOCAB, 2, accuracy=0.6, entropy=0.5, seed=4)
        tree = generate_ddtree(model, drafter, PROMPTS, budget=3, block_size=3, max_new_tokens=n, pdl=pdl)
        for result in (ar, tree):
            assert result.tokens == want
            check_statistics(result, result.max_acceptance)
            assert result.pdl is (pdl and not SIMULATED) and result.summary()["pdl"] is result.pdl


# --- GPU: the small preset --------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_model():
    from ddtree_numba.engine.model import TargetModel
    from reference.weights import init_weights

    config = ModelConfig.from_name("small")
    return config, TargetModel(config, init_weights(config, 0), batch_size=4, kv_capacity=1024, max_rows=64)


def _small_prompts(bs: int, seed: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(8, 64))).tolist() for _ in range(bs)]


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("bs", [1, 4])
def test_gpu_small_lossless(small_model, seed, bs):
    from ddtree_numba.engine.model import TargetModel

    config, base = small_model
    model = base if bs == base.batch_size else TargetModel(config, base.weights, batch_size=bs, kv_capacity=1024,
                                                           max_rows=64)
    prompts = _small_prompts(bs, seed, config.vocab_size)
    n = 48
    for temperature in (0.0, 0.8):
        ar = generate_ar(model, prompts, max_new_tokens=n, temperature=temperature, seed=seed)
        ref = reference_matrix(ar.tokens, n)
        for budget in (8, 32, 128, 512):
            for block in (8, 16):
                drafter = OracleDrafter(ref, config.vocab_size, block - 1, accuracy=0.8, entropy=0.5, seed=seed)
                tree = generate_ddtree(model, drafter, prompts, budget=budget, block_size=block, max_new_tokens=n,
                                       temperature=temperature, seed=seed)
                assert tree.tokens == ar.tokens, (temperature, budget, block)
                check_statistics(tree, block)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_gpu_small_tensor_core_products_lossless(small_model, temperature):
    """products="tensor-core" (kernels.linear_tc for the dense products, batch-invariant on the
    GPU's own mma): DDTree's tokens are AR's over budgets and block sizes, greedy and sampled."""
    from ddtree_numba.engine.model import TargetModel

    config, base = small_model
    model = TargetModel(config, base.weights, batch_size=1, kv_capacity=1024, max_rows=64, products="tensor-core")
    prompts = _small_prompts(1, 5, config.vocab_size)
    n = 40
    ar = generate_ar(model, prompts, max_new_tokens=n, temperature=temperature, seed=5)
    ref = reference_matrix(ar.tokens, n)
    for budget, block in ((8, 8), (32, 16), (256, 16)):
        drafter = OracleDrafter(ref, config.vocab_size, block - 1, accuracy=0.8, entropy=0.5, seed=5)
        tree = generate_ddtree(model, drafter, prompts, budget=budget, block_size=block, max_new_tokens=n,
                               temperature=temperature, seed=5)
        assert tree.tokens == ar.tokens, (temperature, budget, block)
        check_statistics(tree, block)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_gpu_small_pdl_lossless(small_model, temperature):
    """pdl=True (every kernel launched while its predecessor drains, graphs keep the programmatic
    edges): AR's tokens are those of ordinary launches, and DDTree's are AR's over budgets and
    block sizes, greedy and sampled."""
    from ddtree_numba.engine.model import TargetModel

    config, base = small_model
    model = TargetModel(config, base.weights, batch_size=1, kv_capacity=1024, max_rows=64)
    prompts = _small_prompts(1, 7, config.vocab_size)
    n = 40
    from sim.launch import programmatic_launch_count

    plain = generate_ar(model, prompts, max_new_tokens=n, temperature=temperature, seed=7)
    count = programmatic_launch_count()
    ar = generate_ar(model, prompts, max_new_tokens=n, temperature=temperature, seed=7, pdl=True)
    assert programmatic_launch_count() > count + 100   # the prefill, the eager step, the capture
    assert ar.pdl and ar.graphs and ar.tokens == plain.tokens
    ref = reference_matrix(ar.tokens, n)
    for budget, block in ((8, 8), (32, 16), (256, 16)):
        drafter = OracleDrafter(ref, config.vocab_size, block - 1, accuracy=0.8, entropy=0.5, seed=7)
        tree = generate_ddtree(model, drafter, prompts, budget=budget, block_size=block, max_new_tokens=n,
                               temperature=temperature, seed=7, pdl=True)
        assert tree.pdl and tree.tokens == ar.tokens, (temperature, budget, block)
        check_statistics(tree, block)


@pytest.mark.gpu
def test_gpu_small_dflash_lossless(small_model):
    from ddtree_numba.engine.dflash import DFlashDrafter
    from ddtree_numba.engine.model import TargetModel
    from reference.dflash import DFlashConfig

    config, base = small_model
    layers = DFlashConfig.from_name("dflash-small").target_layer_ids  # the target must capture them
    model = TargetModel(config, base.weights, batch_size=4, kv_capacity=1024, max_rows=64, capture_layers=layers)
    prompts = _small_prompts(4, 5, config.vocab_size)
    ar = generate_ar(model, prompts, max_new_tokens=32)
    drafter = DFlashDrafter.random(config, model, 4, seed=0)
    for budget in (8, 128):
        tree = generate_ddtree(model, drafter, prompts, budget=budget, block_size=drafter.horizon + 1,
                               max_new_tokens=32)
        assert tree.tokens == ar.tokens
        check_statistics(tree, drafter.horizon + 1)


@pytest.mark.gpu
def test_gpu_small_five_times_fewer_forwards(small_model):
    from ddtree_numba.engine.model import TargetModel

    config, base = small_model
    model = TargetModel(config, base.weights, batch_size=1, kv_capacity=1024, max_rows=64)
    prompts = _small_prompts(1, 3, config.vocab_size)
    n = 128
    ar = generate_ar(model, prompts, max_new_tokens=n)
    drafter = OracleDrafter(reference_matrix(ar.tokens, n), config.vocab_size, 15, accuracy=1.0, entropy=0.3)
    tree = generate_ddtree(model, drafter, prompts, budget=32, block_size=16, max_new_tokens=n)
    assert tree.tokens == ar.tokens
    assert ar.forward_passes == n and 5 * tree.forward_passes <= ar.forward_passes


@pytest.mark.gpu
def test_gpu_no_device_allocation_inside_the_loop(small_model, monkeypatch):
    config, model = small_model
    prompts = _small_prompts(4, 8, config.vocab_size)
    ar = generate_ar(model, prompts, max_new_tokens=16)
    sampled = generate_ar(model, prompts, max_new_tokens=16, temperature=0.7)  # what the sampled tree must give
    drafter = OracleDrafter(reference_matrix(sampled.tokens, 16), config.vocab_size, 7, accuracy=0.8)
    calls: list[str] = []
    _guard_loop(monkeypatch, calls)
    tree = generate_ddtree(model, drafter, prompts, budget=32, block_size=8, max_new_tokens=16, temperature=0.7)
    replayed = generate_ar(model, prompts, max_new_tokens=16, graphs=True)  # capture + replays guarded too
    eager = generate_ar(model, prompts, max_new_tokens=4, graphs=False)
    assert calls == [] and tree.rounds >= 2 and tree.graphs and replayed.graphs and not eager.graphs
    assert replayed.tokens == ar.tokens and tree.tokens == sampled.tokens


@pytest.mark.gpu
def test_gpu_step_graph_capture_records_without_running():
    counter = cuda.to_device(np.zeros(4, np.int32))
    amount = cuda.to_device(np.ones(4, dtype=np.int32))
    graph = StepGraph(lambda stream: launch(_add_kernel, 1, 32, stream, 0, counter, amount), cuda.stream())
    with pytest.raises(RuntimeError, match="warm_up"):
        graph.capture()
    graph.warm_up()
    graph.capture()  # records only
    graph.stream.synchronize()
    np.testing.assert_array_equal(counter.copy_to_host(), 1)
    graph.replay()
    graph.replay()
    graph.stream.synchronize()
    np.testing.assert_array_equal(counter.copy_to_host(), 3)
    graph.close()



@pytest.mark.gpu
@pytest.mark.parametrize("bs, seed", [(1, 2), (4, 3)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_gpu_small_graph_replay_equals_eager(small_model, temperature, bs, seed):
    """small, batch 1 and 4: graph-replayed AR steps and DDTree rounds (B = 32, b = 16) give the
    eager tokens, token for token; on the caller's numba stream too. One case per batch size: a
    case compiles the kernels of its batch's AR and tree row counts (~4 min on a cold H200)."""
    from ddtree_numba.engine.model import TargetModel

    config, base = small_model
    model = base if bs == base.batch_size else TargetModel(config, base.weights, batch_size=bs, kv_capacity=1024,
                                                           max_rows=64)
    n = 64
    prompts = _small_prompts(model.batch_size, seed, config.vocab_size)
    eager = generate_ar(model, prompts, max_new_tokens=n, temperature=temperature, seed=seed, graphs=False)
    replayed = generate_ar(model, prompts, max_new_tokens=n, temperature=temperature, seed=seed, graphs=True)
    assert replayed.graphs and replayed.replay_s.size == replayed.rounds - 1
    assert replayed.tokens == eager.tokens
    ref = reference_matrix(eager.tokens, n)
    trees = []
    for graphs, stream in ((False, 0), (True, 0), (True, cuda.stream())):
        drafter = OracleDrafter(ref, config.vocab_size, 15, accuracy=0.8, entropy=0.5, seed=seed)
        tree = generate_ddtree(model, drafter, prompts, budget=32, block_size=16, max_new_tokens=n,
                               temperature=temperature, seed=seed, stream=stream, graphs=graphs)
        assert tree.tokens == eager.tokens and tree.graphs is graphs
        check_statistics(tree, 16)
        trees.append(tree)
    for tree in trees[1:]:
        np.testing.assert_array_equal(tree.acceptance, trees[0].acceptance)
