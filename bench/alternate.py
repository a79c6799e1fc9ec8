"""The instrument of the llm section: the implementations of one shape timed in alternating
batches, with the SM clock and what limits it read after each batch.

Timed one after the other, each implementation's runs sit in a block of their own, and a drift of
the GPU (its clock under power or heat, a neighbour's load) lands on one block and not on the
next: their ratio then measures the drift as much as the kernels. Here each implementation gets a
batch in every round and its median is over all of its batches. Each batch's median stays in the
row (their spread says how steady it was), beside the SM clock NVML reported after it (a batch
timed at a lower clock shows: an H200's args rows fell in two groups of batches 12% apart, in
fixed's row and SDPA's alike, perf/NOTES.md v52) and what NVML said limited that clock (at the
power cap, a row's clock follows the watts its kernel draws per cycle: v63).

A batch can also inherit what its predecessor left behind (the clock of a power-capped GPU, its
heat), and a rotating order keeps the same predecessors together. An H200 bench with the order only
rotating, so that SDPA's cuDNN backend followed its flash backend in four rounds of five, timed the
cuDNN forward at (4, 16, 8192, 128) at 3.22-3.24 ms in those four batches and 3.85 ms in the fifth,
and SDPA's default (the same cuDNN kernel, never after flash) at 3.66-3.98 ms. So each round's
order comes from a Williams design (every implementation follows every other one equally often over
n rounds, n even; 2 n, n odd), and on a GPU each batch starts with untimed calls of its own, so
that the GPU is in the state this implementation brings it to when the timing starts. How many: an
H200 ran both fixed's and cuDNN's forward up to 15% slow for 100-150 ms after a heavy row (its
clock recovering, perf/NOTES.md v59), and a fixed 30 ms left the short D = 128 rows 2-4% from where
1 s blocks of each put them. So the untimed calls run in chunks (settings.alternate_settle_ms'
worth each) until two chunks in a row agree (their medians within SETTLE_AGREEMENT), or
settings.alternate_settle_max_ms' worth have run: a batch after a light one is timed after two
chunks, one after a heavy row once it has recovered."""

from __future__ import annotations

import ctypes
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bench.backends import _first_line
from bench.cases import SETTLE_AGREEMENT

NVML_SUCCESS = 0
NVML_CLOCK_SM = 1  # nvmlClockType_t
# nvmlClocksEventReasons bits, the GPU-idle bit (0x1) left out: what holds the clock below its
# maximum. Both fixed and cuDNN ran 471 of 480 issue-30 batches of an H200 at its power cap, at
# different clocks for the same watts (perf/NOTES.md v63): there the clock is the cap's outcome.
CLOCK_LIMITS = {
    0x2: "applications clocks",
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "thermal (software)",
    0x40: "thermal (hardware)",
    0x80: "power brake",
    0x100: "display clock",
}


class SmClock:
    """The current SM clock of a CUDA device, in MHz, and what limits it, from NVML (libnvidia-ml,
    which every NVIDIA driver installs, through ctypes: no Python package). `why_not` says why
    there is none."""

    def __init__(self, device: torch.device):
        self.why_not: str | None = None
        self._nvml = None
        self._handle = ctypes.c_void_p()
        if device.type != "cuda":
            self.why_not = "no CUDA device"
            return
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            if nvml.nvmlInit_v2() != NVML_SUCCESS:
                raise OSError("nvmlInit_v2 failed")
            # By UUID: NVML numbers every GPU, CUDA only the visible ones (CUDA_VISIBLE_DEVICES).
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
            found = nvml.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(self._handle))
            if found != NVML_SUCCESS:
                raise OSError(f"NVML has no device {uuid} (error {found})")
        except (OSError, AttributeError, RuntimeError) as error:
            self.why_not = f"NVML unavailable: {_first_line(error)}"
            return
        self._nvml = nvml

    def mhz(self) -> int | None:
        if self._nvml is None:
            return None
        clock = ctypes.c_uint()
        status = self._nvml.nvmlDeviceGetClockInfo(self._handle, NVML_CLOCK_SM, ctypes.byref(clock))
        return clock.value if status == NVML_SUCCESS else None

    def limits(self) -> list[str] | None:
        """The names of CLOCK_LIMITS that NVML reports now (none: []), or None where unread."""
        if self._nvml is None:
            return None
        reasons = ctypes.c_ulonglong()
        try:  # the name since driver 535; the older one where it is missing
            read = self._nvml.nvmlDeviceGetCurrentClocksEventReasons
        except AttributeError:
            read = getattr(self._nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        if read is None or read(self._handle, ctypes.byref(reasons)) != NVML_SUCCESS:
            return None
        return [name for bit, name in CLOCK_LIMITS.items() if reasons.value & bit]


@dataclass
class Entry:
    """A row that passed its check and warm-up, ready to be timed."""

    row: dict
    call: Callable[[int], object]  # call(i): one call on input set i % n_sets
    n_sets: int
    next_set: int  # the first input set not used yet
    estimate_ms: float
    times: list[float] = field(default_factory=list)
    clocks: list[int] = field(default_factory=list)


def williams_orders(n: int) -> list[list[int]]:
    """Orders of 0 .. n-1, one per round, in which each index directly follows every other one
    equally often (once over the n orders for even n, twice over the 2 n for odd n): a Williams
    design, balanced for what a batch inherits from the one before it."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    orders = [[(index + shift) % n for index in first] for shift in range(n)]
    return orders if n % 2 == 0 else orders + [order[::-1] for order in orders]


def settle_calls(settle_ms: float, estimate_ms: float) -> int:
    """Calls of settle_ms's worth, at least one."""
    return max(1, math.ceil(settle_ms / max(estimate_ms, 1e-3)))


def settle(
    entry: Entry,
    chunk_calls: int,
    max_calls: int,
    time_each: Callable[[Callable[[int], object], list[int], bool], list[float]],
) -> float:
    """Untimed calls of entry on its next input sets, chunk_calls at a time, until two chunks in a
    row agree (medians within SETTLE_AGREEMENT) or max_calls have run (max_calls == chunk_calls:
    one chunk, a fixed settle). Returns their milliseconds."""
    spent, used, previous = 0.0, 0, None
    while used < max_calls:
        count = min(chunk_calls, max_calls - used)
        indices = [(entry.next_set + i) % entry.n_sets for i in range(count)]
        entry.next_set += count
        times = time_each(entry.call, indices, True)
        used, spent = used + count, spent + sum(times)
        median = statistics.median(times)
        if previous is not None and abs(median - previous) <= SETTLE_AGREEMENT * previous:
            break
        previous = median
    return spent


def runs_for(settings, estimate_ms: float) -> int:
    """A row's timed runs: its budget's worth, within --min-runs and --max-runs."""
    budget = int(settings.budget_s * 1e3 / max(estimate_ms, 1e-3))
    return min(settings.max_runs, max(settings.min_runs, budget))


def alternate(
    entries: list[Entry],
    rounds: int,
    settings,
    clock: SmClock,
    time_each: Callable[[Callable[[int], object], list[int], bool], list[float]],
) -> None:
    """Time `entries` in `rounds` rounds of one batch each (round r in williams_orders' order
    r, cycling), on a GPU each batch after settling untimed on its own calls (settle), then
    record each row's median, runs, batch medians, settling times and SM clock. A call that fails
    or runs out of memory marks its row and drops it from later rounds."""
    for entry in entries:
        entry.row["batch_medians_ms"] = []
        entry.row["batch_sm_clock_mhz"] = []  # after each batch, beside its median; None: unread
        entry.row["batch_clock_limits"] = []  # read with it: CLOCK_LIMITS' names, None: unread
        if settings.cuda:
            entry.row["batch_settle_ms"] = []  # each batch's untimed calls before it
    orders = williams_orders(len(entries))
    for round_ in range(rounds):
        for k in orders[round_ % len(orders)]:
            entry = entries[k]
            if entry.row["status"] != "ok":
                continue
            per_batch = math.ceil(runs_for(settings, entry.estimate_ms) / rounds)
            try:
                if settings.cuda:
                    chunk = settle_calls(settings.alternate_settle_ms, entry.estimate_ms)
                    most = settle_calls(settings.alternate_settle_max_ms, entry.estimate_ms)
                    settled_ms = settle(entry, chunk, max(chunk, most), time_each)
                    entry.row["batch_settle_ms"].append(round(settled_ms, 3))
                indices = [(entry.next_set + i) % entry.n_sets for i in range(per_batch)]
                entry.next_set += per_batch
                times = time_each(entry.call, indices, settings.cuda)
            except torch.OutOfMemoryError:
                entry.row["status"] = "skipped: out of GPU memory while timing"
                torch.cuda.empty_cache()
                continue
            except Exception as error:  # it passed its check: a later call failing is a defect
                entry.row["status"] = f"WRONG: a timed call failed: {_first_line(error)}"
                continue
            entry.times += times
            entry.row["batch_medians_ms"].append(statistics.median(times))
            mhz = clock.mhz()
            entry.row["batch_sm_clock_mhz"].append(mhz)
            entry.row["batch_clock_limits"].append(clock.limits())
            if mhz is not None:
                entry.clocks.append(mhz)
    for entry in entries:
        row = entry.row
        if row["status"] != "ok" or not entry.times:
            row.pop("batch_medians_ms", None)
            row.pop("batch_sm_clock_mhz", None)
            row.pop("batch_clock_limits", None)
            row.pop("batch_settle_ms", None)
            continue
        row["median_ms"] = statistics.median(entry.times)
        row["runs"] = len(entry.times)
        row["sm_clock_mhz"] = statistics.median(entry.clocks) if entry.clocks else None
