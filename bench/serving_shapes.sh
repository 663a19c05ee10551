#!/usr/bin/env bash
# On the GPU host: the default draft-step calibration of dense-2b, then `speccal bench --policy`
# at request counts that are not buckets (issue 35's first-use table), recording per policy the
# live tokens/s, the replay prediction of its own trace, and the rounds the table priced.
# Usage (after bench/gpu_session.sh's install): bash bench/serving_shapes.sh OUTDIR [COUNTS...]
set -uo pipefail
d=${1:?OUTDIR}; shift
counts=("${@:-12 5}")
mkdir -p "$d"
M=(--model dense-2b --device cuda --dtype bfloat16)
/usr/bin/time -f "calibrate %e s wall" python3 -m speccal calibrate "${M[@]}" --mode draft_step \
    --out "$d/ds.json" --json > "$d/cal.json" 2> "$d/cal.log"
echo "calibrate rc=$?"; grep -E "^calibrate .* s wall|quality gate: held|^grid" "$d/cal.log"
for n in ${counts[@]}; do
    python3 -m speccal bench "${M[@]}" --policy fixed:1,fixed:2,fixed:3,adaptive-step \
        --cost-table "$d/ds.json" --num-requests "$n" --max-tokens 192 --repeats 3 \
        --acceptance synthetic --profile 0.9,0.85,0.8 --phase 0.5:0.5,0.3,0.2 --json \
        > "$d/bench_$n.json" 2> "$d/bench_$n.log"
    echo "bench n=$n rc=$?"
    python3 - "$d/bench_$n.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
print("table_warnings:", doc["table_warnings"])
for p in doc["policies"]:
    r = p.get("replay") or {}
    print(f"{p['policy']:14s} live {p['round_tokens_per_s']:9.1f} tok/s  replay "
          f"{r.get('predicted_tokens_per_s') or float('nan'):9.1f}  err {r.get('error_pct')} %  "
          f"priced {p.get('rounds_priced')}/{p['rounds']}  gain {p.get('gain_vs_best_fixed_pct')}")
PY
done
