"""`make bench` (the bench/ package): the quick CPU run end to end, the FLOP formula, and the
logic of the GPU-only LLM rows (checks, refusals, ratios, the slow-call limit) driven on the CPU
with tiny shapes; the args section's: test_bench_args.py. Timings are recorded, never asserted."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import time
import types
import warnings

import pytest
import torch

from bench import alternate, arguments, backends, cases, cli, table, timing
from tests.bench_support import CPU_ONLY, cpu_settings_and_implementations


# The quick run, once per module: the tests below read its report.
@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bench")
    path = directory / "b.json"
    assert cli.main(["--quick", "--json", str(path), "--png", str(directory / "b.png")]) == 0
    return json.loads(path.read_text())


def rows_of(report, section):
    return [row for row in report["rows"] if row["section"] == section]


def test_flops_forward_is_4_b_h_l_s_d():
    assert cases.attention_flops(2, 3, 5, 7, 11) == 4 * 2 * 3 * 5 * 7 * 11


def test_flops_causal_halves_and_backward_adds_two_and_a_half():
    forward = cases.attention_flops(4, 16, 1024, 1024, 128)
    assert cases.attention_flops(4, 16, 1024, 1024, 128, causal=True) == forward / 2
    assert cases.attention_flops(4, 16, 1024, 1024, 128, backward=True) == 3.5 * forward
    both = cases.attention_flops(4, 16, 1024, 1024, 128, causal=True, backward=True)
    assert both == 3.5 * forward / 2
    # The LLM sweep's largest shape: 8.8 TFLOP forward.
    assert cases.attention_flops(4, 16, 16384, 16384, 128) == pytest.approx(8.796e12, rel=1e-3)


@CPU_ONLY
def test_quick_run_records_the_machine(quick_report):
    machine = quick_report["machine"]
    for key in ("device", "torch", "cuda", "python", "date", "platform"):
        assert key in machine, f"machine facts lack {key!r}: {machine}"
    assert machine["device"] == "cpu"
    assert machine["torch"] == torch.__version__
    assert quick_report["settings"]["quick"] is True


@CPU_ONLY
def test_quick_run_times_the_host_overhead_of_all_four(quick_report):
    rows = rows_of(quick_report, "overhead")
    assert [row["implementation"] for row in rows] == ["flawed", "fixed", "fixed raw op", "sdpa"]
    for row in rows:
        assert row["status"] == "ok", row
        assert row["median_ms"] > 0 and row["us_per_call"] > 0, row
        assert row["runs"] >= 3, row
        assert row["rel_error"] < 1e-3, row


@CPU_ONLY
def test_quick_run_times_the_kata_shapes(quick_report):
    rows = rows_of(quick_report, "kata")
    assert {row["implementation"] for row in rows} == {"flawed", "fixed", "sdpa", "host round trip"}
    assert len({tuple(row["shape"]) for row in rows}) >= 2
    for row in rows:
        assert row["status"] == "ok", row
        assert row["dtype"] == "float32" and row["shape"][-1] == 64, row
        assert row["median_ms"] > 0 and row["runs"] >= 3, row
        if row["implementation"] != "host round trip":
            assert row["tflops"] > 0 and row["rel_error"] < 1e-3, row
    profiled = quick_report["sdpa_kernels"]["kata float32"]
    assert profiled["ops"], profiled  # the SDPA operator that ran on the CPU


@CPU_ONLY
def test_quick_run_skips_every_llm_row_for_want_of_a_gpu(quick_report):
    rows = rows_of(quick_report, "llm")
    assert {row["implementation"] for row in rows} == {"fixed", "sdpa", "sdpa flash", "sdpa cudnn"}
    assert {row["pass"] for row in rows} == {"fwd", "fwd+bwd"}
    for row in rows:
        assert row["status"].startswith("skipped: ") and "GPU" in row["status"], row
        assert row["median_ms"] is None and row["tflops"] is None, row


@CPU_ONLY
def test_quick_run_skips_every_args_row_for_want_of_a_gpu(quick_report):
    rows = rows_of(quick_report, "args")
    # --quick: one S and one D (head dims 80 and 256 their own), every case and pass, three rows
    # each.
    assert {(r["case"], r["shape"][2], r["shape"][3]) for r in rows} == {
        (case.name, 1024, case.head_dim or 128) for case in arguments.CASES
    }
    assert len(rows) == 3 * 2 * len(arguments.CASES)
    for row in rows:
        assert row["status"].startswith("skipped: ") and "GPU" in row["status"], row


@CPU_ONLY
def test_every_row_has_the_documented_fields(quick_report):
    fields = {
        "section",
        "implementation",
        "shape",
        "dtype",
        "causal",
        "pass",
        "median_ms",
        "runs",
        "tflops",
        "ratio_to_flash",
        "ratio_to_cudnn",
        "status",
    }
    args_fields = {"case", "head_dim_v", "ratio_to_sdpa", "ratio_to_best"}
    for row in quick_report["rows"]:
        assert fields <= row.keys(), row
        if row["section"] == "args":
            assert args_fields <= row.keys(), row
            if row["implementation"] == "sdpa best":
                assert {"backend", "backends"} <= row.keys(), row
        assert row["status"] == "ok" or row["status"].split(":")[0] in {
            "skipped",
            "unavailable",
            "WRONG",
        }, row


def test_rounds_sets_the_alternating_batches_of_a_row_and_refuses_bad_values(cpu_bench, capsys):
    """--rounds N: each llm and args row's alternating batches (5; 3 with --quick), so that a
    ratio near 1.00x can be read from more of them; a bad value is one line and exit 2."""
    parse = cli.build_parser().parse_args
    cpu = torch.device("cpu")
    assert cases.make_settings(parse([]), cpu).alternate_rounds == 5
    assert cases.make_settings(parse(["--quick"]), cpu).alternate_rounds == 3
    assert cases.make_settings(parse(["--quick", "--rounds", "7"]), cpu).alternate_rounds == 7
    settings, impls = cpu_bench
    settings = dataclasses.replace(settings, alternate_rounds=7)
    _, rows = run_llm_shape(settings, impls, (impls.fixed, impls.sdpa), (1, 2, 64, 32), False)
    for row in rows.values():
        assert len(row["batch_medians_ms"]) == 7 and row["runs"] >= 7, row
    assert "over 7 alternating batches" in table._llm_instrument(
        list(rows.values()), {"settings": settings.to_json()}
    )
    for bad in ("0", "-2", "x", "2.5", ""):
        with pytest.raises(SystemExit) as exit_:
            parse(["--rounds", bad])
        assert exit_.value.code == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and "--rounds" in error and "Traceback" not in error, error


# The GPU-only rows' logic, on the CPU: tiny bfloat16 shapes, SDPA's CPU flash kernel standing in
# for the GPU's, no cuDNN (so its rows are refused), and a deliberately wrong implementation.


@pytest.fixture(scope="module")
def cpu_bench():
    return cpu_settings_and_implementations()


def run_llm_shape(settings, impls, chosen, shape, causal):
    runner = timing.Bench(settings, log=lambda text: None)
    groups = {
        pass_: [cases.new_row("llm", impl, shape, torch.bfloat16, causal, pass_) for impl in chosen]
        for pass_ in (cases.FWD, cases.FWD_BWD)
    }
    for rows in groups.values():
        runner.rows.extend(rows)
    runner.llm_shape(impls, chosen, groups, shape, causal, set())
    return runner, {(row["implementation"], row["pass"]): row for row in runner.rows}


def test_llm_rows_check_time_and_refuse(cpu_bench):
    settings, impls = cpu_bench

    def wrong(query, key, value, causal=False):
        return backends.sdpa(query, key, value, causal) * 1.5

    wrong_impl = cases.Impl("wrong", "wrong", wrong)
    chosen = (impls.fixed, impls.sdpa, impls.flash, impls.cudnn, wrong_impl)
    runner, rows = run_llm_shape(settings, impls, chosen, (1, 2, 64, 32), causal=True)
    for pass_ in ("fwd", "fwd+bwd"):
        for key in ("fixed", "sdpa", "sdpa flash"):
            row = rows[(key, pass_)]
            assert row["status"] == "ok", row
            assert row["median_ms"] > 0 and row["runs"] >= settings.min_runs, row
            assert row["rel_error"] < cases.TOLERANCE[torch.bfloat16], row
        assert rows[("sdpa cudnn", pass_)]["status"].startswith("unavailable: "), rows
        wrong_row = rows[("wrong", pass_)]
        assert wrong_row["status"].startswith("WRONG: relative error"), wrong_row
        assert wrong_row["median_ms"] is None, wrong_row
    assert "llm bfloat16 D=32 causal fwd+bwd" in runner.sdpa_kernels
    cases.set_ratios(runner.rows)
    for pass_ in ("fwd", "fwd+bwd"):
        flash, fixed = rows[("sdpa flash", pass_)], rows[("fixed", pass_)]
        assert flash["ratio_to_flash"] == 1.0
        assert fixed["ratio_to_flash"] == pytest.approx(flash["median_ms"] / fixed["median_ms"])
        assert fixed["tflops"] == pytest.approx(
            cases.attention_flops(1, 2, 64, 64, 32, causal=True, backward=pass_ == "fwd+bwd")
            / (fixed["median_ms"] * 1e-3)
            / 1e12
        )
        assert rows[("sdpa cudnn", pass_)]["ratio_to_flash"] is None
        assert fixed["ratio_to_cudnn"] is None  # no cuDNN on the CPU: no bar, no ratio


def test_llm_rows_are_timed_in_alternating_batches(cpu_bench):
    """Each LLM row's median is over one batch per round, every implementation in every round;
    the table says so (the SM clock: none on the CPU, and why)."""
    settings, impls = cpu_bench
    chosen = (impls.fixed, impls.sdpa, impls.flash)
    runner, rows = run_llm_shape(settings, impls, chosen, (1, 2, 64, 32), causal=False)
    for row in rows.values():
        assert len(row["batch_medians_ms"]) == settings.alternate_rounds, row
        assert row["runs"] >= settings.alternate_rounds and row["sm_clock_mhz"] is None, row
        assert row["batch_sm_clock_mhz"] == [None] * settings.alternate_rounds, row
        assert row["batch_clock_limits"] == [None] * settings.alternate_rounds, row
    report = {"settings": settings.to_json(), "sm_clock": runner.clock.why_not}
    line = table._llm_instrument(list(rows.values()), report)
    assert f"over {settings.alternate_rounds} alternating batches" in line, line
    assert "SM clock: no CUDA device" in line, line
    assert "limits" not in line, line  # none read: nothing said of them


class FakeClock:
    def __init__(self):
        self.readings = iter(range(1000, 2000, 10))
        self.limits_read = iter([["power cap"], [], ["power cap", "thermal (software)"]] * 9)

    def mhz(self):
        return next(self.readings)

    def limits(self):
        return next(self.limits_read)


def test_alternate_rotates_the_order_and_records_every_batch():
    settings = types.SimpleNamespace(budget_s=1.0, min_runs=6, max_runs=6, cuda=False)
    order = []

    def timer(call, indices, cuda):
        return [call(i) for i in indices]

    entries = []
    for name, ms in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
        row = {"status": "ok", "median_ms": None, "runs": 0}

        def call(i, name=name, ms=ms):
            order.append(name)
            return ms + i / 100  # the input set's index shows in the time

        entries.append(alternate.Entry(row, call, n_sets=4, next_set=1, estimate_ms=ms))
    alternate.alternate(entries, 3, settings, FakeClock(), timer)
    batches = [order[i : i + 2] for i in range(0, len(order), 2)]
    assert [b[0] for b in batches] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"], order
    for entry, ms in zip(entries, (1.0, 2.0, 3.0), strict=True):
        row = entry.row
        assert row["runs"] == 6 and len(row["batch_medians_ms"]) == 3, row
        # Input sets 1, 2, 3, 0, 1, 2: rotated through, never the checked call's alone.
        assert row["median_ms"] == pytest.approx(ms + 0.015), row
        assert 1000 <= row["sm_clock_mhz"] < 2000, row
    # Each batch's clock beside its median, in the order the batches ran (FakeClock counts up).
    clocks = [entry.row["batch_sm_clock_mhz"] for entry in entries]
    assert clocks == [[1000, 1050, 1070], [1010, 1030, 1080], [1020, 1040, 1060]], clocks
    assert all(
        entry.row["sm_clock_mhz"] == clock[1] for entry, clock in zip(entries, clocks, strict=True)
    )
    # What limited the clock, read with it after each batch.
    limits = [entry.row["batch_clock_limits"] for entry in entries]
    assert limits[0] == [["power cap"], ["power cap", "thermal (software)"], []], limits
    line = table._llm_instrument([entry.row for entry in entries], {})
    assert "SM clock after each batch 1000-1080 MHz (each batch's in JSON)" in line, line
    held = "power cap in 6 of 9, thermal (software) in 3 of 9 batches"
    assert f"its limits then (NVML): {held}" in line, line
    unlimited = [{"batch_clock_limits": [[], [], None]}]  # None: that batch's went unread
    assert "its limits then (NVML): none in 2 batches" in table._llm_instrument(unlimited, {})
    # A run that kept each row's median only (before batch_sm_clock_mhz): its range.
    medians = [{"sm_clock_mhz": entry.row["sm_clock_mhz"]} for entry in entries]
    assert "batch 1030-1050 MHz (per row in JSON)" in table._llm_instrument(medians, {})


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_williams_orders_give_every_implementation_every_predecessor_alike(n):
    orders = alternate.williams_orders(n)
    assert len(orders) == (n if n % 2 == 0 else 2 * n)
    assert all(sorted(order) == list(range(n)) for order in orders), orders
    follows = collections.Counter(
        (order[i], order[i + 1]) for order in orders for i in range(n - 1)
    )
    times = 1 if n % 2 == 0 else 2
    assert follows == {(a, b): times for a in range(n) for b in range(n) if a != b}, orders


def test_alternate_settles_each_gpu_batch_untimed_on_its_own_calls():
    settings = types.SimpleNamespace(
        budget_s=1.0,
        min_runs=4,
        max_runs=4,
        cuda=True,
        alternate_settle_ms=30.0,
        alternate_settle_max_ms=30.0,  # a fixed settle: one chunk
    )
    batches = []

    def timer(call, indices, cuda):  # alternate calls it twice a batch: settling, then timed
        batches.append([call(i) for i in indices])
        return [100.0 if len(batches) % 2 else 1.0] * len(indices)

    entries = []
    for name, ms in (("a", 10.0), ("b", 40.0)):
        row = {"status": "ok", "median_ms": None, "runs": 0}
        entries.append(alternate.Entry(row, lambda i, name=name: (name, i), 8, 0, estimate_ms=ms))
    alternate.alternate(entries, 2, settings, FakeClock(), timer)
    # Per batch: settle_calls untimed calls (30 ms: 3 of a's, 1 of b's), then the timed two.
    sizes = [len(batch) for batch in batches]
    assert sizes == [3, 2, 1, 2, 1, 2, 3, 2], sizes
    assert [batch[0][0] for batch in batches] == ["a", "a", "b", "b", "b", "b", "a", "a"]
    # The input sets run on through the settling calls: a's timed ones are 3, 4, 8 % 8, 9 % 8.
    assert [i for _, i in batches[1] + batches[7]] == [3, 4, 0, 1], batches
    # The settling calls' times (100 ms here) are in no row.
    for entry in entries:
        assert entry.row["runs"] == 4 and entry.row["median_ms"] == 1.0, entry.row
        assert entry.row["batch_medians_ms"] == [1.0, 1.0], entry.row
    # Each batch's settling: its untimed calls' milliseconds.
    assert entries[0].row["batch_settle_ms"] == [300.0, 300.0], entries[0].row
    assert entries[1].row["batch_settle_ms"] == [100.0, 100.0], entries[1].row


def test_settling_runs_until_two_chunks_agree_or_its_longest():
    """After a heavy row the GPU runs slow for about 100 ms (perf/NOTES.md v59): the untimed
    chunks go on until two agree within cases.SETTLE_AGREEMENT, and stop at --settle-max."""
    recovering = iter([1.30, 1.30, 1.10, 1.10, 1.02, 1.02, 1.015, 1.015] + [1.0] * 20)
    entry = alternate.Entry({}, lambda i: i, n_sets=3, next_set=0, estimate_ms=1.0)
    ran = []

    def timer(call, indices, cuda):
        ran.append([call(i) for i in indices])
        return [next(recovering) for _ in indices]

    spent = alternate.settle(entry, chunk_calls=2, max_calls=40, time_each=timer)
    # 1.30 -> 1.10 -> 1.02 (7% and 18% apart), then 1.015 within 1% of 1.02: four chunks.
    assert [len(chunk) for chunk in ran] == [2, 2, 2, 2], ran
    assert entry.next_set == 8 and ran[1] == [2, 0], ran  # the input sets run on
    assert spent == pytest.approx(2 * (1.30 + 1.10 + 1.02 + 1.015))
    # Never steady: stops at max_calls, the last chunk cut to fit.
    chunks = []
    swinging = iter([1.0, 1.0, 2.0, 2.0] * 10)

    def swing(call, indices, cuda):
        chunks.append(len(indices))
        return [next(swinging) for _ in indices]

    alternate.settle(entry, 2, 5, swing)
    assert chunks == [2, 2, 1], chunks
    # A fixed settle (max_calls == chunk_calls): one chunk, whatever it reads.
    chunks.clear()
    alternate.settle(entry, 3, 3, swing)
    assert chunks == [3], chunks


def test_alternate_marks_a_failing_row_and_times_the_others():
    settings = types.SimpleNamespace(budget_s=1.0, min_runs=2, max_runs=2, cuda=False)

    def timer(call, indices, cuda):
        return [call(i) for i in indices]

    def broken(i):
        raise RuntimeError("launch failed\nsecond line")

    good = alternate.Entry({"status": "ok", "median_ms": None}, lambda i: 1.0, 2, 0, 1.0)
    bad = alternate.Entry({"status": "ok", "median_ms": None}, broken, 2, 0, 1.0)
    alternate.alternate([bad, good], 2, settings, FakeClock(), timer)
    assert bad.row["status"] == "WRONG: a timed call failed: RuntimeError: launch failed", bad.row
    assert bad.row["median_ms"] is None and "batch_medians_ms" not in bad.row, bad.row
    assert "batch_clock_limits" not in bad.row, bad.row
    assert good.row["median_ms"] == 1.0 and good.row["runs"] == 2, good.row


def test_sm_clock_says_why_there_is_none():
    clock = alternate.SmClock(torch.device("cpu"))
    assert clock.why_not == "no CUDA device" and clock.mhz() is None and clock.limits() is None


def test_a_call_over_max_call_is_not_timed_nor_are_longer_ones(cpu_bench):
    settings, impls = cpu_bench
    runner = timing.Bench(settings, log=lambda text: None)
    runner.s = cases.Settings(**{**vars(settings), "max_call_s": 0.0})
    row = cases.new_row("llm", impls.sdpa, (1, 1, 8, 16), torch.float32, False, "fwd")
    sets = runner.input_sets([(1, 1, 8, 16)] * 3, torch.float32)
    runner.measure(row, lambda i: backends.sdpa(*sets[i % len(sets)]), len(sets), None, "key")
    assert row["status"].startswith("skipped: one call takes") and row["median_ms"] is None, row
    later = dict(row, status="ok")
    runner.measure(later, lambda i: pytest.fail("not called"), len(sets), None, "key")
    assert later["status"].startswith("skipped: a shorter sequence already took"), later


def test_refusal_names_the_forced_backends_reasons():
    messages = [
        "Memory efficient kernel not used because: (Triggered internally at sdp_utils.cpp:900.)",
        "Memory efficient attention has been runtime disabled. (Triggered internally at x.cpp:1.)",
        "Flash attention kernel not used because: (Triggered internally at sdp_utils.cpp:902.)",
        "Flash attention has been runtime disabled. (Triggered internally at x.cpp:2.)",
        "cuDNN attention kernel not used because: (Triggered internally at sdp_utils.cpp:904.)",
        "cuDNN attention requires head dim <= 128. Got 256. (Triggered internally at x.cpp:3.)",
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for message in messages:
            warnings.warn(message, UserWarning, stacklevel=1)
    error = RuntimeError("No available kernel. Aborting execution.")
    assert (
        backends._refusal(error, caught, "cudnn")
        == "cuDNN attention requires head dim <= 128. Got 256."
    )
    assert backends._refusal(error, caught, "flash") == "Flash attention has been runtime disabled."
    assert (
        backends._refusal(error, [], "flash")
        == "RuntimeError: No available kernel. Aborting execution."
    )


def test_backend_is_read_from_kernel_names():
    assert (
        backends.backend_of(["void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>"])
        == "flash"
    )
    assert (
        backends.backend_of(["cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma"]) == "cudnn"
    )
    assert backends.backend_of(["fmha_cutlassF_bf16_aligned_64x64_rf_sm80"]) == "efficient"
    assert backends.backend_of(["aten::_scaled_dot_product_flash_attention_for_cpu"]) == "flash"


def test_relative_error_of_a_non_finite_result_is_infinite():
    reference = torch.ones(4)
    assert math.isinf(cases.relative_error(torch.tensor([1.0, math.nan, 1.0, 1.0]), reference))
    assert cases.relative_error(reference * 1.01, reference) == pytest.approx(0.01)


def measure_with_a_slow_first_call(cpu_bench, max_call_s: float, first_call_s: float) -> dict:
    """A row measured whose first call alone sleeps first_call_s (one-time work: cuDNN's plans,
    lazy loading), under --max-call max_call_s."""
    settings, impls = cpu_bench
    runner = timing.Bench(settings, log=lambda text: None)
    runner.s = cases.Settings(**{**vars(settings), "max_call_s": max_call_s})
    row = cases.new_row("llm", impls.sdpa, (1, 1, 8, 16), torch.float32, False, "fwd")
    sets = runner.input_sets([(1, 1, 8, 16)] * 3, torch.float32)
    calls = []

    def call(i):
        calls.append(i)
        if len(calls) == 1:
            time.sleep(first_call_s)
        return backends.sdpa(*sets[i % len(sets)])

    runner.measure(row, call, len(sets), None, "key")
    return row


def test_a_slow_first_call_alone_does_not_skip_the_row(cpu_bench):
    """One-time work in the first call (cuDNN plans, lazy loading) is not the row's speed."""
    row = measure_with_a_slow_first_call(cpu_bench, max_call_s=0.2, first_call_s=0.3)
    assert row["status"] == "ok" and row["median_ms"] is not None, row  # timed, not skipped


def test_a_slow_first_call_does_not_set_the_number_of_runs(cpu_bench):
    """A first call slow enough to count as warm-up (cuDNN building its plans) but under
    --max-call: the row's runs follow the later calls' speed (its budget's worth), not its."""
    row = measure_with_a_slow_first_call(
        cpu_bench, max_call_s=5.0, first_call_s=1.2 * cases.NO_WARMUP_MS / 1e3
    )
    assert row["status"] == "ok" and row["runs"] == cpu_bench[0].max_runs, row


def test_llm_table_shows_fixed_over_cudnn(cpu_bench):
    """SDPA's default on Hopper is cuDNN, the bar: each LLM row ends with fixed's speed over it."""
    _, impls = cpu_bench
    shape, rows = (1, 2, 64, 32), []
    for key, ms in (("fixed", 2.0), ("sdpa", 1.5), ("sdpa flash", 3.0), ("sdpa cudnn", 1.0)):
        impl = next(i for i in (impls.fixed, impls.sdpa, impls.flash, impls.cudnn) if i.key == key)
        for pass_ in (cases.FWD, cases.FWD_BWD):
            row = cases.new_row("llm", impl, shape, torch.bfloat16, False, pass_)
            row.update(median_ms=ms * (3 if pass_ == cases.FWD_BWD else 1), tflops=1.0)
            rows.append(row)
    cases.set_ratios(rows)
    fixed = next(r for r in rows if r["implementation"] == "fixed")
    assert fixed["ratio_to_cudnn"] == 0.5 and fixed["ratio_to_flash"] == 1.5
    # The bar is the faster of cuDNN forced and SDPA's default (the same kernel on Hopper).
    slow_cudnn = [dict(r) for r in rows]
    for row in slow_cudnn:
        if row["implementation"] == "sdpa cudnn":
            row["median_ms"] *= 4
    cases.set_ratios(slow_cudnn)
    fixed_rows = [r for r in slow_cudnn if r["implementation"] == "fixed"]
    assert [r["ratio_to_cudnn"] for r in fixed_rows] == [0.75, 0.75], fixed_rows
    lines = "\n".join(table._llm_tables(rows, {"sdpa_kernels": {}})).splitlines()
    headers = [line for line in lines if "fixed/cuDNN" in line]
    data = [line for line in lines if line.strip().startswith("32 no")]
    assert len(headers) == 2 and len(data) == 2, lines
    assert all(line.endswith("0.50×") for line in data), data
