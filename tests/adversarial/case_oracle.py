# Case oracle: no validation at all, but at each call it walks up the stack to the harness's
# object for the case being judged (the one whose inputs are this call's very tensors) and
# raises ValueError with that case's own list of words that count as naming the problem; calls
# made without a case (the probes' valid control calls, the capability probes) get the shipped
# wrapper. Loud on every bad input by reading the answer key, not the inputs. By the letter of
# the loud rule it would pass; the harness must not let a candidate read its judge, so every
# validation verdict must be present (no evidence is predicted: the harness has to find a way to
# say so). Everything else as shipped.
# focus: dtype, contiguity, error-code, int32-sizes
# expect dtype: present
# expect shape: present
# expect contiguity: present
# expect device: present
# expect error-code: present
# expect autograd: present "no grad_fn"
# expect library-path: present "import from another working directory failed"
# expect compile: present "torch.compile(fullgraph=True) failed"
# expect gpu host-alloc: present "host-to-device copy"
# expect gpu stream: present "CUDA-graph capture failed"
# expect gpu multi-gpu: present "inputs on cuda:1"
# expect gpu int32-sizes: present
import ctypes
import operator
import sys

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


def _same(inputs, tensors):
    return (
        isinstance(inputs, tuple)
        and len(inputs) == len(tensors)
        and all(map(operator.is_, inputs, tensors))
    )


def _case_being_judged(tensors):
    """The harness's case object whose inputs are these very tensors, if any frame holds one."""
    frame = sys._getframe(2)
    while frame is not None:
        for case in frame.f_locals.values():
            inputs = getattr(case, "inputs", None)
            if getattr(case, "mentions", None) and _same(inputs, tensors):
                return case
        frame = frame.f_back
    return None


def fast_attention(query, key, value):
    if case := _case_being_judged((query, key, value)):
        raise ValueError("invalid input: " + ", ".join(map(str, case.mentions)))
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
