"""One probe per flaw id. Each runs inside an isolated child process (kata.child) and returns
a Verdict: "fixed" when the implementation behaves, "present" with evidence when it does not.

Input probes follow DESIGN.md's rule, correct or loud: for each input the implementation returns
the float64 reference result (within the dtype's tolerance, on the input's device, with the right
shape) or raises at the call with a message naming the problem. Capability probes require the
capability to work.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kata import reference


class ImplementationImportError(Exception):
    """Importing the implementation under test failed; the probe reports it as the evidence."""

    def __init__(self, cause: str):
        super().__init__(f"importing the implementation failed: {cause}")
        self.cause = cause


# Messages that mean the implementation tripped over the input instead of rejecting it.
UNRELATED_ERRORS = ("values to unpack", "not compiled with cuda")


@dataclass
class Verdict:
    status: str  # "fixed" or "present"
    evidence: str


@dataclass
class ProbeContext:
    """What a probe gets: the implementation's loader, a seeded generator, the device to test."""

    load: Callable[[str], Callable]  # module name -> fast_attention (imports the implementation)
    seed: int
    device: str
    report_case: Callable[[str], None] = lambda name: None
    # Failures are sent as they are found, so that they survive a later crash of the process.
    report_failure: Callable[[str], None] = lambda text: None
    planted_library: Path | None = None
    _fast_attention: Callable | None = field(default=None, repr=False)

    def __post_init__(self):
        self.generator = torch.Generator().manual_seed(self.seed)

    @property
    def fast_attention(self) -> Callable:
        if self._fast_attention is None:
            self._fast_attention = self.load("candidate_attention_wrapper")
        return self._fast_attention

    def inputs(self, *shape, dtype=torch.float32, kv_len=None, device=None):
        return tuple(
            t.to(device or self.device)
            for t in reference.random_inputs(
                *shape, dtype=dtype, generator=self.generator, kv_len=kv_len
            )
        )


def _first_line(error: BaseException) -> str:
    """The exception's type and first line, plus dynamo's one-line explanation when it gives one."""
    if isinstance(error, ImplementationImportError):
        return str(error)
    lines = [line.strip() for line in str(error).strip().splitlines()]
    summary = lines[0] if lines else ""
    explanation = next((line for line in lines if line.startswith("Explanation:")), None)
    if explanation:
        summary += ". " + explanation.removeprefix("Explanation:").strip()
    return f"{type(error).__name__}: {summary}"[:300]


def _names_problem(error: BaseException, keywords: tuple[str, ...]) -> bool:
    message = str(error).lower()
    if any(unrelated in message for unrelated in UNRELATED_ERRORS):
        return False
    return any(word in message for word in keywords)


def _check_result(name, result, expected, inputs) -> str | None:
    """None if `result` is the reference result for `inputs`, else what is wrong with it."""
    query = inputs[0]
    if not isinstance(result, torch.Tensor):
        return f"{name}: returned {type(result).__name__}, not a tensor"
    if result.device != query.device:
        return f"{name}: output on {result.device}, inputs on {query.device}"
    expected_shape = query.shape[:-1] + inputs[2].shape[-1:]
    if tuple(result.shape) != tuple(expected_shape):
        return f"{name}: output shape {list(result.shape)}, expected {list(expected_shape)}"
    if result.device.type == "meta":
        return None  # meta tensors carry no values: device and shape are the whole answer
    if isinstance(expected, _SampledRows):
        error = expected.error(result, inputs)
    else:
        error = reference.relative_error(result, expected)
    tolerance = reference.TOLERANCE[query.dtype]
    if error > tolerance:
        return f"{name}: wrong result, relative error {error:.2g} (tolerance {tolerance:.0e})"
    return None


def correct_or_loud(ctx, name, inputs, keywords, **options):
    """Judge one call: (failure or None, note). `defined=False` in options: the inputs have no
    answer, only a loud error will do."""
    failure, note = _judge_call(ctx, name, inputs, keywords, **options)
    if failure:
        ctx.report_failure(failure)
    return failure, note


def _judge_call(ctx, name, inputs, keywords, *, expected=None, defined=True, **kwargs):
    ctx.report_case(name)
    fast_attention = ctx.fast_attention
    try:
        result = fast_attention(*inputs, **kwargs)
    except Exception as error:
        if failure := _asynchronous_cuda_error(name):
            return failure, ""
        if _names_problem(error, keywords):
            return None, f"{name}: raised {_first_line(error)}"
        return f"{name}: raised an error that does not name the problem: {_first_line(error)}", ""
    if failure := _asynchronous_cuda_error(name):
        return failure, ""
    if not defined:
        return f"{name}: returned a result for inputs that have no answer (no error raised)", ""
    if expected is None:
        expected = _expected(inputs)
    return _check_result(name, result, expected, inputs), f"{name}: correct"


def _asynchronous_cuda_error(name) -> str | None:
    """Kernels fail after the call returns: synchronise so the failure lands on this case."""
    if not torch.cuda.is_initialized():
        return None
    try:
        torch.cuda.synchronize()
    except Exception as error:
        return f"{name}: CUDA failed after the call returned: {_first_line(error)}"
    return None


def _poisoned_context() -> str | None:
    """A fresh CUDA operation must still work after the probe's calls."""
    if not torch.cuda.is_initialized():
        return None
    try:
        if torch.ones(4, device="cuda").add_(1).sum().item() != 8:
            return "a fresh CUDA operation gave a wrong result afterwards"
    except Exception as error:
        return f"the process's CUDA context is poisoned afterwards: {_first_line(error)}"
    return None


def valid_call_works(ctx, shape=(2, 64, 64), device=None) -> str | None:
    """The control of every input probe: None if a valid float32 call (on `device`, else the
    probe's device) gives the reference result, else what went wrong. Loud answers count only
    while this holds: an implementation that raises on everything would otherwise pass every
    input probe."""
    name = f"a valid float32 {tuple(shape)} call" + (f" on {device}" if device else "")
    ctx.report_case(name)
    try:
        inputs = ctx.inputs(*shape, device=device)
        result = ctx.fast_attention(*inputs)
    except Exception as error:
        return f"{name} raised {_first_line(error)}: refusing valid input is not loud, it is wrong"
    return _asynchronous_cuda_error(name) or _check_result(name, result, _expected(inputs), inputs)


def _expected(inputs):
    query, key, value = inputs
    if query.device.type == "meta":
        return torch.empty(query.shape, device="meta")
    return reference.attention(query, key, value)


def _verdict(outcomes, control: str | None = None) -> Verdict:
    """Many (failure, success note) pairs into one verdict. `control`: the failure of
    valid_call_works, which decides only when the verdict would rest on a loud answer."""
    failures = [failure for failure, _ in outcomes if failure]
    count = f" [{len(failures)}/{len(outcomes)} cases]" if failures else ""
    if control and not failures and any("raised" in note for _, note in outcomes):
        failures.append(control)
    if poisoned := _poisoned_context():
        failures.append(poisoned)
    if failures:
        shown = "; ".join(failures[:2])
        more = f" (+{len(failures) - 2} more)" if len(failures) > 2 else ""
        return Verdict("present", f"{shown}{more}{count}")
    loud = [note for failure, note in outcomes if "raised" in note]
    summary = f"{len(outcomes)} case{'s' if len(outcomes) > 1 else ''} correct or loud"
    return Verdict("fixed", f"{summary}; e.g. {loud[0]}" if loud else summary)


# --------------------------------------------------------------------------- input probes

DTYPE_WORDS = ("dtype", "float", "half", "double", "bfloat16", "type")
SHAPE_WORDS = ("shape", "dim", "size", "rank", "head", "match", "length")
CONTIGUITY_WORDS = ("contiguous", "stride", "view")
DEVICE_WORDS = ("device", "meta", "cpu", "cuda")
LENGTH_WORDS = ("seq", "length", "4096", "4097", "code", "status", "limit", "long")


def probe_dtype(ctx: ProbeContext) -> Verdict:
    outcomes = []
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        if dtype is torch.float64 and ctx.device == "cuda":
            continue  # float64 on a GPU may be refused loudly or computed; float16 tells enough
        inputs = ctx.inputs(2, 64, 64, dtype=dtype)
        outcomes.append(correct_or_loud(ctx, f"{_dtype_name(dtype)} inputs", inputs, DTYPE_WORDS))
    return _verdict(outcomes, control=valid_call_works(ctx))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def probe_shape(ctx: ProbeContext) -> Verdict:
    cases = [
        ("head dim 32", ctx.inputs(2, 64, 32), True),
        ("key/value longer than query (L=48, S=80)", ctx.inputs(2, 48, 64, kv_len=80), True),
        ("2-D inputs (L, E)", ctx.inputs(64, 64), True),
        ("4-D inputs (B, H, L, E)", ctx.inputs(2, 3, 32, 64), True),
    ]
    query, _, _ = ctx.inputs(2, 64, 64)
    _, key, value = ctx.inputs(2, 64, 32)
    cases.append(("key/value head dim 32, query's 64", (query, key, value), False))
    outcomes = [
        correct_or_loud(ctx, name, inputs, SHAPE_WORDS, defined=defined)
        for name, inputs, defined in cases
    ]
    return _verdict(outcomes, control=valid_call_works(ctx))


def probe_contiguity(ctx: ProbeContext) -> Verdict:
    q, k, v = ctx.inputs(2, 64, 64)
    seq_major = ctx.inputs(64, 2, 64)[0]  # (L, B, E) storage
    wide = ctx.inputs(2, 64, 128)[1]  # the first 64 columns of a wider tensor
    shared = ctx.inputs(1, 64, 64)[2]  # one batch item broadcast to two
    cases = [
        ("transposed query", (seq_major.transpose(0, 1), k, v)),
        ("sliced key", (q, wide[..., :64], v)),
        ("expanded value", (q, k, shared.expand(2, 64, 64))),
    ]
    outcomes = [correct_or_loud(ctx, n, i, CONTIGUITY_WORDS) for n, i in cases]
    return _verdict(outcomes, control=valid_call_works(ctx))


def probe_device(ctx: ProbeContext) -> Verdict:
    outcomes = []
    if ctx.device == "cuda":  # first: a meta crash must not hide what the GPU cases show
        cpu_inputs = ctx.inputs(2, 64, 64, device="cpu")
        outcomes.append(
            correct_or_loud(ctx, "cpu inputs on a CUDA machine", cpu_inputs, DEVICE_WORDS)
        )
        q, _, _ = ctx.inputs(2, 64, 64)
        _, k, v = ctx.inputs(2, 64, 64, device="cpu")
        mixed = (q, k, v)
        outcomes.append(
            correct_or_loud(ctx, "cuda query, cpu key/value", mixed, DEVICE_WORDS, defined=False)
        )
    outcomes.append(
        correct_or_loud(ctx, "meta inputs", ctx.inputs(2, 64, 64, device="meta"), DEVICE_WORDS)
    )
    q, _, _ = ctx.inputs(2, 64, 64, device="cpu")
    _, k, v = ctx.inputs(2, 64, 64, device="meta")
    outcomes.append(
        correct_or_loud(ctx, "cpu query, meta key/value", (q, k, v), DEVICE_WORDS, defined=False)
    )
    return _verdict(outcomes, control=valid_call_works(ctx))


def probe_happy_path(ctx: ProbeContext) -> Verdict:
    """Plain float32 (B, L, 64) inputs, on the CPU and (on a GPU machine) on the GPU: the one
    input every implementation must get right, on every device it accepts."""
    devices = ["cpu", "cuda"] if ctx.device == "cuda" else ["cpu"]
    outcomes = [
        correct_or_loud(
            ctx, f"float32 (2, 128, 64) on {device}", ctx.inputs(2, 128, 64, device=device), ()
        )
        for device in devices
    ]
    return _verdict(outcomes)


def probe_error_code(ctx: ProbeContext) -> Verdict:
    inputs = ctx.inputs(1, 4097, 64)
    outcome = correct_or_loud(ctx, "seq_len 4097", inputs, LENGTH_WORDS)
    return _verdict([outcome], control=valid_call_works(ctx))


# ---------------------------------------------------------------------- capability probes


def _gradient_errors(ctx, inputs, call) -> list[str]:
    """Backpropagate a loss that mixes attention with other terms; compare every gradient."""
    q, k, v = (t.detach().requires_grad_(True) for t in inputs)
    weight = ctx.inputs(*q.shape)[0]
    output = call(q, k, v)
    loss = (output * weight).sum() + (q * q).sum() + k.sin().sum() + 0.5 * v.sum()
    loss.backward()
    _, dq, dk, dv = reference.attention_with_grads(q, k, v, weight)
    dq, dk, dv = dq + 2 * q.detach().double().cpu(), dk + k.detach().double().cpu().cos(), dv + 0.5
    errors = []
    for name, tensor, expected in (("query", q, dq), ("key", k, dk), ("value", v, dv)):
        if tensor.grad is None:
            errors.append(f"{name}.grad is None")
            continue
        error = reference.relative_error(tensor.grad, expected)
        if error > 1e-4:
            errors.append(f"{name}.grad relative error {error:.2g}")
    if errors and getattr(output, "grad_fn", None) is None:
        errors.append("the output has no grad_fn, so the attention term added nothing")
    return errors


def probe_autograd(ctx: ProbeContext) -> Verdict:
    ctx.report_case("loss = attention term + other terms; backward")
    inputs = ctx.inputs(2, 32, 64)
    fast_attention = ctx.fast_attention
    try:
        errors = _gradient_errors(ctx, inputs, fast_attention)
    except Exception as error:
        return Verdict("present", f"backward through it raised {_first_line(error)}")
    if errors:
        return Verdict("present", "gradients differ from the reference: " + "; ".join(errors))
    return Verdict("fixed", "query, key and value gradients match the float64 reference")


def probe_compile(ctx: ProbeContext) -> Verdict:
    ctx.report_case("torch.compile(fullgraph=True, backend='aot_eager'), forward and backward")
    fast_attention = ctx.fast_attention
    compiled = torch.compile(fast_attention, fullgraph=True, backend="aot_eager")
    inputs = ctx.inputs(2, 64, 64)
    try:
        result = compiled(*inputs)
        failure = _check_result("compiled forward", result, _expected(inputs), inputs)
        if failure:
            return Verdict("present", failure)
        errors = _gradient_errors(ctx, inputs, compiled)
    except Exception as error:
        return Verdict("present", f"torch.compile(fullgraph=True) failed: {_first_line(error)}")
    if errors:
        return Verdict("present", "compiled gradients differ: " + "; ".join(errors))
    return Verdict("fixed", "compiles with fullgraph=True; forward and gradients match")


def probe_library_path(ctx: ProbeContext) -> Verdict:
    """Runs with a fresh empty working directory, not the implementation's directory."""
    from kata.builders import LIBRARY_NAME, PLANTED_MARKER

    home = Path.cwd()
    failures = []

    ctx.report_case("import and call from another working directory")
    (home / "elsewhere").mkdir()
    os.chdir(home / "elsewhere")
    try:
        fast_attention = ctx.load("wrapper_imported_elsewhere")
        inputs = ctx.inputs(2, 64, 64)
        failure = _check_result(
            "call from elsewhere", fast_attention(*inputs), _expected(inputs), inputs
        )
        if failure:
            failures.append(failure)
    except ImplementationImportError as error:
        failures.append(f"import from another working directory failed: {error.cause}")
    except Exception as error:
        failures.append(f"a call from another working directory failed: {_first_line(error)}")

    ctx.report_case("a planted ./custom_attention.so in the working directory")
    (home / "planted").mkdir()
    os.chdir(home / "planted")
    os.symlink(ctx.planted_library, LIBRARY_NAME)
    try:
        fast_attention = ctx.load("wrapper_imported_beside_planted")
        inputs = ctx.inputs(2, 64, 64)
        fast_attention(*inputs)
    except Exception:
        pass  # failing here is fine; loading the planted library is what matters
    if Path(PLANTED_MARKER).exists():
        failures.append(f"a planted ./{LIBRARY_NAME} in the working directory was loaded")

    if failures:
        return Verdict("present", "; ".join(failures))
    return Verdict("fixed", "works from any working directory; a planted library is never loaded")


# --------------------------------------------------------------------------- GPU probes


def probe_host_alloc(ctx: ProbeContext) -> Verdict:
    from torch.profiler import ProfilerActivity, profile

    fast_attention = ctx.fast_attention
    inputs = ctx.inputs(2, 256, 64)
    ctx.report_case("warm-up call")
    fast_attention(*inputs)
    torch.cuda.synchronize()
    findings = []

    ctx.report_case("one call under the profiler")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        result = fast_attention(*inputs)
        torch.cuda.synchronize()
    copies = sorted({e.name for e in profiler.events() if "Memcpy HtoD" in e.name})
    if copies:
        findings.append(f"a host-to-device copy in every call (profiler: {', '.join(copies)})")
    if failure := _check_result("profiled call", result, _expected(inputs), inputs):
        findings.append(failure)

    ctx.report_case("one call under torch.cuda.set_sync_debug_mode('error')")
    torch.cuda.set_sync_debug_mode("error")
    try:
        fast_attention(*inputs)
    except RuntimeError as error:
        findings.append(f"a host synchronisation in every call ({_first_line(error)})")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    if failure := _poisoned_context():
        findings.append(failure)
    for finding in findings:
        ctx.report_failure(finding)
    if findings:
        return Verdict("present", "; ".join(findings))
    return Verdict("fixed", "no host-to-device copy and no host synchronisation inside a call")


STREAM_TRIALS = 5


def probe_stream(ctx: ProbeContext) -> Verdict:
    fast_attention = ctx.fast_attention
    findings = []
    batch, length = 32, 4096  # long enough per call that a missing stream dependency shows
    sample = _SampledRows([0, batch // 2, batch - 1], list(range(0, length, 257)))
    wrong = []
    for trial in range(STREAM_TRIALS):
        ctx.report_case(f"side stream, trial {trial + 1}: inputs made, call, output consumed on s")
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            inputs = _cuda_randn(ctx, 3, (batch, length, 64), trial)  # made on the side stream
            consumed = fast_attention(*inputs).clone()  # and consumed on it right away
        torch.cuda.synchronize()
        error = sample.error(consumed, inputs)
        if error > reference.TOLERANCE[torch.float32]:
            wrong.append(error)
    if wrong:
        findings.append(
            f"output consumed on the current stream was wrong in {len(wrong)}/{STREAM_TRIALS} "
            f"trials (relative error up to {max(wrong):.2g}): the kernel is not ordered on it"
        )
        ctx.report_failure(findings[-1])

    ctx.report_case("CUDA graph: capture one call, replay on new inputs")
    static = ctx.inputs(4, 256, 64)
    try:
        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):
            fast_attention(*static)  # warm up outside capture, as torch.cuda.graphs asks
        torch.cuda.current_stream().wait_stream(warm)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_output = fast_attention(*static)
        fresh = ctx.inputs(4, 256, 64)
        for target, source in zip(static, fresh, strict=True):
            target.copy_(source)
        graph.replay()
        torch.cuda.synchronize()
        if failure := _check_result(
            "graph replay on new inputs", static_output, _expected(fresh), fresh
        ):
            findings.append(failure)
    except Exception as error:
        findings.append(f"CUDA-graph capture failed: {_first_line(error)}")
    if failure := _poisoned_context():
        findings.append(failure)
    if findings:
        return Verdict("present", "; ".join(findings))
    return Verdict(
        "fixed",
        f"right on the current stream in {STREAM_TRIALS}/{STREAM_TRIALS} trials; "
        "CUDA-graph capture and replay give right answers",
    )


def probe_multi_gpu(ctx: ProbeContext) -> Verdict:
    torch.cuda.set_device(0)
    inputs = ctx.inputs(2, 128, 64, device="cuda:1")
    outcome = correct_or_loud(ctx, "inputs on cuda:1, current device 0", inputs, ())
    # A loud refusal is not enough here: the capability is the point.
    failure, note = outcome
    if failure is None and "raised" in note:
        failure = f"{note}, but inputs on a second GPU must work"
    if failure:
        return Verdict("present", failure)
    return Verdict("fixed", "inputs on cuda:1 give the right result on cuda:1")


SIZE_WORDS = ("2^31", "2**31", "int32", "32-bit", "too large", "elements", "size", "overflow")


def probe_int32_sizes(ctx: ProbeContext) -> Verdict:
    # (524289, 64, 64) holds 2^31 + 4096 elements: offsets past 2^31 - 1 wrap in 32 bits.
    batch, length = 2**31 // (64 * 64) + 1, 64
    inputs = _cuda_randn(ctx, 3, (batch, length, 64))
    outcome = correct_or_loud(
        ctx,
        f"({batch}, {length}, 64) float32, past 2^31 elements",
        inputs,
        SIZE_WORDS,
        # the last batch item lies past 2^31 elements
        expected=_SampledRows([0, batch // 2, batch - 1], list(range(0, length, 7))),
    )
    return _verdict([outcome], control=valid_call_works(ctx, device="cuda"))


class _SampledRows:
    """An `expected` for correct_or_loud that checks a sample of (batch, row) pairs: the full
    float64 reference of a problem this large would take longer than the probe itself."""

    def __init__(self, batches, rows):
        self.batches, self.rows = batches, rows

    def error(self, result, inputs) -> float:
        query, key, value = inputs
        got = result[self.batches][:, self.rows]
        sample = query[self.batches][:, self.rows], key[self.batches], value[self.batches]
        return reference.relative_error(got, reference.attention(*sample))


def _cuda_randn(ctx, count, shape, trial=0):
    """Inputs made by kernels on the current stream (not copied from the host), seeded."""
    generator = torch.Generator(device="cuda").manual_seed(ctx.seed + trial)
    return tuple(torch.randn(shape, device="cuda", generator=generator) for _ in range(count))


PROBES: dict[str, Callable[[ProbeContext], Verdict]] = {
    "dtype": probe_dtype,
    "shape": probe_shape,
    "contiguity": probe_contiguity,
    "device": probe_device,
    "error-code": probe_error_code,
    "happy-path": probe_happy_path,
    "autograd": probe_autograd,
    "library-path": probe_library_path,
    "compile": probe_compile,
    "host-alloc": probe_host_alloc,
    "stream": probe_stream,
    "multi-gpu": probe_multi_gpu,
    "int32-sizes": probe_int32_sizes,
}
