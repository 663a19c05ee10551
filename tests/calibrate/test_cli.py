"""``speccal calibrate`` through the CLI: effective-config printout, --json, table reuse refusals,
a real SIGKILL of a calibrating process followed by --resume, and the journal's protection (no
silent discard, one run per output, duplicates dropped, outputs checked before the runner)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from speccal.calibrate.config import KEYS
from speccal.cli import app
from speccal.costmodel.table import load_table

ENV = {"COLUMNS": "120"}
#: The real tiny engine's windows are noisy on a shared CI box: these tests keep the quality gate
#: from re-measuring or refusing (test_gate.py tests the gate with a fake clock).
GATE_OFF = ["--remeasure-rounds", "0", "--accept-noisy"]


@pytest.fixture
def patched(monkeypatch, engine_factory):
    monkeypatch.setattr("speccal.calibrate.pipeline.make_engine", engine_factory)
    return engine_factory


def invoke(*args):
    return CliRunner().invoke(app, ["calibrate", *map(str, args), *GATE_OFF], env=ENV)


def test_effective_configuration_printed_with_sources_and_geometry(
    tmp_path, small, write_config, patched
):
    small.pop("warmup_steps")  # left to its default
    res = invoke(
        "--config", write_config(small), "--out", tmp_path / "t.json", "--window-steps", 3, "--json"
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["points_done"] == 4
    sources = summary["effective_config"]["sources"]
    assert (
        sources["warmup_steps"],
        sources["window_steps"],
        sources["contexts"],
        sources["draft_width"],
    ) == (
        "default (cpu)",  # calibrate.config.KIND_DEFAULTS
        "flag",
        "file",
        "run",
    )
    err = res.stderr
    assert "effective calibration configuration" in err
    assert "captured graph geometry" in err
    for key in KEYS:  # every key printed with its source
        line = next(ln for ln in err.splitlines() if f" {key} " in ln)
        assert sources[key] in line, line
    assert "target rows G per Bcap" in err
    assert "leave-one-point-out" in err  # fit report
    check = CliRunner().invoke(app, ["table", "validate", str(tmp_path / "t.json")], env=ENV)
    assert check.exit_code == 0, check.output


def test_bad_config_exits_2_with_one_line(tmp_path, write_config, patched):
    res = invoke(
        "--config",
        write_config({"calibration": {"windows": 3}, "version": 1}),
        "--out",
        tmp_path / "t.json",
    )
    assert res.exit_code == 2
    assert "calibration.windows" in res.stderr and "Traceback" not in res.stderr


@pytest.fixture
def table_w3(tmp_path, small, write_config, patched):
    out = tmp_path / "w3.json"
    res = invoke("--config", write_config(small), "--out", out)
    assert res.exit_code == 0, res.output
    return out


def test_reuse_compatible_table_skips_sampling(table_w3, patched):
    res = invoke("--cost-table", table_w3, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["status"] == "reused"
    assert patched.last.steps == 0
    assert "sampling and fitting skipped" in res.stderr


def _edit(path, dest, fn):
    doc = json.loads(path.read_text())
    fn(doc)
    dest.write_text(json.dumps(doc))
    return dest


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d["compatibility"]["topology"].update(
            dp=2, world_size=2, devices=d["compatibility"]["topology"]["devices"] * 2),
         "topology.dp"),
        (lambda d: d["compatibility"].update(graph_mode="unified"), "graph_mode"),
    ],
)
def test_table_of_another_topology_or_graph_mode_refused(tmp_path, table_w3, patched, edit, field):
    other = _edit(table_w3, tmp_path / "other.json", edit)
    res = invoke("--cost-table", other)
    assert res.exit_code == 2
    assert field in res.stderr
    assert patched.last.steps == 0


def test_table_of_another_draft_width_refused(tmp_path, small, write_config, patched):
    out = tmp_path / "w2.json"
    small["target_graph_rows"] = {"1": [2], "2": [2]}  # connected through G=2 at w=2
    res = invoke("--config", write_config(small), "--out", out, "--draft-width", 2)
    assert res.exit_code == 0, res.output
    assert load_table(out).calibration.draft_width == 2
    res = invoke("--cost-table", out, "--draft-width", 3)
    assert res.exit_code == 2
    assert "draft_width" in res.stderr


def test_sigkill_mid_calibration_then_resume(tmp_path, small, write_config):
    small.update(
        request_buckets=[1, 2],
        target_graph_rows=None,
        contexts=[{"prefill_tokens": 32, "min_kv_length": 1, "max_kv_length": 255}],
        window_steps=16,
        windows_per_point=3,
    )
    small = {k: v for k, v in small.items() if v is not None}
    cfg = write_config(small)
    out = tmp_path / "table.json"
    journal = tmp_path / "table.json.journal.jsonl"
    previous = b'{"previous": "table"}\n'
    out.write_bytes(previous)
    args = [
        "calibrate",
        "--config",
        cfg,
        "--out",
        out,
        "--max-model-len",
        256,
        "--request-buckets",
        "1,2",
        *GATE_OFF,
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "speccal", *map(str, args)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **ENV, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if journal.exists() and journal.read_text().count('"kind":"window"') >= 2:
                break
            time.sleep(0.01)
        assert proc.poll() is None, "calibration ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert out.read_bytes() == previous  # no partial table, the previous one untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "cfg.json",
        "table.json",
        "table.json.journal.jsonl",
        "table.json.journal.jsonl.lock",  # dead holders' files: the kernel released the locks
        "table.json.lock",
    ]
    before = journal.read_bytes()
    complete = before[: before.rfind(b"\n") + 1].count(b'"kind":"window"')
    assert 2 <= complete < 27

    res = CliRunner().invoke(app, [*map(str, args), "--resume", "--json"], env=ENV)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    # buckets 1 and 2 at w=3: G in {1,2,3,4} and {2,3,4,6,8} -> 9 points x 3 windows
    assert summary["points_total"] == summary["points_done"] == 9
    assert summary["windows"] == 27
    assert summary["windows_measured"] == 27 - complete
    after = journal.read_bytes()
    assert after.startswith(before[: before.rfind(b"\n") + 1])  # finished windows kept as they were
    table = load_table(out)
    assert len(table.fits[0].windows) == 27
    assert not (tmp_path / "table.json.lock").exists()  # the resumed run removed it


@pytest.mark.parametrize(
    "flag, value, reason",
    [
        ("--graph-mode", "split", "captures CUDA/NPU graphs"),
        ("--graph-mode", "bogus", "one of eager, split"),
        ("--attention-backend", "bogus", "one of torch, triton"),
    ],
)
def test_execution_path_flags_are_validated_before_sampling(tmp_path, flag, value, reason):
    out = tmp_path / "t.json"
    res = CliRunner().invoke(app, ["calibrate", flag, value, "--out", str(out)], env=ENV)
    assert res.exit_code == 2, res.output
    assert reason in res.output
    assert not out.exists() and not (tmp_path / "t.json.journal.jsonl").exists()


def test_default_execution_path_follows_the_device():
    from speccal.calibrate.pipeline import CalibrateOptions, make_engine

    eng = make_engine(CalibrateOptions(model="tiny", device="cpu"))
    assert eng.compatibility()["graph_mode"] == "eager"
    assert eng.config.path.attention_backend == "torch"


def one_line_error(res) -> str:
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    return lines[0]


def test_rerun_without_resume_refuses_to_discard_the_journal(tmp_path, table_w3, patched):
    journal = tmp_path / "w3.json.journal.jsonl"
    before = {p: p.read_bytes() for p in (table_w3, journal)}
    patched.last = None
    cfg = tmp_path / "cfg.json"  # written by table_w3
    msg = one_line_error(invoke("--config", cfg, "--out", table_w3))
    assert "8 finished windows" in msg and "--resume" in msg and "--overwrite" in msg
    assert patched.last is None  # refused before the runner was built
    assert {p: p.read_bytes() for p in before} == before
    msg = one_line_error(invoke("--config", cfg, "--out", table_w3, "--resume", "--overwrite"))
    assert "--overwrite" in msg and patched.last is None
    res = invoke("--config", cfg, "--out", table_w3, "--overwrite", "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["windows_measured"] == summary["windows"] == 8
    assert journal.read_bytes() != before[journal]


def test_a_locked_output_is_refused_naming_the_holder(tmp_path, small, write_config, patched):
    from speccal.calibrate.lock import acquire

    out = tmp_path / "t.json"
    with acquire(out, "--out", command="speccal calibrate --out t.json"):
        msg = one_line_error(invoke("--config", write_config(small), "--out", out))
    assert f"locked by pid {os.getpid()} on host " in msg and "since" in msg
    assert patched.last is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.json"]


def test_resume_fits_each_duplicated_window_once(tmp_path, table_w3, patched):
    """A journal in which every window was appended twice (two concurrent --resume runs before
    the lock): resume drops the 8 copies, measures nothing and fits 8 windows, not 16."""
    journal = tmp_path / "w3.json.journal.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join(lines + lines[1:]))
    res = invoke("--config", tmp_path / "cfg.json", "--out", table_w3, "--resume", "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert (summary["windows"], summary["windows_measured"]) == (8, 0)
    assert summary["journal_duplicates_dropped"] == 8
    assert "dropped 8 duplicate window line(s)" in res.stderr
    assert len(load_table(table_w3).fits[0].windows) == 8
    assert journal.read_text() == "".join(lines)


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["--out", "{d}/adir"],
            "--out: got '{d}/adir', expected a file path, not an existing directory",
        ),
        (["--out", "{d}/missing/t.json"], "missing does not exist"),
        (["--out", "{d}/afile/t.json"], "afile is a file"),
        (["--out", "/proc/speccal-t.json"], "cannot create a file in /proc"),
        (["--out", "/sys/speccal-t.json"], "cannot create a file in /sys"),
        (["--out", "{d}/t.json", "--journal", "{d}/adir"], "--journal: got"),
        (["--out", "{d}/t.json", "--journal", "/proc/j.jsonl"], "--journal: got '/proc/j.jsonl'"),
        (["--out", "{d}/t.json", "--journal", "{d}/t.json"], "a path other than --out"),
    ],
)
def test_outputs_checked_before_the_runner_is_built(
    tmp_path, small, write_config, patched, args, words
):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("keep")
    cfg = write_config(small)
    msg = one_line_error(invoke("--config", cfg, *(a.format(d=tmp_path) for a in args)))
    assert words.format(d=tmp_path) in msg
    assert patched.last is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile", "cfg.json"]


def test_calibrate_without_torch_is_one_line(tmp_path):
    code = (
        "import importlib.abc, sys\n"
        "class NoTorch(importlib.abc.MetaPathFinder):\n"  # what a machine without torch has
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] == 'torch':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "from speccal.cli import app\n"
        f"app(['calibrate', '--out', {str(tmp_path / 't.json')!r}])\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **ENV},
        timeout=120,
    )
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs torch" in lines[0], res.stderr
    assert list(tmp_path.iterdir()) == []


def test_paths_with_markup_are_printed_as_typed(tmp_path, small, write_config, patched):
    """A table path that reads as Rich markup or an emoji code is echoed verbatim."""
    out = tmp_path / "my:rocket:[bold]t.json"
    res = invoke("--config", write_config(small), "--out", out)
    assert res.exit_code == 0, res.output
    assert f"wrote {out} (" in res.stderr.replace("\n", "")
