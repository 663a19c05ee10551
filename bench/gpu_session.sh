#!/usr/bin/env bash
# One GPU-host call of the pending H200 measurements, stage by stage under one wall budget.
#
# Here (a machine with pip and the registries), once per checkout:
#     bash bench/gpu_session.sh wheels      # .whl/: packages the GPU image lacks (git-ignored)
# On the GPU host (the device tool: carry .whl; $OUT is where results come back):
#     bash bench/gpu_session.sh run [--budget S] [--commit HASH] STAGE...
#
# Stages, in the order given (a stage that would start with less than its minimum left is
# skipped and said so; each runs under `timeout` of what is left):
#   cold        cold default calibration of dense-2b (empty Triton cache: run it first on a
#               fresh host; cold2, ... repeat it with the cache emptied again)
#               [calibration_cold_wall_s_2b_h200]
#   dscold      cold default --mode draft_step calibration of dense-2b (partly filled buckets
#               measured: issue 35), its table at dscold/ds.json
#   sweep       bench/bench_sweep.py on dscold's table (adaptive-step; every workload in its own
#               process, 3 runs each) [replay_vs_live_error_pct_sweep_max, ...]. Its nine
#               workloads take longer than one call: SWEEP_WORKLOADS=a,b,... runs a subset, and
#               SWEEP_TABLE=PATH a table brought along (dscold's ds.json from an earlier call's
#               session.tgz, in a git-excluded folder named in the call's carry); the metrics of
#               the whole sweep are the worst over its parts (bench_sweep.py --merge over the
#               calls' sweep.<workload>.json computes them); SWEEP_MAX_TOKENS=N the 1.0 of
#               the workloads' max_tokens (default 192: phases of 20-110 rounds, about one
#               adaptive-step window of 20 batches; 512+ lets the window follow a phase change)
#   sweepv      bench/bench_sweep.py on cold's target_verify table (adaptive-verify)
#   pyc         compileall over the image's site-packages (timed; host.txt says whether the
#               image ships bytecode): run before `cold` to time a cold start with it
#   cuda        the CUDA suite (pytest -m cuda tests/runner tests/kernels, 8 workers, verbose)
#   hybridtest  the hybrid engine's CUDA tests and the index-kernel test only
#   pathtest    the CUDA tests of the served path against transformers, attention, the
#               round loop at both queue depths, graphs, verify budgets, the hybrid and MLA
#               engines (a subset of `cuda`, ~2-3 min)
#   moetest     the CUDA tests of routed MoE / MLA: the fused-MoE, MLA attention and rope-cache
#               Triton kernels (and the gated delta-net ones) against the reference, routed
#               layers captured in graphs equal to eager, the MLA and MoE engines against
#               transformers
#   moetiles    bench/bench_moe_tiles.py: the routed experts' two kernels under other launch tiles
#               (moe-16b-a3b's layer, 1 and 8 rows) [moe_expert_kernels_floor_ratio, _best]
#   moebench    bench/bench_moe.py on moe-16b-a3b (B = 1 and 8, k = 3) [moe_decode_step_floor_ratio,
#               moe_verify_full_width_ratio]
#   moeprof     bench/bench_moe.py at B = 1 with SPECCAL_PDL=0: the decode step's kernels each
#               timed alone (under PDL a kernel's time includes its wait); a diagnostic
#   moebest     bench/bench_moe.py at B = 1 with the routed experts on moetiles' best one-row
#               tiles (run it after moetiles) [moe_decode_step_floor_ratio.best_tiles]
#   hybridnext  the CUDA tests of the Qwen3-Next (routed) hybrid engine in captured graphs
#   kvspread    bench/bench_kv_spread.py: a round at one mean KV, uniform vs spread KV lengths
#               [kv_spread_round_ratio_max]; KVSPREAD_ARGS="--batches 24 --means 300" other points
#   moecal      a default speccal calibrate of moe-16b-a3b (cold Triton cache), its table at
#               moecal/moe.json [calibration_cold_wall_s_moe_h200, held-out error]
#   fusedla     the fused gated delta-net kernels (KernelConfig.linear_attention.impl=fused):
#               their CUDA tests, the engine against transformers on them (the gate for making
#               them the default), then bench/bench_hybrid.py --linear-attention fla,fused
#   fusedbench  fusedla's bench alone: bench/bench_hybrid.py --linear-attention fused (the
#               default; FUSED_IMPLS=fla,fused times the fla plan beside it)
#   hybrid      bench/bench_hybrid.py (torch.compile peer skipped) [hybrid_* metrics]
#   hybridhf    bench/bench_hybrid.py decode vs transformers with torch.compile tried
#               [hybrid_decode_speedup_vs_hf_b1 against the fastest configuration]
#   hybridprof  bench/bench_hybrid.py decode step only: its floor ratio and where its device time
#               goes (kernels by time and launches per step)
#   hybridcal   speccal calibrate (draft_step, small grid) + speccal bench --policy on qwen3.5-2b
#   kvgain      bench/bench_kv_gain.py [kv_aware_gain_pct]
#   buildprof   cProfile of one dense-2b engine build (where the model load's seconds go; run
#               it after `cold` so the Triton cache is warm and compiles stay out of it)
#   imports     a short dense-2b calibration in one process (after `cold`: warm Triton cache),
#               then which heavy modules it imported (torch._dynamo, sympy, torch._inductor:
#               seconds each on an image without bytecode) and the stack of each first import
#   decode      bench/bench_decode.py (5 repeats, B = 1 and 8) [decode_step_floor_ratio,
#               verify_full_width_ratio]
#   hf          bench/bench_hf.py: plain decode on the served (pipelined) loop vs transformers
#               [decode_speedup_vs_hf_b1, _b8, _b32]
#   phases      bench/bench_round_phases.py at B = 1 and 8, both loops [round_wall_over_device_b1,
#               _b8, pipelined_speedup_b1, _b8]
#   phasesab    bench/bench_round_phases.py at B = 1 on a base tree (PHASES_BASE: a `git archive`
#               tarball in a carried folder) and this tree, alternated twice on one host
#               (whether a move in round_wall_over_device_sync_b1 is the code's or the host's)
#   policyhost  bench/bench_policy_host.py on this host's CPU (SWEEP_TABLE's draft-step table, else
#               the committed H200 one; then the committed target_verify table)
#               [adaptive_step_host_us_per_round, adaptive_verify_host_us_per_round]
#   live        bench/bench_live_policy.py, one process: the first live stage of a call
#               calibrates the draft-step table, later ones (live2, live3: any name starting with
#               live) load it [replay_vs_live_error_pct: run three]
#
# Everything a stage writes lands under /tmp/w/STAGE; after every stage /tmp/w is packed into
# $OUT/session.tgz (one file: the device tool brings back at most 8), so a call cut by its limit
# still returns what finished. Python runs unbuffered; each stage's tail is printed.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=python3
WHEELS=(pydantic==2.13.4 pydantic_core==2.46.4 annotated-types typing-inspection
        flash-linear-attention==0.6.0 fla-core==0.6.0 transformers==5.24.0)

wheels() {
    mkdir -p .whl
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
    ls -la .whl
}

run() {
    local budget=570
    if [[ "${1:-}" == "--budget" ]]; then budget=$2; shift 2; fi
    # the commit the copied tree is (the host's git metadata may be older than its files):
    # bench/results.py records it instead of `git rev-parse`
    if [[ "${1:-}" == "--commit" ]]; then export SPECCAL_COMMIT=$2; shift 2; fi
    : "${OUT:?OUT must name the folder whose files come back}"
    export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
    local W=/tmp/w T0
    T0=$(date +%s)
    rm -rf "$W"  # a warm host keeps the last call's outputs: every call starts empty
    mkdir -p "$W"
    left() { echo $(( budget - ($(date +%s) - T0) )); }
    pack() { tar czf "$OUT/session.tgz" -C "$W" . 2>/dev/null; }
    # the image's python3 (pip may belong to another interpreter): packages it lacks from
    # .whl, this project in place without its dependencies
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "wheels: install failed"; exit 1; }
    export PYTHONPATH=/tmp/site
    $PY -m pip install -q --no-build-isolation --no-deps -e . > "$W/install.log" 2>&1 \
        || { cat "$W/install.log"; exit 1; }
    { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
      $PY -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
      # whether the interpreter finds bytecode for torch (without it every process compiles
      # the modules it imports from source, seconds of a cold start)
      $PY -c "import glob, os, sys, torch; d = os.path.dirname(torch.__file__); print('torch .py', len(glob.glob(d + '/**/*.py', recursive=True)), '.pyc', len(glob.glob(d + '/**/*.pyc', recursive=True)), 'dont_write_bytecode', sys.flags.dont_write_bytecode)"
      echo "git HEAD $(git rev-parse --short HEAD 2>/dev/null), tree given as ${SPECCAL_COMMIT:-(not given)}"
      # the files' own tree hash (the host's HEAD may be older than the files it got): here,
      # `git log --format='%h %T' | grep HASH` names the commit whose tree it is
      echo "tree $(GIT_INDEX_FILE=/tmp/speccal-index git add -A . ':!.whl' >/dev/null 2>&1 \
                   && GIT_INDEX_FILE=/tmp/speccal-index git write-tree 2>/dev/null)"
    } > "$W/host.txt" 2>&1
    cat "$W/host.txt"
    export TRITON_CACHE_DIR=/tmp/tcache
    local stage min
    for stage in "$@"; do
        case $stage in
            fusedbench) min=150 ;; moebench) min=70 ;; moeprof) min=60 ;; moebest) min=60 ;; moecal) min=150 ;; dscold*) min=120 ;; sweep*) min=150 ;; cold*) min=90 ;; pyc) min=40 ;; cuda) min=330 ;; hybridtest) min=150 ;; pathtest) min=150 ;; moetest) min=120 ;; fusedla) min=240 ;; hybrid) min=120 ;; hybridhf) min=150 ;; hybridprof) min=100 ;;
            hybridcal) min=200 ;; kvgain) min=200 ;; live*) min=200 ;; buildprof) min=60 ;; imports) min=60 ;; phases) min=60 ;;
            decode) min=120 ;; phasesab) min=150 ;; hf) min=150 ;; policyhost) min=30 ;; moetiles) min=60 ;; kvspread) min=90 ;; hybridnext) min=60 ;;
            *) echo "unknown stage $stage"; continue ;;
        esac
        if (( $(left) < min )); then
            echo "=== $stage skipped: $(left) s left, it needs $min"
            continue
        fi
        local d="$W/$stage"
        mkdir -p "$d"
        echo "=== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $stage"
        case $stage in
            dscold*)
                rm -rf "$TRITON_CACHE_DIR"
                /usr/bin/time -v timeout "$(left)" $PY -m speccal calibrate --model dense-2b \
                    --device cuda --dtype bfloat16 --mode draft_step --out "$d/ds.json" --json \
                    > "$d/cal.json" 2> "$d/cal.log"
                echo "rc=$?"
                grep -E "Elapsed|runner build|Triton:|quality gate: (window|held)|^grid" "$d/cal.log" ;;
            sweep*)
                local tab="${SWEEP_TABLE:-$W/dscold/ds.json}"
                [[ $stage == sweepv* ]] && tab="${SWEEP_TABLE:-$W/cold/dense-2b-h200.json}"
                timeout "$(left)" $PY bench/bench_sweep.py --model dense-2b --device cuda \
                    --dtype bfloat16 --table "$tab" --repeats 3 --json-out "$d/sweep.json" --save-runs "$d/runs" \
                    ${SWEEP_WORKLOADS:+--workloads "$SWEEP_WORKLOADS"} \
                    ${SWEEP_MAX_TOKENS:+--max-tokens "$SWEEP_MAX_TOKENS"} \
                    --plot "$d/sweep.png" --record --results "$d/results.jsonl" \
                    > "$d/log.txt" 2>&1
                echo "rc=$?"
                tail -40 "$d/log.txt" ;;
            cold*)
                rm -rf "$TRITON_CACHE_DIR"
                /usr/bin/time -v timeout "$(left)" $PY -m speccal calibrate --model dense-2b \
                    --device cuda --dtype bfloat16 --out "$d/dense-2b-h200.json" --json \
                    > "$d/cal.json" 2> "$d/cal.log"
                echo "rc=$?"
                grep -E "Elapsed|runner build|Triton:|quality gate: (window|held)" "$d/cal.log" ;;
            pyc)
                # bytecode for the image's packages, as pip writes it at install time (the
                # image ships torch without it); timed apart, before a `cold` stage
                local site
                site=$($PY -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
                /usr/bin/time -f "compileall %e s wall" timeout "$(left)" $PY -m compileall -q -j 16 \
                    "$site" /tmp/site > "$d/log.txt" 2>&1
                echo "rc=$?"
                tail -3 "$d/log.txt" ;;
            cuda)
                timeout "$(left)" $PY -m pytest -m cuda tests/runner tests/kernels -n 8 -v -rfE \
                    -p no:cacheprovider --durations=15 > "$d/tests.log" 2>&1
                echo "rc=$?"
                grep -E "^(FAILED|ERROR)|passed|failed" "$d/tests.log" | tail -20 ;;
            hybridtest)
                timeout "$(left)" $PY -m pytest -m cuda tests/runner/test_hybrid_engine.py \
                    tests/kernels/test_triton_kernels.py -k "hybrid or index_kernels" -n 6 -q -rfE \
                    -p no:cacheprovider > "$d/tests.log" 2>&1
                echo "rc=$?"
                tail -5 "$d/tests.log" ;;
            pathtest)
                timeout "$(left)" $PY -m pytest -m cuda tests/runner/test_hf_served_path.py \
                    tests/runner/test_attention.py tests/runner/test_pipeline.py \
                    tests/runner/test_hybrid_engine.py tests/runner/test_mla_engine.py \
                    tests/runner/test_graphs.py tests/runner/test_verify_budget.py \
                    -n 8 -v -rfE -p no:cacheprovider \
                    > "$d/tests.log" 2>&1
                echo "rc=$?"
                grep -E "^(FAILED|ERROR)|passed|failed" "$d/tests.log" | tail -20 ;;
            fusedbench)
                timeout "$(left)" $PY bench/bench_hybrid.py --out "$d" \
                    --skip compile,hf,strategies,greedy --linear-attention "${FUSED_IMPLS:-fused}" \
                    --la-strategy snapshots,scratch_swap \
                    --record \
                    --deadline-s "$(( $(left) - 15 ))" > "$d/log.txt" 2>&1
                echo "rc=$?"; cp bench/results.jsonl "$d/results.jsonl"; tail -60 "$d/log.txt" ;;
            moebench)
                timeout "$(left)" $PY bench/bench_moe.py --out "$d" --record \
                    > "$d/log.txt" 2>&1
                echo "rc=$?"; cp bench/results.jsonl "$d/results.jsonl"; tail -40 "$d/log.txt" ;;
            moeprof)
                # B = 1 without PDL: each kernel's own time in the breakdown (diagnostic, no
                # record; the step is slower than the served one)
                SPECCAL_PDL=0 timeout "$(left)" $PY bench/bench_moe.py --out "$d" --batches 1 \
                    --repeats 5 > "$d/log.txt" 2>&1
                echo "rc=$?"; tail -32 "$d/log.txt" ;;
            moebest)
                timeout "$(left)" $PY bench/bench_moe.py --out "$d" --record --batches 1 \
                    --tiles-from /tmp/w/moetiles/moe_tiles.json > "$d/log.txt" 2>&1
                echo "rc=$?"; cp bench/results.jsonl "$d/results.jsonl"; tail -12 "$d/log.txt" ;;
            hybridnext)
                timeout "$(left)" $PY -m pytest -m cuda tests/runner/test_hybrid_engine.py \
                    -k "qwen3_next and graphs" -n 4 -q -rfE -p no:cacheprovider \
                    > "$d/tests.log" 2>&1
                echo "rc=$?"
                tail -5 "$d/tests.log" ;;
            kvspread)
                timeout "$(left)" $PY bench/bench_kv_spread.py --out "$d" --record ${KVSPREAD_ARGS:-} \
                    > "$d/log.txt" 2>&1
                echo "rc=$?"; cp bench/results.jsonl "$d/results.jsonl"; tail -16 "$d/log.txt" ;;
            moecal)
                rm -rf "$TRITON_CACHE_DIR"
                /usr/bin/time -v timeout "$(left)" $PY -m speccal calibrate --model moe-16b-a3b \
                    --device cuda --dtype bfloat16 --out "$d/moe.json" --json \
                    > "$d/cal.json" 2> "$d/cal.log"
                echo "rc=$?"
                grep -E "Elapsed|runner build|Triton:|quality gate: (window|held)|^grid|error" "$d/cal.log" ;;
            moetest)
                SPECCAL_KERNEL_TEST_DEVICE=cuda timeout "$(left)" $PY -m pytest -m cuda \
                    tests/kernels/test_fused_moe.py tests/kernels/test_mla_decode.py \
                    tests/kernels/test_mla_rope.py tests/kernels/test_gated_delta.py \
                    tests/runner/test_graphs.py \
                    tests/runner/test_mla_engine.py tests/runner/test_moe_engine.py \
                    -n 8 -v -rfE -p no:cacheprovider > "$d/tests.log" 2>&1
                echo "rc=$?"
                grep -E "^(FAILED|ERROR)|passed|failed" "$d/tests.log" | tail -20 ;;
            fusedla)
                timeout "$(( $(left) / 2 ))" $PY -m pytest tests/kernels/test_gated_delta.py \
                    tests/runner/test_hybrid_engine.py -k "gated_delta or fused_linear_attention" \
                    -n 8 -v -rfE -p no:cacheprovider > "$d/tests.log" 2>&1
                echo "rc=$?"
                grep -E "^(FAILED|ERROR)|passed|failed" "$d/tests.log" | tail -20
                timeout "$(left)" $PY bench/bench_hybrid.py --out "$d" --skip compile,hf \
                    --linear-attention fla,fused --record --deadline-s "$(( $(left) - 15 ))" \
                    > "$d/log.txt" 2>&1
                echo "rc=$?"; cp bench/results.jsonl "$d/results.jsonl"; tail -20 "$d/log.txt" ;;
            hybrid)
                timeout "$(left)" $PY bench/bench_hybrid.py --out "$d" --skip compile \
                    --deadline-s "$(( $(left) - 15 ))" > "$d/log.txt" 2>&1
                echo "rc=$?"
                tail -22 "$d/log.txt" ;;
            hybridhf)
                # the decode comparison with every transformers configuration, torch.compile
                # included (the fastest that works is the peer); strategies and greedy skipped
                timeout "$(left)" $PY bench/bench_hybrid.py --out "$d" --skip strategies,greedy \
                    --deadline-s "$(( $(left) - 15 ))" > "$d/log.txt" 2>&1
                echo "rc=$?"
                tail -16 "$d/log.txt" ;;
            hybridprof)
                timeout "$(left)" $PY bench/bench_hybrid.py --out "$d" \
                    --skip hf,compile,strategies,greedy > "$d/log.txt" 2>&1
                echo "rc=$?"
                grep -E " us .* x |decode step|built in" "$d/log.txt" | cut -c1-150 | head -50 ;;
            hybridcal)
                echo '{"request_buckets": [1, 2, 4], "contexts": [{"prefill_tokens": 256, "min_kv_length": 1, "max_kv_length": 1024}], "warmup_steps": 4, "window_steps": 16, "windows_per_point": 3}' > "$d/cfg.json"
                timeout "$(( $(left) - 60 ))" $PY -m speccal calibrate --model qwen3.5-2b \
                    --device cuda --dtype bfloat16 --mode draft_step --request-buckets 1,2,4 \
                    --config "$d/cfg.json" --out "$d/t.json" --json > "$d/cal.json" 2> "$d/cal.log"
                echo "rc=$?"
                grep -E "^(runner build|Triton|quality gate: (window|held)|wrote|error)" "$d/cal.log"
                timeout "$(left)" $PY -m speccal bench --model qwen3.5-2b --device cuda \
                    --policy adaptive-step --policy fixed:1 --policy fixed:3 --cost-table "$d/t.json" \
                    --acceptance synthetic --profile 0.7,0.5,0.35 --num-requests 4 \
                    --request-buckets 1,2,4 --max-tokens 64 --repeats 2 --json \
                    > "$d/bench.json" 2> "$d/bench.log"
                echo "rc=$?"
                grep -v "^bench:" "$d/bench.log" | tail -14 ;;
            kvgain)
                timeout "$(left)" $PY bench/bench_kv_gain.py --model dense-2b --device cuda \
                    --dtype bfloat16 --out "$d" > "$d/log.txt" 2>&1
                echo "rc=$?"
                tail -6 "$d/log.txt" ;;
            buildprof)
                # from a file: the compile workers are spawned and re-import the main script
                cat > "$d/build.py" <<'PYEOF'
import cProfile, pstats, sys
from speccal.runner.engine import Engine, EngineConfig
from speccal.runner.path import KernelConfig, served_path
cfg = EngineConfig(model="dense-2b", device="cuda", dtype="bfloat16", acceptance="forced",
                   pipeline=True, path=served_path("cuda", KernelConfig()))
if __name__ == "__main__":
    cProfile.run("engine = Engine(cfg)", sys.argv[1])
    print(engine.build_timings)
    stats = pstats.Stats(sys.argv[1])
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(45)
PYEOF
                timeout "$(left)" $PY "$d/build.py" "$d/build.prof" > "$d/profile.txt" 2>&1
                echo "rc=$?"
                head -60 "$d/profile.txt" | cut -c1-160 ;;
            imports)
                echo '{"request_buckets": [1, 2], "warmup_steps": 2, "window_steps": 8, "windows_per_point": 1}' > "$d/cfg.json"
                cat > "$d/imports.py" <<'PYEOF'
import runpy, sys, traceback
HEAVY = ("torch._dynamo", "sympy", "torch._inductor")
first = {}
class Watch:
    """records the stack of the first import of each heavy package; finds nothing itself"""
    def find_spec(self, name, path=None, target=None):
        if name in HEAVY and name not in first:
            first[name] = "".join(traceback.format_stack(limit=40)[:-1])
        return None
if __name__ == "__main__":
    sys.meta_path.insert(0, Watch())
    sys.argv = ["speccal", "calibrate", "--model", "dense-2b", "--device", "cuda", "--dtype",
                "bfloat16", "--request-buckets", "1,2", "--config", sys.argv[1], "--out",
                sys.argv[2], "--accept-noisy", "--json"]
    try:
        runpy.run_module("speccal", run_name="__main__")
    except SystemExit as exc:
        print("exit", exc.code, file=sys.stderr)
    print("heavy modules imported:", sorted(h for h in HEAVY if h in sys.modules), file=sys.stderr)
    for h, stack in first.items():
        print(f"--- first import of {h}:\n{stack}", file=sys.stderr)
PYEOF
                timeout "$(left)" $PY "$d/imports.py" "$d/cfg.json" "$d/t.json" > "$d/cal.json" 2> "$d/log.txt"
                echo "rc=$?"
                grep -A80 "^heavy modules" "$d/log.txt" | grep -v "^    " | tail -40 ;;
            decode)
                timeout "$(left)" $PY bench/bench_decode.py --out "$d" --repeats 5 \
                    --batches 1,8 > "$d/log.txt" 2>&1
                echo "rc=$?"
                tail -30 "$d/log.txt" ;;
            hf)
                # the compiled peer at B = 1 and 8 (each compile ~75 s on an H100)
                timeout "$(left)" $PY bench/bench_hf.py --out "$d" --compile-batches 1,8 \
                    --deadline-s "$(( $(left) < 260 ? $(left) - 10 : 250 ))" > "$d/log.txt" 2>&1
                echo "rc=$?"
                tail -20 "$d/log.txt" ;;
            moetiles)
                timeout "$(left)" $PY bench/bench_moe_tiles.py --out "$d" --record \
                    --results "$d/results.jsonl" > "$d/log.txt" 2>&1
                echo "rc=$?"; grep -E "^rows .*(default|best)|floor ratio" "$d/log.txt" ;;
            policyhost)
                # the host time the adaptive policy adds to a live round, on this host's CPU
                # (bench/bench_policy_host.py; the draft-step table of SWEEP_TABLE, else the
                # committed H200 one at B = 8) [adaptive_step_host_us_per_round]
                local pt="${SWEEP_TABLE:-tables/dense-2b-h200-draft-step.json}" pb=12
                [[ -z "${SWEEP_TABLE:-}" ]] && pb=8
                timeout "$(left)" $PY bench/bench_policy_host.py --table "$pt" --batch $pb \
                    --record --results "$d/results.jsonl" --device-label "$(nproc)-core GPU host" \
                    > "$d/log.txt" 2>&1
                echo "rc=$?"
                # adaptive-verify on the committed H200 target_verify table (buckets 1-8)
                timeout "$(left)" $PY bench/bench_policy_host.py \
                    --table tables/dense-2b-h200.json --batch 8 --record \
                    --results "$d/results.jsonl" --device-label "$(nproc)-core GPU host" \
                    >> "$d/log.txt" 2>&1
                echo "rc=$?"; cat "$d/log.txt" ;;
            phases)
                # round wall / device time, pipelined vs synchronous, B = 1 and 8 (one process
                # each) [round_wall_over_device_b1, _b8, pipelined_speedup_b1, _b8]
                local b
                for b in 1 8; do
                    timeout "$(left)" $PY bench/bench_round_phases.py --model dense-2b \
                        --device cuda --pipeline both --modes forced --trim --batch $b \
                        --out "$d/rp$b" > "$d/log$b.txt" 2>&1
                    echo "B=$b rc=$?"
                    tail -14 "$d/log$b.txt"
                done ;;
            phasesab)
                # the B = 1 round phases of a base tree and this one, alternated (base, this,
                # base, this) on one host: a change in round_wall_over_device_sync_b1 told apart
                # from a difference between hosts. PHASES_BASE: a `git archive` tarball of the
                # base commit in a carried folder (e.g. .carry/base.tar)
                if [[ ! -f "${PHASES_BASE:-}" ]]; then
                    echo "phasesab: PHASES_BASE=${PHASES_BASE:-<unset>} is not a file"; continue
                fi
                local base=/tmp/phases-base here tree r name
                rm -rf "$base" && mkdir -p "$base" && tar -xf "$PHASES_BASE" -C "$base"
                here=$(pwd)
                for r in 1 2; do
                    for tree in "$base" "$here"; do
                        name=head; [[ $tree == "$base" ]] && name=base
                        (cd "$tree" && $PY -m pip install -q --no-build-isolation --no-deps -e . \
                            > /dev/null 2>&1 && timeout "$(left)" $PY \
                            bench/bench_round_phases.py --model dense-2b --device cuda \
                            --pipeline both --modes forced --trim --batch 1 \
                            --out "$d/$name-$r" > "$d/$name-$r.txt" 2>&1)
                        echo "$name run $r rc=$?"
                        grep -E "^forced" "$d/$name-$r.txt"
                    done
                done
                $PY -m pip install -q --no-build-isolation --no-deps -e . > /dev/null 2>&1 ;;
            live*)
                # the first live stage calibrates the draft-step table in its process, the
                # later ones load it (three back-to-back processes, as the metric asks)
                local table=(--table-out "$W/live-table.json")
                [[ -f "$W/live-table.json" ]] && table=(--table "$W/live-table.json")
                timeout "$(left)" $PY bench/bench_live_policy.py --model dense-2b --device cuda \
                    --dtype bfloat16 --graph-mode split --attention-backend triton \
                    --num-requests 32 --max-tokens 256 --warmup-steps 4 --window-steps 32 \
                    --windows-per-point 3 --repeats 4 --pipeline \
                    "${table[@]}" --json-out "$d/live.json" > "$d/log.txt" 2>&1
                echo "rc=$?"
                tail -12 "$d/log.txt" ;;
        esac
        pack
    done
    echo "=== done +$(( $(date +%s) - T0 ))s"
}

case "${1:-}" in
    wheels) wheels ;;
    run) shift; run "$@" ;;
    *) awk 'NR > 1 && /^#/ {print; next} NR > 1 {exit}' "$0"; exit 2 ;;
esac
