"""The DFlash drafter on the GPU (spec §2): the Drafter protocol of ``engine/drafters.py``, FP32.

Semantics are ``reference/dflash.py`` (``draft_forward`` driven by ``DraftSession``): a request's
context rows (target features at the ``target_layer_ids`` layers) become, through
``c = RMSNorm(W_fc · features)``, K / V rows of every draft layer's cache; each round drafts the
block ``[bonus, mask × L]`` at ``start`` non-causally over [cached context | block] and reads the
target's lm_head on the last L rows.

Device state (allocated once by the constructor, at capacity; nothing is allocated or read back
by ``begin`` / ``draft`` / ``commit``, so a round can be captured in a CUDA graph):

- per draft layer, the context cache K / V ``[n_layers, bs, S, Hkv, hd]`` and ``cache_lens``
  int32 [bs] (the context rows cached = the request's committed length);
- the pending context ``[bs, b, F]`` and ``pending_counts`` int32 [bs]: ``commit`` gathers the
  verify features of the accepted node indices there (spec §1.6); the next ``draft`` ingests them
  at positions ``cache_lens ..`` before drafting (the official order), so block rows are never
  cached and nothing needs cropping.

Launches per ``draft``: 4 to ingest the pending context (W_fc; RMSNorm; one product for the K / V
of ALL layers, since they depend only on c; k_norm + RoPE + cache write for all layers), one
length update, the block embedding, 7 per layer (q and k|v projections with the input-norm
prologue, q/k norm + RoPE, attention, o_proj + residual, gate|up with the post-norm prologue,
down with the SwiGLU prologue + residual), then a gather of rows 1..L and the lm_head with the
final-norm prologue. Every product goes through ``kernels.linear`` (batch-invariant) and every
other kernel works per request, so a request's logits are bit-identical whatever else is in the
batch.

Device guards: a ``start`` that disagrees with the drafter's context length, a context over the
cache capacity or a bad accepted index give NaN logits for that request, never silent garbage.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from numba import cuda

from ddtree_numba.config import ModelConfig
from ddtree_numba.kernels import draft_attention as da
from ddtree_numba.kernels._args import as_kernel_array, check_array, host_values, is_c_contiguous
from ddtree_numba.kernels.linear import linear
from ddtree_numba.kernels.model_ops import rms_norm
from reference._checks import require_int
from reference.dflash import PRESETS, DFlashConfig, check_weights, init_weights, rope_cos_sin

__all__ = ["DFlashDrafter", "device_layouts"]


def device_layouts(config: DFlashConfig, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Host float32 arrays in the kernels' layouts (fused where one launch reads several matrices).

    Returns a dict: ``fc`` [D, F], ``hidden_norm`` [D], ``kv_all`` [n_layers · 2 · Hkv · hd, D]
    (layer l's rows: k_proj then v_proj, so one product gives the context K / V of every layer),
    ``k_norm`` [n_layers, hd], and per layer (leading axis n_layers): ``in_norm`` [D], ``q`` [H·hd, D],
    ``q_norm`` [hd], ``o`` [D, H·hd], ``post_norm`` [D], ``gate_up`` [2I, D] (gate rows then up rows,
    the SwiGLU prologue's order), ``down`` [D, I]; ``final_norm`` [D].
    """
    check_weights(weights, config)

    def f32(name: str) -> np.ndarray:
        return np.ascontiguousarray(weights[name], dtype=np.float32)

    layers = [f"layers.{i}." for i in range(config.n_layers)]
    return {
        "fc": f32("fc.weight"),
        "hidden_norm": f32("hidden_norm.weight"),
        "kv_all": np.concatenate([np.concatenate([f32(f"{p}self_attn.k_proj.weight"),
                                                  f32(f"{p}self_attn.v_proj.weight")]) for p in layers]),
        "k_norm": np.stack([f32(f"{p}self_attn.k_norm.weight") for p in layers]),
        "in_norm": np.stack([f32(f"{p}input_layernorm.weight") for p in layers]),
        "q": np.stack([f32(f"{p}self_attn.q_proj.weight") for p in layers]),
        "q_norm": np.stack([f32(f"{p}self_attn.q_norm.weight") for p in layers]),
        "o": np.stack([f32(f"{p}self_attn.o_proj.weight") for p in layers]),
        "post_norm": np.stack([f32(f"{p}post_attention_layernorm.weight") for p in layers]),
        "gate_up": np.stack([np.concatenate([f32(f"{p}mlp.gate_proj.weight"), f32(f"{p}mlp.up_proj.weight")])
                             for p in layers]),
        "down": np.stack([f32(f"{p}mlp.down_proj.weight") for p in layers]),
        "final_norm": f32("norm.weight"),
    }


def _device_table(arr: Any, name: str, hidden: int, vocab: int | None = None) -> Any:
    """A float32 C-contiguous [V, hidden] device array, V >= 1 (== ``vocab`` if given); errors name ``name``."""
    if isinstance(arr, np.ndarray):
        raise TypeError(f"{name} must be a device array (the target's, shared), got a NumPy array")
    arr = as_kernel_array(arr, name)
    if np.dtype(arr.dtype) != np.float32:
        raise TypeError(f"{name} must have dtype float32, got {np.dtype(arr.dtype).name}")
    rows = arr.shape[0] if vocab is None and len(arr.shape) == 2 else vocab
    if len(arr.shape) != 2 or tuple(arr.shape) != (rows, hidden) or rows < 1:
        raise ValueError(f"{name} must have shape ({'V' if vocab is None else vocab}, {hidden}), "
                         f"got {tuple(arr.shape)}")
    if not is_c_contiguous(arr):
        raise ValueError(f"{name} must be C-contiguous")
    return arr


class DFlashDrafter:
    """DFlash drafter for a batch of requests (the ``Drafter`` protocol of ``engine/drafters.py``).

    Args:
        config: the drafter.
        weights: its parameters (``reference.dflash.parameter_shapes`` names), any float dtype.
        embed, lm_head: the target's ``embed_tokens`` and ``lm_head`` float32 [V, D] DEVICE arrays
            (shared, not copied; ``TargetModel.weights.embed`` / ``.lm_head``).
        batch_size: requests (bs).
        kv_capacity: S, context rows per request (the longest committed length).
        prompt_capacity: P, the most feature rows ``begin`` takes per request (the target's
            ``max_rows`` when its prefill features are passed straight in).
        stream: stream of the weight uploads.

    Attributes:
        horizon: L = block_size - 1; feature_layers: the config's ``target_layer_ids``.
        cache_lens: int32 [bs] device, context rows cached per request (-1: poisoned by a bad input).
    """

    def __init__(self, config: DFlashConfig, weights: Mapping[str, np.ndarray], *, embed: Any, lm_head: Any,
                 batch_size: int, kv_capacity: int, prompt_capacity: int, stream: Any = 0) -> None:
        if not isinstance(config, DFlashConfig):
            raise TypeError(f"config must be a DFlashConfig, got {type(config).__name__}")
        self.config = config
        self.batch_size = require_int(batch_size, "batch_size", 1)
        self.kv_capacity = require_int(kv_capacity, "kv_capacity", 1)
        self.prompt_capacity = require_int(prompt_capacity, "prompt_capacity", 1)
        d = config.hidden_size
        self.embed = _device_table(embed, "embed", d)
        vocab = self.embed.shape[0]
        self.lm_head = _device_table(lm_head, "lm_head", d, vocab)
        if config.mask_token_id >= vocab:
            raise ValueError(f"config: mask_token_id {config.mask_token_id} >= vocab size {vocab}")
        self.vocab_size = vocab
        self.horizon = config.horizon
        self.feature_layers = config.target_layer_ids
        self.eps = config.rms_norm_eps

        host = device_layouts(config, weights)
        self.w = {name: cuda.to_device(arr, stream=stream) for name, arr in host.items()}
        kv_rows = 2 * config.n_kv_heads * config.head_dim  # rows of kv_all per layer
        self.kv_per_layer = [self.w["kv_all"][i * kv_rows:(i + 1) * kv_rows] for i in range(config.n_layers)]
        cos, sin = rope_cos_sin(config, np.arange(self.kv_capacity + config.block_size))  # [S + b, hd / 2]
        self.cos = cuda.to_device(cos.astype(np.float32), stream=stream)
        self.sin = cuda.to_device(sin.astype(np.float32), stream=stream)
        self._allocate(stream)

    def _allocate(self, stream: Any) -> None:
        """Every buffer, once, at capacity."""
        c, bs, s = self.config, self.batch_size, self.kv_capacity
        b, d, f, hd = c.block_size, c.hidden_size, c.feature_dim, c.head_dim
        hkv, h, n_l = c.n_kv_heads, c.n_heads, c.n_layers

        def zeros(shape: tuple[int, ...], dtype: type = np.float32) -> Any:
            return cuda.to_device(np.zeros(shape, dtype=dtype), stream=stream)

        self.cache_k = zeros((n_l, bs, s, hkv, hd))
        self.cache_v = zeros((n_l, bs, s, hkv, hd))
        self.cache_lens = zeros((bs,), np.int32)
        self.pending_counts = zeros((bs,), np.int32)
        self._zeros = zeros((bs,), np.int32)
        self.pending = zeros((bs, b, f))
        # Context workspace, flat so that the round (b rows per request) and begin (P rows) use prefixes.
        rows = bs * max(b, self.prompt_capacity)
        self._c_raw = zeros((rows * d,))
        self._c = zeros((rows * d,))
        self._kv_ctx = zeros((rows * n_l * 2 * hkv * hd,))
        # Block activations.
        self.h = zeros((bs, b, d))
        self.q = zeros((bs, b, h, hd))
        self.kv_block = zeros((bs, b, 2, hkv, hd))
        self.attn = zeros((bs, b, h, hd))
        self.gate_up = zeros((bs * b, 2 * c.intermediate))
        self.h_last = zeros((bs, self.horizon, d))
        self.logits = zeros((bs, self.horizon, self.vocab_size))
        self._last_index = cuda.to_device(np.tile(np.arange(1, b, dtype=np.int32), (bs, 1)), stream=stream)
        self._last_counts = cuda.to_device(np.full(bs, self.horizon, np.int32), stream=stream)
        self._scratch_counts = zeros((bs,), np.int32)
        self.attention_plan = da.plan(bs, b, h, hkv, hd, s)
        self._cache_views = [(self.cache_k[i], self.cache_v[i]) for i in range(n_l)]
        self._round_ctx = self._context_views(b)
        self._prompt_ctx = self._context_views(self.prompt_capacity)

    def _context_views(self, rows: int) -> tuple[Any, Any, Any]:
        """(c_raw [bs·rows, D], c [bs·rows, D], kv_ctx [bs, rows, n_layers, 2, Hkv, hd]) over the workspace."""
        c, bs = self.config, self.batch_size
        d, m = c.hidden_size, bs * rows
        kv_shape = (bs, rows, c.n_layers, 2, c.n_kv_heads, c.head_dim)
        kv_size = int(np.prod(kv_shape))
        return (self._c_raw[:m * d].reshape(m, d), self._c[:m * d].reshape(m, d),
                self._kv_ctx[:kv_size].reshape(*kv_shape))

    # ------------------------------------------------------------------------- construction helper

    @classmethod
    def random(cls, target_config: ModelConfig, target_model: Any, batch_size: int, seed: int, *,
               preset: str | None = None, kv_capacity: int | None = None, prompt_capacity: int | None = None,
               stream: Any = 0) -> DFlashDrafter:
        """A drafter with seeded random weights sharing ``target_model``'s embedding and lm_head.

        Args:
            target_config: the target's config; ``preset`` None picks the DFlash preset built for
                it (``dflash-tiny`` for ``tiny``, ``dflash-small`` for ``small``: same hidden size
                and layer count).
            target_model: a ``TargetModel`` capturing exactly the preset's ``target_layer_ids``.
            batch_size, seed: requests; weight seed (>= 0).
            kv_capacity, prompt_capacity: default the target's ``kv_capacity`` and ``max_rows``.
        """
        if not isinstance(target_config, ModelConfig):
            raise TypeError(f"target_config must be a ModelConfig, got {type(target_config).__name__}")
        if preset is None:
            fits = [name for name in PRESETS if DFlashConfig.from_name(name).hidden_size == target_config.hidden_size
                    and DFlashConfig.from_name(name).n_target_layers == target_config.n_layers]
            if not fits:
                raise ValueError(f"preset: no DFlash preset fits a target with hidden_size {target_config.hidden_size} "
                                 f"and {target_config.n_layers} layers; pass one of {list(PRESETS)}")
            preset = fits[0]
        config = DFlashConfig.from_name(preset)
        config.check_target(target_config)
        captured = tuple(getattr(target_model, "capture_layers", ()))
        if captured != config.target_layer_ids:
            raise ValueError(f"target_model must capture layers {config.target_layer_ids} (the drafter's "
                             f"target_layer_ids), got {captured}")
        weights = init_weights(config, seed)
        return cls(config, weights, embed=target_model.weights.embed, lm_head=target_model.weights.lm_head,
                   batch_size=batch_size,
                   kv_capacity=target_model.kv_capacity if kv_capacity is None else kv_capacity,
                   prompt_capacity=target_model.max_rows if prompt_capacity is None else prompt_capacity,
                   stream=stream)

    # ------------------------------------------------------------------------- protocol

    def begin(self, features: Any, prompt_lens: Any, stream: Any = 0) -> None:
        """Take the prompt context: features float32 [bs, P, F] (P <= prompt_capacity; rows >=
        prompt_lens[b] are padding), prompt_lens int32 [bs] in [1, min(P, S)]. Resets the request
        state: the cache holds the prompt's context rows at positions 0 .. prompt_lens[b] - 1."""
        c, bs = self.config, self.batch_size
        features = check_array(features, "features", np.float32, 3)
        n_rows = features.shape[1]
        if features.shape[0] != bs or features.shape[2] != c.feature_dim or not 1 <= n_rows <= self.prompt_capacity:
            raise ValueError(f"features must have shape ({bs}, P, {c.feature_dim}) with 1 <= P <= "
                             f"{self.prompt_capacity}, got {tuple(features.shape)}")
        prompt_lens = check_array(prompt_lens, "prompt_lens", np.int32, 1)
        if tuple(prompt_lens.shape) != (bs,):
            raise ValueError(f"prompt_lens must have shape ({bs},), got {tuple(prompt_lens.shape)}")
        lens = host_values(prompt_lens)
        if lens is not None and np.any((lens < 1) | (lens > min(n_rows, self.kv_capacity))):
            raise ValueError(f"prompt_lens must lie in [1, {min(n_rows, self.kv_capacity)}]")
        views = self._context_views(n_rows) if n_rows != self.prompt_capacity else self._prompt_ctx
        self._ingest(features.reshape(bs * n_rows, c.feature_dim), views, self._zeros, prompt_lens, stream)
        # A device length past the feature rows or the cache poisons the request (NaN drafts).
        da.context_lengths(self.cache_lens, self._zeros, prompt_lens, min(n_rows, self.kv_capacity), clear=False,
                           stream=stream)
        da.context_lengths(self.pending_counts, self._zeros, self._zeros, self.kv_capacity, clear=False,
                           stream=stream)

    def draft(self, bonus: Any, start: Any, stream: Any = 0) -> Any:
        """Draft logits float32 [bs, L, V] (the drafter's buffer) for positions start + 1 .. start + L.

        bonus: int32 [bs], the round's root token; start: int32 [bs], the committed length, which
        must equal the context ingested so far (a request where it does not gets NaN logits).
        """
        c, bs = self.config, self.batch_size
        bonus = check_array(bonus, "bonus", np.int32, 1)
        start = check_array(start, "start", np.int32, 1)
        for name, arr in (("bonus", bonus), ("start", start)):
            if tuple(arr.shape) != (bs,):
                raise ValueError(f"{name} must have shape ({bs},), got {tuple(arr.shape)}")
        b_host, s_host = host_values(bonus), host_values(start)
        if b_host is not None and np.any((b_host < 0) | (b_host >= self.vocab_size)):
            raise ValueError(f"bonus must lie in [0, {self.vocab_size})")
        if s_host is not None and np.any((s_host < 0) | (s_host > self.kv_capacity)):
            raise ValueError(f"start must lie in [0, {self.kv_capacity}]")

        self._ingest(self.pending.reshape(bs * c.block_size, c.feature_dim), self._round_ctx, self.cache_lens,
                     self.pending_counts, stream)
        da.context_lengths(self.cache_lens, self.cache_lens, self.pending_counts, self.kv_capacity, clear=True,
                           stream=stream)
        da.block_embed(self.embed, bonus, start, self.cache_lens, c.mask_token_id, self.h, stream=stream)
        m = bs * c.block_size
        h2d = self.h.reshape(m, c.hidden_size)
        q2d = self.q.reshape(m, c.n_heads * c.head_dim)
        kv2d = self.kv_block.reshape(m, 2 * c.n_kv_heads * c.head_dim)
        attn2d = self.attn.reshape(m, c.n_heads * c.head_dim)
        w = self.w
        for layer in range(c.n_layers):
            linear(h2d, w["q"][layer], q2d, norm_weight=w["in_norm"][layer], eps=self.eps, stream=stream)
            linear(h2d, self.kv_per_layer[layer], kv2d, norm_weight=w["in_norm"][layer], eps=self.eps,
                   stream=stream)
            da.norm_rope(self.q, self.kv_block, w["q_norm"][layer], w["k_norm"][layer], self.cos, self.sin, start,
                         self.eps, stream=stream)
            cache_k, cache_v = self._cache_views[layer]
            da.run(self.attention_plan, self.q, self.kv_block, cache_k, cache_v, self.cache_lens, c.softmax_scale,
                   self.attn, stream=stream)
            linear(attn2d, w["o"][layer], h2d, residual=h2d, stream=stream)
            linear(h2d, w["gate_up"][layer], self.gate_up, norm_weight=w["post_norm"][layer], eps=self.eps,
                   stream=stream)
            linear(self.gate_up, w["down"][layer], h2d, swiglu=True, residual=h2d, stream=stream)
        da.gather_rows(self.h, self._last_index, self._last_counts, self.h_last, self._scratch_counts, stream=stream)
        linear(self.h_last.reshape(bs * self.horizon, c.hidden_size), self.lm_head,
               self.logits.reshape(bs * self.horizon, self.vocab_size), norm_weight=w["final_norm"], eps=self.eps,
               stream=stream)
        return self.logits

    def commit(self, features: Any, accepted: Any, lengths: Any, stream: Any = 0) -> None:
        """Keep the verify features of the accepted nodes as the next draft's context (spec §1.6).

        features: float32 [bs, N, F]; accepted: int32 [bs, W] node indices (root first, -1 padded);
        lengths: int32 [bs] in [1, min(W, block_size)] (a bad device length or index poisons the
        request: its next draft gives NaN logits).
        """
        c, bs = self.config, self.batch_size
        features = check_array(features, "features", np.float32, 3)
        if features.shape[0] != bs or features.shape[2] != c.feature_dim or features.shape[1] < 1:
            raise ValueError(f"features must have shape ({bs}, N, {c.feature_dim}) with N >= 1, "
                             f"got {tuple(features.shape)}")
        accepted = check_array(accepted, "accepted", np.int32, 2)
        lengths = check_array(lengths, "lengths", np.int32, 1)
        n_host = host_values(lengths)
        if n_host is not None and n_host.shape == (bs,) and np.any(n_host < 1):
            raise ValueError("lengths must be >= 1 (the root is always accepted)")
        a_host = host_values(accepted)
        if a_host is not None and n_host is not None and a_host.shape[0] == bs and n_host.shape == (bs,):
            for b in range(bs):
                acc = a_host[b, :min(n_host[b], a_host.shape[1])].astype(np.int64)
                if acc.size and (acc[0] != 0 or np.any(np.diff(acc) <= 0)):
                    raise ValueError(f"accepted[{b}] must start at 0 (the root) and strictly increase")
        da.gather_rows(features, accepted, lengths, self.pending, self.pending_counts, stream=stream)

    # ------------------------------------------------------------------------- internals

    def _ingest(self, rows: Any, views: tuple[Any, Any, Any], base: Any, counts: Any, stream: Any) -> None:
        """Context rows [bs·R, F] -> c -> K / V of every layer -> cache rows base[b] + i, i < counts[b]."""
        c_raw, c_norm, kv_ctx = views
        n_l, hkv, hd = self.config.n_layers, self.config.n_kv_heads, self.config.head_dim
        linear(rows, self.w["fc"], c_raw, stream=stream)
        rms_norm(c_raw, self.w["hidden_norm"], self.eps, c_norm, stream=stream)
        linear(c_norm, self.w["kv_all"], kv_ctx.reshape(c_norm.shape[0], n_l * 2 * hkv * hd), stream=stream)
        da.context_kv_write(kv_ctx, self.w["k_norm"], self.cos, self.sin, base, counts, self.cache_k, self.cache_v,
                            self.eps, stream=stream)
