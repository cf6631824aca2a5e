"""Float64 NumPy reference forward of the MLA + MoE target (DeepSeek-V3 / Kimi K2 architecture).

Ordered bottom-up like DeepSeek-V3's ``inference/model.py``: norm, RoPE, MLA (naive and absorbed
side by side), gate, MoE, block, forward. Weights are the HF-named dict of ``reference/weights.py``
([out, in] layouts); every computation is float64 whatever the stored dtype.

One forward serves prefill, decode and tree verify: T new tokens at explicit positions attend to
all S cached rows plus the new rows they may see (``visibility`` [T, T]: causal for prefill /
decode, the ancestor-or-self mask for a draft tree, whose positions are past_len + depth,
docs/ARCHITECTURE.md). The cache holds, per layer, the normed latent [S, kv_lora] and the
RoPE'd key [S, qk_rope] (limits §2: 576 values per token and layer for Kimi K2).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from ddtree_numba.config import ROPE_LAYOUTS, ModelConfig
from reference._checks import as_int64, require_array, require_finite, require_shape
from reference.attention import verify_attention
from reference.weights import check_weights

ATTN_IMPLS = ("absorbed", "naive")
GATE_NORM_EPS = 1e-20  # HF noaux_tc: denominator of the top-k renormalisation


class LayerCache(NamedTuple):
    """One layer's KV cache: S rows of the latent cache."""

    latent: np.ndarray  # [S, kv_lora] float64; kv_a_layernorm(c_kv); also the values in absorbed form
    k_rope: np.ndarray  # [S, qk_rope] float64; RoPE'd key part, shared by all heads


class ForwardOutput(NamedTuple):
    """Result of :func:`forward`."""

    logits: np.ndarray  # [T, V] float64
    hidden: np.ndarray  # [n_layers + 1, T, D] float64; entry 0 = embeddings, l + 1 = after layer l
    new_cache: list[LayerCache]  # per layer, the T new rows (append with extend_cache)


# --------------------------------------------------------------------------- cache helpers


def empty_cache(config: ModelConfig) -> list[LayerCache]:
    """A cache with S = 0 rows in every layer."""
    return [LayerCache(np.zeros((0, config.kv_lora_rank)), np.zeros((0, config.qk_rope_dim)))
            for _ in range(config.n_layers)]


def extend_cache(cache: Sequence[LayerCache], rows: Sequence[LayerCache]) -> list[LayerCache]:
    """``cache`` with ``rows`` appended per layer (both from this module, so shapes agree)."""
    if len(cache) != len(rows):
        raise ValueError(f"rows must have one entry per layer ({len(cache)}), got {len(rows)}")
    return [LayerCache(np.concatenate([c.latent, r.latent]), np.concatenate([c.k_rope, r.k_rope]))
            for c, r in zip(cache, rows)]


def causal_visibility(t: int) -> np.ndarray:
    """bool [T, T] lower triangle: new row i sees new rows 0..i."""
    return np.tril(np.ones((t, t), dtype=bool))


# --------------------------------------------------------------------------- elementwise pieces


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x², last axis) + eps) · weight.  x [..., D], weight [D] -> [..., D] float64."""
    x = x.astype(np.float64, copy=False)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def sigmoid(z: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-z) through e^-|z|, which never overflows and keeps full relative precision."""
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0, e) / (1.0 + e)


def silu(z: np.ndarray) -> np.ndarray:
    """z · sigmoid(z)."""
    return z * sigmoid(z)


def softmax(z: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax; entries of -inf get 0 (at least one entry per row must be finite)."""
    e = np.exp(z - np.max(z, axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


# --------------------------------------------------------------------------- RoPE with YaRN


def _yarn_correction_dim(n_rotations: float, dim: int, base: float, original_len: int) -> float:
    """Frequency index whose wavelength fits ``n_rotations`` times into the original context."""
    return dim * math.log(original_len / (n_rotations * 2 * math.pi)) / (2 * math.log(base))


def _yarn_ramp(low: float, high: float, n: int) -> np.ndarray:
    """float64 [n]: 0 up to index ``low``, linear to 1 at ``high`` (a 0.001 gap if they are equal)."""
    if low == high:
        high += 0.001
    return np.clip((np.arange(n) - low) / (high - low), 0.0, 1.0)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """float64 [qk_rope / 2] angular frequencies, YaRN-corrected when ``rope_scaling`` is set.

    HF / DeepSeek-V3 rule: dims rotating more than beta_fast times over the original context keep
    their frequency, those rotating fewer than beta_slow times are divided by ``factor``, linear in
    between (correction range floored / ceiled and clamped to [0, dim - 1]). Like HF, the correction
    applies whenever ``rope_scaling`` is set (DeepSeek's own code: only if max_seq_len > original).
    """
    dim, base = config.qk_rope_dim, float(config.rope_theta)
    freq = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)  # [R / 2]
    rs = config.rope_scaling
    if rs is None:
        return freq
    orig = rs.original_max_position_embeddings
    low = max(math.floor(_yarn_correction_dim(rs.beta_fast, dim, base, orig)), 0)
    high = min(math.ceil(_yarn_correction_dim(rs.beta_slow, dim, base, orig)), dim - 1)
    interpolated = _yarn_ramp(low, high, dim // 2)  # [R / 2]; 1 = fully divided by factor
    return freq / rs.factor * interpolated + freq * (1.0 - interpolated)


def rope_cos_sin(config: ModelConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) float64 [T, qk_rope / 2] at integer ``positions`` [T], times HF's YaRN amplitude
    ``config.rope_mscale`` (1 for DeepSeek-V3 / Kimi K2)."""
    angles = positions.astype(np.float64)[:, None] * rope_inv_freq(config)[None, :]  # [T, R / 2]
    return config.rope_mscale * np.cos(angles), config.rope_mscale * np.sin(angles)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, layout: str) -> np.ndarray:
    """Rotate pairs of the last axis of x [T, ..., R] by the per-row angles of cos / sin [T, R / 2].

    "interleaved" rotates (x[2i], x[2i+1]) (DeepSeek's complex view; HF de-interleaves first, which
    permutes q and k alike and leaves q·k unchanged); "neox" rotates (x[i], x[i + R/2]).
    """
    if layout not in ROPE_LAYOUTS:
        raise ValueError(f"layout must be one of {ROPE_LAYOUTS}, got {layout!r}")
    extra = (1,) * (x.ndim - 2)  # broadcast over the middle (head) axes
    c = cos.reshape(cos.shape[0], *extra, cos.shape[1])  # [T, 1.., R / 2]
    s = sin.reshape(sin.shape[0], *extra, sin.shape[1])
    half = x.shape[-1] // 2
    out = np.empty(x.shape, dtype=np.float64)
    if layout == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]  # [T, .., R / 2] each
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., :half], x[..., half:]
        out[..., :half], out[..., half:] = a * c - b * s, a * s + b * c
    return out


# --------------------------------------------------------------------------- MLA


class MlaInputs(NamedTuple):
    """Per-token MLA projections of T new tokens."""

    q_nope: np.ndarray  # [T, H, qk_nope]
    q_rope: np.ndarray  # [T, H, qk_rope], RoPE'd
    latent: np.ndarray  # [T, kv_lora], normed: the new cache rows
    k_rope: np.ndarray  # [T, qk_rope], RoPE'd: the new cache rows


def _w(weights: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    """A parameter as float64."""
    return np.asarray(weights[name], dtype=np.float64)


def mla_project(x: np.ndarray, weights: Mapping[str, np.ndarray], prefix: str, config: ModelConfig,
                cos: np.ndarray, sin: np.ndarray) -> MlaInputs:
    """Query (low-rank path with its norm, or q_proj) and latent kv projections of x [T, D] (normed).

    ``prefix`` = ``model.layers.{i}.self_attn.``; cos / sin [T, qk_rope / 2] from :func:`rope_cos_sin`.
    """
    t, eps = x.shape[0], config.rms_norm_eps
    if config.q_lora_rank:
        q_low = rms_norm(x @ _w(weights, f"{prefix}q_a_proj.weight").T,
                         _w(weights, f"{prefix}q_a_layernorm.weight"), eps)  # [T, q_lora]
        q = q_low @ _w(weights, f"{prefix}q_b_proj.weight").T  # [T, H * (nope + rope)]
    else:
        q = x @ _w(weights, f"{prefix}q_proj.weight").T  # [T, H * (nope + rope)]
    q = q.reshape(t, config.n_heads, config.qk_head_dim)  # [T, H, nope + rope]
    kv = x @ _w(weights, f"{prefix}kv_a_proj_with_mqa.weight").T  # [T, kv_lora + rope]
    latent = rms_norm(kv[:, :config.kv_lora_rank], _w(weights, f"{prefix}kv_a_layernorm.weight"), eps)
    return MlaInputs(
        q_nope=q[:, :, :config.qk_nope_dim],
        q_rope=apply_rope(q[:, :, config.qk_nope_dim:], cos, sin, config.rope_layout),
        latent=latent,
        k_rope=apply_rope(kv[:, config.kv_lora_rank:], cos, sin, config.rope_layout),
    )


def _split_kv_b(kv_b: np.ndarray, n_heads: int, nope: int) -> tuple[np.ndarray, np.ndarray]:
    """kv_b_proj [H * (nope + v), C] -> (W_UK [H, nope, C], W_UV [H, v, C]) (limits §2)."""
    w = kv_b.reshape(n_heads, -1, kv_b.shape[1])  # [H, nope + v, C]
    return w[:, :nope], w[:, nope:]


def mla_naive(q_nope: np.ndarray, q_rope: np.ndarray, kv_latent: np.ndarray, k_rope: np.ndarray,
              visibility: np.ndarray, kv_b: np.ndarray, scale: float) -> np.ndarray:
    """MLA with keys and values expanded per head from the latent (DeepSeek-V3 attn_impl="naive").

    Args:
        q_nope: [T, H, nope]; q_rope: [T, H, R] (RoPE'd).
        kv_latent: [S + T, C] normed latent rows, cached then new; k_rope: [S + T, R] (RoPE'd).
        visibility: bool [T, T]; new row i sees new row j iff visibility[i, j]; all S cached rows are seen.
        kv_b: kv_b_proj.weight [H * (nope + v), C]; scale: softmax scale.

    Returns:
        float64 [T, H, v] attention output per head (before o_proj).
    """
    t, h, nope = q_nope.shape
    w_uk, w_uv = _split_kv_b(kv_b, h, nope)  # [H, nope, C], [H, v, C]
    k_nope = np.einsum("hdc,sc->shd", w_uk, kv_latent)  # [S + T, H, nope]
    values = np.einsum("hdc,sc->shd", w_uv, kv_latent)  # [S + T, H, v]
    scores = scale * (np.einsum("thd,shd->ths", q_nope, k_nope)
                      + np.einsum("thr,sr->ths", q_rope, k_rope))  # [T, H, S + T]
    n_past = kv_latent.shape[0] - t
    visible = np.concatenate([np.ones((t, n_past), dtype=bool), visibility], axis=1)  # [T, S + T]
    probs = softmax(np.where(visible[:, None, :], scores, -np.inf))  # [T, H, S + T]
    return np.einsum("ths,shd->thd", probs, values)  # [T, H, v]


def mla_absorbed(q_nope: np.ndarray, q_rope: np.ndarray, kv_latent: np.ndarray, k_rope: np.ndarray,
                 visibility: np.ndarray, kv_b: np.ndarray, scale: float) -> np.ndarray:
    """MLA in weight-absorbed form (DeepSeek-V3 attn_impl="absorb", limits §2); same contract as
    :func:`mla_naive`.

    q_nope is absorbed through W_UK into the latent (q̃ = W_UKᵀ q_nope, [T, H, C]); scores are
    q̃·c + q_rope·k_rope; the values are the latent rows themselves (``reference.attention.
    verify_attention``, the oracle of the tree-verify kernel); the latent output goes out through W_UV.
    """
    t, h, nope = q_nope.shape
    w_uk, w_uv = _split_kv_b(kv_b, h, nope)  # [H, nope, C], [H, v, C]
    q_latent = np.einsum("thd,hdc->thc", q_nope, w_uk)  # [T, H, C]
    out_latent, _ = verify_attention(q_latent, q_rope, kv_latent, k_rope, visibility, scale)  # [T, H, C]
    return np.einsum("thc,hdc->thd", out_latent, w_uv)  # [T, H, v]


def attention(x: np.ndarray, weights: Mapping[str, np.ndarray], prefix: str, config: ModelConfig,
              cos: np.ndarray, sin: np.ndarray, cache: LayerCache, visibility: np.ndarray,
              attn: str) -> tuple[np.ndarray, LayerCache]:
    """MLA sublayer on normed x [T, D] over ``cache`` (S rows) + the new rows: ([T, D], new rows)."""
    proj = mla_project(x, weights, prefix, config, cos, sin)
    kv_latent = np.concatenate([cache.latent, proj.latent])  # [S + T, C]
    k_rope = np.concatenate([cache.k_rope, proj.k_rope])  # [S + T, R]
    mla = mla_absorbed if attn == "absorbed" else mla_naive
    heads = mla(proj.q_nope, proj.q_rope, kv_latent, k_rope, visibility,
                _w(weights, f"{prefix}kv_b_proj.weight"), config.softmax_scale)  # [T, H, v]
    out = heads.reshape(x.shape[0], -1) @ _w(weights, f"{prefix}o_proj.weight").T  # [T, D]
    return out, LayerCache(proj.latent, proj.k_rope)


# --------------------------------------------------------------------------- FFN and MoE


def swiglu_ffn(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """down(silu(gate x) · up x).  x [T, D]; w_gate, w_up [I, D]; w_down [D, I] -> [T, D]."""
    return (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def _ffn(x: np.ndarray, weights: Mapping[str, np.ndarray], prefix: str) -> np.ndarray:
    """:func:`swiglu_ffn` with ``prefix``{gate,up,down}_proj.weight."""
    return swiglu_ffn(x, _w(weights, f"{prefix}gate_proj.weight"), _w(weights, f"{prefix}up_proj.weight"),
                      _w(weights, f"{prefix}down_proj.weight"))


def _top_indices(values: np.ndarray, k: int) -> np.ndarray:
    """int64 [T, k]: indices of the k largest per row, ties to the lower index."""
    return np.argsort(-values, axis=-1, kind="stable")[:, :k]


def moe_gate(x: np.ndarray, gate_weight: np.ndarray, bias: np.ndarray | None,
             config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Routing of x [T, D] (normed) to ``n_activated_experts`` of ``n_routed_experts`` (spec §6).

    scores = sigmoid (or softmax) of gate_weight [E, D] · x; the bias [E] (sigmoid only) shifts the
    scores for selection only. With groups, a group's score is the sum of its top-2 biased scores
    (HF noaux_tc; without a bias, its max score), the ``n_limited_groups`` best groups are kept,
    then the top k experts among them. Weights are the unbiased scores of the chosen experts,
    renormalised to sum 1 when ``norm_topk_prob`` and k > 1 (HF rule, +1e-20), then times
    ``route_scale``. Ties (groups and experts) go to the lower index.

    Returns:
        (indices int64 [T, k] in descending biased score, weights float64 [T, k]).
    """
    logits = x @ gate_weight.T  # [T, E]
    scores = sigmoid(logits) if config.score_func == "sigmoid" else softmax(logits)  # [T, E]
    choice = scores if bias is None else scores + bias  # [T, E]
    t, g = x.shape[0], config.n_expert_groups
    if g > 1:
        grouped = choice.reshape(t, g, -1)  # [T, G, E / G]
        group_score = (np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1) if bias is not None
                       else grouped.max(axis=-1))  # [T, G]
        kept = np.zeros((t, g), dtype=bool)
        np.put_along_axis(kept, _top_indices(group_score, config.n_limited_groups), True, axis=1)
        choice = np.where(kept[:, :, None], grouped, -np.inf).reshape(t, -1)  # [T, E]
    indices = _top_indices(choice, config.n_activated_experts)  # [T, k]
    weights = np.take_along_axis(scores, indices, axis=1)  # [T, k], unbiased
    if config.norm_topk_prob and config.n_activated_experts > 1:
        weights = weights / (weights.sum(axis=1, keepdims=True) + GATE_NORM_EPS)
    return indices, weights * config.route_scale


def moe(x: np.ndarray, weights: Mapping[str, np.ndarray], prefix: str, config: ModelConfig) -> np.ndarray:
    """MoE FFN of normed x [T, D]: routed experts (a loop over the experts that got tokens) plus the
    shared expert. ``prefix`` = ``model.layers.{i}.mlp.``.  Returns float64 [T, D]."""
    bias = _w(weights, f"{prefix}gate.e_score_correction_bias") if config.has_gate_bias else None
    indices, gate = moe_gate(x, _w(weights, f"{prefix}gate.weight"), bias, config)  # [T, k] each
    out = np.zeros(x.shape, dtype=np.float64)  # [T, D]
    for e in np.unique(indices):
        rows, slots = np.nonzero(indices == e)  # tokens routed to expert e, and which of their k slots
        out[rows] += gate[rows, slots, None] * _ffn(x[rows], weights, f"{prefix}experts.{e}.")
    if config.n_shared_experts:
        out += _ffn(x, weights, f"{prefix}shared_experts.")
    return out


# --------------------------------------------------------------------------- block and forward


def block(x: np.ndarray, weights: Mapping[str, np.ndarray], layer: int, config: ModelConfig,
          cos: np.ndarray, sin: np.ndarray, cache: LayerCache, visibility: np.ndarray,
          attn: str) -> tuple[np.ndarray, LayerCache]:
    """Pre-norm decoder layer on the residual stream x [T, D]: ([T, D], the layer's new cache rows)."""
    prefix = f"model.layers.{layer}."
    eps = config.rms_norm_eps
    h, rows = attention(rms_norm(x, _w(weights, f"{prefix}input_layernorm.weight"), eps), weights,
                        f"{prefix}self_attn.", config, cos, sin, cache, visibility, attn)
    x = x + h
    normed = rms_norm(x, _w(weights, f"{prefix}post_attention_layernorm.weight"), eps)
    ffn = moe(normed, weights, f"{prefix}mlp.", config) if config.is_moe_layer(layer) else \
        _ffn(normed, weights, f"{prefix}mlp.")
    return x + ffn, rows


def _check_cache(cache: Sequence[LayerCache] | None, config: ModelConfig) -> list[LayerCache]:
    """None (empty) or one (latent [S, kv_lora], k_rope [S, qk_rope]) per layer, the same S everywhere."""
    if cache is None:
        return empty_cache(config)
    if not isinstance(cache, Sequence) or len(cache) != config.n_layers:
        raise ValueError(f"cache must be a sequence of {config.n_layers} (latent, k_rope) pairs")
    checked = []
    n_rows = None
    for layer, entry in enumerate(cache):
        if not isinstance(entry, Sequence) or len(entry) != 2:
            raise ValueError(f"cache[{layer}] must be a (latent, k_rope) pair")
        latent = require_array(entry[0], f"cache[{layer}].latent", "float", ndim=2)
        k_rope = require_array(entry[1], f"cache[{layer}].k_rope", "float", ndim=2)
        n_rows = latent.shape[0] if n_rows is None else n_rows
        require_shape(latent, f"cache[{layer}].latent", (n_rows, config.kv_lora_rank))
        require_shape(k_rope, f"cache[{layer}].k_rope", (n_rows, config.qk_rope_dim))
        require_finite(latent, f"cache[{layer}].latent")
        require_finite(k_rope, f"cache[{layer}].k_rope")
        checked.append(LayerCache(latent.astype(np.float64), k_rope.astype(np.float64)))
    return checked


def _check_ids(arr: np.ndarray, name: str, t: int | None, upper: int) -> np.ndarray:
    """int 1-D [T] (T >= 1, or == t) with values in [0, upper), as int64."""
    arr = require_array(arr, name, "int", ndim=1)
    if t is None and arr.shape[0] == 0:
        raise ValueError(f"{name} must hold at least one token")
    if t is not None:
        require_shape(arr, name, (t,))
    arr = as_int64(arr, name)
    if np.any(arr < 0) or np.any(arr >= upper):
        raise ValueError(f"{name} must be in [0, {upper})")
    return arr


def forward(weights: Mapping[str, np.ndarray], config: ModelConfig, tokens: np.ndarray, positions: np.ndarray,
            cache: Sequence[LayerCache] | None = None, visibility: np.ndarray | None = None,
            *, attn: str = "absorbed") -> ForwardOutput:
    """Target forward of T new tokens over a KV cache of S rows, in float64.

    Args:
        weights: HF-named parameters of ``config`` (``reference.weights``), any float dtype.
        config: the model.
        tokens: int [T], T >= 1, ids in [0, vocab_size).
        positions: int [T] RoPE positions in [0, max_seq_len) (tree nodes: past_len + depth).
        cache: None (S = 0) or per layer (latent [S, kv_lora], k_rope [S, qk_rope]) float.
        visibility: bool [T, T] over the new rows (diagonal true), or None for causal; every new row
            sees all S cached rows.
        attn: "absorbed" (default) or "naive"; equal up to rounding.

    Returns:
        :class:`ForwardOutput` (logits [T, V], hidden [n_layers + 1, T, D], the new cache rows).
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    if attn not in ATTN_IMPLS:
        raise ValueError(f"attn must be one of {ATTN_IMPLS}, got {attn!r}")
    check_weights(weights, config)
    tokens = _check_ids(tokens, "tokens", None, config.vocab_size)
    t = tokens.shape[0]
    positions = _check_ids(positions, "positions", t, config.max_seq_len)
    cache = _check_cache(cache, config)
    if visibility is None:
        visibility = causal_visibility(t)
    visibility = require_array(visibility, "visibility", "bool", ndim=2)
    require_shape(visibility, "visibility", (t, t))
    if not np.all(np.diagonal(visibility)):
        raise ValueError("visibility must include the diagonal (every new row sees itself)")

    cos, sin = rope_cos_sin(config, positions)  # [T, R / 2] each
    x = np.asarray(weights["model.embed_tokens.weight"][tokens], dtype=np.float64)  # [T, D]
    hidden = [x]
    new_rows = []
    for layer in range(config.n_layers):
        x, rows = block(x, weights, layer, config, cos, sin, cache[layer], visibility, attn)
        hidden.append(x)
        new_rows.append(rows)
    final = rms_norm(x, _w(weights, "model.norm.weight"), config.rms_norm_eps)  # [T, D]
    logits = final @ _w(weights, "lm_head.weight").T  # [T, V]
    return ForwardOutput(logits=logits, hidden=np.stack(hidden), new_cache=new_rows)
