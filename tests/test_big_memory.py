"""The big-memory lock: the int32-sizes probes of reviews side by side on one GPU take turns,
and a review waits for its turn no longer than its patience allows."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from kata.harness import review as review_module
from kata.harness.catalog import CATALOG, Need


def _hold_lock(path: Path) -> subprocess.Popen:
    """Another review's big-memory probe: a process holding the lock until it is killed."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time\n"
            "f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True)\n"
            "time.sleep(60)",
            str(path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "held\n"
    return holder


def test_big_memory_probes_take_turns(tmp_path, monkeypatch, capfd):
    """Two reviews on one GPU never run int32-sizes at once: the second waits for the lock (and
    says so), gives up after its patience, and checks the free memory once it holds it."""
    lock = tmp_path / "big.lock"
    monkeypatch.setattr(review_module, "BIG_MEMORY_LOCK", lock)
    free = {"bytes": 80 * 2**30}
    monkeypatch.setattr(review_module, "free_gpu_bytes", lambda: free["bytes"])
    holder = _hold_lock(lock)
    try:
        with review_module.big_memory_turn(patience=0.5) as cannot:
            assert cannot == "another review held the GPU's memory for over 0 s"
        assert "waits for another review's big-memory probe" in capfd.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    with review_module.big_memory_turn(patience=0.5) as cannot:  # a dead holder frees it
        assert cannot is None
    free["bytes"] = 30 * 2**30  # another program took the memory since the review began
    with review_module.big_memory_turn(patience=0.5) as cannot:
        assert cannot == "needs about 60 GB of free GPU memory; 30 GB free"
    readings = iter([30 * 2**30, 30 * 2**30, 70 * 2**30])  # another review's probes end
    monkeypatch.setattr(review_module, "free_gpu_bytes", lambda: next(readings))
    with review_module.big_memory_turn(patience=5) as cannot:
        assert cannot is None
    assert "waits for 60 GB of GPU memory to be free (30 GB now)" in capfd.readouterr().err


def test_big_memory_patience_counts_per_holder(tmp_path, monkeypatch):
    """A queue of reviews, each holding the lock for less than the patience, is waited out: the
    patience restarts when the lock changes hands (its holder's token changes). With one
    deadline for the whole wait, eight reviews at once on an H200 skipped int32-sizes."""
    lock = tmp_path / "big.lock"
    monkeypatch.setattr(review_module, "BIG_MEMORY_LOCK", lock)
    monkeypatch.setattr(review_module, "free_gpu_bytes", lambda: 80 * 2**30)
    holder = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    os.pwrite(holder, b"review 1", 0)  # what each holder writes: a token of its own
    outcome = {}

    def wait_for_turn():
        with review_module.big_memory_turn(patience=1.0) as cannot:
            outcome["cannot"] = cannot

    waiter = threading.Thread(target=wait_for_turn)
    waiter.start()
    try:
        time.sleep(0.7)
        os.pwrite(holder, b"review 2", 0)  # the lock passes to the next review in line
        time.sleep(0.7)  # 1.4 s in all, each holder 0.7 s
    finally:
        fcntl.flock(holder, fcntl.LOCK_UN)
        os.close(holder)
    waiter.join(timeout=10)
    assert outcome == {"cannot": None}


def test_big_memory_queue_has_an_end(tmp_path, monkeypatch):
    """A lock whose token keeps changing (a long queue, or anyone writing the file) is waited
    for QUEUE_PATIENCE holders' patience in all, then the probe is skipped, never hung."""
    lock = tmp_path / "big.lock"
    monkeypatch.setattr(review_module, "BIG_MEMORY_LOCK", lock)
    holder = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    stop = threading.Event()

    def rotate_tokens():
        for n in range(1000):
            if stop.wait(0.2):
                return
            os.pwrite(holder, f"review {n:03d}".encode(), 0)

    rotator = threading.Thread(target=rotate_tokens)
    rotator.start()
    try:
        started = time.monotonic()
        with review_module.big_memory_turn(patience=0.5) as cannot:
            waited = time.monotonic() - started
    finally:
        stop.set()
        rotator.join()
        os.close(holder)
    assert cannot == "other reviews held the GPU's memory for over 2 s in all"
    assert 2.0 <= waited < 5.0, waited


def test_only_a_gpu_too_small_skips_big_memory_before_the_turn():
    """Free memory at the review's start is not the verdict: other reviews' probes hold it for a
    moment. Only a GPU with too little memory in all skips int32-sizes before its turn."""
    flaw = next(flaw for flaw in CATALOG if Need.BIG_MEMORY in flaw.needs)
    busy_h100 = review_module.Machine("H100", "cuda", 1, 20 * 2**30, 79 * 2**30)
    assert busy_h100.skip_reason(flaw) is None
    small = review_module.Machine("L4", "cuda", 1, 22 * 2**30, 22 * 2**30)
    assert small.skip_reason(flaw) == "needs about 60 GB of GPU memory; this GPU has 22 GB"
