"""The supported torch range (pyproject.toml) and what the kata relies on in every release of it:
`make deps` names the range in one line for a torch outside it, fixed/ states the same lower
bound, and the private torch APIs fixed/ uses behave as it expects on the torch this runs on.
.ci/run runs these at both ends of the range."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

import fixed
from kata import REPO_ROOT
from kata.toolchain import deps, torch_support


def test_pyproject_declares_a_bounded_range_and_this_torch_is_in_it():
    oldest, upper = torch_support.supported_range()
    assert oldest < upper
    assert torch_support.problem(torch.__version__) is None, (
        f"the suite runs on torch {torch.__version__}, outside {torch_support.requirement()}"
    )


@pytest.mark.parametrize(
    ("version", "numbers"),
    [("2.15.0+cu132", (2, 15, 0)), ("2.11.0a0+gitabc", (2, 11, 0)), ("2.6", (2, 6, 0))],
)
def test_release_reads_local_and_pre_release_versions(version, numbers):
    assert torch_support.release(version) == numbers


def test_a_torch_outside_the_range_gets_one_line_naming_it():
    oldest, upper = torch_support.supported_range()
    spec = torch_support.requirement().removeprefix("torch")
    below = f"{oldest[0]}.{oldest[1] - 1}.0" if oldest[1] else f"{oldest[0] - 1}.99.0"
    above = f"{upper[0]}.{upper[1]}.0+cu999"
    old_line, new_line = torch_support.problem(below), torch_support.problem(above)
    assert spec in old_line and "older" in old_line and "\n" not in old_line
    assert spec in new_line and "newer" in new_line and "\n" not in new_line
    assert torch_support.too_old(below) and not torch_support.too_old(above)


@pytest.mark.parametrize(("which", "status"), [("older", 1), ("newer", 0)])
def test_make_deps_stops_on_an_older_torch_and_warns_on_a_newer(monkeypatch, capsys, which, status):
    upper = torch_support.supported_range()[1]
    version = "1.13.1" if which == "older" else f"{upper[0]}.{upper[1] + 3}.0"
    monkeypatch.setattr(torch_support, "installed", lambda: version)
    monkeypatch.setattr(deps, "is_installed", lambda name: True)
    assert deps.main() == status
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"make deps: torch {version} is {which}"), lines


def test_make_deps_installs_torch_from_the_range(monkeypatch, capsys):
    """On a machine without torch, make deps asks pip for a torch inside the range."""
    asked = []
    monkeypatch.setattr(deps, "is_installed", lambda name: name != "torch")
    monkeypatch.setattr(torch_support, "installed", lambda: torch.__version__)
    monkeypatch.delenv("TORCH_SPEC", raising=False)
    monkeypatch.setattr(
        subprocess,
        "run",
        lambda command, **_: asked.append(command) or subprocess.CompletedProcess(command, 0),
    )
    assert deps.main() == 0
    (command,) = asked
    assert command[-1] == torch_support.requirement(), command


def test_fixed_states_the_same_oldest_torch():
    assert torch_support.supported_range()[0][:2] == fixed.OLDEST_TORCH, (
        "fixed/__init__.py and pyproject.toml disagree on the oldest supported torch"
    )


def test_private_check_helpers_raise_the_typed_errors_fixed_relies_on():
    """fixed/ops.py's fake kernels use torch._check_value and torch._check_type (private: a
    leading underscore) because, unlike `raise`, they accept symbolic sizes under
    torch.compile. Pinned here on every supported torch: the error type and the lazy message."""
    torch._check_value(True, lambda: "never built")
    torch._check_type(True, lambda: "never built")
    with pytest.raises(ValueError, match=r"^head dim 65 is not 64$"):
        torch._check_value(False, lambda: "head dim 65 is not 64")
    with pytest.raises(TypeError, match=r"^query must be float32$"):
        torch._check_type(False, lambda: "query must be float32")


def test_cpp_extension_behaviour_the_build_relies_on():
    """fixed/_build.py uses only cpp_extension's public surface: load() with these keywords,
    CUDA_HOME, and the TORCH_CUDA_ARCH_LIST variable, whose 9.0a it asks for on Hopper."""
    import inspect

    from torch.utils import cpp_extension

    parameters = inspect.signature(cpp_extension.load).parameters
    for keyword in (
        "name",
        "sources",
        "extra_cflags",
        "extra_cuda_cflags",
        "extra_ldflags",
        "build_directory",
        "with_cuda",
        "is_python_module",
    ):
        assert keyword in parameters, keyword
    assert hasattr(cpp_extension, "CUDA_HOME")
    source = (REPO_ROOT / "fixed" / "_build.py").read_text()
    assert "FileBaton" not in source and "_get_cuda_arch_flags" not in source


def test_cpp_extension_build_lock_is_the_kind_round_two_expects():
    """Round two's prepare() removes stale cpp_extension build locks only where the file's
    existence blocks (torch.utils.file_baton); where it is an flock() it leaves them. Which one
    the installed torch's JIT build takes is private: pinned here."""
    from torch.utils import cpp_extension

    from kata.harness import round2

    source = inspect.getsource(cpp_extension._jit_compile)
    assert ("FileBaton(" in source) == round2.locks_block_while_they_exist(), torch.__version__
    assert ("FileLock(" in source) != round2.locks_block_while_they_exist(), torch.__version__


def test_kata_refuses_an_older_torch_in_one_line(tmp_path):
    """python -m kata, run directly (not through make), says so too."""
    script = (
        "import sys; from kata.toolchain import torch_support as t; "
        "t.installed = lambda: '1.13.1'; "
        "from kata.__main__ import main; sys.exit(main(['list']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"kata: {torch_support.problem('1.13.1')}"], (
        result.stderr
    )


def test_kata_without_torch_says_so_in_one_line():
    """A Python without torch (python -m kata run by another interpreter than make's): the
    commands that need torch print one line and exit 2, where they printed a traceback; the
    others still run."""
    script = (
        "import sys; from kata.toolchain import torch_support as t; "
        "t.installed = lambda: None; "
        "from kata.__main__ import main; sys.exit(main(sys.argv[1:]))"
    )

    def kata(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", script, *argv],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    for command in ("check", "review", "watch", "build", "bench"):
        result = kata(command)
        assert result.returncode == 2, (command, result.stderr)
        assert result.stderr.strip().splitlines() == [
            f"kata: this Python ({sys.executable}) has no torch; `make deps` installs it"
        ], (command, result.stderr)
    listing = kata("list")
    assert listing.returncode == 0 and "int32-sizes" in listing.stdout, listing.stderr


def test_torch_cuda_sleep_keeps_the_device_busy_as_host_alloc_expects():
    """The host-alloc probe (runner._waits_for_the_device) holds the device with the private
    torch.cuda._sleep(cycles): it must exist on every supported torch, and on a GPU keep the
    current stream busy while the host goes on."""
    import inspect

    assert list(inspect.signature(torch.cuda._sleep).parameters) == ["cycles"]
    if not torch.cuda.is_available():
        return
    torch.cuda.synchronize()
    busy = torch.cuda.Event()
    torch.cuda._sleep(1_000_000_000)
    busy.record()
    assert not busy.query(), "the device finished half a second of spinning at once"
    torch.cuda.synchronize()
    assert busy.query()
