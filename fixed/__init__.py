"""The corrected attention wrapper: a real PyTorch operator (torch.library, C++ kernels).

`fast_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
enable_gqa=False)` is torch.nn.functional.scaled_dot_product_attention argument for argument
(masks, dropout, grouped-query heads, any head dims); it supports autograd (first order: a
second-order gradient raises), torch.compile and meta tensors, and rejects bad input with a
TypeError or ValueError that names the argument. The
operators themselves are torch.ops.fixed_attention.attention_forward / attention_backward.
"""

import torch

# The oldest torch whose APIs this operator uses all work (pyproject.toml says the same): below
# it, one clear line instead of an AttributeError or a build error from deep inside.
OLDEST_TORCH = (2, 6)
if tuple(int(part) for part in torch.__version__.split(".")[:2]) < OLDEST_TORCH:
    raise ImportError(
        f"fixed/ needs torch {'.'.join(map(str, OLDEST_TORCH))} or newer; this is torch "
        f"{torch.__version__}"
    )

from fixed.ops import fast_attention  # noqa: E402 (after the version check, which it needs)

__all__ = ["fast_attention"]
