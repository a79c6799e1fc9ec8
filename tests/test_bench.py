"""`make bench` (the bench/ package): the quick CPU run end to end, the FLOP formula, and the
logic of the GPU-only rows (checks, refusals, ratios, the slow-call limit) driven on the CPU with
tiny shapes. Timings are recorded, never asserted."""

from __future__ import annotations

import json
import math
import time
import warnings

import pytest
import torch

from bench import backends, cases, cli, table, timing

CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="checks the CPU run; on this GPU machine run `python -m kata bench --quick` instead",
)


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
    for row in quick_report["rows"]:
        assert fields <= row.keys(), row
        assert row["status"] == "ok" or row["status"].split(":")[0] in {
            "skipped",
            "unavailable",
            "WRONG",
        }, row


def test_time_limit_skips_rows_with_the_reason(tmp_path, capsys):
    path = tmp_path / "b.json"
    argv = ["--quick", "--only", "kata", "--time-limit", "0", "--json", str(path)]
    assert cli.main(argv) == 0
    rows = json.loads(path.read_text())["rows"]
    assert rows and all("--time-limit" in row["status"] for row in rows), rows
    assert "Skipped rows:" in capsys.readouterr().out


# The GPU-only rows' logic, on the CPU: tiny bfloat16 shapes, SDPA's CPU flash kernel standing in
# for the GPU's, no cuDNN (so its rows are refused), and a deliberately wrong implementation.


@pytest.fixture(scope="module")
def cpu_bench():
    args = cli.build_parser().parse_args(["--quick"])
    settings = cases.make_settings(args, torch.device("cpu"))
    return settings, backends.Implementations(["llm"])


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


def test_a_slow_first_call_alone_does_not_skip_the_row(cpu_bench):
    """One-time work in the first call (cuDNN plans, lazy loading) is not the row's speed."""
    settings, impls = cpu_bench
    runner = timing.Bench(settings, log=lambda text: None)
    runner.s = cases.Settings(**{**vars(settings), "max_call_s": 0.2})
    row = cases.new_row("llm", impls.sdpa, (1, 1, 8, 16), torch.float32, False, "fwd")
    sets = runner.input_sets([(1, 1, 8, 16)] * 3, torch.float32)
    calls = []

    def call(i):
        calls.append(i)
        if len(calls) == 1:
            time.sleep(0.3)  # over --max-call, once
        return backends.sdpa(*sets[i % len(sets)])

    runner.measure(row, call, len(sets), None, "key")
    assert row["status"] == "ok" and row["median_ms"] is not None, row  # timed, not skipped


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
    lines = "\n".join(table._llm_tables(rows, {"sdpa_kernels": {}})).splitlines()
    headers = [line for line in lines if "fixed/cuDNN" in line]
    data = [line for line in lines if line.strip().startswith("32 no")]
    assert len(headers) == 2 and len(data) == 2, lines
    assert all(line.endswith("0.50×") for line in data), data
