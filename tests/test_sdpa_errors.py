"""Bad arguments to fixed.fast_attention's SDPA signature: each a typed error (TypeError for a
wrong type, ValueError for a wrong value or shape, NotImplementedError for a mask that wants a
gradient) whose message names the argument; the same from the fake kernel (meta tensors) and
from the operator itself (the C++ checks), never a crash or a silent result."""

from __future__ import annotations

import pytest
import torch

import fixed
from tests.sdpa_support import rng_fixture

rng = rng_fixture("SDPA_SEED")
forward_op = torch.ops.fixed_attention.attention_forward
backward_op = torch.ops.fixed_attention.attention_backward

# query (2, 3, 4, 8), key (2, 3, 6, 8), value (2, 3, 6, 5): the output is (2, 3, 4, 5), S = 6.
Q_SHAPE, K_SHAPE, V_SHAPE = (2, 3, 4, 8), (2, 3, 6, 8), (2, 3, 6, 5)


def change(**kwargs):
    """make(q, k, v) -> (q, k, v, kwargs): the base inputs with these keyword arguments."""
    return lambda q, k, v: (q, k, v, kwargs)


def mask_of(shape, dtype=torch.bool, **kwargs):
    return lambda q, k, v: (q, k, v, {"attn_mask": torch.ones(shape, dtype=dtype), **kwargs})


def heads(q_heads, k_heads, v_heads=None, **kwargs):
    v_heads = k_heads if v_heads is None else v_heads
    return lambda q, k, v: (
        q[:, :1].expand(2, q_heads, 4, 8),
        k[:, :1].expand(2, k_heads, 6, 8),
        v[:, :1].expand(2, v_heads, 6, 5),
        kwargs,
    )


# (id, make, exception, message pattern). Patterns name the argument; shapes where the spec
# asks for the expected one.
BAD = [
    (
        "scale tensor",
        change(scale=torch.tensor(0.5)),
        TypeError,
        r"scale must be a float or None; got Tensor",
    ),
    ("scale bool", change(scale=True), TypeError, r"scale"),
    ("scale str", change(scale="0.5"), TypeError, r"scale"),
    ("is_causal None", change(is_causal=None), TypeError, r"is_causal"),
    ("is_causal int", change(is_causal=1), TypeError, r"is_causal"),
    ("is_causal tensor", change(is_causal=torch.tensor(True)), TypeError, r"is_causal"),
    ("enable_gqa None", change(enable_gqa=None), TypeError, r"enable_gqa"),
    ("enable_gqa int", change(enable_gqa=1), TypeError, r"enable_gqa"),
    ("dropout_p -0.1", change(dropout_p=-0.1), ValueError, r"dropout_p"),
    ("dropout_p 1.5", change(dropout_p=1.5), ValueError, r"dropout_p"),
    ("dropout_p nan", change(dropout_p=float("nan")), ValueError, r"dropout_p"),
    ("dropout_p tensor", change(dropout_p=torch.tensor(0.1)), TypeError, r"dropout_p"),
    ("dropout_p None", change(dropout_p=None), TypeError, r"dropout_p"),
    ("attn_mask (5, 6)", mask_of((5, 6)), ValueError, r"(?s)attn_mask.*2, 3, 4, 6"),
    ("attn_mask wrong S", mask_of((4, 5)), ValueError, r"(?s)attn_mask.*2, 3, 4, 6"),
    ("attn_mask (5,)", mask_of((5,)), ValueError, r"(?s)attn_mask.*2, 3, 4, 6"),
    ("attn_mask more dims", mask_of((3, 2, 3, 4, 6)), ValueError, r"(?s)attn_mask.*2, 3, 4, 6"),
    ("attn_mask heads 2", mask_of((2, 2, 4, 6)), ValueError, r"(?s)attn_mask.*2, 3, 4, 6"),
    ("attn_mask int32", mask_of((4, 6), torch.int32), TypeError, r"(?s)attn_mask.*int32"),
    ("attn_mask int64", mask_of((4, 6), torch.int64), TypeError, r"(?s)attn_mask.*int64"),
    ("attn_mask uint8", mask_of((4, 6), torch.uint8), TypeError, r"(?s)attn_mask.*uint8"),
    ("attn_mask list", change(attn_mask=[[True] * 6] * 4), TypeError, r"attn_mask"),
    ("attn_mask with is_causal", mask_of((4, 6), is_causal=True), ValueError, r"attn_mask"),
    (
        "float attn_mask with is_causal",
        mask_of((4, 6), torch.float32, is_causal=True),
        ValueError,
        r"(?s)(attn_mask.*is_causal|is_causal.*attn_mask)",
    ),
    ("GQA 4/3", heads(4, 3, enable_gqa=True), ValueError, r"(enable_gqa|key)"),
    ("GQA 3/2", heads(3, 2, enable_gqa=True), ValueError, r"(enable_gqa|key)"),
    ("Hq != Hkv without GQA", heads(4, 2), ValueError, r"key"),
    ("key and value heads differ under GQA", heads(4, 2, 1, enable_gqa=True), ValueError, r"value"),
    (
        "GQA on 2-D inputs",
        lambda q, k, v: (q[0, 0], k[0, 0], v[0, 0], {"enable_gqa": True}),
        ValueError,
        r"enable_gqa",
    ),
    ("key head dim", lambda q, k, v: (q, k[..., :4], v, {}), ValueError, r"key"),
    ("value length", lambda q, k, v: (q, k, v[..., :5, :], {}), ValueError, r"value"),
    (
        "batch not broadcastable",
        lambda q, k, v: (q, k[:1].expand(3, 3, 6, 8), v, {}),
        ValueError,
        "key",
    ),
    (
        "head dim 0",
        lambda q, k, v: (q[..., :0], k[..., :0], v, {}),
        ValueError,
        r"(query|head dim)",
    ),
    ("value head dim 0", lambda q, k, v: (q, k, v[..., :0], {}), ValueError, r"(value|head dim)"),
    ("mixed dtypes", lambda q, k, v: (q, k.half(), v, {}), TypeError, r"key"),
]
IDS = [case[0] for case in BAD]


@pytest.mark.parametrize(("make", "error", "pattern"), [c[1:] for c in BAD], ids=IDS)
def test_bad_argument_raises(rng, make, error, pattern):
    q, k, v, kwargs = make(*rng.qkv(Q_SHAPE, K_SHAPE, V_SHAPE))
    with pytest.raises(error, match=pattern):
        fixed.fast_attention(q, k, v, **kwargs)


@pytest.mark.parametrize(("make", "error", "pattern"), [c[1:] for c in BAD], ids=IDS)
def test_bad_argument_raises_on_meta_tensors(make, error, pattern):
    """Meta and fake tensors (torch.compile) never reach C++: the fake kernel restates the
    checks, so a bad call fails at trace time with the same error, not silently."""
    q, k, v = (torch.empty(s, device="meta") for s in (Q_SHAPE, K_SHAPE, V_SHAPE))
    q, k, v, kwargs = make(q, k, v)
    if isinstance(kwargs.get("attn_mask"), torch.Tensor):
        kwargs["attn_mask"] = kwargs["attn_mask"].to("meta")
    with pytest.raises(error, match=pattern):
        fixed.fast_attention(q, k, v, **kwargs)


def test_mask_that_requires_grad_is_not_implemented(rng):
    q, k, v = rng.qkv(Q_SHAPE, K_SHAPE, V_SHAPE)
    mask = rng.float_mask(4, 6).requires_grad_(True)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        fixed.fast_attention(q, k, v, attn_mask=mask)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        fixed.fast_attention(q.requires_grad_(True), k, v, attn_mask=mask * 2)
    # The operator itself refuses it, for callers that skip fast_attention.
    with pytest.raises(NotImplementedError, match="attn_mask"):
        torch.ops.fixed_attention.attention_forward(q, k, v, 0.5, False, mask)


def test_mask_on_another_device(rng):
    """Only the meta device exists on a CPU-only machine: a mask there must be refused, naming
    attn_mask and the device it must be on (not run, not crash)."""
    q, k, v = rng.qkv(Q_SHAPE, K_SHAPE, V_SHAPE)
    mask = torch.ones(4, 6, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"(?s)attn_mask.*cpu"):
        fixed.fast_attention(q, k, v, attn_mask=mask)


# The operator's own checks (C++): the same rules for callers that skip fast_attention.
OP_BAD = [
    (
        "mask wrong shape",
        dict(attn_mask=torch.ones(5, 6, dtype=torch.bool)),
        ValueError,
        "attn_mask",
    ),
    ("mask int", dict(attn_mask=torch.ones(4, 6, dtype=torch.int32)), TypeError, "attn_mask"),
    (
        "mask with causal",
        dict(attn_mask=torch.ones(4, 6, dtype=torch.bool), causal=True),
        ValueError,
        "attn_mask",
    ),
    ("dropout without a seed", dict(dropout_p=0.5), ValueError, "dropout_seed"),
    (
        "float seed",
        dict(dropout_p=0.5, dropout_seed=torch.tensor(1.0)),
        TypeError,
        "dropout_seed",
    ),
    (
        "seed not 0-dim",
        dict(dropout_p=0.5, dropout_seed=torch.tensor([1, 2])),
        ValueError,
        "dropout_seed",
    ),
    ("dropout_p 2", dict(dropout_p=2.0, dropout_seed=torch.tensor(1)), ValueError, "dropout_p"),
    ("dropout_p -1", dict(dropout_p=-1.0, dropout_seed=torch.tensor(1)), ValueError, "dropout_p"),
]


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"), [c[1:] for c in OP_BAD], ids=[c[0] for c in OP_BAD]
)
def test_operator_checks_the_new_arguments(rng, kwargs, error, pattern):
    q, k, v = rng.qkv(Q_SHAPE, K_SHAPE, V_SHAPE)
    full = {
        "attn_mask": None,
        "causal": False,
        "enable_gqa": False,
        "dropout_p": 0.0,
        "dropout_seed": None,
        **kwargs,
    }
    args = (full["causal"], full["attn_mask"], full["enable_gqa"], full["dropout_p"])
    with pytest.raises(error, match=pattern):
        forward_op(q, k, v, 0.3, *args, full["dropout_seed"])
    out, lse = forward_op(q, k, v, 0.3, False)
    with pytest.raises(error, match=pattern):
        backward_op(out, q, k, v, out, lse, 0.3, *args, full["dropout_seed"])


def test_operator_checks_gqa(rng):
    q, k, v = rng.qkv((2, 4, 4, 8), (2, 3, 6, 8), (2, 3, 6, 5))
    with pytest.raises(ValueError, match=r"(enable_gqa|key)"):
        forward_op(q, k, v, 0.3, False, None, True)
    with pytest.raises(ValueError, match=r"key"):
        forward_op(q, k, v, 0.3, False)  # no broadcasting at the operator level
