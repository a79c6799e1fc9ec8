"""Probe processes die with the process that started them.

A review stopped by Ctrl-C kills its probes itself (isolation.kill_all). A review killed outright
(SIGKILL, the SIGHUP of a closed terminal, an unhandled SIGTERM) runs no cleanup, and its probes,
in sessions of their own, would run on: a hung candidate's at full CPU, holding GPU memory.
Linux's parent-death signal ends them with it: the judge when the review does, the runner (or its
sandbox launcher, whose namespace ends with it) when the judge does.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable

from kata.harness.sandbox import PR_SET_PDEATHSIG


def die_with_this_thread() -> Callable[[], None] | None:
    """A preexec_fn for subprocess.Popen: the child is killed when the thread that starts it ends
    (the parent-death signal follows the thread, not the process: start it from the thread that
    waits for it). None off Linux, where there is no such signal."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent ended before the signal was armed
            os._exit(1)

    return arm


def end_group(leader: int) -> None:
    """Kill what is left of the process group `leader` led, once the leader has ended: children
    it started and did not wait for. torch 2.6's Inductor compile workers outlive a runner that
    called torch.compile by a second or two, writing into its TMPDIR (the probe's scratch
    directory) while that is removed. Nothing where the group is gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signal.SIGKILL)
