"""What an implementation's process leaves behind ends with its probe: a child it started, still
writing into the probe's scratch directory (its TMPDIR) after the implementation's process
exits. torch 2.6's Inductor does that in every runner that calls torch.compile: its compile
workers outlive the runner by a second or two, and a review's cleanup of the scratch directory
once failed on one ("Directory not empty"), ending the review with a traceback."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from kata import FLAWED_DIR
from kata.harness import sandbox as sandbox_module
from kata.harness.review import resolve_implementation, run_review
from tests.process_support import alive

# A wrapper that, when imported, starts a child (a process group of its own it does not take)
# writing a new file into TMPDIR every millisecond for 20 s; the calls it answers are the
# shipped wrapper's. The marker names the child in /proc.
LEAVER = """
import os, subprocess, sys

subprocess.Popen(
    [sys.executable, "-c", '''
import os, time
marker = "{marker}"
end = time.monotonic() + 20
n = 0
while time.monotonic() < end:
    n += 1
    try:
        with open(os.path.join(os.environ["TMPDIR"], f"left-{{n}}"), "w"):
            pass
    except OSError:
        pass
    time.sleep(0.001)
'''],
    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
)

"""


def leftovers(marker: str) -> list[int]:
    """The pids of the processes whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return [pid for pid in found if alive(pid)]


@pytest.fixture
def leaving_candidate(tmp_path, flawed_library):
    copy = tmp_path / "candidate"
    shutil.copytree(FLAWED_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    marker = f"kata-leftover-{os.getpid()}-{time.monotonic_ns()}"
    wrapper = copy / "attention_wrapper.py"
    wrapper.write_text(LEAVER.format(marker=marker) + wrapper.read_text())
    yield resolve_implementation(str(copy)), marker
    for pid in leftovers(marker):  # the old harness left them running
        os.kill(pid, signal.SIGKILL)


# A sandbox with a PID namespace ends them with its init; fixed/'s runner, and any runner with
# the sandbox off (or none on the machine), had nothing that did.
@pytest.mark.parametrize("sandbox", ["off", "detected"])
def test_a_child_left_writing_ends_with_its_probe_and_the_review_completes(
    leaving_candidate, monkeypatch, sandbox
):
    if sandbox == "off":
        monkeypatch.setenv("KATA_SANDBOX", "off")
    implementation, marker = leaving_candidate
    sandbox_module.detect.cache_clear()  # decided once per process: here, for this test alone
    try:
        review = run_review(implementation, only=["shape"])  # raised OSError before (off)
    finally:
        sandbox_module.detect.cache_clear()
    [report] = review.reports
    assert report.result.status in ("present", "fixed"), report.result
    # Each runner's child is killed with its process group when the probe ends.
    deadline = time.monotonic() + 5
    while leftovers(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers(marker) == [], "a runner's child outlived its probe"
