"""Model configuration of the MLA + MoE target (DeepSeek-V3 / Kimi K2 architecture).

One frozen :class:`ModelConfig` describes a model; sizes live in JSON presets under
``data/presets/<name>.json`` (:meth:`ModelConfig.from_name`):

- ``tiny``: runs under the CUDA simulator and in the float64 NumPy reference in milliseconds;
- ``small``: a few hundred million parameters for one GPU, with Kimi K2's real head geometry
  (64 heads, kv_lora 512, qk_nope 128, qk_rope 64, v 128) so kernels see real shapes;
- ``kimi-k2``: the real geometry (spec §6); it drives kernel shapes and benchmarks, and its weights
  are never materialized.

JSON keys are the field names; keys starting with ``_`` (such as ``"_notes"``, where the presets
mark uncertain values) are comments and ignored. :meth:`ModelConfig.from_hf_config` maps a Hugging
Face ``config.json`` of this architecture (``model_type`` ``deepseek_v3`` / ``kimi_k2``).
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

PRESET_DIR = Path(__file__).resolve().parent.parent / "data" / "presets"
SCORE_FUNCS = ("sigmoid", "softmax")
ROPE_LAYOUTS = ("interleaved", "neox")
T = TypeVar("T")


def int_field(name: str, value: Any, minimum: int) -> None:
    """An int (bool rejected) >= minimum."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def float_field(name: str, value: Any, minimum: float, strict: bool) -> None:
    """A finite real (bool rejected) > minimum (strict) or >= minimum."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        raise ValueError(f"{name} must be finite and {'>' if strict else '>='} {minimum}, got {value}")


def choice_field(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """One of ``choices``."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def parse_json(text: str | bytes) -> Any:
    """The value of JSON ``text`` (TypeError: not str / bytes; ValueError: not valid JSON)."""
    if not isinstance(text, (str, bytes)):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"text is not valid JSON: {exc}") from None


def fields_from_dict(cls: type[T], data: Mapping[str, Any],
                     fill: Callable[[dict[str, Any]], None] | None = None) -> T:
    """A config dataclass ``cls`` (with a ``notes`` field) from a dict of field values.

    ``_``-prefixed keys are comments (``_notes`` is kept as notes); unknown or missing keys raise
    ValueError naming them. ``fill(values)``, if given, fills derived defaults in place once every
    required key is known to be there.
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"config must be a JSON object / mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)} - {"notes"}
    values = {k: v for k, v in data.items() if not k.startswith("_")}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"config has unknown key(s) {unknown}")
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = sorted(required - set(values))
    if missing:
        raise ValueError(f"config is missing key(s) {missing}")
    if fill is not None:
        fill(values)
    notes = data.get("_notes", {})
    if not isinstance(notes, Mapping):
        raise TypeError(f"_notes must be a JSON object, got {type(notes).__name__}")
    return cls(**values, notes=dict(notes))



def fields_to_dict(config: Any, convert: Callable[[Any], Any]) -> dict[str, Any]:
    """JSON-able dict of a config dataclass's fields, each through ``convert`` (notes as ``_notes``)."""
    out = {f.name: convert(getattr(config, f.name)) for f in dataclasses.fields(config) if f.name != "notes"}
    if config.notes:
        out["_notes"] = dict(config.notes)
    return out

def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN attention-temperature factor m = 0.1 · mscale · ln(factor) + 1, or 1 for factor <= 1.

    HF ``yarn_get_mscale`` / DeepSeek-V3 ``MLA.__init__`` (limits §2).
    """
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """YaRN RoPE scaling (the only kind this architecture uses); HF ``rope_scaling`` keys."""

    type: str = "yarn"
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float = 1.0
    mscale_all_dim: float = 0.0  # 0: no softmax-scale correction (HF rule)

    def validate(self) -> None:
        """Raise ValueError / TypeError naming the first bad field (``rope_scaling.<field>``)."""
        choice_field("rope_scaling.type", self.type, ("yarn",))
        float_field("rope_scaling.factor", self.factor, 1.0, strict=False)
        int_field("rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings, 1)
        float_field("rope_scaling.beta_fast", self.beta_fast, 0.0, strict=True)
        float_field("rope_scaling.beta_slow", self.beta_slow, 0.0, strict=True)
        float_field("rope_scaling.mscale", self.mscale, 0.0, strict=False)
        float_field("rope_scaling.mscale_all_dim", self.mscale_all_dim, 0.0, strict=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RopeScaling:
        """From an HF-style dict; unknown keys raise ValueError naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"rope_scaling has unknown key(s) {unknown}; expected a subset of {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as exc:  # a required key is missing
            raise ValueError(f"rope_scaling: {exc}") from None


class ParamCount(NamedTuple):
    """Parameter counts; ``activated`` is what one token touches (all dense weights, embeddings and
    lm_head included, as model cards count them; routed experts only ``n_activated_experts``)."""

    total: int
    activated: int


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes and switches of an MLA + MoE decoder (DeepSeek-V3 ``ModelArgs``; HF names in parentheses).

    Layers ``[0, n_dense_layers)`` have a dense SwiGLU FFN of width ``dense_intermediate``; the others
    are MoE layers. A KV-cache row is ``kv_lora_rank + qk_rope_dim`` values per token and layer
    (576 for Kimi K2 / DeepSeek-V3, limits §2).
    """

    # vocabulary and stack
    vocab_size: int
    hidden_size: int
    n_layers: int  # num_hidden_layers
    n_dense_layers: int  # first_k_dense_replace
    dense_intermediate: int  # intermediate_size
    moe_intermediate: int  # moe_intermediate_size (each routed and shared expert)

    # MLA attention
    n_heads: int
    q_lora_rank: int  # 0: no low-rank query path (q_proj instead of q_a_proj / q_b_proj)
    kv_lora_rank: int
    qk_nope_dim: int  # qk_nope_head_dim
    qk_rope_dim: int  # qk_rope_head_dim; even
    v_head_dim: int

    # MoE routing
    n_routed_experts: int
    n_activated_experts: int  # num_experts_per_tok
    n_shared_experts: int  # fused into one SwiGLU of width n_shared_experts * moe_intermediate
    n_expert_groups: int  # n_group
    n_limited_groups: int  # topk_group
    score_func: str  # scoring_func: "sigmoid" (with a selection-only bias) | "softmax" (no bias)
    route_scale: float  # routed_scaling_factor
    norm_topk_prob: bool  # renormalise the k selected weights to sum to 1 before route_scale

    # positions
    rope_theta: float
    rope_layout: str  # "interleaved": pairs (2i, 2i+1) (DeepSeek); "neox": pairs (i, i + d/2)
    rope_scaling: RopeScaling | None = None  # also accepts the HF dict
    max_seq_len: int  # max_position_embeddings

    # normalisation
    rms_norm_eps: float

    # special tokens (None where the model has none)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    mask_token_id: int | None = None  # the DFlash drafter's mask token (spec §2)

    # Not a field of the model: where a preset came from, kept out of equality.
    notes: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        self.validate()

    # ----------------------------------------------------------------------------- validation

    def validate(self) -> None:
        """Raise ValueError (bad value) or TypeError (bad type) naming the first bad field."""
        for name in ("vocab_size", "hidden_size", "n_layers", "dense_intermediate", "moe_intermediate",
                     "n_heads", "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim",
                     "n_routed_experts", "n_activated_experts", "n_expert_groups", "n_limited_groups",
                     "max_seq_len"):
            int_field(name, getattr(self, name), 1)
        for name in ("n_dense_layers", "q_lora_rank", "n_shared_experts"):
            int_field(name, getattr(self, name), 0)
        if self.n_dense_layers > self.n_layers:
            raise ValueError(f"n_dense_layers must be <= n_layers = {self.n_layers}, got {self.n_dense_layers}")
        if self.qk_rope_dim % 2:
            raise ValueError(f"qk_rope_dim must be even (RoPE rotates pairs), got {self.qk_rope_dim}")
        self._validate_routing()
        float_field("rope_theta", self.rope_theta, 1.0, strict=True)
        choice_field("rope_layout", self.rope_layout, ROPE_LAYOUTS)
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, RopeScaling):
                kind = type(self.rope_scaling).__name__
                raise TypeError(f"rope_scaling must be None, a dict or RopeScaling, got {kind}")
            self.rope_scaling.validate()
        float_field("rms_norm_eps", self.rms_norm_eps, 0.0, strict=True)
        for name in ("bos_token_id", "eos_token_id", "mask_token_id"):
            value = getattr(self, name)
            if value is not None:
                int_field(name, value, 0)
                if value >= self.vocab_size:
                    raise ValueError(f"{name} must be < vocab_size = {self.vocab_size}, got {value}")

    def _validate_routing(self) -> None:
        """MoE fields: groups divide the experts and leave at least k candidates."""
        if self.n_activated_experts > self.n_routed_experts:
            raise ValueError(f"n_activated_experts must be <= n_routed_experts = {self.n_routed_experts}, "
                             f"got {self.n_activated_experts}")
        if self.n_routed_experts % self.n_expert_groups:
            raise ValueError(f"n_expert_groups must divide n_routed_experts = {self.n_routed_experts}, "
                             f"got {self.n_expert_groups}")
        if self.n_limited_groups > self.n_expert_groups:
            raise ValueError(f"n_limited_groups must be <= n_expert_groups = {self.n_expert_groups}, "
                             f"got {self.n_limited_groups}")
        candidates = self.n_limited_groups * self.experts_per_group
        if self.n_activated_experts > candidates:
            raise ValueError(f"n_activated_experts must be <= n_limited_groups * experts per group = {candidates}, "
                             f"got {self.n_activated_experts}")
        choice_field("score_func", self.score_func, SCORE_FUNCS)
        if self.score_func == "sigmoid" and self.n_expert_groups > 1 and self.experts_per_group < 2:
            raise ValueError("n_expert_groups: sigmoid routing scores a group by its top-2 experts, "
                             f"so groups need >= 2 experts, got {self.experts_per_group}")
        float_field("route_scale", self.route_scale, 0.0, strict=True)
        if not isinstance(self.norm_topk_prob, bool):
            raise TypeError(f"norm_topk_prob must be a bool, got {type(self.norm_topk_prob).__name__}")

    # ----------------------------------------------------------------------------- derived sizes

    @property
    def qk_head_dim(self) -> int:
        """Query / key width per head in the naive form: qk_nope_dim + qk_rope_dim (192)."""
        return self.qk_nope_dim + self.qk_rope_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values per token and layer in the latent cache: kv_lora_rank + qk_rope_dim (576)."""
        return self.kv_lora_rank + self.qk_rope_dim

    @property
    def experts_per_group(self) -> int:
        """Routed experts per routing group."""
        return self.n_routed_experts // self.n_expert_groups

    @property
    def has_gate_bias(self) -> bool:
        """Sigmoid routing carries ``e_score_correction_bias`` (HF ``topk_method`` noaux_tc)."""
        return self.score_func == "sigmoid"

    @property
    def softmax_scale(self) -> float:
        """Attention softmax scale: qk_head_dim^-1/2, times m² under YaRN (limits §2).

        HF rule (``DeepseekV3Attention.__init__``): whenever ``rope_scaling`` is set and its
        ``mscale_all_dim`` is nonzero, m = 0.1 · mscale_all_dim · ln(factor) + 1. (DeepSeek's own
        inference code uses ``mscale`` and only when max_seq_len > original length; for the real
        checkpoints, mscale == mscale_all_dim == 1 and max_seq_len is above it, so both agree.)
        Kimi K2 with factor 64: 192^-1/2 · 1.415888² = 0.144680.
        """
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def rope_mscale(self) -> float:
        """Amplitude of HF's YaRN cos / sin tables: m(factor, mscale) / m(factor, mscale_all_dim); 1 without YaRN.

        Equal to 1 for DeepSeek-V3 and Kimi K2 (mscale == mscale_all_dim), where RoPE is a pure rotation.
        """
        rs = self.rope_scaling
        if rs is None:
            return 1.0
        return yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer`` (0-based) has an MoE FFN rather than the dense one."""
        return layer >= self.n_dense_layers

    def param_count(self) -> ParamCount:
        """Total and per-token activated parameter counts (see :class:`ParamCount`)."""
        d, h = self.hidden_size, self.n_heads
        if self.q_lora_rank:
            q = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
        else:
            q = d * h * self.qk_head_dim
        kv = d * self.kv_cache_dim + self.kv_lora_rank + self.kv_lora_rank * h * (self.qk_nope_dim + self.v_head_dim)
        attention = q + kv + h * self.v_head_dim * d + 2 * d  # + o_proj + the two layer norms
        dense_ffn = 3 * d * self.dense_intermediate
        expert = 3 * d * self.moe_intermediate
        gate = self.n_routed_experts * d + (self.n_routed_experts if self.has_gate_bias else 0)
        shared = self.n_shared_experts * expert
        n_moe = self.n_layers - self.n_dense_layers
        common = 2 * self.vocab_size * d + d + self.n_layers * attention + self.n_dense_layers * dense_ffn
        total = common + n_moe * (gate + shared + self.n_routed_experts * expert)
        activated = common + n_moe * (gate + shared + self.n_activated_experts * expert)
        return ParamCount(total=total, activated=activated)

    # ----------------------------------------------------------------------------- (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of the fields (``rope_scaling`` as the HF dict; notes as ``_notes``)."""
        return fields_to_dict(self, lambda v: dataclasses.asdict(v) if isinstance(v, RopeScaling) else v)

    def to_json(self) -> str:
        """JSON text of :meth:`to_dict` (indented, field order)."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """From a dict of field values; ``_``-prefixed keys are comments (``_notes`` is kept as notes).

        Unknown or missing keys raise ValueError naming them.
        """
        return fields_from_dict(cls, data)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        """From JSON text (see :meth:`from_dict`)."""
        return cls.from_dict(parse_json(text))

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        """The preset ``data/presets/<name>.json`` (``tiny``, ``small``, ``kimi-k2``)."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        path = PRESET_DIR / f"{name}.json"
        if "/" in name or "\\" in name or not path.is_file():
            raise ValueError(f"name: no preset {name!r}; available: {preset_names()}")
        return cls.from_json(path.read_text())

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Map a Hugging Face DeepSeek-V3 / Kimi K2 ``config.json`` (K2.5 / K2.6: its ``text_config``).

        Absent ``rope_interleave`` means interleaved (HF ``modeling_deepseek`` always de-interleaves);
        a null ``q_lora_rank`` means 0; ``max_position_embeddings`` becomes max_seq_len.
        """
        if not isinstance(hf, Mapping):
            raise TypeError(f"hf must be a mapping, got {type(hf).__name__}")
        if "text_config" in hf:
            hf = hf["text_config"]
        names = {
            "vocab_size": "vocab_size", "hidden_size": "hidden_size", "n_layers": "num_hidden_layers",
            "n_dense_layers": "first_k_dense_replace", "dense_intermediate": "intermediate_size",
            "moe_intermediate": "moe_intermediate_size", "n_heads": "num_attention_heads",
            "kv_lora_rank": "kv_lora_rank", "qk_nope_dim": "qk_nope_head_dim",
            "qk_rope_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
            "n_routed_experts": "n_routed_experts", "n_activated_experts": "num_experts_per_tok",
            "n_shared_experts": "n_shared_experts", "n_expert_groups": "n_group",
            "n_limited_groups": "topk_group", "score_func": "scoring_func",
            "route_scale": "routed_scaling_factor", "norm_topk_prob": "norm_topk_prob",
            "rope_theta": "rope_theta", "max_seq_len": "max_position_embeddings", "rms_norm_eps": "rms_norm_eps",
        }
        missing = sorted(key for key in names.values() if key not in hf)
        if missing:
            raise ValueError(f"hf is missing key(s) {missing}")
        values = {ours: hf[theirs] for ours, theirs in names.items()}
        values["q_lora_rank"] = hf.get("q_lora_rank") or 0
        values["rope_layout"] = "interleaved" if hf.get("rope_interleave", True) else "neox"
        scaling = hf.get("rope_scaling")
        if scaling is not None:  # newer transformers spell "type" as "rope_type"
            scaling = {**scaling, "type": scaling.get("type", scaling.get("rope_type", "yarn"))}
            scaling.pop("rope_type", None)
        values["rope_scaling"] = scaling
        for name in ("bos_token_id", "eos_token_id", "mask_token_id"):
            values[name] = hf.get(name)
        return cls(**values)


def preset_names() -> list[str]:
    """Names of the target-model JSON presets in ``data/presets`` (drafter presets excluded)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json") if not p.stem.startswith("dflash-"))
