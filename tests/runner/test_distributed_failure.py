"""A rank failing mid-run under ``torchrun``: its peer, blocked in a TP collective with it, is
released within the failure grace (not the group's timeout), the job exits non-zero, and the
output names the failing rank and its error.

One launch: ``torchrun --nproc-per-node 2 THIS_FILE generate --tp 2 ...`` runs the real CLI on
both ranks, this file's ``__main__`` making rank 1's third ``Engine.step`` raise (rank 0 is then
inside that step's forward, in an all-reduce rank 1 never joins) and shortening the failure
grace from its 5 s default to 1 s (``Topology.failure_grace_s``; test time). The in-process
protocol (an agreed failure, a rank leaving the group, the notes) is tested by
test_distributed_ranks.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

#: The group's collective timeout the CLI uses (``Topology.timeout_s``): a hang would last it.
GROUP_TIMEOUT_S = 600.0
ARGS = ["generate", "--tp", "2", "--model", "tiny", "--prompt-ids", "1,2,3", "--max-tokens",
        "12", "--loop", "synchronous"]


def test_rank_failing_inside_a_collective_ends_the_torchrun_job_naming_it():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", __file__, *ARGS]
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"})
    elapsed = time.monotonic() - t0
    assert res.returncode != 0, res.stderr[-4000:]
    # start-up (~6 s on 2 busy cores) plus the 1 s grace; a hang would take GROUP_TIMEOUT_S
    assert elapsed < 60 < GROUP_TIMEOUT_S, f"took {elapsed:.0f} s:\n{res.stderr[-4000:]}"
    errors = [" ".join(x.split()) for x in res.stderr.splitlines() if x.startswith("error:")]
    root = ("speccal generate failed on {n} rank(s), first on rank 1: rank 1: ValueError: "
            "injected failure in round 3 of rank 1")
    # rank 1 says it itself (torchrun may stop rank 0 before it prints) ...
    assert "error: " + root.format(n=1) + " (not every rank reached the error barrier: the " \
        "ranks left the process group)" in errors, res.stderr[-4000:]
    # ... and rank 0, if it printed first, names rank 1 first, then its own broken collective
    assert all(e.startswith("error: " + root.format(n=2) + "; rank 0: RuntimeError: ")
               for e in errors if "on 2 rank(s)" in e), errors
    assert len(errors) <= 2
    assert not re.search(r"Timed out|timeout", res.stderr)
    assert not [x for x in res.stdout.splitlines() if x.startswith("{")]  # no result printed


if __name__ == "__main__":  # one rank of the launch above
    import dataclasses

    from speccal.cli import main
    from speccal.runner.distributed import comm
    from speccal.runner.engine import Engine

    join = comm.init_comm
    comm.init_comm = lambda topology, env, device: join(
        dataclasses.replace(topology, failure_grace_s=1.0), env, device)

    if os.environ["RANK"] == "1":
        step = Engine.step
        calls = []

        def failing_step(self, plan):
            calls.append(plan)
            if len(calls) == 3:
                raise ValueError("injected failure in round 3 of rank 1")
            return step(self, plan)

        Engine.step = failing_step
    sys.argv = ["speccal", *sys.argv[1:]]
    main()
