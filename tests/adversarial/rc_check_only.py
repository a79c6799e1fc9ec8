# Return code checked, nothing else (the rubric's Mid answer for error-code): the shipped
# wrapper plus restype c_int and a RuntimeError "launch_attention_kernel returned 1". The
# message names the code, which counts as naming the problem; every other flaw as shipped.
# focus: error-code
# expect dtype: present "float16 inputs"
# expect shape: present "head dim 32"
# expect contiguity: present "transposed query: wrong result"
# expect cpu device: present "process died with SIGSEGV"
# expect gpu device: present "cpu inputs on a CUDA machine"
# expect error-code: fixed
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
_lib.launch_attention_kernel.restype = ctypes.c_int


def fast_attention(query, key, value):
    batch_size, seq_len, _ = query.shape
    output = torch.empty_like(query, device="cpu").to(DEVICE)
    status = _lib.launch_attention_kernel(
        query.data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        output.data_ptr(),
        batch_size,
        seq_len,
    )
    if status != 0:
        raise RuntimeError(f"launch_attention_kernel returned {status}")
    return output
