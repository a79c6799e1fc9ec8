"""The corrected attention wrapper: a real PyTorch operator (torch.library, C++ kernels).

`fast_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
enable_gqa=False)` is torch.nn.functional.scaled_dot_product_attention argument for argument
(masks, dropout, grouped-query heads, any head dims); it supports autograd (first order: a
second-order gradient raises), torch.compile and meta tensors, and rejects bad input with a
TypeError or ValueError that names the argument. The
operators themselves are torch.ops.fixed_attention.attention_forward / attention_backward.
"""

from fixed.ops import fast_attention

__all__ = ["fast_attention"]
