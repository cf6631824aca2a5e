"""Weights of the MLA + MoE target: Hugging Face names and layouts, seeded init, HDF5 save / load.

Parameter names and layouts are those of DeepSeek-V3 / Kimi K2 checkpoints on Hugging Face
(``modeling_deepseek``): linear weights are ``[out, in]``, so a real checkpoint of this
architecture maps in name for name (its bf16 / fp8 tensors converted to a float dtype first).

File format (HDF5 via h5py): one root dataset per parameter, named exactly as below, and the
:class:`~ddtree_numba.config.ModelConfig` as JSON text in the root attribute ``config``. Nothing
else is needed, so a checkpoint written by hand with h5py loads too.
"""
from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ddtree_numba.atomic import atomic_path
from ddtree_numba.config import ModelConfig
from reference._checks import require_finite, require_int

CONFIG_ATTR = "config"
# Refuse to materialize more than this (8 GB in fp32): kimi-k2's ~1.03e12 parameters never are.
MAX_INIT_PARAMS = 2_000_000_000
NORM_JITTER = 0.1  # norm weights are 1 + N(0, 0.1²), so a dropped norm weight changes the output
BIAS_STD = 0.1  # e_score_correction_bias ~ N(0, 0.1²): comparable to the spread of sigmoid scores
_RESIDUAL_OUT = ("o_proj.weight", "down_proj.weight")  # projections that write into the residual stream

PathLike = str | os.PathLike


def _ffn_shapes(prefix: str, hidden: int, width: int) -> dict[str, tuple[int, ...]]:
    """SwiGLU FFN ``prefix``{gate,up,down}_proj.weight in [out, in] layout."""
    return {
        f"{prefix}gate_proj.weight": (width, hidden),
        f"{prefix}up_proj.weight": (width, hidden),
        f"{prefix}down_proj.weight": (hidden, width),
    }


def _attention_shapes(prefix: str, c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """MLA projections of one layer (``prefix`` = ``model.layers.{i}.self_attn.``)."""
    d, h = c.hidden_size, c.n_heads
    shapes: dict[str, tuple[int, ...]] = {}
    if c.q_lora_rank:
        shapes[f"{prefix}q_a_proj.weight"] = (c.q_lora_rank, d)
        shapes[f"{prefix}q_a_layernorm.weight"] = (c.q_lora_rank,)
        shapes[f"{prefix}q_b_proj.weight"] = (h * c.qk_head_dim, c.q_lora_rank)
    else:
        shapes[f"{prefix}q_proj.weight"] = (h * c.qk_head_dim, d)
    shapes[f"{prefix}kv_a_proj_with_mqa.weight"] = (c.kv_lora_rank + c.qk_rope_dim, d)
    shapes[f"{prefix}kv_a_layernorm.weight"] = (c.kv_lora_rank,)
    shapes[f"{prefix}kv_b_proj.weight"] = (h * (c.qk_nope_dim + c.v_head_dim), c.kv_lora_rank)
    shapes[f"{prefix}o_proj.weight"] = (d, h * c.v_head_dim)
    return shapes


def _mlp_shapes(prefix: str, layer: int, c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Dense FFN or MoE of one layer (``prefix`` = ``model.layers.{i}.mlp.``)."""
    d = c.hidden_size
    if not c.is_moe_layer(layer):
        return _ffn_shapes(prefix, d, c.dense_intermediate)
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}gate.weight": (c.n_routed_experts, d)}
    if c.has_gate_bias:
        shapes[f"{prefix}gate.e_score_correction_bias"] = (c.n_routed_experts,)
    for e in range(c.n_routed_experts):
        shapes.update(_ffn_shapes(f"{prefix}experts.{e}.", d, c.moe_intermediate))
    if c.n_shared_experts:
        shapes.update(_ffn_shapes(f"{prefix}shared_experts.", d, c.n_shared_experts * c.moe_intermediate))
    return shapes


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's HF name -> shape, in checkpoint order (embeddings, layers, norm, lm_head)."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    d = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, d)}
    for i in range(config.n_layers):
        layer = f"model.layers.{i}."
        shapes[f"{layer}input_layernorm.weight"] = (d,)
        shapes.update(_attention_shapes(f"{layer}self_attn.", config))
        shapes[f"{layer}post_attention_layernorm.weight"] = (d,)
        shapes.update(_mlp_shapes(f"{layer}mlp.", i, config))
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (config.vocab_size, d)
    return shapes


def check_parameters(weights: Mapping[str, np.ndarray], expected: Mapping[str, tuple[int, ...]]) -> None:
    """Exactly the parameters ``expected`` (name -> shape), floating ndarrays of those shapes.

    Raises:
        ValueError: a missing, unexpected or wrong-shape parameter (named).
        TypeError: ``weights`` not a mapping, or a parameter not a floating ndarray (named).
    """
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a mapping of name -> ndarray, got {type(weights).__name__}")
    missing = [name for name in expected if name not in weights]
    if missing:
        raise ValueError(f"weights: missing parameter {missing[0]!r} ({len(missing)} missing in all)")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise ValueError(f"weights: unexpected parameter {extra[0]!r} ({len(extra)} unexpected in all)")
    for name, shape in expected.items():
        arr = weights[name]
        if not isinstance(arr, np.ndarray) or arr.dtype.kind != "f":
            kind = arr.dtype if isinstance(arr, np.ndarray) else type(arr).__name__
            raise TypeError(f"weights[{name!r}] must be a floating ndarray, got {kind}")
        if arr.shape != shape:
            raise ValueError(f"weights[{name!r}] must have shape {shape}, got {arr.shape}")


def check_weights(weights: Mapping[str, np.ndarray], config: ModelConfig) -> None:
    """Exactly the parameters of ``config``, floating, with the right shapes (:func:`check_parameters`)."""
    check_parameters(weights, parameter_shapes(config))


def _init_std(name: str, shape: tuple[int, ...], n_layers: int) -> float:
    """Std of a matrix: 1 for embeddings; 1/sqrt(fan_in) otherwise, divided by sqrt(2 · n_layers) on
    projections into the residual stream (GPT-2 style) so the stream stays O(1) through the layers."""
    if name == "model.embed_tokens.weight":
        return 1.0
    std = shape[1] ** -0.5
    if name.endswith(_RESIDUAL_OUT):
        std /= (2 * n_layers) ** 0.5
    return std


def init_parameter(name: str, shape: tuple[int, ...], n_layers: int, seed: int, dtype: type, *,
                   float64_draw: bool = False) -> np.ndarray:
    """One parameter from its own stream, keyed by (seed, crc32(name)): independent of the others' order.

    Norm gains are 1 + N(0, NORM_JITTER²), ``e_score_correction_bias`` N(0, BIAS_STD²), matrices
    N(0, :func:`_init_std`²). Matrices are drawn in ``dtype``, or in float64 then cast where
    ``float64_draw`` (the DFlash drafter's stream, ``reference.dflash``).
    """
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name.endswith("norm.weight"):  # RMSNorm gains: q_a / kv_a / input / post_attention layernorms, model.norm
        return (1.0 + NORM_JITTER * rng.standard_normal(shape)).astype(dtype)
    if name.endswith("e_score_correction_bias"):
        return (BIAS_STD * rng.standard_normal(shape)).astype(dtype)
    draws = rng.standard_normal(shape, dtype=np.float64 if float64_draw else dtype)
    return (_init_std(name, shape, n_layers) * draws).astype(dtype, copy=False)


def check_seed_and_dtype(seed: int, dtype: type) -> int:
    """``seed`` an int >= 0 (returned as int) and ``dtype`` np.float32 or np.float64."""
    seed = require_int(seed, "seed", 0)
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"dtype must be np.float32 or np.float64, got {dtype!r}")
    return seed


def init_weights(config: ModelConfig, seed: int, dtype: type = np.float32) -> dict[str, np.ndarray]:
    """Deterministic random weights with HF names and layouts (see :func:`parameter_shapes`).

    Scaled so activations stay O(1) through the layers and logits have a std of about 1.

    Args:
        config: the model; more than ``MAX_INIT_PARAMS`` parameters (kimi-k2) raises ValueError.
        seed: int >= 0; each parameter is drawn from its own stream keyed by (seed, name).
        dtype: np.float32 (default, what the GPU forward uses) or np.float64.

    Returns:
        dict name -> array of ``dtype``, in checkpoint order.
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    seed = check_seed_and_dtype(seed, dtype)
    total = config.param_count().total
    if total > MAX_INIT_PARAMS:
        raise ValueError(f"config: {total:,} parameters ({total * 4 / 1e9:,.0f} GB in fp32); weights of this size "
                         f"are never materialized (limit {MAX_INIT_PARAMS:,}); use param_count() and the shapes")
    return {name: init_parameter(name, shape, config.n_layers, seed, dtype)
            for name, shape in parameter_shapes(config).items()}


def save_weights(path: PathLike, weights: Mapping[str, np.ndarray], config: ModelConfig) -> Path:
    """Write ``weights`` and ``config`` to an HDF5 checkpoint atomically (temp file, fsync, rename).

    Everything is checked first (:func:`check_weights`, finite values); on any error the old file,
    if any, is untouched and no temp file remains.

    Returns:
        The written path.
    """
    return save_checkpoint(path, weights, config, ModelConfig, parameter_shapes)


def load_weights(path: PathLike) -> tuple[dict[str, np.ndarray], ModelConfig]:
    """Read a checkpoint written by :func:`save_weights` (or by hand in the same format).

    Returns:
        (weights name -> ndarray in the stored dtype, config).

    Raises:
        ValueError: missing / non-HDF5 file, no or bad ``config`` attribute, a non-dataset entry, or a
            missing / unexpected / wrong-shape parameter (named).
        TypeError: a parameter with a non-floating dtype (named).
    """
    return load_checkpoint(path, ModelConfig, parameter_shapes, "model")


def save_checkpoint(path: PathLike, weights: Mapping[str, np.ndarray], config: Any, config_type: type,
                    shapes: Callable[[Any], dict[str, tuple[int, ...]]]) -> Path:
    """Write the parameters ``shapes(config)`` (checked, finite) and ``config.to_json()`` (root
    attribute ``config``) to HDF5 atomically; on any error the old file is untouched."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be str or os.PathLike, got {type(path).__name__}")
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"path: directory {path.parent} does not exist")
    if not isinstance(config, config_type):
        raise TypeError(f"config must be a {config_type.__name__}, got {type(config).__name__}")
    expected = shapes(config)
    check_parameters(weights, expected)
    for name, arr in weights.items():
        require_finite(arr, f"weights[{name!r}]")

    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        f.attrs[CONFIG_ATTR] = config.to_json()
        for name in expected:
            f.create_dataset(name, data=weights[name])
    return path


def load_checkpoint(path: PathLike, config_type: Any, shapes: Callable[[Any], dict[str, tuple[int, ...]]],
                    what: str) -> tuple[dict[str, np.ndarray], Any]:
    """Read a checkpoint written by :func:`save_checkpoint`: (weights in the stored dtype, config
    from ``config_type.from_json``), checked against ``shapes(config)``; ``what`` names the config
    in the missing-attribute error."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be str or os.PathLike, got {type(path).__name__}")
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path: {path} does not exist")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise ValueError(f"path: {path} is not a readable HDF5 file ({exc})") from None
    with f:
        if CONFIG_ATTR not in f.attrs:
            raise ValueError(f"path: {path} has no {CONFIG_ATTR!r} attribute (the {what} config as JSON)")
        text = f.attrs[CONFIG_ATTR]
        config = config_type.from_json(text.decode() if isinstance(text, bytes) else str(text))
        weights: dict[str, np.ndarray] = {}
        for name, item in f.items():
            if not isinstance(item, h5py.Dataset):
                raise ValueError(f"path: {path} entry {name!r} is not a dataset (parameters are root datasets)")
            weights[name] = item[()]
    check_parameters(weights, shapes(config))
    return weights, config
