"""reference/attention.py against a dense additive-mask formulation over the concatenated 576-dim q/k."""
from __future__ import annotations

import numpy as np
import pytest

from reference.attention import verify_attention, verify_attention_batch
from reference.tree import build_tree

KIMI_SCALE = 0.144680  # limits §2, YaRN factor 64


def _dense(q_latent, q_rope, kv_latent, k_rope, visibility, scale):
    """Independent oracle: additive mask [T, N + T] (0 visible, -inf hidden) on one concatenated q·k."""
    t = q_latent.shape[0]
    n_past = kv_latent.shape[0] - t
    q = np.concatenate([q_latent, q_rope], axis=-1).astype(np.float64)  # [T, H, Dl + Dr]
    k = np.concatenate([kv_latent, k_rope], axis=-1).astype(np.float64)  # [N + T, Dl + Dr]
    mask = np.zeros((t, n_past + t))
    mask[:, n_past:] = np.where(visibility, 0.0, -np.inf)
    logits = scale * np.einsum("thc,jc->thj", q, k) + mask[:, None, :]  # [T, H, N + T]
    shift = logits.max(axis=-1, keepdims=True)
    e = np.exp(logits - shift)
    p = e / e.sum(axis=-1, keepdims=True)
    out = np.einsum("thj,jd->thd", p, kv_latent.astype(np.float64))
    lse = np.log(e.sum(axis=-1)) + shift[..., 0]
    return out, lse


def _random_visibility(rng: np.random.Generator, t: int) -> np.ndarray:
    """A real tree's ancestor mask when possible, otherwise a random mask with the diagonal set."""
    if rng.random() < 0.5 and t > 1:
        k = int(rng.integers(1, 4))
        tree = build_tree(np.log(rng.dirichlet(np.ones(k), size=4)), np.tile(np.arange(k), (4, 1)), t - 1)
        if tree.n_nodes == t:
            return tree.visibility
    return (rng.random((t, t)) < 0.4) | np.eye(t, dtype=bool)


def _inputs(rng, t, n_past, heads, d_latent, d_rope, dtype=np.float64):
    q_latent = rng.normal(size=(t, heads, d_latent)).astype(dtype)
    q_rope = rng.normal(size=(t, heads, d_rope)).astype(dtype)
    kv_latent = rng.normal(size=(n_past + t, d_latent)).astype(dtype)
    k_rope = rng.normal(size=(n_past + t, d_rope)).astype(dtype)
    return q_latent, q_rope, kv_latent, k_rope, _random_visibility(rng, t)


def test_matches_dense_kimi_dims() -> None:
    rng = np.random.default_rng(0)
    for t, n_past in ((1, 0), (1, 9), (7, 0), (9, 33)):
        args = _inputs(rng, t, n_past, 4, 512, 64)
        out, lse = verify_attention(*args, KIMI_SCALE)
        want_out, want_lse = _dense(*args, KIMI_SCALE)
        assert out.dtype == lse.dtype == np.float64 and out.shape == (t, 4, 512) and lse.shape == (t, 4)
        np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_matches_dense_random_sizes(dtype) -> None:
    rng = np.random.default_rng(1)
    for _ in range(25):
        t, n_past = int(rng.integers(1, 12)), int(rng.integers(0, 20))
        heads, d_latent, d_rope = int(rng.integers(1, 5)), int(rng.integers(1, 40)), int(rng.integers(0, 9))
        args = _inputs(rng, t, n_past, heads, d_latent, d_rope, dtype)
        scale = float(rng.uniform(0.01, 1.0))
        out, lse = verify_attention(*args, scale)
        want_out, want_lse = _dense(*args, scale)
        np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-13)


def test_single_visible_key_is_that_row() -> None:
    """N = 0 and a root-only row: the softmax has one key, so out is that latent row exactly."""
    rng = np.random.default_rng(2)
    q_latent, q_rope, kv_latent, k_rope, _ = _inputs(rng, 3, 0, 2, 8, 4)
    vis = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=bool)
    out, lse = verify_attention(q_latent, q_rope, kv_latent, k_rope, vis, 0.5)
    np.testing.assert_array_equal(out[0], np.broadcast_to(kv_latent[0], (2, 8)))
    np.testing.assert_allclose(lse[0], 0.5 * (q_latent[0] @ kv_latent[0] + q_rope[0] @ k_rope[0]), rtol=1e-14)


def test_hidden_keys_do_not_matter() -> None:
    rng = np.random.default_rng(3)
    q_latent, q_rope, kv_latent, k_rope, _ = _inputs(rng, 5, 4, 2, 16, 4)
    vis = np.tril(np.ones((5, 5), dtype=bool))
    out, lse = verify_attention(q_latent, q_rope, kv_latent, k_rope, vis, 0.3)
    kv2, kr2 = kv_latent.copy(), k_rope.copy()
    kv2[4 + 4], kr2[4 + 4] = 1e3, -1e3  # tree row 4 is visible only to query 4
    out2, lse2 = verify_attention(q_latent, q_rope, kv2, kr2, vis, 0.3)
    np.testing.assert_array_equal(out2[:4], out[:4])
    np.testing.assert_array_equal(lse2[:4], lse[:4])


def test_batch_matches_single() -> None:
    rng = np.random.default_rng(4)
    bs, tc, heads, d_latent, d_rope, s = 4, 6, 3, 20, 5, 30
    past_lens = np.array([0, 7, 24, 3])
    sizes = np.array([1, 6, 6, 0])  # request 3 is an idle slot
    q_latent = rng.normal(size=(bs, tc, heads, d_latent))
    q_rope = rng.normal(size=(bs, tc, heads, d_rope))
    kv_latent = rng.normal(size=(bs, s, d_latent))
    k_rope = rng.normal(size=(bs, s, d_rope))
    vis = rng.random((bs, tc, tc)) < 0.5  # padding rows/columns hold garbage, diagonal off there
    for b in range(bs):
        vis[b, :sizes[b], :sizes[b]] = _random_visibility(rng, int(sizes[b])) if sizes[b] else vis[b, :0, :0]
    out, lse = verify_attention_batch(q_latent, q_rope, kv_latent, k_rope, past_lens, sizes, vis, 0.2)
    assert out.shape == (bs, tc, heads, d_latent) and lse.shape == (bs, tc, heads)
    for b in range(bs):
        n, t = int(past_lens[b]), int(sizes[b])
        want_out, want_lse = verify_attention(
            q_latent[b, :t], q_rope[b, :t], kv_latent[b, :n + t], k_rope[b, :n + t], vis[b, :t, :t], 0.2)
        np.testing.assert_array_equal(out[b, :t], want_out)
        np.testing.assert_array_equal(lse[b, :t], want_lse)
        assert not out[b, t:].any() and not lse[b, t:].any()


def _args(t=3, n_past=2, heads=2, d_latent=4, d_rope=2):
    rng = np.random.default_rng(5)
    q_latent, q_rope, kv_latent, k_rope, _ = _inputs(rng, t, n_past, heads, d_latent, d_rope)
    return dict(q_latent=q_latent, q_rope=q_rope, kv_latent=kv_latent, k_rope=k_rope,
                visibility=np.eye(t, dtype=bool), scale=0.5)


def _batch_args():
    a = _args()
    return dict(q_latent=a["q_latent"][None], q_rope=a["q_rope"][None], kv_latent=a["kv_latent"][None],
                k_rope=a["k_rope"][None], past_lens=np.array([2]), tree_sizes=np.array([3]),
                visibility=a["visibility"][None], scale=0.5)


def _with(base, **changes):
    return {**base, **changes}


_A = _args()
_B = _batch_args()
_ERRORS = {
    "q_latent_int": (verify_attention, _with(_A, q_latent=np.zeros((3, 2, 4), dtype=np.int64)), TypeError, "q_latent"),
    "q_latent_2d": (verify_attention, _with(_A, q_latent=np.zeros((3, 8))), ValueError, "q_latent"),
    "q_latent_nan": (verify_attention, _with(_A, q_latent=np.full((3, 2, 4), np.nan)), ValueError, "q_latent"),
    "q_rope_heads": (verify_attention, _with(_A, q_rope=np.zeros((3, 1, 2))), ValueError, "q_rope"),
    "kv_latent_short": (verify_attention, _with(_A, kv_latent=np.zeros((2, 4))), ValueError, "kv_latent"),
    "kv_latent_width": (verify_attention, _with(_A, kv_latent=np.zeros((5, 3))), ValueError, "kv_latent"),
    "kv_latent_inf": (verify_attention, _with(_A, kv_latent=np.full((5, 4), np.inf)), ValueError, "kv_latent"),
    "k_rope_rows": (verify_attention, _with(_A, k_rope=np.zeros((4, 2))), ValueError, "k_rope"),
    "k_rope_dtype": (verify_attention, _with(_A, k_rope=np.zeros((5, 2), dtype=bool)), TypeError, "k_rope"),
    "visibility_dtype": (verify_attention, _with(_A, visibility=np.eye(3)), TypeError, "visibility"),
    "visibility_shape": (verify_attention, _with(_A, visibility=np.eye(4, dtype=bool)), ValueError, "visibility"),
    "visibility_diagonal": (verify_attention, _with(_A, visibility=np.tril(np.ones((3, 3), dtype=bool), -1)),
                            ValueError, "visibility"),
    "scale_zero": (verify_attention, _with(_A, scale=0.0), ValueError, "scale"),
    "scale_nan": (verify_attention, _with(_A, scale=float("nan")), ValueError, "scale"),
    "scale_type": (verify_attention, _with(_A, scale="0.5"), TypeError, "scale"),
    "batch_q_latent_3d": (verify_attention_batch, _with(_B, q_latent=_A["q_latent"]), ValueError, "q_latent"),
    "batch_kv_width": (verify_attention_batch, _with(_B, kv_latent=np.zeros((1, 5, 3))), ValueError, "kv_latent"),
    "batch_k_rope_shape": (verify_attention_batch, _with(_B, k_rope=np.zeros((1, 5, 3))), ValueError, "k_rope"),
    "batch_past_lens_dtype": (verify_attention_batch, _with(_B, past_lens=np.array([2.0])), TypeError, "past_lens"),
    "batch_past_lens_negative": (verify_attention_batch, _with(_B, past_lens=np.array([-1])), ValueError, "past_lens"),
    "batch_past_lens_overflow": (verify_attention_batch, _with(_B, past_lens=np.array([3])), ValueError, "past_lens"),
    "batch_tree_sizes_big": (verify_attention_batch, _with(_B, tree_sizes=np.array([4])), ValueError, "tree_sizes"),
    "batch_tree_sizes_shape": (verify_attention_batch, _with(_B, tree_sizes=np.array([3, 3])),
                               ValueError, "tree_sizes"),
    "batch_visibility_diag": (verify_attention_batch, _with(_B, visibility=np.zeros((1, 3, 3), dtype=bool)),
                              ValueError, "visibility"),
    "batch_scale": (verify_attention_batch, _with(_B, scale=-1.0), ValueError, "scale"),
}


@pytest.mark.parametrize("case", sorted(_ERRORS))
def test_validation(case: str) -> None:
    fn, kwargs, error, name = _ERRORS[case]
    with pytest.raises(error, match=rf"\b{name}\b"):
        fn(**kwargs)
