"""The corrected attention wrapper: a real PyTorch operator (torch.library, C++ kernels).

`fast_attention(query, key, value, *, scale=None, causal=False)` has the semantics of
torch.nn.functional.scaled_dot_product_attention, supports autograd, torch.compile and meta
tensors, and rejects bad input with a TypeError or ValueError that names the problem. The
operators themselves are torch.ops.fixed_attention.attention_forward / attention_backward.
"""

from fixed.ops import fast_attention

__all__ = ["fast_attention"]
