"""Start a child as a terminal's shell would: with Ctrl-C (SIGINT) at its default action.

A test run started as a background job of a non-interactive shell (`nohup make test &` in a
script) inherits SIGINT ignored, and an ignored signal stays ignored across exec: without this,
the tests that press Ctrl-C would wait for a process that never hears it.
"""

from __future__ import annotations

import signal


def sigint_at_default() -> None:
    """preexec_fn for subprocess.Popen: SIGINT back to its default action in the child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
