"""Bad input under ``torchrun``: speccal's one ``error:`` line comes first, and torchrun's own
failure report (it exits 1 whatever the ranks' code: docs/distributed.md) names that line and
the rank's exit code 2 instead of pointing at torch's documentation."""

from __future__ import annotations

import os
import re
import subprocess
import sys

WORLD_SIZE_LINE = ("error: world size (torchrun --nproc-per-node x nodes): got 2, expected "
                   "tp * dp = 2 * 2 = 4")


def test_bad_input_under_torchrun_is_one_line_and_the_report_names_it(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "speccal", "calibrate", "--tp", "2", "--dp", "2", "--out",
           str(tmp_path / "t.json")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"})
    assert res.returncode != 0
    lines = res.stderr.splitlines()
    assert [x for x in lines if x.startswith("error:")] == [WORLD_SIZE_LINE]  # rank 0 only
    assert lines[0] == WORLD_SIZE_LINE  # before anything torchrun prints
    root = res.stderr.split("Root Cause")[-1]
    assert re.search(r"exitcode\s*: 2 ", root), root
    assert re.search(r"traceback\s*: " + re.escape(WORLD_SIZE_LINE), root), root
    assert not (tmp_path / "t.json").exists()
