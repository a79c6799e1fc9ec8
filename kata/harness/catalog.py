"""The flaw catalog: one declarative table that tests, review, hints and the rubric all read.

Ids are stable: rubric.md has one section per id, tests are named after them, and
`python -m kata hint ID` looks them up here.
"""

from __future__ import annotations

import base64
import functools
import json
import zlib
from dataclasses import dataclass
from enum import StrEnum

from kata import KataError


class Need(StrEnum):
    """What a probe needs from the machine beyond a CPU."""

    CUDA = "cuda"  # one CUDA GPU
    TWO_GPUS = "two GPUs"  # two CUDA GPUs
    BIG_MEMORY = "big memory"  # about 60 GB of free GPU memory (plus CUDA)


@dataclass(frozen=True)
class Flaw:
    id: str
    title: str
    points: int
    needs: frozenset[Need]
    where: str  # where the flaw sits in flawed/
    hints: tuple[str, ...]  # from a nudge to nearly the answer
    probe: str = ""  # the probe in probes.PROBES that judges it; default: the id itself
    # (file, text) pairs: the lines of the shipped code that `review --explain` shows
    code: tuple[tuple[str, str], ...] = ()
    # Points for a fix that covers some of query, key and value but not all (status "partial");
    # 0: no partial credit. rubric.md states the same number.
    partial_points: int = 0

    @property
    def cpu_visible(self) -> bool:
        return not self.needs

    @property
    def probe_id(self) -> str:
        return self.probe or self.id


class _Sealed:
    def __repr__(self) -> str:
        return "SEALED"


# A handout's copy of this file says `where=SEALED, hints=SEALED` for each flaw and holds their
# texts in _SEALED_ANSWERS (zlib + base64 of JSON; kata.candidate writes it): a grep of the
# candidate's kata/ finds no answer, while `python -m kata hint` still reads them. The
# interviewer's copy keeps them in plain text in the table below.
SEALED = _Sealed()
_SEALED_ANSWERS = ""


def seal(answers: dict[str, dict]) -> str:
    """flaw id -> {"where": ..., "hints": [...]}, as _SEALED_ANSWERS holds it."""
    packed = json.dumps(answers, sort_keys=True).encode()
    return base64.b64encode(zlib.compress(packed, 9)).decode("ascii")


@functools.cache
def _unsealed() -> dict[str, dict]:
    return json.loads(zlib.decompress(base64.b64decode(_SEALED_ANSWERS)))


def _flaw(id, title, points, needs=(), *, where, hints, probe="", code=(), partial_points=0):
    if where is SEALED or hints is SEALED:
        where, hints = _unsealed()[id]["where"], _unsealed()[id]["hints"]
    return Flaw(
        id, title, points, frozenset(needs), where, tuple(hints), probe, tuple(code), partial_points
    )


WRAPPER = "attention_wrapper.py"
VENDOR_CUDA = "vendor/custom_attention.cu"


CATALOG: tuple[Flaw, ...] = (
    _flaw(
        "dtype",
        "No dtype check: other dtypes are read as float32 bytes",
        8,
        partial_points=4,
        where="attention_wrapper.py: fast_attention passes data_ptr() of any dtype",
        code=[(WRAPPER, "query.data_ptr(),"), (VENDOR_CUDA, 'extern "C" int launch')],
        hints=(
            "Call it with float16 or float64 inputs and compare with a float64 reference.",
            "The vendor kernel reads every buffer as float32. Who makes sure it gets float32?",
            "Raise a TypeError naming the dtype unless query, key and value are all float32, "
            "or convert explicitly and return the caller's dtype.",
        ),
    ),
    _flaw(
        "shape",
        "No shape check: wrong head dim, mismatched or wrong-rank inputs",
        8,
        partial_points=4,
        where="attention_wrapper.py: `batch_size, seq_len, _ = query.shape` and nothing else",
        code=[(WRAPPER, "batch_size, seq_len, _ = query.shape")],
        hints=(
            "Try a head dim of 32, a key with a different length, and a 2-D or 4-D query.",
            "The kernel assumes (batch, seq, 64) for all three tensors. "
            "An unpack ValueError does not name the problem.",
            "Check ranks, equal shapes and head dim 64 before the call; raise ValueError "
            "with the expected and the actual shape.",
        ),
    ),
    _flaw(
        "contiguity",
        "Raw pointers of views: strided inputs are read as if dense",
        8,
        partial_points=4,
        where="attention_wrapper.py: data_ptr() of possibly non-contiguous tensors",
        code=[(WRAPPER, "query.data_ptr(),")],
        hints=(
            "Pass query.transpose(0, 1) of a (seq, batch, 64) tensor, or an expanded key.",
            "data_ptr() is only the first element; the kernel assumes dense row-major strides.",
            "Make one contiguous copy (`.contiguous()`) of each input before taking pointers.",
        ),
    ),
    _flaw(
        "device",
        "No device check or dispatch",
        10,
        partial_points=5,
        where="attention_wrapper.py: DEVICE chosen once at import; pointers passed blindly",
        code=[(WRAPPER, "DEVICE = "), (WRAPPER, "torch.empty_like(")],
        hints=(
            "Give it meta tensors, or mix a CPU tensor with a meta one "
            "(and on a GPU, CPU tensors to the CUDA build).",
            "A pointer does not say which device it lives on; the kernel trusts it. "
            "The output's device should follow the inputs, not a global.",
            "Check that all inputs share one device the library supports and raise a "
            "ValueError naming the devices; allocate the output on the inputs' device.",
        ),
    ),
    _flaw(
        "error-code",
        "The vendor's return code is ignored",
        8,
        where="attention_wrapper.py: the result of launch_attention_kernel is dropped",
        code=[(WRAPPER, "_lib.launch_attention_kernel(")],
        hints=(
            "What does the kernel do with seq_len 4097?",
            "The library returns nonzero and writes nothing; the wrapper returns the "
            "uninitialised output anyway.",
            "Check the return code and raise with a message naming it (and the length limit); "
            "better, check seq_len <= 4096 before calling.",
        ),
    ),
    _flaw(
        "host-alloc",
        "Output allocated on the host, then copied to the device",
        8,
        [Need.CUDA],
        where="attention_wrapper.py: torch.empty_like(query, device='cpu').to(DEVICE)",
        code=[(WRAPPER, "torch.empty_like(")],
        hints=(
            "Profile one call on a GPU: what copies and synchronisations do you see?",
            "empty_like on the CPU followed by .to('cuda') is a pageable host-to-device copy "
            "and a host sync on every call.",
            "Allocate the output directly on the inputs' device, from the contiguous query "
            "(empty_like keeps a view's strides): torch.empty_like(query.contiguous()).",
        ),
    ),
    _flaw(
        "stream",
        "Kernel runs on the legacy default stream",
        12,
        [Need.CUDA],
        where="vendor library launches on stream 0; the wrapper ignores torch's current stream",
        code=[(VENDOR_CUDA, "<<<")],
        hints=(
            "Call it inside `with torch.cuda.stream(s):` and use the output on s right away.",
            "The kernel is ordered on the legacy default stream, not on the stream PyTorch "
            "made current; CUDA-graph capture fails for the same reason.",
            "Pass torch.cuda.current_stream() to the library (an ABI change, with a reason), "
            "or build a real operator that launches on getCurrentCUDAStream().",
        ),
    ),
    _flaw(
        "autograd",
        "No backward: gradients silently missing",
        10,
        where="attention_wrapper.py: fast_attention returns a tensor with no grad_fn",
        code=[(WRAPPER, "def fast_attention"), (WRAPPER, "return output")],
        hints=(
            "Use it inside a loss with other terms and compare the gradients with a reference.",
            "The output has no grad_fn, so backward() succeeds but the attention term "
            "contributes nothing.",
            "Wrap it in a torch.autograd.Function (or register_autograd on a torch.library op) "
            "with a real backward.",
        ),
    ),
    _flaw(
        "library-path",
        "dlopen by a relative path (CWE-427)",
        6,
        where="attention_wrapper.py: ctypes.CDLL('./custom_attention.so')",
        code=[(WRAPPER, "ctypes.CDLL(")],
        hints=(
            "Import the wrapper from another working directory.",
            "'./custom_attention.so' is resolved against the current working directory, "
            "so whoever controls that directory controls the code you load.",
            "Load the library by an absolute path built from the module's own location "
            "(Path(__file__).resolve().parent).",
        ),
    ),
    _flaw(
        "compile",
        "Opaque to PyTorch: torch.compile cannot trace it",
        8,
        where="attention_wrapper.py: a ctypes call on data_ptr()s inside a plain function",
        code=[(WRAPPER, "_lib.launch_attention_kernel(")],
        hints=(
            "Try torch.compile(fast_attention, fullgraph=True).",
            "Dynamo cannot trace into ctypes, and there is no schema or fake kernel to "
            "reason about shapes.",
            "Register a torch.library custom op with a fake (meta) implementation, "
            "or build a real operator with TORCH_LIBRARY.",
        ),
    ),
    _flaw(
        "multi-gpu",
        "Hard-coded device, no device guard",
        6,
        [Need.CUDA, Need.TWO_GPUS],
        where="attention_wrapper.py: DEVICE = 'cuda'; the kernel launches on the current device",
        code=[(WRAPPER, "DEVICE = "), (VENDOR_CUDA, "<<<")],
        hints=(
            "Put the inputs on cuda:1 while the current device is 0.",
            "'cuda' means the current device, and the kernel launches there, "
            "whatever device the pointers belong to.",
            "Allocate on query.device and run under torch.cuda.device(query.device) "
            "(a device guard in C++).",
        ),
    ),
    _flaw(
        "int32-sizes",
        "32-bit sizes and indices",
        8,
        [Need.CUDA, Need.BIG_MEMORY],
        where="vendor library: int batch_size, seq_len and int offsets",
        code=[(VENDOR_CUDA, "int rows = "), (VENDOR_CUDA, "const float* k_batch = ")],
        hints=(
            "How many elements does (batch, 4096, 64) hold when batch is 8193?",
            "batch * seq * 64 passes 2^31 and the int offsets wrap around.",
            "Refuse inputs over 2^31 - 1 elements with a clear error, or change the ABI "
            "to int64_t sizes and offsets.",
        ),
    ),
)

BY_ID: dict[str, Flaw] = {flaw.id: flaw for flaw in CATALOG}


def get(flaw_id: str) -> Flaw:
    """A flaw of round one. Round two's catalog (round2.py, which imports this module) is
    not looked up here: its callers know whether this copy has it (a handout does not)."""
    try:
        return BY_ID[flaw_id]
    except KeyError:
        known = ", ".join(BY_ID)
        raise KataError(f"unknown flaw id {flaw_id!r}; known ids: {known}") from None
