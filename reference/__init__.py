"""NumPy reference of the DDTree round: it defines the semantics every kernel is tested against."""
from reference.accept import AcceptResult, accept, accept_batch
from reference.attention import verify_attention, verify_attention_batch
from reference.compact import compact, compact_batch
from reference.dflash import DFlashConfig, DraftSession, default_layer_ids, draft_forward
from reference.model import ForwardOutput, forward
from reference.sampling import gumbel_noise, philox4x32, sample_posterior
from reference.topk import bf16_to_float32, float32_to_bf16, topk_log_probs
from reference.tree import (
    DraftTree,
    TreeBatch,
    build_tree,
    build_tree_batch,
    pack_visibility,
    unpack_visibility,
)
from reference.weights import init_weights, load_weights, save_weights

__all__ = [
    "AcceptResult",
    "DFlashConfig",
    "DraftSession",
    "DraftTree",
    "ForwardOutput",
    "TreeBatch",
    "accept",
    "accept_batch",
    "bf16_to_float32",
    "build_tree",
    "build_tree_batch",
    "compact",
    "compact_batch",
    "default_layer_ids",
    "draft_forward",
    "float32_to_bf16",
    "forward",
    "gumbel_noise",
    "init_weights",
    "load_weights",
    "pack_visibility",
    "philox4x32",
    "sample_posterior",
    "save_weights",
    "topk_log_probs",
    "unpack_visibility",
    "verify_attention",
    "verify_attention_batch",
]
