"""The output lock: one holder at a time, the refusal names the holder, a killed holder frees it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from speccal.base.errors import OutputError
from speccal.calibrate.lock import OutputLockedError, acquire, lock_path, read_holder

HOLD = """
import sys, time
from speccal.calibrate.lock import acquire
lk = acquire(sys.argv[1], "--out", command="speccal calibrate --out held.json")
print("held", flush=True)
time.sleep(120)
"""


def test_second_acquirer_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "t.json"
    with acquire(out, "--out", command="speccal calibrate --out t.json") as held:
        assert lock_path(out) == tmp_path / "t.json.lock"
        holder = read_holder(lock_path(out))
        assert holder == held.holder
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        # flock belongs to the open file description: a second open in this process conflicts too
        with pytest.raises(OutputLockedError) as exc:
            acquire(out, "--out")
        msg = str(exc.value)
        assert msg.startswith("--out: got ")
        assert f"locked by pid {os.getpid()} on host {socket.gethostname()} since " in msg
        assert holder["started"] in msg and "(speccal calibrate --out t.json)" in msg
        assert "\n" not in msg and exc.value.exit_code == 2
    assert not lock_path(out).exists()  # released and removed
    with acquire(out, "--out") as again:
        assert again.held
    assert not again.held


def test_lock_of_another_process_and_its_death(tmp_path):
    out = tmp_path / "t.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(OutputLockedError, match=f"locked by pid {proc.pid} on host"):
            acquire(out, "--out")
        proc.send_signal(signal.SIGKILL)  # no cleanup runs: the lock file stays behind
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert lock_path(out).exists()
    deadline = time.monotonic() + 10
    while True:  # the kernel drops a dead process's flock at once; allow for a slow reaper
        try:
            lk = acquire(out, "--out")
            break
        except OutputLockedError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert lk.holder["pid"] == os.getpid()
    lk.release()


def test_unwritable_lock_location_is_an_output_error(tmp_path):
    with pytest.raises(OutputError, match="--out"):
        acquire("/proc/speccal-test.json", "--out")
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError):
        acquire(tmp_path / "f" / "t.json", "--out")
