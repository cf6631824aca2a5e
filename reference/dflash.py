"""Float64 NumPy reference of the DFlash drafter (spec §2) and its round-to-round context carry (spec §1.6).

The drafter is a small Qwen3-style decoder stack that shares the target's embedding and lm_head
(its ``hidden_size`` is the target's). One call drafts a whole block non-causally:

- **context** ``c = RMSNorm_hidden(W_fc · target_hidden)``: the target's hidden states at the
  ``target_layer_ids`` layers (id ``l`` = output of layer ``l``, hidden-state entry ``l + 1``),
  concatenated ``[C, n_sel · D]``; ``c`` is the same for every draft layer and never normed again;
- **block** ``[bonus, MASK × (b - 1)]`` embedded with the target's embedding, at positions
  ``start .. start + b - 1``;
- **layer**: ``x = RMSNorm_in(h)`` (block rows only); ``Q = RoPE(q_norm(W_q x))`` per head;
  ``K = RoPE(k_norm([W_k c; W_k x]))``, ``V = [W_v c; W_v x]`` (GQA); every block query attends,
  with no mask, to the cached context rows, the new context rows and the whole block
  (scale ``head_dim^-1/2``); ``h += W_o · attn``; ``h += SwiGLU(RMSNorm_post(h))``;
- **output**: final RMSNorm, the target's lm_head on the last ``b - 1`` rows.

The draft KV cache holds context rows only (block rows are never cached): their K / V depend
only on ``c`` and the row's position, so :func:`draft_forward` returns them as the new cache rows.
RoPE is NeoX (Qwen3 ``rotate_half``) with plain ``rope_theta`` frequencies.

Weights use the official DFlash / Qwen3 names without a ``model.`` prefix (``fc.weight``,
``hidden_norm.weight``, ``layers.{i}.self_attn.q_proj.weight``, ..., ``norm.weight``), [out, in]
layouts, seeded init and HDF5 save / load like ``reference/weights.py``. :class:`DraftSession`
drives the drafter over DDTree rounds exactly as the official loop does: prompt features first,
then per round the verify features gathered at the accepted node indices (spec §1.6).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np

from ddtree_numba.config import PRESET_DIR, ModelConfig, fields_from_dict, fields_to_dict, float_field, parse_json
from reference._checks import as_int64, require_array, require_finite, require_int, require_shape
from reference.model import apply_rope, rms_norm, softmax, swiglu_ffn
from reference.weights import (PathLike, check_parameters, check_seed_and_dtype, init_parameter, load_checkpoint,
                               save_checkpoint)

PRESETS = ("dflash-tiny", "dflash-small")


# --------------------------------------------------------------------------- configuration


def default_layer_ids(n_target_layers: int, n_draft_layers: int) -> list[int]:
    """Target layers whose outputs feed the drafter: the official ``build_target_layer_ids`` (spec §2).

    One draft layer reads the middle target layer ``[n_t // 2]``; otherwise ``n_d`` ids spread from
    1 to ``n_t - 3``: ``int(round(1 + i · (n_t - 4) / (n_d - 1)))`` with Python's round-half-to-even.
    E.g. (64, 5) -> [1, 16, 31, 46, 61]; (61, 6) -> [1, 12, 24, 35, 47, 58].
    """
    n_t = require_int(n_target_layers, "n_target_layers", 1)
    n_d = require_int(n_draft_layers, "n_draft_layers", 1)
    if n_d == 1:
        return [n_t // 2]
    return [int(round(1 + i * (n_t - 4) / (n_d - 1))) for i in range(n_d)]


def _fill_layer_ids(values: dict[str, Any]) -> None:
    """A JSON ``target_layer_ids: null`` means :func:`default_layer_ids`."""
    if values["target_layer_ids"] is None:
        values["target_layer_ids"] = default_layer_ids(values["n_target_layers"], values["n_layers"])


@dataclass(frozen=True)
class DFlashConfig:
    """Shape of a DFlash drafter (spec §2); JSON presets in ``data/presets/dflash-*.json``.

    Attributes:
        hidden_size: D, equal to the target's (embedding and lm_head are shared).
        n_layers: draft decoder layers.
        n_heads, n_kv_heads: query and key/value heads (GQA: n_kv_heads divides n_heads).
        head_dim: per-head width (even: NeoX RoPE rotates half-dims).
        intermediate: SwiGLU width.
        block_size: b, rows drafted per call: the bonus plus b - 1 masks; horizon L = b - 1.
        n_target_layers: layers of the target this drafter reads.
        target_layer_ids: target layers whose outputs form the context (distinct, in
            [0, n_target_layers)); a JSON ``null`` means :func:`default_layer_ids`.
        mask_token_id: the token of the b - 1 mask rows (a target vocabulary id).
        rope_theta: RoPE base (NeoX layout, no scaling).
        rms_norm_eps: epsilon of every RMSNorm.
    """

    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    block_size: int
    n_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    notes: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    rope_layout: ClassVar[str] = "neox"  # Qwen3 rotate_half

    def __post_init__(self) -> None:
        ids = self.target_layer_ids
        if isinstance(ids, (list, tuple)):
            object.__setattr__(self, "target_layer_ids", tuple(ids))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError (bad value) or TypeError (bad type) naming the first bad field."""
        for name in ("hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate",
                     "n_target_layers"):
            require_int(getattr(self, name), name, 1)
        require_int(self.block_size, "block_size", 2)
        require_int(self.mask_token_id, "mask_token_id", 0)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads must divide n_heads = {self.n_heads}, got {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (NeoX RoPE rotates half-dims), got {self.head_dim}")
        ids = self.target_layer_ids
        if not isinstance(ids, tuple):
            raise TypeError(f"target_layer_ids must be a list of ints, got {type(ids).__name__}")
        if not ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        for i in ids:
            require_int(i, "target_layer_ids", 0, self.n_target_layers - 1)
        if len(set(ids)) != len(ids):
            raise ValueError(f"target_layer_ids must be distinct, got {list(ids)}")
        float_field("rope_theta", self.rope_theta, 1, strict=True)
        float_field("rms_norm_eps", self.rms_norm_eps, 0, strict=True)

    # ----------------------------------------------------------------------------- derived sizes

    @property
    def horizon(self) -> int:
        """L = block_size - 1 positions drafted per call."""
        return self.block_size - 1

    @property
    def n_selected(self) -> int:
        """Number of target layers in the context."""
        return len(self.target_layer_ids)

    @property
    def feature_dim(self) -> int:
        """Width of one context row: n_selected · hidden_size."""
        return self.n_selected * self.hidden_size

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    @property
    def softmax_scale(self) -> float:
        """head_dim^-1/2."""
        return self.head_dim ** -0.5

    def check_target(self, target: ModelConfig) -> None:
        """Raise ValueError unless this drafter fits ``target`` (hidden size, layer count, mask id)."""
        if not isinstance(target, ModelConfig):
            raise TypeError(f"target must be a ModelConfig, got {type(target).__name__}")
        if target.hidden_size != self.hidden_size:
            raise ValueError(f"target: hidden_size {target.hidden_size} != drafter hidden_size {self.hidden_size}")
        if target.n_layers != self.n_target_layers:
            raise ValueError(f"target: n_layers {target.n_layers} != drafter n_target_layers {self.n_target_layers}")
        if self.mask_token_id >= target.vocab_size:
            raise ValueError(f"target: mask_token_id {self.mask_token_id} >= vocab_size {target.vocab_size}")

    # ----------------------------------------------------------------------------- (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of the fields (notes as ``_notes``)."""
        return fields_to_dict(self, lambda v: list(v) if isinstance(v, tuple) else v)  # target_layer_ids

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DFlashConfig:
        """From field values; ``_``-prefixed keys are comments; ``target_layer_ids: null`` means the default."""
        return fields_from_dict(cls, data, fill=_fill_layer_ids)

    @classmethod
    def from_json(cls, text: str | bytes) -> DFlashConfig:
        return cls.from_dict(parse_json(text))

    @classmethod
    def from_name(cls, name: str) -> DFlashConfig:
        """The preset ``data/presets/<name>.json``: ``dflash-tiny`` (for ``tiny``), ``dflash-small`` (for ``small``)."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        if name not in PRESETS:
            raise ValueError(f"name: no DFlash preset {name!r}; available: {list(PRESETS)}")
        return cls.from_json((PRESET_DIR / f"{name}.json").read_text())


# --------------------------------------------------------------------------- weights


def parameter_shapes(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every drafter parameter's name -> shape, in checkpoint order ([out, in] for linears)."""
    if not isinstance(config, DFlashConfig):
        raise TypeError(f"config must be a DFlashConfig, got {type(config).__name__}")
    d, hd = config.hidden_size, config.head_dim
    q, kv, inter = config.n_heads * hd, config.n_kv_heads * hd, config.intermediate
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (d, config.feature_dim), "hidden_norm.weight": (d,)}
    for i in range(config.n_layers):
        p = f"layers.{i}."
        shapes.update({
            f"{p}input_layernorm.weight": (d,),
            f"{p}self_attn.q_proj.weight": (q, d),
            f"{p}self_attn.k_proj.weight": (kv, d),
            f"{p}self_attn.v_proj.weight": (kv, d),
            f"{p}self_attn.o_proj.weight": (d, q),
            f"{p}self_attn.q_norm.weight": (hd,),
            f"{p}self_attn.k_norm.weight": (hd,),
            f"{p}post_attention_layernorm.weight": (d,),
            f"{p}mlp.gate_proj.weight": (inter, d),
            f"{p}mlp.up_proj.weight": (inter, d),
            f"{p}mlp.down_proj.weight": (d, inter),
        })
    shapes["norm.weight"] = (d,)
    return shapes


def check_weights(weights: Mapping[str, np.ndarray], config: DFlashConfig) -> None:
    """Exactly the parameters of ``config``, floating ndarrays of the right shapes (errors name them)."""
    check_parameters(weights, parameter_shapes(config))


def init_weights(config: DFlashConfig, seed: int, dtype: type = np.float32) -> dict[str, np.ndarray]:
    """Deterministic random drafter weights (see :func:`parameter_shapes`); dtype float32 or float64."""
    if not isinstance(config, DFlashConfig):
        raise TypeError(f"config must be a DFlashConfig, got {type(config).__name__}")
    seed = check_seed_and_dtype(seed, dtype)
    # Scaled like the target's; matrices drawn in float64 then cast (this drafter's stream).
    return {name: init_parameter(name, shape, config.n_layers, seed, dtype, float64_draw=True)
            for name, shape in parameter_shapes(config).items()}


def save_weights(path: PathLike, weights: Mapping[str, np.ndarray], config: DFlashConfig) -> Path:
    """Write ``weights`` and ``config`` (JSON in the root attribute ``config``) to HDF5 atomically.

    Everything is checked first (names, shapes, finite values); on error the old file is untouched.
    """
    return save_checkpoint(path, weights, config, DFlashConfig, parameter_shapes)


def load_weights(path: PathLike) -> tuple[dict[str, np.ndarray], DFlashConfig]:
    """Read a checkpoint written by :func:`save_weights`: (weights in the stored dtype, config)."""
    return load_checkpoint(path, DFlashConfig, parameter_shapes, "drafter")


# --------------------------------------------------------------------------- forward


class LayerKV(NamedTuple):
    """One draft layer's cached context rows (K normed and RoPE'd at the rows' positions)."""

    k: np.ndarray  # [S, n_kv_heads, head_dim] float64
    v: np.ndarray  # [S, n_kv_heads, head_dim] float64


class DraftOutput(NamedTuple):
    """Result of :func:`draft_forward`."""

    logits: np.ndarray  # [b - 1, V] float64: rows 1 .. b - 1 of the block
    new_cache: list[LayerKV]  # per layer, the C new context rows (append with extend_cache)


def empty_cache(config: DFlashConfig) -> list[LayerKV]:
    """A cache with S = 0 rows in every layer."""
    shape = (0, config.n_kv_heads, config.head_dim)
    return [LayerKV(np.zeros(shape), np.zeros(shape)) for _ in range(config.n_layers)]


def extend_cache(cache: Sequence[LayerKV], rows: Sequence[LayerKV]) -> list[LayerKV]:
    """``cache`` with ``rows`` appended per layer."""
    if len(cache) != len(rows):
        raise ValueError(f"rows must have one entry per layer ({len(cache)}), got {len(rows)}")
    return [LayerKV(np.concatenate([c.k, r.k]), np.concatenate([c.v, r.v])) for c, r in zip(cache, rows)]


def rope_cos_sin(config: DFlashConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) float64 [T, head_dim / 2] of plain RoPE at integer ``positions`` [T]."""
    hd = config.head_dim
    inv_freq = 1.0 / float(config.rope_theta) ** (np.arange(0, hd, 2, dtype=np.float64) / hd)  # [hd / 2]
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]  # [T, hd / 2]
    return np.cos(angles), np.sin(angles)


def gqa_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Unmasked grouped-query attention. q [T, H, hd], k / v [S, Hkv, hd] -> [T, H, hd] float64;
    query head h reads key/value head h // (H / Hkv)."""
    group = q.shape[1] // k.shape[1]
    k_h = np.repeat(k, group, axis=1)  # [S, H, hd]
    v_h = np.repeat(v, group, axis=1)
    probs = softmax(scale * np.einsum("thd,shd->hts", q, k_h))  # [H, T, S]
    return np.einsum("hts,shd->thd", probs, v_h)


def _w(weights: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    return np.asarray(weights[name], dtype=np.float64)


def _context_kv(c: np.ndarray, weights: Mapping[str, np.ndarray], prefix: str, config: DFlashConfig,
                cos: np.ndarray, sin: np.ndarray) -> LayerKV:
    """K (k_norm, RoPE) and V of rows c [C, D] for one layer; the same for context and block rows."""
    n, hkv, hd, eps = c.shape[0], config.n_kv_heads, config.head_dim, config.rms_norm_eps
    k = rms_norm((c @ _w(weights, f"{prefix}k_proj.weight").T).reshape(n, hkv, hd),
                 _w(weights, f"{prefix}k_norm.weight"), eps)  # [C, Hkv, hd]
    v = (c @ _w(weights, f"{prefix}v_proj.weight").T).reshape(n, hkv, hd)  # [C, Hkv, hd]
    return LayerKV(apply_rope(k, cos, sin, config.rope_layout), v)


def _check_cache(cache: Sequence[LayerKV] | None, config: DFlashConfig) -> list[LayerKV]:
    """None (empty) or one (k, v) pair [S, Hkv, hd] per layer, the same S everywhere, finite."""
    if cache is None:
        return empty_cache(config)
    if not isinstance(cache, Sequence) or len(cache) != config.n_layers:
        raise ValueError(f"cache must be a sequence of {config.n_layers} (k, v) pairs")
    out, n_rows = [], None
    for i, entry in enumerate(cache):
        if not isinstance(entry, Sequence) or len(entry) != 2:
            raise ValueError(f"cache[{i}] must be a (k, v) pair")
        k = require_array(entry[0], f"cache[{i}].k", "float", ndim=3)
        v = require_array(entry[1], f"cache[{i}].v", "float", ndim=3)
        n_rows = k.shape[0] if n_rows is None else n_rows
        for name, arr in ((f"cache[{i}].k", k), (f"cache[{i}].v", v)):
            require_shape(arr, name, (n_rows, config.n_kv_heads, config.head_dim))
            require_finite(arr, name)
        out.append(LayerKV(k.astype(np.float64), v.astype(np.float64)))
    return out


def _check_ids(arr: Any, name: str, n: int | None, upper: int) -> np.ndarray:
    """int 1-D (length n if given) with values in [0, upper), as int64."""
    arr = require_array(arr, name, "int", ndim=1)
    if n is not None:
        require_shape(arr, name, (n,))
    arr = as_int64(arr, name)
    if np.any(arr < 0) or np.any(arr >= upper):
        raise ValueError(f"{name} must be in [0, {upper})")
    return arr


def _check_table(arr: Any, name: str, config: DFlashConfig) -> np.ndarray:
    """A finite float [V, D] table (target embedding or lm_head)."""
    arr = require_array(arr, name, "float", ndim=2)
    if arr.shape[1] != config.hidden_size or arr.shape[0] < 1:
        raise ValueError(f"{name} must have shape (V, {config.hidden_size}) with V >= 1, got {arr.shape}")
    require_finite(arr, name)
    return arr


def draft_forward(weights: Mapping[str, np.ndarray], config: DFlashConfig, target_embed: np.ndarray,
                  target_lm_head: np.ndarray, context_features: np.ndarray, ctx_positions: np.ndarray,
                  cache: Sequence[LayerKV] | None, block_tokens: np.ndarray,
                  block_positions: np.ndarray) -> DraftOutput:
    """One DFlash call in float64 (spec §2): new context rows, then the block, non-causally.

    Args:
        weights: drafter parameters (:func:`parameter_shapes`), any float dtype.
        config: the drafter.
        target_embed: the target's ``model.embed_tokens.weight`` [V, D].
        target_lm_head: the target's ``lm_head.weight`` [V, D].
        context_features: [C, n_sel · D] target hidden states of the new context rows (C >= 0).
        ctx_positions: int [C] their positions.
        cache: None or per layer (k, v) [S, Hkv, hd] of the cached context rows.
        block_tokens: int [T] (T >= 1; the drafter's block is [bonus, mask × (b - 1)]).
        block_positions: int [T] (start .. start + T - 1 in a DDTree round).

    Returns:
        :class:`DraftOutput`: logits [T - 1, V] of block rows 1 .. T - 1 and, per layer, the C new
        cache rows (every block query attends to the S cached rows, the C new ones and all T block rows).
    """
    if not isinstance(config, DFlashConfig):
        raise TypeError(f"config must be a DFlashConfig, got {type(config).__name__}")
    check_weights(weights, config)
    embed = _check_table(target_embed, "target_embed", config)
    lm_head = _check_table(target_lm_head, "target_lm_head", config)
    feats = require_array(context_features, "context_features", "float", ndim=2)
    if feats.shape[1] != config.feature_dim:
        raise ValueError(f"context_features must have shape (C, {config.feature_dim}), got {feats.shape}")
    require_finite(feats, "context_features")
    n_ctx = feats.shape[0]
    ctx_positions = _check_ids(ctx_positions, "ctx_positions", n_ctx, np.iinfo(np.int32).max)
    cache = _check_cache(cache, config)
    tokens = _check_ids(block_tokens, "block_tokens", None, embed.shape[0])
    if tokens.shape[0] < 1:
        raise ValueError("block_tokens must hold at least one token")
    block_positions = _check_ids(block_positions, "block_positions", tokens.shape[0], np.iinfo(np.int32).max)

    t, h_n, hd, eps = tokens.shape[0], config.n_heads, config.head_dim, config.rms_norm_eps
    c = rms_norm(feats.astype(np.float64) @ _w(weights, "fc.weight").T,
                 _w(weights, "hidden_norm.weight"), eps)  # [C, D]: no further norm on c in the layers
    cos_c, sin_c = rope_cos_sin(config, ctx_positions)  # [C, hd / 2]
    cos_b, sin_b = rope_cos_sin(config, block_positions)  # [T, hd / 2]
    h = embed[tokens].astype(np.float64)  # [T, D]
    new_rows = []
    for layer in range(config.n_layers):
        p = f"layers.{layer}."
        a = f"{p}self_attn."
        x = rms_norm(h, _w(weights, f"{p}input_layernorm.weight"), eps)  # [T, D]
        q = rms_norm((x @ _w(weights, f"{a}q_proj.weight").T).reshape(t, h_n, hd),
                     _w(weights, f"{a}q_norm.weight"), eps)  # [T, H, hd]
        q = apply_rope(q, cos_b, sin_b, config.rope_layout)
        ctx = _context_kv(c, weights, a, config, cos_c, sin_c)  # [C, Hkv, hd] each
        blk = _context_kv(x, weights, a, config, cos_b, sin_b)  # [T, Hkv, hd] each
        k = np.concatenate([cache[layer].k, ctx.k, blk.k])  # [S + C + T, Hkv, hd]
        v = np.concatenate([cache[layer].v, ctx.v, blk.v])
        attn = gqa_attention(q, k, v, config.softmax_scale)  # [T, H, hd]
        h = h + attn.reshape(t, h_n * hd) @ _w(weights, f"{a}o_proj.weight").T
        post = rms_norm(h, _w(weights, f"{p}post_attention_layernorm.weight"), eps)
        h = h + swiglu_ffn(post, _w(weights, f"{p}mlp.gate_proj.weight"), _w(weights, f"{p}mlp.up_proj.weight"),
                           _w(weights, f"{p}mlp.down_proj.weight"))
        new_rows.append(ctx)
    final = rms_norm(h[1:], _w(weights, "norm.weight"), eps)  # [T - 1, D]
    return DraftOutput(logits=final @ lm_head.astype(np.float64).T, new_cache=new_rows)


# --------------------------------------------------------------------------- round driver


class DraftSession:
    """One request's drafter across DDTree rounds, as the official loop drives it (spec §1.1, §1.6).

    ``begin`` takes the prompt's features; each ``draft`` ingests the pending context rows into
    the cache (positions ``cache_len ..``) and drafts the block at ``start`` (which must equal
    ``cache_len + pending rows``: the cache is cropped to ``start``, block rows never cached);
    ``commit`` takes the verify features and keeps the rows of the accepted node indices, the
    next round's context at positions ``start_old .. start_new - 1``.
    """

    def __init__(self, weights: Mapping[str, np.ndarray], config: DFlashConfig, target_embed: np.ndarray,
                 target_lm_head: np.ndarray) -> None:
        if not isinstance(config, DFlashConfig):
            raise TypeError(f"config must be a DFlashConfig, got {type(config).__name__}")
        check_weights(weights, config)
        self.weights, self.config = weights, config
        self.embed = _check_table(target_embed, "target_embed", config)
        self.lm_head = _check_table(target_lm_head, "target_lm_head", config)
        self.cache: list[LayerKV] = empty_cache(config)
        self.pending = np.zeros((0, config.feature_dim))

    @property
    def cache_len(self) -> int:
        """Context rows in the draft KV cache."""
        return self.cache[0].k.shape[0]

    def _features(self, features: Any) -> np.ndarray:
        feats = require_array(features, "features", "float", ndim=2)
        if feats.shape[1] != self.config.feature_dim:
            raise ValueError(f"features must have shape (N, {self.config.feature_dim}), got {feats.shape}")
        return feats.astype(np.float64)

    def begin(self, features: np.ndarray) -> None:
        """Start a request: an empty cache and the prompt's P feature rows [P, n_sel · D] pending."""
        self.cache = empty_cache(self.config)
        self.pending = self._features(features)

    def draft(self, bonus: int, start: int) -> np.ndarray:
        """Logits [L, V] of positions start + 1 .. start + L for the block [bonus, mask × L] at ``start``."""
        bonus = require_int(bonus, "bonus", 0, self.embed.shape[0] - 1)
        start = require_int(start, "start", 0)
        n_ctx = self.pending.shape[0]
        if self.cache_len + n_ctx != start:
            raise ValueError(f"start must equal cached + pending context rows = {self.cache_len + n_ctx}, got {start}")
        b = self.config.block_size
        tokens = np.full(b, self.config.mask_token_id, dtype=np.int64)
        tokens[0] = bonus
        out = draft_forward(self.weights, self.config, self.embed, self.lm_head, self.pending,
                            np.arange(self.cache_len, start), self.cache, tokens, np.arange(start, start + b))
        self.cache = extend_cache(self.cache, out.new_cache)
        self.pending = np.zeros((0, self.config.feature_dim))
        return out.logits

    def commit(self, features: np.ndarray, accepted: np.ndarray) -> None:
        """Keep the verify feature rows [N, n_sel · D] of the accepted node indices (root first, increasing)."""
        feats = self._features(features)
        acc = _check_ids(accepted, "accepted", None, feats.shape[0])
        if acc.shape[0] < 1 or acc[0] != 0 or np.any(np.diff(acc) <= 0):
            raise ValueError("accepted must start at 0 (the root) and strictly increase")
        if acc.shape[0] > self.config.block_size:
            raise ValueError(f"accepted must hold at most block_size = {self.config.block_size} nodes")
        self.pending = feats[acc]
