"""Zygotes kept between runs (kata/harness/keeper.py): the next run adopts them, only a run like
the one that started them does, they end when idle, and nothing outside the kata is signalled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kata import REPO_ROOT
from kata.harness import forked, keeper, zygote
from tests.process_support import alive

IDLE_S = 3


@pytest.fixture
def keeping():
    """The environment of a run outside pytest and CI, keeping its zygotes IDLE_S seconds."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST", "CI")}
    env.pop("KATA_ZYGOTE", None)
    return dict(env, PYTHONPATH=str(REPO_ROOT), **{keeper.KEEP_ENV: str(IDLE_S)})


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:  # the keeper is this process's child here (a run's ends with the run): reap it
            if os.waitpid(pid, os.WNOHANG)[0]:
                return True
        except ChildProcessError:
            pass
        if not alive(pid):
            return True
        time.sleep(0.1)
    return False


def gone_within_listening(name: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while zygote.Adopted("runner", name).usable():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def fork_from(name: str, tmp_path) -> str:
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent("""
        import torch
        torch.calls = getattr(torch, "calls", 0) + 1
        print(torch.calls, torch.cuda.is_initialized())
    """)
    )
    child = forked.spawn(
        name, [str(script)], cwd=str(tmp_path), env=dict(os.environ), binds=None, path=[]
    )
    stdout, stderr = child.communicate(timeout=60)
    assert child.returncode == 0, stderr.decode()
    return stdout.decode().strip()


def test_the_next_run_adopts_the_kept_zygotes_and_they_end_when_idle(keeping, tmp_path):
    first = keeper.kept(keeping, tmp_path)
    assert first and first["started"], "no keeper started"
    try:
        runners = zygote.Adopted("runner", first["runner"], keeper=first["pid"])
        assert runners.usable(), "the kept runner zygote never listened"
        second = keeper.kept(keeping, tmp_path)
        assert second and not second["started"]
        assert (second["pid"], second["runner"]) == (first["pid"], first["runner"])
        # each child starts from the zygote, never from a sibling or an earlier run's child
        assert fork_from(first["runner"], tmp_path) == "1 False"
        assert fork_from(second["runner"], tmp_path) == "1 False"
        # another environment (what the zygotes imported torch with) gets a keeper of its own,
        # beside the first: a run still using the first keeps its probes
        other = keeper.kept({**keeping, "KATA_SOMETHING_NEW": "1"}, tmp_path)
        assert other and other["started"] and other["pid"] != first["pid"]
        assert other["file"] != first["file"]
        assert runners.usable() and fork_from(first["runner"], tmp_path) == "1 False"
        # idle: no run touched their files for IDLE_S seconds
        for ended in (first, other):
            assert gone_within(ended["pid"], IDLE_S + 10), "an idle keeper lives on"
            assert gone_within_listening(ended["runner"], 10), "an idle keeper's zygote lives on"
        assert not list(tmp_path.glob("kept-*.json"))
    finally:
        keeper.stop(tmp_path)


def test_stop_ends_every_keeper_and_the_next_run_starts_afresh(keeping, tmp_path):
    first = keeper.kept(keeping, tmp_path)
    other = keeper.kept({**keeping, "KATA_SOMETHING_NEW": "1"}, tmp_path)
    assert first and other and first["pid"] != other["pid"]
    assert keeper.stop(tmp_path) == 2
    for ended in (first, other):
        assert gone_within(ended["pid"], 10), "a stopped keeper lives on"
        assert gone_within_listening(ended["runner"], 10), "a stopped keeper's zygote lives on"
    again = keeper.kept(keeping, tmp_path)
    try:
        assert again and again["started"] and again["pid"] != first["pid"]
    finally:
        keeper.stop(tmp_path)


def test_a_state_file_naming_another_process_never_gets_it_signalled(keeping, tmp_path):
    """A keeper's file is only trusted to name a keeper: a stale or forged pid is left alone."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        want = keeper.digest(keeping)
        state = {"pid": bystander.pid, "digest": want, "judge": "x", "runner": "y"}
        forged = tmp_path / f"kept-{want[:32]}.json"
        forged.write_text(json.dumps(state))
        started = keeper.kept(keeping, tmp_path)
        assert started and started["started"] and started["pid"] != bystander.pid
        forged.write_text(json.dumps(state))
        assert keeper.stop(tmp_path) == 0
        assert bystander.poll() is None, "a process named in a keeper's file was signalled"
    finally:
        keeper.stop(tmp_path)
        bystander.kill()
        bystander.wait()


def test_nothing_is_kept_under_pytest_ci_or_when_turned_off(keeping, tmp_path):
    assert keeper.idle_seconds(keeping) == IDLE_S
    assert keeper.idle_seconds({}) == keeper.IDLE_S
    unset = {k: v for k, v in keeping.items() if k != keeper.KEEP_ENV}
    for env in [
        {**keeping, keeper.KEEP_ENV: "0"},
        {**keeping, keeper.KEEP_ENV: "soon"},
        {**keeping, "KATA_ZYGOTE": "off"},
        {**unset, "CI": "true"},
        {**unset, "PYTEST_CURRENT_TEST": "tests/x.py::y (call)"},
    ]:
        assert keeper.idle_seconds(env) == 0, env
        assert keeper.kept(env, tmp_path) is None
    assert not list(tmp_path.glob("kept-*.json"))
    assert keeper.idle_seconds({**keeping, "CI": "true"}) == IDLE_S, "asked for, and not kept"


def test_an_adopted_zygote_must_be_this_users(keeping, tmp_path):
    """A name in a keeper's file that nobody listens on, or whose keeper is gone, is not adopted."""
    assert not zygote.Adopted("runner", "kata-runner-nobody", keeper=None).usable()
    waited = time.monotonic()
    assert not zygote.Adopted("runner", "kata-runner-nobody", keeper=2**22 + 1).usable()
    assert time.monotonic() - waited < 5, "waited for a keeper that does not exist"


def test_a_run_asks_the_keeper_once_and_again_after_closing_its_zygotes(monkeypatch):
    """watch closes its zygotes when kata/ changed: the next ones must come from a keeper of
    the new sources, not from the answer it had before."""
    from kata.harness import isolation

    asked = []
    monkeypatch.setattr(keeper, "kept", lambda env: asked.append(env) or None)
    monkeypatch.setattr(isolation, "_keeper_state", None)
    with isolation._running_lock:
        isolation._kept()
        isolation._kept()
    assert len(asked) == 1
    isolation.close_zygotes()
    with isolation._running_lock:
        isolation._kept()
    assert len(asked) == 2


def test_a_kept_zygote_whose_keeper_died_is_not_waited_for(tmp_path):
    """The run that started a keeper is its parent: a keeper that died unreaped (a zombie) must
    not make the run wait out the minute it gives a zygote still importing torch."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{dead.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.05)
    try:
        waited = time.monotonic()
        assert not zygote.Adopted("runner", "kata-runner-nobody", keeper=dead.pid).usable()
        assert time.monotonic() - waited < 5, "waited for a keeper that is a zombie"
    finally:
        dead.wait()
