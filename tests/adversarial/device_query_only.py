# Device checked on query only: the shipped wrapper plus a ValueError unless query is on the
# library's device. A meta (on a GPU: CPU) key next to a good query still reaches the kernel:
# a null pointer on a CPU machine (the process dies), a host pointer on a GPU (an illegal
# address). Each crash fails its own case and the next case runs in a fresh runner, so query,
# handled in every case, earns the partial credit (a crash used to end the probe: present).
# focus: device
# expect dtype: present "float16 inputs"
# expect shape: present "head dim 32"
# expect contiguity: present "transposed query: wrong result"
# expect cpu device: partial "key and value unchecked"
# expect gpu device: partial "key and value unchecked"
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
    if query.device.type != DEVICE:
        raise ValueError(f"query is on {query.device}; the library runs on {DEVICE}")
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
