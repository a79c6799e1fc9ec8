"""The bench's table read by people: a ratio whose rows' batches disagree is marked, a saved run's
JSON prints again (`--table`), and a bad flag or file gets one line."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from bench import cases, table
from kata import REPO_ROOT

STEADY = [1.00, 1.01, 0.99, 1.00, 1.02]
ONE_SLOW_BATCH = [1.00, 1.01, 2.10, 1.00, 1.02]  # as an H200 showed: a batch at twice the time


def llm_rows(batches: dict[str, list[float]]) -> list[dict]:
    """One LLM shape, both passes: fixed 2 ms, SDPA's default 1.5, flash 3, cuDNN 1 (the bar);
    each implementation's batch medians (scaled) from `batches`, STEADY where not named."""
    rows = []
    for key, ms in (("fixed", 2.0), ("sdpa", 1.5), ("sdpa flash", 3.0), ("sdpa cudnn", 1.0)):
        impl = SimpleNamespace(key=key, label=key)
        for pass_ in (cases.FWD, cases.FWD_BWD):
            row = cases.new_row("llm", impl, (4, 16, 2048, 64), "bfloat16", False, pass_)
            row.update(median_ms=ms, tflops=100.0)
            row["batch_medians_ms"] = [ms * b for b in batches.get(key, STEADY)]
            rows.append(row)
    cases.set_ratios(rows)
    return rows


def args_rows(batches: dict[str, list[float]]) -> list[dict]:
    rows = []
    for key, ms in (("fixed", 2.0), ("sdpa", 1.5), ("sdpa best", 1.0)):
        row = cases.new_row(
            "args", SimpleNamespace(key=key, label=key), (4, 16, 2048, 64), "bfloat16", False, "fwd"
        )
        row.update(median_ms=ms, tflops=100.0, case="plain", backend="cudnn")
        row["batch_medians_ms"] = [ms * b for b in batches.get(key, STEADY)]
        rows.append(row)
    cases.set_ratios(rows, {"ratio_to_sdpa": ("sdpa",), "ratio_to_best": ("sdpa best",)})
    return rows


def data_lines(lines: list[str], start: str) -> list[str]:
    return [line for line in lines if line.strip().startswith(start)]


@pytest.mark.parametrize("unsteady", ["fixed", "sdpa cudnn", "sdpa flash", None])
def test_llm_ratio_is_marked_where_fixed_or_its_bar_ran_unsteady(unsteady):
    lines = table._llm_tables(llm_rows({unsteady: ONE_SLOW_BATCH}), {"sdpa_kernels": {}})
    data = data_lines(lines, "64 no")
    assert len(data) == 2, lines
    if unsteady in ("fixed", "sdpa cudnn"):  # fixed/cuDNN compares these two
        assert all(line.endswith("0.50×~") for line in data), data
        assert sum(line == table.UNSTEADY_NOTE for line in lines) == 2, lines
    else:  # flash is not in the ratio: its batches say nothing about it
        assert all(line.endswith("0.50×") for line in data), data
        assert table.UNSTEADY_NOTE not in lines, lines
    # The ratios stay in one column, marked or not.
    assert len({line.index("0.50×") for line in data}) == 1


def test_args_ratios_are_marked_each_for_its_own_pair():
    lines = table._args_table(args_rows({"sdpa best": ONE_SLOW_BATCH}), {})
    (data,) = data_lines(lines, "plain")
    assert "0.75× " in data and data.endswith("0.50×~"), data  # default steady, best not
    assert lines[-1] == table.UNSTEADY_NOTE, lines
    lines = table._args_table(args_rows({}), {})
    assert "~" not in data_lines(lines, "plain")[0] and table.UNSTEADY_NOTE not in lines


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kata", "bench", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )


def test_table_prints_a_saved_run_again(tmp_path):
    report = {
        "machine": {"device": "a GPU", "torch": "2.x", "cuda": None, "python": "3", "date": "d"},
        "settings": {"quick": False},
        "sdpa_kernels": {},
        "rows": llm_rows({"fixed": ONE_SLOW_BATCH}),
    }
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps(report))
    result = bench("--table", str(saved))
    assert result.returncode == 0, result.stderr
    assert result.stdout == table.format_table(report) + "\n"
    assert "0.50×~" in result.stdout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--bogus",), "unrecognized arguments: --bogus"),
        (("--table", "missing.json"), "--table: cannot read missing.json: No such file"),
        (("--table", "README.md"), "--table: README.md is not JSON"),
        (("--table", "pyproject.toml"), "is not JSON"),
    ],
)
def test_a_bad_flag_or_file_is_one_line(args, says):
    result = bench(*args)
    assert result.returncode == 2 and not result.stdout, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench: ") and says in lines[0], lines


def test_json_that_is_no_report_is_one_line(tmp_path):
    other = tmp_path / "other.json"
    other.write_text('{"rows": 3}')
    result = bench("--table", str(other))
    assert result.returncode == 2, result
    assert result.stderr.splitlines() == [
        f"bench: --table: {other} is not a bench.json (rows, machine and settings) "
        "(see `python -m kata bench --help`)"
    ]
