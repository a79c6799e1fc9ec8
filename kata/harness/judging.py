"""How a probe judges one call, and many calls into one verdict.

The rule is DESIGN.md's, correct or loud: for each input the implementation returns the float64
reference result (within the dtype's tolerance, on the input's device, with the right shape), or
raises at the call an exception whose message names the problem: the argument's name, the
offending value or the expected one (`Case.mentions`). Two more rules keep the verdict honest:
on inputs the vendor kernel supports, the answer must be the kernel's (kernel_check), and the
validation probes try query, key and value each on its own (`Case.args`), so a fix that covers
only some of them is "partial".

Two more keep a wrapper from telling the judge's calls apart. Checked calls: supported float32
calls whose answers must be right and the kernel's, a few before a probe's first call in each
process and after every case, how many and how large drawn from the seed (--seed replays them),
so that a wrapper that counts its calls, times them or caches answers meets one where it changes
behaviour. Fresh runners: a case that kills the runner (or leaves its CUDA context poisoned)
fails alone, with the arguments it isolates, and the next case runs in a fresh runner.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kata.harness import reference
from kata.harness.endings import cap_reached
from kata.harness.kernel_check import BYPASSED, VendorKernel
from kata.harness.remote import (
    Answer,
    ImplementationImportError,
    NotATensor,
    Remote,
    RemoteError,
    RunnerStopped,
    materialize,
    pack_all,
)

ARGUMENTS = ("query", "key", "value")
CANDIDATE_MODULE = "candidate_attention_wrapper"
# Checked calls before a process's first probe call, at least and at most: at least one, so that
# even library-path's process (its own call and the checked ones after it) makes three supported
# calls, past a wrapper that answers two with the kernel (tests/adversarial/call_counter.py).
CHECKED_BEFORE = (1, 3)
CHECKED_AFTER = (1, 3)  # after every case that did not fail
# Their shapes (head dim 64): half the time one of the (batch, length) most probe calls take, else
# any up to (3, 160). The first before a process's first probe call takes that call's shape (up
# to (4, 256); else one of PROBE_SHAPES), and the first after a case the case's. Nothing in a
# call's shape tells a checked call from a probe's own, so a wrapper that counts or caches by
# shape meets the checked calls too (tests/adversarial/shape_keyed_counter.py counted only even
# lengths when every checked length was odd). Larger random ones cost the CPU suite minutes.
PROBE_SHAPES = ((2, 32), (2, 64), (2, 128))
RANDOM_SIZES = (3, 160)  # batch and length at most, for the rest
LARGEST_FIRST = (4, 256)  # a call's own shape, taken by the checked call next to it, at most
FRESH_RUNNERS = 12  # runners a probe (or a lane of it) may start after crashes before it stops
LANES_ENV = "KATA_CASE_LANES"  # case_lanes


@dataclass
class Verdict:
    status: str  # "fixed", "partial" or "present"
    evidence: str


@dataclass
class ProbeContext:
    """What a probe gets: the implementation's process (remote.py), a seeded generator, the
    device to test, and (for a candidate's wrapper) the shipped vendor kernel to recognise its
    answers by."""

    remote: Remote
    seed: int
    device: str
    report_case: Callable[[str, int], None] = lambda name, lane: None  # (name, its lane)
    # Failures are sent as they are found, so that they survive a later crash of the process.
    report_failure: Callable[[str], None] = lambda text: None
    planted_library: Path | None = None
    kernel: VendorKernel | None = None
    probe: str = ""  # its id: each probe draws its own checked calls from the seed
    broken: list[str] = field(default_factory=list)  # checked calls that failed outside a case
    lane: int = 0  # 0, or which of judge_cases' lanes this context judges
    # Told when a lane has judged all its cases (a timeout is then no longer its case's).
    report_lane_done: Callable[[int], None] = lambda lane: None
    _loaded: set = field(default_factory=set, repr=False)
    _fresh_runners: int = 0

    def __post_init__(self):
        self.generator = torch.Generator().manual_seed(self.seed)
        report, self.case = self.report_case, None
        self.report_case_in_lane = report  # (name, lane)

        def report_case(name: str) -> None:  # remembered: the checked calls put it back
            self.case = name
            report(name, self.lane)

        self.report_case = report_case
        # The checked calls: where they fall, their sizes and their data, apart from the cases'
        # inputs (a seed gives the same cases whatever the checked calls did). Each lane has its
        # own; lane 0's are those of a probe without lanes.
        lane = f"/lane {self.lane}" if self.lane else ""
        self.schedule = random.Random(f"{self.seed}/{self.probe}{lane}")
        self.checked_data = torch.Generator().manual_seed(self.seed + 1 + 1000 * self.lane)

    def in_lane(self, lane: int) -> ProbeContext:
        """A context beside this one, for cases judged at the same time: a runner of its own
        (forked and sandboxed as every runner is), its own checked calls, the same kernel."""
        return ProbeContext(
            remote=self.remote.twin(),
            seed=self.seed,
            device=self.device,
            report_case=self.report_case_in_lane,
            report_failure=self.report_failure,
            planted_library=self.planted_library,
            kernel=self.kernel,
            probe=self.probe,
            broken=self.broken,  # shared: a lane's broken checked call counts for the probe
            lane=lane,
            report_lane_done=self.report_lane_done,
        )

    def load(self, module: str = CANDIDATE_MODULE, chdir: Path | None = None, upcoming=()) -> None:
        """Import the implementation in its process (once per module name and process); the
        wrapper's first import in a process is followed by a few checked calls, the first of the
        `upcoming` call's shape where the kernel supports it."""
        if module in self._loaded:
            return
        request = {"op": "load", "module": module, "chdir": str(chdir) if chdir else None}
        reply, _ = self.remote.request(request)
        if "import_error" in reply:
            raise ImplementationImportError(reply["import_error"])
        self._loaded.add(module)
        case, count = self.case, self.schedule.randint(*CHECKED_BEFORE)
        first = _supported_shape(upcoming) or self.schedule.choice(PROBE_SHAPES)
        if failure := self.checked_calls(count, "before the probe's own", module, first):
            self.broken.append(failure)
            self.report_failure(failure)
        if case is not None and count:  # a crash from here on is the probe's case's
            self.report_case(case)

    def checked_after(self, name: str, module: str = CANDIDATE_MODULE, inputs=()) -> str | None:
        """The checked calls that follow a probe's call `name` on `inputs` (the first of their
        shape where the kernel supports it): None, or the first failure."""
        count, first = self.schedule.randint(*CHECKED_AFTER), _supported_shape(inputs)
        return self.checked_calls(count, f"after '{name}'", module, first)

    def checked_calls(
        self, count: int, when: str, module: str = CANDIDATE_MODULE, first=None
    ) -> str | None:
        """`count` supported calls on fresh data, the first of shape `first` if given: None when
        every answer is right (and the vendor kernel's, for a candidate's wrapper), else the first
        failure."""
        for index in range(count):
            batch, length = first if first and index == 0 else self._checked_shape()
            name = f"a checked ({batch}, {length}, 64) float32 call {when}"
            self.report_case(name)
            inputs = tuple(
                t.to(self.device)
                for t in reference.random_inputs(batch, length, 64, generator=self.checked_data)
            )
            answer = self.call(inputs, module=module)
            if answer.cuda_failed:
                self.fresh_runner(answer.cuda_failed)  # as after a case: the context is poisoned
                return f"{name}: CUDA failed after the call returned: {answer.cuda_failed}"
            if answer.error is not None:
                return f"{name} raised {first_line(answer.error)}: valid input must be computed"
            if failure := overwritten(name, answer) or wrong_answer(
                self, name, answer.result, inputs
            ):
                return failure
        return None

    def _checked_shape(self) -> tuple[int, int]:
        if self.schedule.random() < 0.5:
            return self.schedule.choice(PROBE_SHAPES)
        most_batch, most_length = RANDOM_SIZES
        return self.schedule.randint(1, most_batch), self.schedule.randint(1, most_length)

    def fresh_runner(self, why: str) -> None:
        """End the runner (dead, or with a poisoned CUDA context): the next call starts a fresh
        one. Past FRESH_RUNNERS of them, the probe stops with `why`."""
        self._fresh_runners += 1
        if self._fresh_runners > FRESH_RUNNERS:
            raise RunnerStopped(f"{why} (and {FRESH_RUNNERS} fresh runners before it)")
        self.remote.close()
        self.remote.process = None  # Remote.request starts the next one
        self._loaded.clear()

    def call(self, inputs, *, module: str = CANDIDATE_MODULE, op="call", **options) -> Answer:
        """One call of the implementation on `inputs`; what it returned or raised."""
        self.load(module, upcoming=inputs)
        tensors = {}
        specs = pack_all(tensors, "in", inputs)
        reply, received = self.remote.request(
            {"op": op, "module": module, "inputs": specs, **options}, tensors
        )
        answer = Answer(
            cuda_failed=reply.get("cuda_failed"),
            overwritten=tuple(reply.get("overwritten", ())),
            header=reply,
        )
        if "raised" in reply:
            answer.error = RemoteError(reply["raised"])
        elif "result" in reply:
            answer.result = materialize(reply["result"], received)
        return answer

    def inputs(self, *shape, dtype=torch.float32, kv_len=None, device=None):
        return tuple(
            t.to(device or self.device)
            for t in reference.random_inputs(
                *shape, dtype=dtype, generator=self.generator, kv_len=kv_len
            )
        )


def _supported_shape(inputs) -> tuple[int, int] | None:
    """(batch, length) of a call the vendor kernel supports in shape (three alike 3-D tensors of
    head dim 64) and small enough for a checked call; None for any other."""
    shapes = {tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in inputs}
    if len(inputs) != 3 or len(shapes) != 1:
        return None
    [shape] = shapes
    if shape is None or len(shape) != 3 or shape[2] != 64:
        return None
    batch, length, _ = shape
    fits = 1 <= batch <= LARGEST_FIRST[0] and 1 <= length <= LARGEST_FIRST[1]
    return (batch, length) if fits else None


@dataclass
class Case:
    """One call of a probe. `mentions`: what a loud message may name (the wrong arguments, the
    offending values, the expected ones). `args`: the arguments that are wrong, when the case
    isolates one of them. `defined=False`: the inputs have no answer; only a loud error will do."""

    name: str
    inputs: tuple
    mentions: Sequence[str] = ()
    args: frozenset[str] = frozenset()
    defined: bool = True
    expected: object = None
    tolerance_dtype: torch.dtype | None = None  # default: the query's


@dataclass
class Outcome:
    case: str
    failure: str | None
    note: str = ""  # what happened when it did not fail: "correct" or "raised ..."
    args: frozenset[str] = frozenset()

    @property
    def loud(self) -> bool:
        return self.note.startswith(f"{self.case}: raised")


def first_line(error: BaseException) -> str:
    """The exception's type and first line, plus dynamo's one-line explanation when it gives one."""
    if isinstance(error, ImplementationImportError):
        return str(error)
    kind = error.type_name if isinstance(error, RemoteError) else type(error).__name__
    lines = [line.strip() for line in str(error).strip().splitlines()]
    summary = lines[0] if lines else ""
    explanation = next((line for line in lines if line.startswith("Explanation:")), None)
    if explanation:
        summary += ". " + explanation.removeprefix("Explanation:").strip()
    cap = cap_reached(f"{kind}: {summary}")  # an allocation the sandbox's cap refused, say
    return f"{kind}: {summary}"[:300] + (f" ({cap})" if cap else "")


# Errors that mean the implementation tripped over the input instead of rejecting it: a bug of
# the wrapper's own (an attribute it does not have, an index out of range) is not validation.
UNRELATED_TYPES = (
    "AttributeError",
    "NameError",
    "ImportError",
    "KeyError",
    "IndexError",
    "ZeroDivisionError",
    "RecursionError",
    "ctypes.ArgumentError",
)
UNRELATED_MESSAGES = ("values to unpack", "not compiled with cuda")


def names_problem(error: RemoteError, mentions: Sequence[str]) -> bool:
    """Whether the message names the problem: one of `mentions` as a whole word."""
    if any(name.rpartition(".")[2] in error.mro for name in UNRELATED_TYPES):
        return False
    message = str(error).lower()
    if any(unrelated in message for unrelated in UNRELATED_MESSAGES):
        return False
    return any(
        re.search(rf"(?<![a-z0-9_]){re.escape(word.lower())}(?![a-z0-9_])", message)
        for word in mentions
    )


def check_result(name, result, expected, inputs, tolerance_dtype=None) -> str | None:
    """None if `result` is the reference result for `inputs`, else what is wrong with it."""
    query = inputs[0]
    if isinstance(result, NotATensor):
        return f"{name}: returned {result.type_name}, not a tensor"
    if result.device != query.device:
        return f"{name}: output on {result.device}, inputs on {query.device}"
    # SDPA's output has its inputs' dtype: a float32 answer to float16 inputs is not one a caller
    # asked for (and mixed inputs, where SDPA refuses, may give either dtype).
    if result.dtype not in {tensor.dtype for tensor in inputs}:
        given = "/".join(sorted({dtype_name(tensor.dtype) for tensor in inputs}))
        return f"{name}: output dtype {dtype_name(result.dtype)}, inputs {given}"
    expected_shape = query.shape[:-1] + inputs[2].shape[-1:]
    if tuple(result.shape) != tuple(expected_shape):
        return f"{name}: output shape {list(result.shape)}, expected {list(expected_shape)}"
    if result.device.type == "meta":
        return None  # meta tensors carry no values: device and shape are the whole answer
    if isinstance(expected, SampledRows):
        error = expected.error(result, inputs)
    else:
        error = reference.relative_error(result, expected)
    tolerance = reference.TOLERANCE[tolerance_dtype or query.dtype]
    if error > tolerance:
        return f"{name}: wrong result, relative error {error:.2g} (tolerance {tolerance:.0e})"
    return None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def case_lanes(count: int) -> int:
    """How many runners `count` cases may use at once: $KATA_CASE_LANES where it is a positive
    number, else up to 4 on a machine of 8 cores or more, else 1 (on 2 cores a second runner
    only competes for them)."""
    told = os.environ.get(LANES_ENV, "")
    lanes = int(told) if told.isdigit() and int(told) > 0 else None
    if lanes is None:
        lanes = 4 if (os.cpu_count() or 1) >= 8 else 1
    return max(1, min(count, lanes))


def judge_cases(ctx: ProbeContext, cases: Sequence[Case]) -> list[Outcome]:
    """Judge `cases`, in their order, or in lanes (case_lanes) at the same time: each lane a
    runner of its own, its share of the cases in order. Where every case kills or poisons its
    runner (device on a GPU), fresh runners one after another made one probe last the whole
    review (16 s of an H100's 20)."""
    lanes = case_lanes(len(cases))
    if lanes == 1:
        return [judge(ctx, case) for case in cases]

    def judge_share(lane: int) -> list[Outcome]:
        lane_ctx = ctx.in_lane(lane)
        try:
            return [judge(lane_ctx, case) for case in cases[lane - 1 :: lanes]]
        finally:
            lane_ctx.remote.close()
            ctx.report_lane_done(lane)

    with ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="lane") as pool:
        shares = list(pool.map(judge_share, range(1, lanes + 1)))  # a lane's error raises here
    outcomes: list[Outcome | None] = [None] * len(cases)
    for lane, share in enumerate(shares):
        outcomes[lane::lanes] = share
    return outcomes


def judge(ctx: ProbeContext, case: Case) -> Outcome:
    """Call the implementation on one case and judge what it did, then make the checked calls
    that follow every case. A crash, or a checked call that fails after the case, is the case's
    failure: what broke the process came from its inputs."""
    failure, note = _judge(ctx, case)
    if failure is None:
        try:
            failure = ctx.checked_after(case.name, inputs=case.inputs)
        except RunnerStopped as stop:
            ctx.fresh_runner(str(stop))
            failure = f"a checked call after '{case.name}': {stop}"
        if failure is not None:
            note = ""
    if failure:
        ctx.report_failure(failure)
    return Outcome(case.name, failure, note, case.args)


def _judge(ctx, case: Case):
    name = case.name
    ctx.report_case(name)
    try:
        # Each input ends where its mapping ends: a launch that reads past it faults
        # (runner.InputGuards), even when the wrapper raises a clear error afterwards.
        answer = ctx.call(case.inputs, guarded=True)
    except RunnerStopped as stop:  # the case's failure; the next case gets a fresh runner
        ctx.fresh_runner(str(stop))
        return f"{name}: {stop}", ""
    if answer.cuda_failed:
        ctx.fresh_runner(answer.cuda_failed)  # a poisoned context would fail every later case
        return f"{name}: CUDA failed after the call returned: {answer.cuda_failed}", ""
    if failure := overwritten(name, answer):
        return failure, ""
    if (error := answer.error) is not None:
        if names_problem(error, case.mentions):
            return None, f"{name}: raised {first_line(error)}"
        return f"{name}: raised an error that does not name the problem: {first_line(error)}", ""
    if not case.defined:
        return f"{name}: returned a result for inputs that have no answer (no error raised)", ""
    expected = case.expected if case.expected is not None else expected_for(case.inputs)
    if failure := check_result(name, answer.result, expected, case.inputs, case.tolerance_dtype):
        return failure, ""
    return kernel_failure(ctx, name, answer.result, case.inputs), f"{name}: correct"


def overwritten(name, answer: Answer) -> str | None:
    if not answer.overwritten:
        return None
    which = _and([ARGUMENTS[i] for i in answer.overwritten])
    return f"{name}: the call wrote into its input {which} (the caller's tensors are not scratch)"


def wrong_answer(ctx, name, result, inputs) -> str | None:
    """None if `result` is right for `inputs` and, where the vendor kernel supports them, the
    kernel's own answer; else what is wrong with it."""
    return check_result(name, result, expected_for(inputs), inputs) or kernel_failure(
        ctx, name, result, inputs
    )


def kernel_failure(ctx, name, result, inputs) -> str | None:
    """On inputs the vendor kernel supports, the answer must be the kernel's."""
    return ctx.kernel.judge(name, result, inputs) if ctx.kernel is not None else None


def poisoned_context(ctx) -> str | None:
    """A fresh CUDA operation must still work in the implementation's process afterwards."""
    reply, _ = ctx.remote.request({"op": "health"})
    return reply.get("cuda_failed")


def valid_call_works(ctx, shape=(2, 64, 64), device=None) -> str | None:
    """The control of every input probe: None if two valid float32 calls on fresh data (on
    `device`, else the probe's device) give the reference result, computed by the vendor
    kernel, else what went wrong. Loud answers count only while this holds: an implementation
    that raises on everything would otherwise pass every input probe. Two calls of one shape:
    an answer cached by shape shows."""
    for attempt in ("", ", again on new data"):
        name = f"a valid float32 {tuple(shape)} call" + (f" on {device}" if device else "")
        name += attempt
        ctx.report_case(name)
        inputs = ctx.inputs(*shape, device=device)
        answer = ctx.call(inputs)
        if answer.cuda_failed:
            return f"{name}: CUDA failed after the call returned: {answer.cuda_failed}"
        if answer.error is not None:
            refused = first_line(answer.error)
            return f"{name} raised {refused}: refusing valid input is not loud, it is wrong"
        if failure := overwritten(name, answer) or wrong_answer(ctx, name, answer.result, inputs):
            return failure
    return None


def expected_for(inputs):
    query, key, value = inputs
    if query.device.type == "meta":
        return torch.empty(query.shape, device="meta")
    return reference.attention(query, key, value)


def verdict(
    ctx, outcomes: list[Outcome], control: str | None = None, *, per_argument=False
) -> Verdict:
    """Many outcomes into one verdict. `control`: the failure of valid_call_works (a wrong or
    refused valid call, or one the vendor kernel did not compute), which decides whatever the
    cases did. `per_argument`: the probe isolates query,
    key and value, and a fix that covers some of them but not all earns "partial"."""
    failures = [o.failure for o in outcomes if o.failure]
    tried = f" [{len(failures)}/{len(outcomes)} cases]" if failures else ""
    # Failures no coverage of arguments can excuse: the control, checked calls outside cases.
    broken = [*ctx.broken, control] if control else list(ctx.broken)
    if poisoned := poisoned_context(ctx):
        broken.append(poisoned)
    if not failures and not broken:
        return Verdict("fixed", _fixed_evidence(outcomes))
    covered = _covered_arguments(outcomes) if per_argument and not broken else []
    if covered:
        unchecked = [a for a in ARGUMENTS if a not in covered]
        failed = [o.failure for o in outcomes if o.failure]
        return Verdict(
            "partial",
            f"{_and(unchecked)} unchecked ({_and(covered)} handled in every case): "
            + _shown(failed)
            + tried,
        )
    return Verdict("present", _shown(failures + broken) + tried)


def _covered_arguments(outcomes: list[Outcome]) -> list[str]:
    """The arguments handled in every case that involves them, when at least one argument is
    and every failing case involves only other arguments (and is no bypass of the kernel)."""
    failing = [o for o in outcomes if o.failure]
    if any(not o.args or BYPASSED in o.failure for o in failing):
        return []
    wrong = set().union(*(o.args for o in failing))
    return [
        argument
        for argument in ARGUMENTS
        if argument not in wrong and any(o.args == {argument} for o in outcomes)
    ]


def _fixed_evidence(outcomes: list[Outcome]) -> str:
    """What was tried and what it did: every case by name, and one loud answer in full."""
    names = ", ".join(o.case for o in outcomes)
    loud = [o.note for o in outcomes if o.loud]
    summary = f"{len(outcomes)} case{'s' if len(outcomes) > 1 else ''} correct or loud ({names})"
    return f"{summary}; e.g. {loud[0]}" if loud else summary


def _shown(failures: list[str]) -> str:
    more = f" (+{len(failures) - 2} more)" if len(failures) > 2 else ""
    return "; ".join(failures[:2]) + more


def _and(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


class SampledRows:
    """An `expected` for a case that checks a sample of (batch, row) pairs: the full float64
    reference of a problem this large would take longer than the probe itself."""

    def __init__(self, batches, rows):
        self.batches, self.rows = batches, rows

    def error(self, result, inputs) -> float:
        return self.error_of_rows(result[self.batches][:, self.rows], inputs)

    def error_of_rows(self, rows, inputs) -> float:
        """The error of the sampled rows alone (sent by the implementation's process)."""
        query, key, value = inputs
        sample = query[self.batches][:, self.rows], key[self.batches], value[self.batches]
        return reference.relative_error(rows, reference.attention(*sample))
