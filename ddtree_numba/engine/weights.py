"""Target weights on the device, in the layouts the kernels read (uploaded once per model).

:func:`kernel_layouts` turns the Hugging Face checkpoint dict (``reference/weights.py``, ``[out, in]``
linear weights) into float32 host arrays in kernel layouts, pure NumPy (testable without a GPU);
:meth:`DeviceWeights.from_host` uploads them. Layouts (``ddtree_numba.kernels.linear`` contract):

- ``w_a`` fuses ``q_a_proj`` and ``kv_a_proj_with_mqa`` rows, so ONE linear with the input-RMSNorm
  prologue computes both low-rank projections; without a low-rank q path (``q_lora_rank == 0``)
  it is ``kv_a_proj_with_mqa`` alone and ``w_q`` is ``q_proj`` (its own linear, same prologue);
- ``w_uk_t[h] = W_UK[h]ᵀ`` ([C, nope]) for the absorbed query
  ``q_latent[m, h] = q_nope[m, h] @ W_UK[h]``; ``w_uv[h] = W_UV[h]`` ([v, C]) takes the latent
  attention output to the head's values (limits §2: ``kv_b_proj`` rows of head h are
  ``[W_UK[h] (nope rows) | W_UV[h] (v rows)]``); the model reads both k-major
  (:meth:`DeviceWeights.k_major`, made on first use: ``kernels.absorb``, or with
  ``engine.model.SEGMENT_ABSORBS`` off ``head_linear``, whose many-row kernel reads them too);
- SwiGLU weights stack ``[gate | up]`` rows (``linear(..., swiglu=True)`` reads
  ``silu(x[:, :I]) * x[:, I:]``): the dense FFN, the shared expert, and the routed experts
  stacked ``[E, 2I, D]`` (down projections ``[E, D, I]``); with one shared expert the upload is
  ``[E + 1, 2I, D]`` / ``[E + 1, D, I]``, the shared expert last (:class:`MoeWeights`'
  ``w13_all`` / ``w2_all``, the per-expert arrays views of it).

Each layer's weights are one :class:`LayerWeights` object, so a later version can place layers on
different GPUs by uploading each under its own device context.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numba import cuda

from ddtree_numba.config import ModelConfig
from reference.weights import check_weights

__all__ = [
    "AttentionWeights",
    "DenseFfnWeights",
    "DeviceWeights",
    "LayerWeights",
    "MoeWeights",
    "kernel_layouts",
]


def _f32(arr: np.ndarray) -> np.ndarray:
    """A C-contiguous float32 copy-or-view."""
    return np.ascontiguousarray(arr, dtype=np.float32)


def _swiglu_stack(weights: Mapping[str, np.ndarray], prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """(``[gate | up]`` [2I, D], down [D, I]) of ``prefix``{gate,up,down}_proj.weight."""
    w13 = np.concatenate([weights[f"{prefix}gate_proj.weight"], weights[f"{prefix}up_proj.weight"]])
    return _f32(w13), _f32(weights[f"{prefix}down_proj.weight"])


def _attention_layouts(w: Mapping[str, np.ndarray], p: str, c: ModelConfig) -> dict[str, np.ndarray]:
    """Kernel layouts of one MLA sublayer (``p`` = ``model.layers.{i}.``)."""
    a = f"{p}self_attn."
    kv_a = w[f"{a}kv_a_proj_with_mqa.weight"]  # [C + R, D]
    out = {"attn_norm": _f32(w[f"{p}input_layernorm.weight"]),
           "kv_norm": _f32(w[f"{a}kv_a_layernorm.weight"])}
    if c.q_lora_rank:
        out["w_a"] = _f32(np.concatenate([w[f"{a}q_a_proj.weight"], kv_a]))  # [Qa + C + R, D]
        out["q_norm"] = _f32(w[f"{a}q_a_layernorm.weight"])  # [Qa]
        out["w_q"] = _f32(w[f"{a}q_b_proj.weight"])  # [H * (nope + rope), Qa]
    else:
        out["w_a"] = _f32(kv_a)  # [C + R, D]
        out["w_q"] = _f32(w[f"{a}q_proj.weight"])  # [H * (nope + rope), D]
    kv_b = np.asarray(w[f"{a}kv_b_proj.weight"]).reshape(c.n_heads, c.qk_nope_dim + c.v_head_dim,
                                                         c.kv_lora_rank)  # [H, nope + v, C]
    out["w_uk_t"] = _f32(kv_b[:, :c.qk_nope_dim].transpose(0, 2, 1))  # [H, C, nope]
    out["w_uv"] = _f32(kv_b[:, c.qk_nope_dim:])  # [H, v, C]
    out["w_o"] = _f32(w[f"{a}o_proj.weight"])  # [D, H * v]
    return out


def _ffn_layouts(w: Mapping[str, np.ndarray], p: str, layer: int, c: ModelConfig) -> dict[str, np.ndarray]:
    """Kernel layouts of one FFN sublayer: dense SwiGLU or MoE (``p`` = ``model.layers.{i}.``)."""
    m = f"{p}mlp."
    out = {"ffn_norm": _f32(w[f"{p}post_attention_layernorm.weight"])}
    if not c.is_moe_layer(layer):
        out["w13"], out["w2"] = _swiglu_stack(w, m)  # [2I, D], [D, I]
        return out
    out["gate"] = _f32(w[f"{m}gate.weight"])  # [E, D]
    if c.has_gate_bias:
        out["bias"] = _f32(w[f"{m}gate.e_score_correction_bias"])  # [E]
    experts = [_swiglu_stack(w, f"{m}experts.{e}.") for e in range(c.n_routed_experts)]
    out["w13"] = _f32(np.stack([e[0] for e in experts]))  # [E, 2I, D]
    out["w2"] = _f32(np.stack([e[1] for e in experts]))  # [E, D, I]
    if c.n_shared_experts:
        out["shared_w13"], out["shared_w2"] = _swiglu_stack(w, f"{m}shared_experts.")  # [2Is, D], [D, Is]
    return out


def kernel_layouts(config: ModelConfig, weights: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Float32 host arrays in kernel layouts (checked with ``reference.weights.check_weights``).

    Returns:
        ``{"embed": [V, D], "final_norm": [D], "lm_head": [V, D], "layers": [per-layer dict]}``;
        a layer dict holds ``attn_norm, w_a, q_norm (low-rank q only), w_q, kv_norm, w_uk_t, w_uv,
        w_o, ffn_norm`` and ``w13, w2`` (dense: [2I, D], [D, I]) or ``gate, bias (sigmoid only),
        w13 [E, 2I, D], w2 [E, D, I], shared_w13, shared_w2 (with shared experts)``.

    Raises:
        TypeError / ValueError: ``config`` not a ModelConfig, or the weights do not match it (named).
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    check_weights(weights, config)
    layers = []
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        layers.append({**_attention_layouts(weights, p, config), **_ffn_layouts(weights, p, i, config)})
    return {"embed": _f32(weights["model.embed_tokens.weight"]), "final_norm": _f32(weights["model.norm.weight"]),
            "lm_head": _f32(weights["lm_head.weight"]), "layers": layers}


# --------------------------------------------------------------------------- device objects


@dataclass(frozen=True)
class AttentionWeights:
    """One MLA sublayer on the device (float32, C-contiguous). Qa = q_lora_rank (0: no low-rank q)."""

    norm: Any  # [D] input_layernorm
    w_a: Any  # [Qa + C + R, D]: q_a_proj rows then kv_a_proj_with_mqa rows
    q_norm: Any | None  # [Qa] q_a_layernorm; None without the low-rank q path
    w_q: Any  # [H * (nope + R), Qa] q_b_proj, or [H * (nope + R), D] q_proj
    kv_norm: Any  # [C] kv_a_layernorm
    w_uk_t: Any  # [H, C, nope]: W_UK[h]ᵀ
    w_uv: Any  # [H, v, C]: W_UV[h]
    w_o: Any  # [D, H * v] o_proj


@dataclass(frozen=True)
class DenseFfnWeights:
    """A dense SwiGLU FFN on the device."""

    norm: Any  # [D] post_attention_layernorm
    w13: Any  # [2I, D]: gate rows then up rows
    w2: Any  # [D, I] down_proj


@dataclass(frozen=True)
class MoeWeights:
    """An MoE FFN on the device: router, stacked routed experts, the shared expert."""

    norm: Any  # [D] post_attention_layernorm
    gate: Any  # [E, D] router
    bias: Any | None  # [E] e_score_correction_bias (sigmoid scoring only)
    w13: Any  # [E, 2I, D]: per expert gate rows then up rows
    w2: Any  # [E, D, I]
    shared_w13: Any | None  # [2Is, D], Is = n_shared_experts * moe_intermediate
    shared_w2: Any | None  # [D, Is]
    # With one shared expert (Is = I) the storage is w13_all / w2_all, the routed experts then the
    # shared one, and w13, w2, shared_w13, shared_w2 are views of it: the engine can run the shared
    # expert as expert E of the routed experts' launches (engine.model.FOLD_SHARED_EXPERT).
    w13_all: Any | None = None  # [E + 1, 2I, D]
    w2_all: Any | None = None  # [E + 1, D, I]


def _moe_weights(config: ModelConfig, lw: Mapping[str, np.ndarray], up: Any) -> MoeWeights:
    """One MoE layer uploaded; with one shared expert, its products stacked after the routed
    experts' (one upload each of w13_all, w2_all; the per-expert arrays are views)."""
    common = {"norm": up(lw["ffn_norm"]), "gate": up(lw["gate"]), "bias": up(lw.get("bias"))}
    n_routed = config.n_routed_experts
    if config.n_shared_experts != 1:
        return MoeWeights(**common, w13=up(lw["w13"]), w2=up(lw["w2"]), shared_w13=up(lw.get("shared_w13")),
                          shared_w2=up(lw.get("shared_w2")))
    w13_all = up(np.concatenate([lw["w13"], lw["shared_w13"][None]]))  # [E + 1, 2I, D]
    w2_all = up(np.concatenate([lw["w2"], lw["shared_w2"][None]]))  # [E + 1, D, I]
    return MoeWeights(**common, w13=w13_all[:n_routed], w2=w2_all[:n_routed], shared_w13=w13_all[n_routed],
                      shared_w2=w2_all[n_routed], w13_all=w13_all, w2_all=w2_all)


@dataclass(frozen=True)
class LayerWeights:
    """Everything one decoder layer reads (the unit of placement on a GPU)."""

    index: int
    attn: AttentionWeights
    ffn: DenseFfnWeights | MoeWeights


@dataclass(frozen=True)
class DeviceWeights:
    """The whole target on the device in kernel layouts."""

    config: ModelConfig
    embed: Any  # [V, D] embed_tokens
    layers: tuple[LayerWeights, ...]
    final_norm: Any  # [D] model.norm
    lm_head: Any  # [V, D]
    _split: dict = field(default_factory=dict, compare=False, repr=False)
    _k_major: dict = field(default_factory=dict, compare=False, repr=False)

    def k_major(self, name: str, *, stream: Any = 0) -> tuple[Any, ...]:
        """Per layer, the absorb weight ``w_uk_t`` ([H, C, nope]) or ``w_uv`` ([H, v, C]) k-major,
        ``[H, K, N]`` (``w_kn[h, k, n] = w[h, n, k]``): what ``kernels.absorb`` (and
        ``linear.head_linear``'s thread-serial kernel) reads, coalesced (made on first use, once
        for every model sharing these weights: the AR and tree-verify models)."""
        if name not in ("w_uk_t", "w_uv"):
            raise ValueError(f"name must be 'w_uk_t' or 'w_uv', got {name!r}")
        if name not in self._k_major:
            self._k_major[name] = tuple(
                cuda.to_device(np.ascontiguousarray(getattr(lw.attn, name).copy_to_host().transpose(0, 2, 1)),
                               stream=stream) for lw in self.layers)
        return self._k_major[name]

    def split(self, name: str, *, stream: Any = 0) -> tuple[Any, ...]:
        """Per layer, ``w_o`` (o_proj) or ``w2`` (a dense FFN's down_proj; None in MoE layers)
        re-laid [G, N, K / G] for ``linear_split_k`` (made on first use, once for every model
        sharing these weights: the models of many-row launches)."""
        from ddtree_numba.kernels.linear import split_k_weight

        if name not in ("w_o", "w2"):
            raise ValueError(f"name must be 'w_o' or 'w2', got {name!r}")
        if name not in self._split:
            self._split[name] = tuple(
                split_k_weight(lw.attn.w_o, stream=stream) if name == "w_o"
                else split_k_weight(lw.ffn.w2, stream=stream) if isinstance(lw.ffn, DenseFfnWeights)
                else None for lw in self.layers)
        return self._split[name]

    @classmethod
    def from_host(cls, config: ModelConfig, weights: Mapping[str, np.ndarray], *, stream: Any = 0) -> DeviceWeights:
        """Check ``weights`` (HF names, any float dtype), build :func:`kernel_layouts`, upload once."""
        host = kernel_layouts(config, weights)

        def up(arr: np.ndarray | None) -> Any:
            return None if arr is None else cuda.to_device(arr, stream=stream)

        layers = []
        for i, lw in enumerate(host["layers"]):
            attn = AttentionWeights(norm=up(lw["attn_norm"]), w_a=up(lw["w_a"]), q_norm=up(lw.get("q_norm")),
                                    w_q=up(lw["w_q"]), kv_norm=up(lw["kv_norm"]), w_uk_t=up(lw["w_uk_t"]),
                                    w_uv=up(lw["w_uv"]), w_o=up(lw["w_o"]))
            if config.is_moe_layer(i):
                ffn: DenseFfnWeights | MoeWeights = _moe_weights(config, lw, up)
            else:
                ffn = DenseFfnWeights(norm=up(lw["ffn_norm"]), w13=up(lw["w13"]), w2=up(lw["w2"]))
            layers.append(LayerWeights(index=i, attn=attn, ffn=ffn))
        return cls(config=config, embed=up(host["embed"]), layers=tuple(layers), final_norm=up(host["final_norm"]),
                   lm_head=up(host["lm_head"]))
