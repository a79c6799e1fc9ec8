# The empty_like trap (rubric, contiguity): the shipped wrapper plus dense copies of the inputs,
# but the output still comes from torch.empty_like(query), which keeps a transposed query's
# strides: the kernel writes row-major data into a permuted buffer. The sliced key and the
# expanded value are right, the transposed query is not: partial, query named.
# focus: contiguity
# expect dtype: present "float16 inputs"
# expect shape: present "head dim 32"
# expect contiguity: partial "query unchecked"
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
    q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
    batch_size, seq_len, _ = q.shape
    output = torch.empty_like(query, device="cpu").to(DEVICE)
    _lib.launch_attention_kernel(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        output.data_ptr(),
        batch_size,
        seq_len,
    )
    return output
