"""NumPy reference of the DDTree round: it defines the semantics every kernel is tested against."""
from reference.accept import AcceptResult, accept, accept_batch
from reference.attention import verify_attention, verify_attention_batch
from reference.compact import compact, compact_batch
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

__all__ = [
    "AcceptResult",
    "DraftTree",
    "TreeBatch",
    "accept",
    "accept_batch",
    "bf16_to_float32",
    "build_tree",
    "build_tree_batch",
    "compact",
    "compact_batch",
    "float32_to_bf16",
    "gumbel_noise",
    "pack_visibility",
    "philox4x32",
    "sample_posterior",
    "topk_log_probs",
    "unpack_visibility",
    "verify_attention",
    "verify_attention_batch",
]
