"""Bad inputs across every command: each one a clean refusal before any work.

One table of (command line, words of the message). Every case must exit with status 2, print
exactly one line (``error: ...``) on stderr and nothing on stdout, show no traceback, and leave
every file of the scratch directory as it was (names, types and SHA-256 of the contents, compared
before and after). Outputs are checked before the work, so the whole table runs in seconds: no
case calibrates, fits, records or benchmarks anything. ``{d}`` in a case is the scratch
directory; ``{other_mode}`` the mode the scratch table was not fitted in.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat

import pytest
from typer.testing import CliRunner

from speccal.calibrate.lock import acquire
from speccal.cli import app
from speccal.costmodel.measurements import write_measurements
from speccal.costmodel.synthetic import make_measurements
from speccal.costmodel.table import load_table
from speccal.scenarios import generate, make_scenario
from speccal.trace import save_trace

ENV = {"COLUMNS": "120", "NO_COLOR": "1"}

SMALL_CONFIG = {
    "request_buckets": [1, 2],
    "target_graph_rows": {"1": [2], "2": [4]},
    "contexts": [{"prefill_tokens": 32, "min_kv_length": 1, "max_kv_length": 128}],
    "warmup_steps": 1,
    "window_steps": 2,
    "windows_per_point": 2,
}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """The files the cases point at: valid ones (a table, a trace, a config, measurement rows)
    and bad ones (binary, empty, truncated, not JSON, a directory, a FIFO, ...)."""
    d = tmp_path_factory.mktemp("bad_inputs")
    df = make_measurements(
        bias_ms=4.0,
        alpha_ms={1: 0.0, 2: 0.3},
        theta_ms={g: 0.05 * g for g in (2, 3, 4, 6, 8)},
        draft_width=3,
        noise_ms=0.01,
        seed=1,
    )
    write_measurements(df, d / "m.csv")
    # target_verify rows whose Bcap 1 full-width point reads G 5 > Bcap * (w + 1) = 4: refused,
    # not a wider geometry; without a mode column (fit's default is target_verify, as calibrate).
    tv = make_measurements(
        bias_ms=4.0,
        alpha_ms={1: 0.0, 2: 0.3},
        theta_ms={g: 0.05 * g for g in (1, 2, 3, 4, 5, 6, 8)},
        points=[(1, 1), (1, 2), (1, 5), (2, 2), (2, 4), (2, 6), (2, 8)],
        draft_width=3,
        mode="target_verify",
        seed=1,
    )
    tv.drop(columns=["mode"]).to_csv(d / "wide.csv", index=False)
    res = CliRunner().invoke(
        app,
        ["fit", str(d / "m.csv"), "--draft-width", "3", "--out", str(d / "table.json")],
        env=ENV,
    )
    assert res.exit_code == 0, res.output
    table = load_table(d / "table.json")
    compat = table.compatibility.model_dump(mode="json")
    (d / "compat.json").write_text(json.dumps(compat))
    (d / "compat_w5.json").write_text(json.dumps({**compat, "draft_width": 5}))
    text = (d / "table.json").read_text()
    (d / "truncated.json").write_text(text[: len(text) // 2])
    (d / "newer.json").write_text(json.dumps({**json.loads(text), "schema_version": 99}))
    trace = generate(make_scenario("steady", rounds=100, draft_width=3, num_requests=2))
    save_trace(trace, d / "trace.jsonl")
    (d / "config.json").write_text(json.dumps(SMALL_CONFIG))
    (d / "badkey.json").write_text(json.dumps({"windows": 3}))
    (d / "badtype.json").write_text(json.dumps({"window_steps": "many"}))
    binary = bytes(range(128, 256)) * 4  # not UTF-8 from the first byte
    for name in ("bin.dat", "bin.csv", "bin.jsonl"):
        (d / name).write_bytes(binary)
    (d / "notjson.json").write_text("{oops")
    (d / "empty.json").write_text("")
    (d / "list.json").write_text("[1, 2]")
    (d / "m.txt").write_text("not measurement rows")
    (d / "nocols.csv").write_text("a,b\n1,2\n")
    (d / "afile").write_text("a plain file, not a directory")
    (d / "adir").mkdir()
    (d / "adir.json").mkdir()
    os.mkfifo(d / "fifo")  # reading it would block forever
    # A journal with finished windows of an earlier run (a rerun must not discard them).
    (d / "old.json.journal.jsonl").write_text(
        '{"kind":"header"}\n{"kind":"window","row":{}}\n{"kind":"window","row":{}}\n'
    )
    lock = acquire(d / "locked.json", "--out", command="speccal calibrate --out locked.json")
    yield {"d": d, "other_mode": "target_verify" if table.mode == "draft_step" else "draft_step"}
    lock.release()


def snapshot(d) -> dict[str, str]:
    """Every entry under ``d``: a regular file by the SHA-256 of its bytes, others by type."""
    out = {}
    for root, dirs, files in os.walk(d):
        for name in dirs + files:
            p = os.path.join(root, name)
            mode = os.lstat(p).st_mode
            rel = os.path.relpath(p, d)
            if stat.S_ISREG(mode):
                with open(p, "rb") as fh:
                    out[rel] = hashlib.sha256(fh.read()).hexdigest()
            else:
                out[rel] = "dir" if stat.S_ISDIR(mode) else f"mode {stat.S_IFMT(mode):o}"
    return out


CAL = ["calibrate", "--config", "{d}/config.json"]
NEW = ["--out", "{d}/new.json"]
SCEN = ["--scenario", "steady", "--rounds", "100"]

# (id, argv, words that the one line must contain)
CASES = [
    # calibrate: outputs, lock and journal, before the runner is built
    ("cal-out-dir", [*CAL, "--out", "{d}/adir"], "not an existing directory"),
    ("cal-out-no-parent", [*CAL, "--out", "{d}/missing/t.json"], "missing does not exist"),
    ("cal-out-under-file", [*CAL, "--out", "{d}/afile/t.json"], "afile is a file"),
    ("cal-out-proc", [*CAL, "--out", "/proc/speccal-bad.json"], "cannot create a file in /proc"),
    ("cal-out-denied", [*CAL, "--out", "/sys/speccal-bad.json"], "Permission denied"),
    ("cal-journal-dir", [*CAL, *NEW, "--journal", "{d}/adir"], "--journal: got"),
    ("cal-journal-is-out", [*CAL, *NEW, "--journal", "{d}/new.json"], "a path other than --out"),
    ("cal-journal-discard", [*CAL, "--out", "{d}/old.json"], "pass --resume to continue it"),
    ("cal-locked", [*CAL, "--out", "{d}/locked.json"], "locked by pid"),
    ("cal-resume-overwrite", [*CAL, *NEW, "--resume", "--overwrite"], "--overwrite"),
    ("cal-cost-table-missing", ["calibrate", "--cost-table", "{d}/missing.json"], "--cost-table"),
    (
        "cal-cost-table-resume",
        ["calibrate", "--cost-table", "{d}/table.json", "--resume"],
        "not combined with --cost-table",
    ),
    (
        "cal-cost-table-overwrite",
        ["calibrate", "--cost-table", "{d}/table.json", "--overwrite"],
        "not combined with --cost-table",
    ),
    # calibrate: the config file and the flags
    ("cal-config-missing", ["calibrate", "--config", "{d}/missing.json", *NEW], "--config: got"),
    ("cal-config-binary", ["calibrate", "--config", "{d}/bin.dat", *NEW], "UTF-8 text file"),
    ("cal-config-dir", ["calibrate", "--config", "{d}/adir", *NEW], "not a directory"),
    ("cal-config-device", ["calibrate", "--config", "/dev/null", *NEW], "a regular file"),
    ("cal-config-not-json", ["calibrate", "--config", "{d}/notjson.json", *NEW], "valid JSON"),
    ("cal-config-unknown-key", ["calibrate", "--config", "{d}/badkey.json", *NEW], "windows"),
    ("cal-config-bad-type", ["calibrate", "--config", "{d}/badtype.json", *NEW], "window_steps"),
    ("cal-buckets", [*CAL, *NEW, "--request-buckets", "a,b"], "--request-buckets"),
    ("cal-buckets-empty", [*CAL, *NEW, "--request-buckets", ","], "at least one bucket"),
    ("cal-graph-mode", [*CAL, *NEW, "--graph-mode", "bogus"], "graph_mode"),
    ("cal-attention", [*CAL, *NEW, "--attention-backend", "bogus"], "attention_backend"),
    ("cal-device", [*CAL, *NEW, "--device", "bogus"], "device"),
    # fit
    ("fit-missing", ["fit", "{d}/missing.csv", *NEW], "measurements"),
    ("fit-dir", ["fit", "{d}/adir", *NEW], "measurements"),
    ("fit-binary", ["fit", "{d}/bin.csv", *NEW], "a readable .csv file"),
    ("fit-suffix", ["fit", "{d}/m.txt", *NEW], "ending in .csv or .parquet"),
    ("fit-columns", ["fit", "{d}/nocols.csv", *NEW], "got a, b, expected all of context_index"),
    ("fit-columns-missing", ["fit", "{d}/nocols.csv", *NEW], "missing: context_index"),
    ("fit-k-above-width", ["fit", "{d}/m.csv", *NEW, "--draft-width", "2"], "k <= draft_width = 2"),
    ("fit-g-past-full-width", ["fit", "{d}/wide.csv", *NEW], "a verify budget in [1, 4]"),
    (
        "fit-draft-step-shapes",
        ["fit", "{d}/wide.csv", *NEW, "--mode", "draft_step"],
        "G in [num_requests * (k + 1), bcap * (k + 1)]",
    ),
    ("fit-mode", ["fit", "{d}/m.csv", *NEW, "--mode", "bogus"], "--mode"),
    ("fit-mode-rows", ["fit", "{d}/m.csv", *NEW, "--mode", "target_verify"], "the rows' mode"),
    ("fit-model", ["fit", "{d}/m.csv", *NEW, "--model", "bogus"], "--model"),
    ("fit-combine", ["fit", "{d}/m.csv", *NEW, "--combine", "bogus"], "--combine"),
    ("fit-width", ["fit", "{d}/m.csv", *NEW, "--draft-width", "0"], "--draft-width"),
    ("fit-compat-missing", ["fit", "{d}/m.csv", *NEW, "--compat", "{d}/missing.json"], "--compat"),
    ("fit-compat-binary", ["fit", "{d}/m.csv", *NEW, "--compat", "{d}/bin.dat"], "UTF-8"),
    ("fit-compat-not-json", ["fit", "{d}/m.csv", *NEW, "--compat", "{d}/notjson.json"], "JSON"),
    ("fit-compat-list", ["fit", "{d}/m.csv", *NEW, "--compat", "{d}/list.json"], "JSON object"),
    ("fit-compat-fifo", ["fit", "{d}/m.csv", *NEW, "--compat", "{d}/fifo"], "a regular file"),
    (
        "fit-compat-width",
        ["fit", "{d}/m.csv", *NEW, "--compat", "{d}/compat.json", "--draft-width", "5"],
        "--draft-width",
    ),
    ("fit-calibration", ["fit", "{d}/m.csv", *NEW, "--calibration", "{d}/bin.dat"], "UTF-8"),
    ("fit-out-suffix", ["fit", "{d}/m.csv", "--out", "{d}/t.txt"], "ending in .json"),
    ("fit-out-dir", ["fit", "{d}/m.csv", "--out", "{d}/adir.json"], "not an existing directory"),
    ("fit-out-no-parent", ["fit", "{d}/m.csv", "--out", "{d}/missing/t.json"], "does not exist"),
    ("fit-out-under-file", ["fit", "{d}/m.csv", "--out", "{d}/afile/t.json"], "is a file"),
    ("fit-out-proc", ["fit", "{d}/m.csv", "--out", "/proc/speccal-bad.json"], "/proc"),
    ("fit-out-denied", ["fit", "{d}/m.csv", "--out", "/sys/speccal-bad.json"], "denied"),
    # table show / validate / export / diff
    ("show-missing", ["table", "show", "{d}/missing.json"], "readable cost table"),
    ("show-dir", ["table", "show", "{d}/adir"], "not a directory"),
    ("show-binary", ["table", "show", "{d}/bin.dat"], "invalid JSON"),
    ("show-empty", ["table", "show", "{d}/empty.json"], "empty file"),
    ("show-truncated", ["table", "show", "{d}/truncated.json"], "invalid JSON"),
    ("show-list", ["table", "show", "{d}/list.json"], "a JSON object"),
    ("show-fifo", ["table", "show", "{d}/fifo"], "special file"),
    ("show-newer", ["table", "show", "{d}/newer.json"], "newer speccal"),
    ("validate-not-json", ["table", "validate", "{d}/notjson.json"], "invalid JSON"),
    (
        "validate-expect-missing",
        ["table", "validate", "{d}/table.json", "--expect", "{d}/missing.json"],
        "--expect",
    ),
    (
        "validate-expect-binary",
        ["table", "validate", "{d}/table.json", "--expect", "{d}/bin.dat"],
        "UTF-8",
    ),
    (
        "validate-expect-dir",
        ["table", "validate", "{d}/table.json", "--expect", "{d}/adir"],
        "not a directory",
    ),
    (
        "validate-expect-not-json",
        ["table", "validate", "{d}/table.json", "--expect", "{d}/notjson.json"],
        "a JSON file",
    ),
    (
        "validate-expect-device",
        ["table", "validate", "{d}/table.json", "--expect", "/dev/null"],
        "a regular file",
    ),
    (
        "validate-expect-width",
        ["table", "validate", "{d}/table.json", "--expect", "{d}/compat_w5.json"],
        "draft_width",
    ),
    ("export-format", ["table", "export", "{d}/table.json", "--format", "bogus"], "--format"),
    (
        "export-out-dir",
        ["table", "export", "{d}/table.json", "--out", "{d}/adir"],
        "not an existing directory",
    ),
    ("export-out-proc", ["table", "export", "{d}/table.json", "--out", "/proc/x.csv"], "/proc"),
    (
        "export-out-under-file",
        ["table", "export", "{d}/table.json", "--out", "{d}/afile/x.csv"],
        "is a file",
    ),
    (
        "export-out-no-parent",
        ["table", "export", "{d}/table.json", "--out", "{d}/missing/x.csv"],
        "does not exist",
    ),
    ("export-missing", ["table", "export", "{d}/missing.json"], "readable cost table"),
    (
        "export-measurements-no-out",
        ["table", "export", "{d}/table.json", "--format", "measurements"],
        "a .csv or .parquet file",
    ),
    (
        "export-measurements-suffix",
        ["table", "export", "{d}/table.json", "--format", "measurements", "--out", "{d}/x.json"],
        "a .csv or .parquet file",
    ),
    ("compat-out-suffix", ["table", "compat", "--out", "{d}/c.txt"], "ending in .json"),
    ("compat-out-dir", ["table", "compat", "--out", "{d}/adir.json"], "not an existing directory"),
    ("compat-out-proc", ["table", "compat", "--out", "/proc/c.json"], "/proc"),
    ("diff-a-missing", ["table", "diff", "{d}/missing.json", "{d}/table.json"], "missing.json"),
    ("diff-b-binary", ["table", "diff", "{d}/table.json", "{d}/bin.dat"], "invalid JSON"),
    # trace
    ("trace-kind", ["trace", "--kind", "bogus", "--out", "{d}/t.jsonl"], "--kind"),
    ("trace-scenario", ["trace", "--scenario", "bogus", "--out", "{d}/t.jsonl"], "scenario"),
    (
        "trace-scenario-tokens",
        ["trace", *SCEN, "--kind", "tokens", "--out", "{d}/t.jsonl"],
        "rounds with --scenario",
    ),
    ("trace-out-dir", ["trace", *SCEN, "--out", "{d}/adir"], "not an existing directory"),
    ("trace-out-proc", ["trace", *SCEN, "--out", "/proc/t.jsonl"], "/proc"),
    ("trace-out-under-file", ["trace", *SCEN, "--out", "{d}/afile/t.jsonl"], "is a file"),
    ("trace-out-denied", ["trace", *SCEN, "--out", "/sys/t.jsonl"], "denied"),
    ("trace-out-suffix", ["trace", *SCEN, "--out", "{d}/t.txt"], ".parquet or .jsonl"),
    (
        "trace-rounds-out",
        ["trace", *SCEN, "--out", "{d}/t.jsonl", "--rounds-out", "{d}/r.jsonl"],
        "only with --kind tokens",
    ),
    ("trace-acceptance", ["trace", "--acceptance", "bogus", "--out", "{d}/t.jsonl"], "acceptance"),
    # replay
    ("replay-nothing", ["replay"], "exactly one of"),
    ("replay-both", ["replay", "--trace", "{d}/trace.jsonl", *SCEN], "exactly one of"),
    ("replay-table-missing", ["replay", "--table", "{d}/missing.json", *SCEN], "cost table"),
    ("replay-table-binary", ["replay", "--table", "{d}/bin.dat", *SCEN], "invalid JSON"),
    ("replay-trace-missing", ["replay", "--trace", "{d}/missing.jsonl"], "trace"),
    ("replay-trace-binary", ["replay", "--trace", "{d}/bin.jsonl"], "trace"),
    ("replay-trace-dir", ["replay", "--trace", "{d}/adir"], "trace"),
    ("replay-plot-file", ["replay", *SCEN, "--plot", "{d}/afile"], "afile is a file"),
    ("replay-plot-proc", ["replay", *SCEN, "--plot", "/proc/figs"], "/proc"),
    ("replay-plot-denied", ["replay", *SCEN, "--plot", "/sys/figs"], "denied"),
    ("replay-policy", ["replay", *SCEN, "--policy", "bogus"], "policy"),
    ("replay-mode", ["replay", *SCEN, "--mode", "bogus"], "--mode"),
    ("replay-rounds", ["replay", "--scenario", "steady", "--rounds", "0"], "rounds"),
    ("replay-switch-gain", ["replay", *SCEN, "--switch-min-gain", "5"], "[0, 1)"),
    ("replay-switch-gain-neg", ["replay", *SCEN, "--switch-min-gain", "-0.1"], "[0, 1)"),
    (
        "replay-table-width",
        ["replay", "--table", "{d}/table.json", *SCEN, "--draft-width", "9"],
        "--draft-width",
    ),
    (
        "replay-table-mode",
        ["replay", "--table", "{d}/table.json", *SCEN, "--mode", "{other_mode}"],
        "--mode",
    ),
    # plot
    ("plot-missing", ["plot", "{d}/missing.json", "--out", "{d}/figs"], "cost table"),
    ("plot-out-file", ["plot", "{d}/table.json", "--out", "{d}/afile"], "afile is a file"),
    ("plot-out-proc", ["plot", "{d}/table.json", "--out", "/proc/figs"], "/proc"),
    ("plot-out-under-file", ["plot", "{d}/table.json", "--out", "{d}/afile/figs"], "is a file"),
    (
        "plot-trace-and-scenario",
        ["plot", "{d}/table.json", "--out", "{d}/figs", "--trace", "{d}/trace.jsonl", *SCEN],
        "at most one",
    ),
    (
        "plot-trace-binary",
        ["plot", "{d}/table.json", "--out", "{d}/figs", "--trace", "{d}/bin.jsonl"],
        "trace",
    ),
    # bench and generate on the tiny preset, refused before the engine is built
    ("bench-adaptive-no-table", ["bench", "--policy", "adaptive-step"], "--cost-table"),
    (
        "bench-table-missing",
        ["bench", "--policy", "fixed:1", "--cost-table", "{d}/missing.json"],
        "--cost-table",
    ),
    ("bench-table-no-policy", ["bench", "--cost-table", "{d}/table.json"], "only together"),
    ("bench-repeats", ["bench", "--repeats", "0"], "--repeats"),
    ("bench-policy", ["bench", "--policy", "bogus"], "policy"),
    (
        "bench-two-adaptive",
        ["bench", "--policy", "adaptive-step,adaptive-verify", "--cost-table", "{d}/table.json"],
        "cannot be combined",
    ),
    ("bench-sample", ["bench", "--acceptance", "sample"], "--acceptance"),
    ("bench-requests", ["bench", "--num-requests", "0"], "--num-requests"),
    ("bench-requests-max", ["bench", "--num-requests", "100000"], "an integer in [1, 256]"),
    ("bench-triton-cpu", ["bench", "--attention-backend", "triton"], "attention_backend='triton'"),
    ("bench-loop", ["bench", "--loop", "overlapped"], "--loop: got 'overlapped'"),
    (
        "cal-triton-cpu",
        [*CAL, *NEW, "--attention-backend", "triton"],
        "attention_backend='triton'",
    ),
    ("bench-k", ["bench", "--k", "9"], "--k"),
    ("bench-device", ["bench", "--device", "bogus"], "device"),
    (
        "bench-trace-out-proc",
        ["bench", "--policy", "fixed:1", "--trace-out", "/proc/t.jsonl"],
        "--trace-out",
    ),
    (
        "bench-trace-out-dir",
        ["bench", "--policy", "fixed:1", "--trace-out", "{d}/adir"],
        "not an existing directory",
    ),
    ("generate-no-prompt", ["generate"], "at least one prompt"),
    ("generate-ids", ["generate", "--prompt-ids", "abc"], "--prompt-ids"),
    ("generate-k", ["generate", "--prompt-ids", "1,2", "--k", "9"], "--k"),
    ("generate-temperature", ["generate", "--prompt-ids", "1,2", "--temperature", "-1"], "temp"),
]


def test_the_table_is_large_and_covers_every_command():
    assert len(CASES) >= 60
    assert len({c[0] for c in CASES}) == len(CASES)
    commands = {c[1][0] if c[1][0] != "table" else " ".join(c[1][:2]) for c in CASES}
    assert commands >= {
        "calibrate",
        "fit",
        "table show",
        "table validate",
        "table export",
        "table diff",
        "table compat",
        "trace",
        "replay",
        "plot",
        "bench",
        "generate",
    }


@pytest.mark.parametrize("argv, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(scratch, monkeypatch, argv, words):
    d = scratch["d"]
    monkeypatch.chdir(d)  # a stray relative output would land here and be seen
    args = [a.format(**scratch) for a in argv]
    before = snapshot(d)
    res = CliRunner().invoke(app, args, env=ENV)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2, res.output
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert words.format(**scratch) in lines[0], lines[0]
    assert "Traceback" not in res.output and res.stdout == ""
    assert snapshot(d) == before
