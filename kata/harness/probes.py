"""One probe per flaw id. Each runs inside an isolated child process (child.py) and returns
a Verdict: "fixed" when the implementation behaves, "partial" when a validation fix covers some of
query, key and value, "present" with evidence when it does not.

Input probes follow DESIGN.md's rule, correct or loud (kata.harness.judging): for each input the
implementation returns the float64 reference result or raises at the call with a message naming
the problem; on inputs the vendor kernel supports, the answer must be the kernel's. Capability
probes require the capability to work.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from kata.harness import reference
from kata.harness.judging import (
    ARGUMENTS,
    Case,
    Outcome,
    ProbeContext,
    SampledRows,
    Verdict,
    dtype_name,
    first_line,
    judge,
    judge_cases,
    kernel_failure,
    names_problem,
    overwritten,
    poisoned_context,
    valid_call_works,
    verdict,
    wrong_answer,
)
from kata.harness.remote import ImplementationImportError, RemoteError, materialize, pack_all

__all__ = ["PROBES", "ImplementationImportError", "ProbeContext", "Verdict"]

# --------------------------------------------------------------------------- input probes

DTYPE_NAMES = {
    torch.float16: ("float16", "half", "fp16", "f16"),
    torch.bfloat16: ("bfloat16", "bf16"),
    torch.float64: ("float64", "double", "fp64", "f64"),
    torch.int32: ("int32", "int"),
    torch.int64: ("int64", "long"),
    torch.int16: ("int16", "short"),
    torch.uint8: ("uint8", "byte"),
    torch.bool: ("bool", "boolean"),
    torch.complex64: ("complex64", "complex", "cfloat", "complexfloat"),
}
# Tensors with no attention to compute, for the dtype probe: int32, the width of float32, always
# (a check of the element size lets it through), and one of the others, a different one per seed
# (a check that lists the dtypes it refuses, rather than requiring float32, passes the float
# cases and reads these bytes as float32 too).
NOT_FLOATING = (torch.int64, torch.int16, torch.uint8, torch.bool, torch.complex64)
EXPECTED_DTYPE = ("float32", "float", "fp32", "f32", "single")


def probe_dtype(ctx: ProbeContext) -> Verdict:
    cases = []
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        if dtype is torch.float64 and ctx.device == "cuda":
            continue  # float64 on a GPU may be refused loudly or computed; float16 tells enough
        inputs = ctx.inputs(2, 64, 64, dtype=dtype)
        cases.append(_dtype_case(f"{dtype_name(dtype)} inputs", inputs, ARGUMENTS, dtype))
    # One argument of another dtype at a time: each must be checked, not only the query. Mixed
    # dtypes may be refused or computed; computed, the loosest dtype's tolerance applies.
    odd_ones = (torch.float16, torch.float16, torch.bfloat16)
    for argument, dtype in zip(ARGUMENTS, odd_ones, strict=True):
        inputs = list(ctx.inputs(2, 64, 64))
        inputs[ARGUMENTS.index(argument)] = inputs[ARGUMENTS.index(argument)].to(dtype)
        name = f"{dtype_name(dtype)} {argument}, float32 others"
        cases.append(_dtype_case(name, tuple(inputs), (argument,), dtype))
    # No attention to compute (SDPA refuses them too): only a loud error will do.
    for dtype in (torch.int32, random.Random(f"{ctx.seed}/dtype").choice(NOT_FLOATING)):
        inputs = tuple(_not_floating(t, dtype) for t in ctx.inputs(2, 64, 64))
        mentions = (*ARGUMENTS, *DTYPE_NAMES[dtype], *EXPECTED_DTYPE)
        args = frozenset(ARGUMENTS)
        cases.append(Case(f"{dtype_name(dtype)} inputs", inputs, mentions, args, defined=False))
    outcomes = [judge(ctx, case) for case in cases]
    return verdict(ctx, outcomes, control=valid_call_works(ctx), per_argument=True)


def _not_floating(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Standard-normal `values` as `dtype`, with few zeros: integers to about +-100 (0 to 200
    unsigned), a sign as bool, complex with an imaginary part of its own."""
    if dtype is torch.bool:
        return values > 0
    if dtype.is_complex:
        return torch.complex(values, values.roll(1, -1)).to(dtype)
    scaled = (values * 50).round()
    return (scaled.abs() if dtype is torch.uint8 else scaled).to(dtype)


def _dtype_case(name, inputs, arguments, dtype) -> Case:
    # The vendor kernel computes in float32: converting to it and casting the result back (a
    # contract rubric.md accepts) is as accurate as float32, float64 inputs included.
    dtypes = [*(t.dtype for t in inputs), torch.float32]
    loosest = max(dtypes, key=lambda d: reference.TOLERANCE[d])
    return Case(
        name,
        inputs,
        mentions=(*arguments, *DTYPE_NAMES[dtype], *EXPECTED_DTYPE),
        args=frozenset(arguments),
        tolerance_dtype=loosest,
    )


def _shape_words(*tensors) -> tuple[str, ...]:
    """How a message may name shapes: each size, and each shape as a tuple or a list."""
    words = {str(size) for t in tensors for size in t.shape}
    for t in tensors:
        sizes = ", ".join(str(size) for size in t.shape)
        words |= {f"({sizes})", f"[{sizes}]", f"{t.dim()}-d", f"{t.dim()}d"}
    return tuple(sorted(words))


WIDE_HEAD_DIMS = (80, 96, 128, 256)


def probe_shape(ctx: ProbeContext) -> Verdict:
    ranks = ("3-d", "3d", "3 dimensions", "3 dims", "(batch, seq, 64)")
    cases = [
        Case("head dim 32", ctx.inputs(2, 64, 32), (*ARGUMENTS, "32", "64"), frozenset(ARGUMENTS)),
        Case(
            "key/value longer than query (L=48, S=80)",
            ctx.inputs(2, 48, 64, kv_len=80),
            (*ARGUMENTS, "48", "80"),
            frozenset({"key", "value"}),
        ),
    ]
    ranked = (("2-D inputs (L, E)", (64, 64)), ("4-D inputs (B, H, L, E)", (2, 3, 32, 64)))
    for name, shape in ranked:
        inputs = ctx.inputs(*shape)
        words = (*ARGUMENTS, *ranks, *_shape_words(inputs[0]))
        cases.append(Case(name, inputs, words, frozenset(ARGUMENTS)))
    # One argument of a shape the others cannot go with: each must be checked on its own.
    query, key, value = ctx.inputs(2, 64, 64)
    narrow = ctx.inputs(2, 64, 32)[0]
    long_value = ctx.inputs(2, 80, 64)[2]
    for argument, inputs, words in (
        ("query", (narrow, key, value), ("32", "64")),
        ("key", (query, narrow, value), ("32", "64")),
        ("value", (query, key, long_value), ("80", "64")),
    ):
        wrong = inputs[ARGUMENTS.index(argument)]
        name = f"{argument} of shape {tuple(wrong.shape)}, the others (2, 64, 64)"
        mentions = (argument, *words, *_shape_words(wrong))
        cases.append(Case(name, inputs, mentions, frozenset({argument}), defined=False))
    # A head dim above 64 too, a different one per seed: a check for too few elements (the
    # kernel's reads past the end) lets it through, and the kernel then reads rows at a 64 stride.
    wide = random.Random(f"{ctx.seed}/shape").choice(WIDE_HEAD_DIMS)
    words = (*ARGUMENTS, str(wide), "64")
    cases.append(Case(f"head dim {wide}", ctx.inputs(2, 64, wide), words, frozenset(ARGUMENTS)))
    outcomes = [judge(ctx, case) for case in cases]
    return verdict(ctx, outcomes, control=valid_call_works(ctx), per_argument=True)


CONTIGUITY_WORDS = ("contiguous", "non-contiguous", "stride", "strides", "strided", "view", "dense")


def probe_contiguity(ctx: ProbeContext) -> Verdict:
    q, k, v = ctx.inputs(2, 64, 64)
    seq_major = ctx.inputs(64, 2, 64)[0]  # (L, B, E) storage
    wide = ctx.inputs(2, 64, 128)[1]  # the first 64 columns of a wider tensor
    shared = ctx.inputs(1, 64, 64)[2]  # one batch item broadcast to two
    cases = [
        ("query", "transposed query", (seq_major.transpose(0, 1), k, v)),
        ("key", "sliced key", (q, wide[..., :64], v)),
        ("value", "expanded value", (q, k, shared.expand(2, 64, 64))),
    ]
    outcomes = [
        judge(ctx, Case(name, inputs, (argument, *CONTIGUITY_WORDS), frozenset({argument})))
        for argument, name, inputs in cases
    ]
    return verdict(ctx, outcomes, control=valid_call_works(ctx), per_argument=True)


DEVICE_WORDS = ("cpu", "cuda", "cuda:0", "meta", "same device", "one device")


def probe_device(ctx: ProbeContext) -> Verdict:
    cases = []
    # On a GPU machine first: a meta crash must not hide what the GPU cases show.
    others = ["cuda", "meta"] if ctx.device == "cuda" else ["meta"]
    home = ctx.device
    for other in others:
        if other == "cuda":
            # CPU tensors on a CUDA machine have an answer (compute it on the CPU, or refuse).
            inputs = ctx.inputs(2, 64, 64, device="cpu")
            cases.append(Case("cpu inputs on a CUDA machine", inputs, (*ARGUMENTS, *DEVICE_WORDS)))
            stray = "cpu"
        else:
            inputs = ctx.inputs(2, 64, 64, device="meta")
            cases.append(Case("meta inputs", inputs, (*ARGUMENTS, *DEVICE_WORDS)))
            stray = "meta"
        # One argument on another device at a time: no answer, each must be refused.
        for argument in ARGUMENTS:
            inputs = list(ctx.inputs(2, 64, 64, device=home))
            index = ARGUMENTS.index(argument)
            inputs[index] = inputs[index].to(stray)
            name = f"{stray} {argument}, {home} others"
            mentions = (argument, *DEVICE_WORDS)
            cases.append(Case(name, tuple(inputs), mentions, frozenset({argument}), defined=False))
    outcomes = judge_cases(ctx, cases)  # on a GPU each case ends its runner: in lanes
    return verdict(ctx, outcomes, control=valid_call_works(ctx), per_argument=True)


def probe_happy_path(ctx: ProbeContext) -> Verdict:
    """Plain float32 (B, L, 64) inputs, on the CPU and (on a GPU machine) on the GPU: the one
    input every implementation must get right, on every device it accepts."""
    devices = ["cpu", "cuda"] if ctx.device == "cuda" else ["cpu"]
    outcomes = [
        judge(ctx, Case(f"float32 (2, 128, 64) on {device}", ctx.inputs(2, 128, 64, device=device)))
        for device in devices
    ]
    return verdict(ctx, outcomes)


# What names the length problem itself: the argument, the length, the limit.
LIMIT_WORDS = (*ARGUMENTS, "seq_len", "seq_length", "sequence length", "4096", "4097")
# Round one's flaw is an ignored status; raising with the vendor's status (its code or CUDA's
# name for it, "invalid argument") is that flaw's fix, so the status words count there too.
LENGTH_WORDS = (
    *LIMIT_WORDS,
    "returned 1",
    "code 1",
    "code: 1",
    "status 1",
    "status: 1",
    "error 1",
    "cudaerrorinvalidvalue",
    "invalid argument",
)


def _over_the_limit(ctx: ProbeContext, mentions: tuple[str, ...]) -> Verdict:
    case = Case("seq_len 4097", ctx.inputs(1, 4097, 64), mentions, frozenset(ARGUMENTS))
    return verdict(ctx, [judge(ctx, case)], control=valid_call_works(ctx))


def probe_error_code(ctx: ProbeContext) -> Verdict:
    return _over_the_limit(ctx, LENGTH_WORDS)


def probe_length_limit(ctx: ProbeContext) -> Verdict:
    """Round two's error path: seq_len 4097 must be answered, or refused by a message that names
    the length or the limit; a status's wording ("invalid argument") names neither."""
    return _over_the_limit(ctx, LIMIT_WORDS)


# ---------------------------------------------------------------------- capability probes


def _gradient_errors(ctx, inputs, *, compiled=False) -> list[str]:
    """Backpropagate a loss that mixes attention with other terms, in the implementation's
    process; compare the output and every gradient here. The forward's answer must be the vendor
    kernel's, as in every probe."""
    weight = ctx.inputs(*inputs[0].shape)[0]
    tensors = {"weight": weight.cpu()}
    specs = pack_all(tensors, "in", inputs)
    ctx.load(upcoming=inputs)
    reply, received = ctx.remote.request(
        {"op": "gradients", "inputs": specs, "compile": compiled}, tensors
    )
    if "raised" in reply:
        raise RuntimeError(first_line(RemoteError(reply["raised"])))
    if reply.get("cuda_failed"):
        return [f"CUDA failed: {reply['cuda_failed']}"]
    output = materialize(reply["result"], received)
    errors = []
    if failure := wrong_answer(ctx, "forward", output, inputs):
        errors.append(failure)
    q, k, v = inputs
    _, dq, dk, dv = reference.attention_with_grads(q, k, v, weight)
    dq, dk, dv = dq + 2 * q.detach().double().cpu(), dk + k.detach().double().cpu().cos(), dv + 0.5
    for name, expected in (("query", dq), ("key", dk), ("value", dv)):
        if f"grad_{name}" not in received:
            errors.append(f"{name}.grad is None")
            continue
        error = reference.relative_error(received[f"grad_{name}"], expected)
        if error > 1e-4:
            errors.append(f"{name}.grad relative error {error:.2g}")
    if errors and not reply["result"].get("grad_fn"):
        errors.append("the output has no grad_fn, so the attention term added nothing")
    return errors


def probe_autograd(ctx: ProbeContext) -> Verdict:
    ctx.report_case("loss = attention term + other terms; backward")
    inputs = ctx.inputs(2, 32, 64)
    try:
        errors = _gradient_errors(ctx, inputs)
    except RuntimeError as error:
        return Verdict("present", f"backward through it raised {error}")
    if errors:
        return Verdict("present", "against the float64 reference: " + "; ".join(errors))
    return Verdict(
        "fixed",
        "a loss mixing the (2, 32, 64) float32 output with other terms: the output and the "
        "query, key and value gradients match the float64 reference",
    )


def probe_compile(ctx: ProbeContext) -> Verdict:
    ctx.report_case("torch.compile(fullgraph=True, backend='aot_eager'), forward and backward")
    inputs = ctx.inputs(2, 64, 64)
    try:
        errors = _gradient_errors(ctx, inputs, compiled=True)
    except RuntimeError as error:
        return Verdict("present", f"torch.compile(fullgraph=True) failed: {error}")
    if errors:
        return Verdict("present", "compiled: " + "; ".join(errors))
    return Verdict(
        "fixed",
        "torch.compile(fullgraph=True, backend='aot_eager') traced it; the compiled forward and "
        "its gradients match the float64 reference",
    )


def probe_library_path(ctx: ProbeContext) -> Verdict:
    """The implementation's process starts in a fresh empty working directory, not the
    implementation's directory."""
    from kata.toolchain.builders import LIBRARY_NAME, PLANTED_MARKER

    home = Path.cwd()
    failures = []

    ctx.report_case("import and call from another working directory")
    (home / "elsewhere").mkdir()
    try:
        inputs = ctx.inputs(2, 64, 64)
        ctx.load("wrapper_imported_elsewhere", chdir=home / "elsewhere", upcoming=inputs)
        answer = ctx.call(inputs, module="wrapper_imported_elsewhere")
        if answer.error is not None:
            failures.append(
                f"a call from another working directory failed: {first_line(answer.error)}"
            )
        else:
            name = "call from elsewhere"
            if failure := (
                overwritten(name, answer)
                or wrong_answer(ctx, name, answer.result, inputs)
                or ctx.checked_after(name, module="wrapper_imported_elsewhere", inputs=inputs)
            ):
                failures.append(failure)
    except ImplementationImportError as error:
        failures.append(f"import from another working directory failed: {error.cause}")

    ctx.report_case("a planted ./custom_attention.so in the working directory")
    (home / "planted").mkdir()
    shutil.copyfile(ctx.planted_library, home / "planted" / LIBRARY_NAME)
    tensors = {}
    specs = pack_all(tensors, "in", ctx.inputs(2, 64, 64))
    request = {"op": "planted", "module": "wrapper_imported_beside_planted", "inputs": specs}
    ctx.remote.request({**request, "chdir": str(home / "planted")}, tensors)
    if (home / "planted" / PLANTED_MARKER).exists():  # seen here, not taken from the runner
        failures.append(f"a planted ./{LIBRARY_NAME} in the working directory was loaded")

    if failures:
        return Verdict("present", "; ".join(failures))
    return Verdict(
        "fixed",
        "imported and called from another working directory (right answer), and beside a "
        f"planted ./{LIBRARY_NAME}, which was never loaded",
    )


# --------------------------------------------------------------------------- GPU probes

# Runtime calls that block the host until the device (or a stream) is done: inside a call they
# cost what the host round trip costs, whoever makes them (torch.cuda.synchronize, ctypes).
SYNCHRONISING_CALLS = (
    "cudaDeviceSynchronize",
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",  # the synchronous copy; cudaMemcpyAsync is another name
    "cuCtxSynchronize",
    "cuStreamSynchronize",
)


def probe_host_alloc(ctx: ProbeContext) -> Verdict:
    inputs = ctx.inputs(2, 256, 64)
    ctx.report_case("one warmed-up call under the profiler, one under set_sync_debug_mode")
    answer = ctx.call(inputs, op="host_alloc")
    reply, findings = answer.header, []
    copies = [name for name in reply["all"] if "Memcpy HtoD" in name]
    if copies:
        findings.append(f"a host-to-device copy in every call (profiler: {', '.join(copies)})")
    if not reply["window"]:
        findings.append("the profiler did not record the call (was the profiler disabled?)")
    elif syncs := [name for name in reply["inside"] if name in SYNCHRONISING_CALLS]:
        findings.append(
            f"a host synchronisation inside every call (profiler: {', '.join(syncs)}): the host "
            "waits for the device, as the host round trip makes it wait"
        )
    if failure := wrong_answer(ctx, "profiled call", answer.result, inputs):
        findings.append(failure)
    if reply["sync_debug"]:
        findings.append(f"a host synchronisation in every call ({reply['sync_debug']})")
    if reply.get("waited") and not findings:
        findings.append(
            "the call returned only after the device had finished work queued before it "
            "(torch.cuda._sleep): it waits for the device (a synchronize, a blocking copy or an "
            "event polled in a loop)"
        )
    if answer.cuda_failed:
        findings.append(answer.cuda_failed)
    for finding in findings:
        ctx.report_failure(finding)
    if findings:
        return Verdict("present", "; ".join(findings))
    return Verdict(
        "fixed",
        "one (2, 256, 64) call under the profiler: no host-to-device copy and no synchronising "
        f"runtime call ({', '.join(SYNCHRONISING_CALLS[:3])}, ...); under "
        "set_sync_debug_mode('error') no synchronising torch call; the answer is right",
    )


STREAM_TRIALS = 5


def probe_stream(ctx: ProbeContext) -> Verdict:
    findings = []
    batch, length = 32, 4096  # long enough per call that a missing stream dependency shows
    sample = SampledRows([0, batch // 2, batch - 1], list(range(0, length, 257)))
    wrong = []
    ctx.load()
    for trial in range(STREAM_TRIALS):
        ctx.report_case(f"side stream, trial {trial + 1}: inputs made, call, output consumed on s")
        request = {"op": "stream", "shape": [batch, length, 64], "seed": ctx.seed + trial}
        _, received = ctx.remote.request(request)
        consumed = received["result"].to("cuda")
        inputs = _cuda_randn(ctx, 3, (batch, length, 64), trial)  # the same, made here
        error = sample.error(consumed, inputs)
        if error > reference.TOLERANCE[torch.float32]:
            wrong.append(error)
        elif failure := kernel_failure(ctx, f"side stream, trial {trial + 1}", consumed, inputs):
            findings.append(failure)
            break
    if wrong:
        findings.append(
            f"output consumed on the current stream was wrong in {len(wrong)}/{STREAM_TRIALS} "
            f"trials (relative error up to {max(wrong):.2g}): the kernel is not ordered on it"
        )
    for finding in findings:
        ctx.report_failure(finding)

    ctx.report_case("CUDA graph: capture one call, replay on new inputs")
    static, fresh = ctx.inputs(4, 256, 64), ctx.inputs(4, 256, 64)
    tensors = {}
    specs, new = pack_all(tensors, "in", static), pack_all(tensors, "new", fresh)
    reply, received = ctx.remote.request({"op": "graph", "inputs": specs, "fresh": new}, tensors)
    if "raised" in reply:
        findings.append(f"CUDA-graph capture failed: {first_line(RemoteError(reply['raised']))}")
    else:
        replayed = materialize(reply["result"], received)
        name = "graph replay on new inputs"
        if failure := wrong_answer(ctx, name, replayed, fresh):
            findings.append(failure)
    if failure := poisoned_context(ctx):
        findings.append(failure)
    if findings:
        return Verdict("present", "; ".join(findings))
    return Verdict(
        "fixed",
        f"({batch}, {length}, 64) inputs made and the output consumed on a side stream: right "
        f"in {STREAM_TRIALS}/{STREAM_TRIALS} trials; one call captured in a CUDA graph and "
        "replayed on new inputs: right",
    )


def probe_multi_gpu(ctx: ProbeContext) -> Verdict:
    inputs = ctx.inputs(2, 128, 64, device="cuda:1")
    name = "inputs on cuda:1, current device 0"
    ctx.report_case(name)
    answer = ctx.call(inputs, set_device=0)
    # A loud refusal is not enough here: the capability is the point.
    if answer.cuda_failed:
        failure = f"{name}: CUDA failed after the call returned: {answer.cuda_failed}"
    elif answer.error is not None:
        failure = f"{name}: raised {first_line(answer.error)}, but inputs on a second GPU must work"
    else:
        failure = wrong_answer(ctx, name, answer.result, inputs)
    if failure:
        return Verdict("present", failure)
    return Verdict(
        "fixed", "(2, 128, 64) inputs on cuda:1 with device 0 current: the right result, on cuda:1"
    )


SIZE_WORDS = (
    *ARGUMENTS,
    "2^31",
    "2**31",
    "2 ** 31",
    "2147483647",
    "2147483648",
    "int32",
    "32-bit",
    "int64",
    "elements",
    "524289",
)


def probe_int32_sizes(ctx: ProbeContext) -> Verdict:
    # (524289, 64, 64) holds 2^31 + 4096 elements: offsets past 2^31 - 1 wrap in 32 bits. The
    # inputs are made in both processes from one seed: too large to send.
    batch, length = 2**31 // (64 * 64) + 1, 64
    name = f"({batch}, {length}, 64) float32, past 2^31 elements"
    ctx.report_case(name)
    sample = SampledRows([0, batch // 2, batch - 1], list(range(0, length, 7)))
    ctx.load()
    request = {"op": "big", "shape": [batch, length, 64], "seed": ctx.seed}
    request |= {"batches": sample.batches, "rows": sample.rows}
    reply, received = ctx.remote.request(request)
    failure, note = None, f"{name}: correct"
    if reply.get("cuda_failed"):
        failure = f"{name}: CUDA failed after the call returned: {reply['cuda_failed']}"
    elif "raised" in reply:
        error = RemoteError(reply["raised"])
        if not names_problem(error, SIZE_WORDS):
            failure = f"{name}: raised an error that does not name the problem: {first_line(error)}"
        else:
            note = f"{name}: raised {first_line(error)}"
    elif reply["result"].get("type") != "Tensor" or "sample" not in received:
        failure = f"{name}: returned {reply['result'].get('type')} of the wrong shape"
    else:
        inputs = _cuda_randn(ctx, 3, (batch, length, 64))
        error = sample.error_of_rows(received["sample"], inputs)
        if error > reference.TOLERANCE[torch.float32]:
            failure = f"{name}: wrong result, relative error {error:.2g} (tolerance 1e-05)"
        del inputs
        torch.cuda.empty_cache()
    outcome = Outcome(name, failure, "" if failure else note, frozenset(ARGUMENTS))
    if failure:
        ctx.report_failure(failure)
    return verdict(ctx, [outcome], control=valid_call_works(ctx, device="cuda"))


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
    "length-limit": probe_length_limit,
    "happy-path": probe_happy_path,
    "autograd": probe_autograd,
    "library-path": probe_library_path,
    "compile": probe_compile,
    "host-alloc": probe_host_alloc,
    "stream": probe_stream,
    "multi-gpu": probe_multi_gpu,
    "int32-sizes": probe_int32_sizes,
}
