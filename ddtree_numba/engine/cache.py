"""The target's latent KV cache on the device: per layer ``latent [bs, S, C]`` and ``k_rope [bs, S, R]``.

A cache row is what MLA attends to in absorbed form (limits §2): the kv-normed latent (also the
value) and the RoPE'd shared key, ``C + R`` = 576 floats per token and layer for Kimi K2. Request
``b`` owns rows ``[0, S)`` of its slice; ``past_lens[b]`` (device int32) counts its committed rows.
A forward writes its new rows at ``past_lens[b] + i`` without advancing ``past_lens``: the caller
either advances it (:meth:`KVCache.advance`, prefill / AR step) or compacts the accepted tree rows
(``ddtree_numba.kernels.compact`` over :meth:`KVCache.stacked`, or :meth:`KVCache.buffers`, spec §1.5).

Each layer's buffers are one :class:`LayerKV` object, what the layer's kernels take. They are
views of two arrays holding every layer (so all layers live on one device), latents
[n_layers, bs, S, C] and rope keys [n_layers, bs, S, R] (:meth:`KVCache.stacked`), so a round's
compaction is two launches however many layers there are. A layer's view starts l * bs * S * C
floats in, a multiple of 16 bytes when C % 4 == 0 (R likewise): the attention kernels' float4
loads, used only at such dims (C = 512, R = 64), need that, and ``verify_attention.run`` checks it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda, int32

from ddtree_numba.config import ModelConfig
from ddtree_numba.kernels._args import check_array, check_shape, host_values
from ddtree_numba.kernels.pdl import pdl_begin
from ddtree_numba.kernels.registry import register
from sim.launch import launch

__all__ = ["ADVANCE_THREADS", "KVCache", "LayerKV"]

ADVANCE_THREADS = 32  # one thread per request; batches are small


@cuda.jit
def _advance_kernel(past_lens, lengths):
    """past_lens[b] += lengths[b] for every request b (int32 [bs] each)."""
    pdl_begin()  # PDL: wait for the previous kernel, then let the next one launch
    b = cuda.grid(1)
    if b < past_lens.shape[0]:
        past_lens[b] += lengths[b]


register("engine_advance_past_lens", _advance_kernel, [(int32[::1], int32[::1])],
         "KV cache: past_lens[b] += lengths[b] (device-side commit of new rows)", block_threads=ADVANCE_THREADS)


@dataclass(frozen=True)
class LayerKV:
    """One layer's cache (float32, C-contiguous)."""

    latent: Any  # [bs, S, C] kv_a_layernorm(c_kv): keys (with w_uk absorbed) and values
    k_rope: Any  # [bs, S, R] RoPE'd shared key

    def flat(self) -> tuple[Any, Any]:
        """Views ``[bs * S, C]`` and ``[bs * S, R]``: the flat rows ``mla_kv_write`` indexes."""
        bs, s, c = self.latent.shape
        return self.latent.reshape(bs * s, c), self.k_rope.reshape(bs * s, self.k_rope.shape[2])


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


class KVCache:
    """Per-layer latent caches of ``batch_size`` requests with ``capacity`` rows each, zero-filled,
    and ``past_lens`` (device int32 [bs], zero). Everything is allocated here, once: one latent and
    one rope array for all layers, which ``layers`` views layer by layer."""

    def __init__(self, config: ModelConfig, batch_size: int, capacity: int, *, stream: Any = 0) -> None:
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        self.config = config
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.capacity = _positive_int(capacity, "capacity")
        bs, s, n_layers = self.batch_size, self.capacity, config.n_layers
        self._latents = cuda.to_device(np.zeros((n_layers, bs, s, config.kv_lora_rank), np.float32),
                                       stream=stream)  # [L, bs, S, C]
        self._ropes = cuda.to_device(np.zeros((n_layers, bs, s, config.qk_rope_dim), np.float32),
                                     stream=stream)  # [L, bs, S, R]
        self.layers: tuple[LayerKV, ...] = tuple(
            LayerKV(latent=self._latents[i], k_rope=self._ropes[i]) for i in range(n_layers))
        self.past_lens = cuda.to_device(np.zeros(bs, np.int32), stream=stream)  # [bs]
        # Keys per attention segment of the models that decode this cache (numerics: they must
        # agree); set by the first TargetModel built on it, checked by the next ones.
        self.attention_split: int | None = None
        self.products: str | None = None      # the dense products' kernels (TargetModel's products), likewise

    def stacked(self) -> tuple[Any, Any]:
        """The arrays every layer's buffers view: latents [n_layers, bs, S, C] and rope keys
        [n_layers, bs, S, R], e.g. for ``kernels.compact.plan_compaction(..., layered=True)``."""
        return self._latents, self._ropes

    def buffers(self) -> list[Any]:
        """Every cache buffer ([bs, S, ...] each: latent then k_rope, per layer), e.g. for
        ``kernels.compact.plan_compaction`` (one launch per buffer; :meth:`stacked` takes two)."""
        return [buf for layer in self.layers for buf in (layer.latent, layer.k_rope)]

    def set_past_lens(self, values: np.ndarray, *, stream: Any = 0) -> None:
        """Overwrite ``past_lens`` from host ints [bs] in [0, capacity] (setup, not the hot path)."""
        arr = np.asarray(values)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"values must be integers, got {arr.dtype}")
        if arr.shape != (self.batch_size,):
            raise ValueError(f"values must have shape ({self.batch_size},), got {arr.shape}")
        if np.any(arr < 0) or np.any(arr > self.capacity):
            raise ValueError(f"values must lie in [0, {self.capacity}]")
        self.past_lens.copy_to_device(arr.astype(np.int32), stream=stream)

    def read_past_lens(self, *, stream: Any = 0) -> np.ndarray:
        """``past_lens`` copied to the host (synchronises; for set-up, stats and tests)."""
        return self.past_lens.copy_to_host(stream=stream)

    def advance(self, lengths: Any, *, stream: Any = 0) -> None:
        """``past_lens += lengths`` on the device (int32 [bs], NumPy or device; host values must be
        >= 0). No host copy, graph-capturable."""
        lengths = check_array(lengths, "lengths", (np.int32,), 1)
        check_shape(lengths, "lengths", (self.batch_size,))
        host = host_values(lengths)
        if host is not None and np.any(host < 0):
            raise ValueError("lengths must be >= 0")
        launch(_advance_kernel, -(-self.batch_size // ADVANCE_THREADS), ADVANCE_THREADS, stream, 0,
               self.past_lens, lengths)
