# Dtype checked on query only (the rubric's Mid answer): the shipped wrapper plus a TypeError
# when query is not float32. A float16 key or a bfloat16 value next to a float32 query is still
# read as float32 bytes (garbage, half the buffer read past its end). Partial credit, naming the
# arguments left unchecked; everything else as shipped.
# focus: dtype
# expect dtype: partial "key and value unchecked"
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
    if query.dtype != torch.float32:
        raise TypeError(f"query must be float32, got {query.dtype}")
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
