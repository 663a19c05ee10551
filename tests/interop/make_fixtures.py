"""Regenerate the interop example inputs and golden outputs: ``python3 tests/interop/make_fixtures.py``.

Inputs (``notebooks/data/interop/``, read by docs/INTEROP.md, the notebook and the tests): the
acceptance of the shipped trace ``notebooks/data/transition.parquet`` written as each engine
writes it (``engine_files``). Golden outputs (``tests/interop/golden/``): ``speccal export`` of
the shipped tables with that trace or those files, each with its sidecar (``created`` is
ignored by the comparison). Run from anywhere; paths in the sidecars are relative to the root.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_files  # noqa: E402

from speccal.costmodel.table import load_table, save_table  # noqa: E402
from speccal.costmodel.table_build import refit_table  # noqa: E402
from speccal.interop.export import ExportRequest, run_export  # noqa: E402
from speccal.trace import load_trace  # noqa: E402

DATA = Path("notebooks/data/interop")
GOLDEN = Path("tests/interop/golden")
TRACE = Path("notebooks/data/transition.parquet")
DRAFT_STEP = Path("tables/dense-2b-h200-draft-step.json")
TINY = Path("tables/tiny-cpu.json")
SPS_TABLE = GOLDEN / "tiny-cpu-sps.table.json"
#: Illustrative k = 0 step times (ms) of the draft-step table's buckets (docs/INTEROP.md).
K0_MS = "1=1.5,2=1.5,4=1.7,8=1.9"

#: name -> (table, engine, export options)
EXPORTS = {
    "vllm.json": (DRAFT_STEP, "vllm", {"trace": TRACE}),
    "trtllm.yaml": (DRAFT_STEP, "trtllm", {"trace": TRACE}),
    "vllm-metrics-k0.json": (
        DRAFT_STEP,
        "vllm",
        {"profile": str(DATA / "vllm-metrics.prom"), "k0_ms": K0_MS, "kv_length": 1024.0},
    ),
    "sglang-additive.json": (TINY, "sglang", {"trace": TRACE}),
    # acceptance imported from a dynamic-K deployment's per-request stats, exported as steps
    "sglang-adaptive.json": (
        DRAFT_STEP,
        "sglang-adaptive",
        {"profile": str(DATA / "vllm-requests-dynamic-k.json"), "k0_ms": K0_MS},
    ),
    "sglang-sps.json": (SPS_TABLE, "sglang", {}),
}


def write_inputs() -> None:
    tr = load_trace(TRACE)
    DATA.mkdir(parents=True, exist_ok=True)
    half = tr.num_rounds // 2
    (DATA / "vllm-metrics-before.prom").write_text(
        engine_files.vllm_metrics_text(engine_files.counts(tr, slice(0, half)), engines=2)
    )
    (DATA / "vllm-metrics.prom").write_text(
        engine_files.vllm_metrics_text(engine_files.counts(tr), engines=2)
    )
    (DATA / "vllm-requests.json").write_text(
        engine_files.dumps(engine_files.vllm_request_metrics(tr, rounds=250))
    )
    (DATA / "vllm-requests-legacy.json").write_text(
        engine_files.dumps(engine_files.vllm_request_stats(tr, rounds=250))
    )
    (DATA / "vllm-requests-dynamic-k.json").write_text(
        engine_files.dumps(engine_files.vllm_dynamic_k_requests(rounds=4000))
    )
    (DATA / "speculation_profile.json").write_text(
        engine_files.dumps(engine_files.speculation_profile(tr))
    )
    (DATA / "accepted.csv").write_text(engine_files.accepted_csv(tr, rounds=100))


def _undated(table) -> dict:
    doc = table.to_json_dict()
    doc["provenance"].pop("created")
    return doc


def write_goldens() -> None:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    sps = refit_table(load_table(TINY), model="sps")
    if not SPS_TABLE.exists() or _undated(load_table(SPS_TABLE)) != _undated(sps):
        save_table(sps, SPS_TABLE)  # else keep the file: its sha256 is in a golden sidecar
    for name, (table, engine, opts) in EXPORTS.items():
        run_export(ExportRequest(table=table, engine=engine, out=GOLDEN / name, **opts))


if __name__ == "__main__":
    os.chdir(ROOT)
    warnings.simplefilter("ignore")
    write_inputs()
    write_goldens()
    for p in sorted([*DATA.iterdir(), *GOLDEN.iterdir()]):
        print(p, p.stat().st_size)
