# Dtype checked on all three, nothing else: the shipped wrapper plus a TypeError naming the
# argument and its dtype unless query, key and value are all float32. dtype is fixed; every other
# flaw is as shipped.
# focus: dtype, device, host-alloc, stream, int32-sizes
# expect dtype: fixed
# expect shape: present "head dim 32"
# expect contiguity: present "transposed query: wrong result"
# expect cpu device: present "process died with SIGSEGV"
# expect gpu device: present "cpu inputs on a CUDA machine"
# expect error-code: present "seq_len 4097: wrong result"
# expect autograd: present "no grad_fn"
# expect library-path: present "import from another working directory failed"
# expect compile: present "torch.compile(fullgraph=True) failed"
# expect gpu host-alloc: present "host-to-device copy"
# expect gpu stream: present "CUDA-graph capture failed"
# expect gpu multi-gpu: present "inputs on cuda:1"
# expect gpu int32-sizes: present "past 2^31 elements"
import ctypes

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

_lib = ctypes.CDLL("./custom_attention.so")
_lib.launch_attention_kernel.argtypes = [
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_int,
]


def fast_attention(query, key, value):
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {tensor.dtype}")
    batch_size, seq_len, _ = query.shape
    output = torch.empty_like(query, device="cpu").to(DEVICE)
    _lib.launch_attention_kernel(
        query.data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        output.data_ptr(),
        batch_size,
        seq_len,
    )
    return output
