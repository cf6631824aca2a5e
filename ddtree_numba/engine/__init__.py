"""The DDTree engine: the target model on the GPU (weights, KV cache, forward), drafters, decode loops.

- :mod:`.weights`: :class:`DeviceWeights`, the checkpoint uploaded once in kernel layouts;
- :mod:`.cache`: :class:`KVCache`, per-layer latent caches and the device ``past_lens``;
- :mod:`.model`: :class:`TargetModel`, the FP32 forward for prefill, AR decode and tree verify.

Names resolve lazily (``from ddtree_numba.engine import TargetModel`` imports the kernels only
then), so the weight and cache modules load without the model kernels.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DeviceWeights": "weights",
    "kernel_layouts": "weights",
    "KVCache": "cache",
    "ForwardOut": "model",
    "TargetModel": "model",
    "prefill_visibility": "model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
