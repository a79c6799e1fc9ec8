"""The bench's command line (bench/cli.py): each flag's bad values are one line and exit 2 before
any timing, and a bench.json that cannot be written is refused before the run, or is one line
after its table. The rows' and the sections' tests: test_bench.py, test_bench_args.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import alternate, cases, cli


def test_a_json_path_that_cannot_be_written_is_one_line_before_any_timing(
    tmp_path, capsys, monkeypatch
):
    """bench.json is written last, after minutes of timing on a GPU: a path that cannot take it
    is refused first, in one line; one that fails at the end (changed during the run) is one
    line and exit 1 after the table, not a traceback."""
    blocker = tmp_path / "a file"
    blocker.write_text("")
    for path, says in (
        (tmp_path, "is a directory"),
        (blocker / "sub" / "b.json", f"{blocker} is a file, not a folder"),
    ):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["--quick", "--only", "kata", "--json", str(path)])
        assert exit_.value.code == 2
        out, error = capsys.readouterr()
        assert out == "" and error.count("\n") == 1 and says in error, error
    assert cli.json_destination_problem(tmp_path / "new" / "b.json") is None
    assert (tmp_path / "new").is_dir()

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "write_text", refuse)
    path = tmp_path / "new" / "b.json"
    assert cli.main(["--quick", "--only", "kata", "--time-limit", "0", "--json", str(path)]) == 1
    out, error = capsys.readouterr()
    assert "Skipped rows:" in out, out  # the table came first
    assert error.strip().splitlines()[-1] == f"bench: could not write {path}: Permission denied"


def test_time_limit_skips_rows_with_the_reason(tmp_path, capsys):
    path = tmp_path / "b.json"
    argv = ["--quick", "--only", "kata", "--time-limit", "0", "--json", str(path)]
    assert cli.main(argv) == 0
    rows = json.loads(path.read_text())["rows"]
    assert rows and all("--time-limit" in row["status"] for row in rows), rows
    assert "Skipped rows:" in capsys.readouterr().out


def test_settle_sets_the_untimed_lead_of_each_batch_and_refuses_bad_values(capsys):
    """--settle MS, --settle-max MS: each alternating batch's untimed calls come in chunks of
    --settle until two agree, for at most --settle-max (GPU power states take about 100 ms to
    settle, perf/NOTES.md v59); --quick, or a --settle above the default longest, is a fixed
    settle; a bad value is one line and exit 2."""
    parse = cli.build_parser().parse_args
    cpu = torch.device("cpu")
    settings = cases.make_settings(parse([]), cpu)
    assert (settings.alternate_settle_ms, settings.alternate_settle_max_ms) == (30.0, 250.0)
    assert settings.time_limit_s == 600.0  # a full run's settling fits
    settings = cases.make_settings(parse(["--settle", "50", "--settle-max", "100"]), cpu)
    assert (settings.alternate_settle_ms, settings.alternate_settle_max_ms) == (50.0, 100.0)
    settings = cases.make_settings(parse(["--settle", "300"]), cpu)
    assert (settings.alternate_settle_ms, settings.alternate_settle_max_ms) == (300.0, 300.0)
    settings = cases.make_settings(parse(["--quick"]), cpu)
    assert settings.alternate_settle_max_ms == settings.alternate_settle_ms == 30.0
    assert alternate.settle_calls(250.0, 0.5) == 500
    for flag in ("--settle", "--settle-max"):
        for bad in ("-1", "x", "inf", "nan"):
            with pytest.raises(SystemExit) as exit_:
                parse([flag, bad])
            assert exit_.value.code == 2
            error = capsys.readouterr().err
            assert error.count("\n") == 1 and flag in error and "Traceback" not in error, error
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--settle", "50", "--settle-max", "40", "--only", "kata"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--settle-max 40 is below --settle 50" in error, error


@pytest.mark.parametrize(
    ("flag", "bad"),
    [
        ("--budget", ("-1", "nan", "inf", "x")),
        ("--min-runs", ("0", "-3", "2.5", "x")),
        ("--max-runs", ("0", "-3", "2.5", "x")),
        ("--max-call", ("0", "-1", "nan", "inf")),
        ("--time-limit", ("-5", "nan", "inf", "x")),
        ("--max-seq", ("0", "-4", "1e3", "x")),
        ("--seed", ("x", "1.5", str(2**64), str(-(2**63) - 1))),
    ],
)
def test_each_number_flag_refuses_what_would_end_in_a_traceback_or_empty_rows(flag, bad, capsys):
    """A value that used to end the run in a traceback (no median of zero runs; an inf or nan
    in bench.json) or time nothing without saying so is one line and exit 2, before any timing.
    --time-limit 0 stays: it times nothing and every row says so."""
    parse = cli.build_parser().parse_args
    for value in bad:
        with pytest.raises(SystemExit) as exit_:
            parse([flag, value])
        assert exit_.value.code == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and flag in error and repr(value) in error, error
    good, field, expected = {
        "--budget": ("0.5", "budget_s", 0.5),
        "--min-runs": ("2", "min_runs", 2),
        "--max-runs": ("9", "max_runs", 9),
        "--max-call": ("0.1", "max_call_s", 0.1),
        "--time-limit": ("0", "time_limit_s", 0.0),
        "--max-seq": ("2048", "max_seq", 2048),
        "--seed": (str(2**64 - 1), "seed", 2**64 - 1),
    }[flag]
    assert getattr(cases.make_settings(parse([flag, good]), torch.device("cpu")), field) == expected
