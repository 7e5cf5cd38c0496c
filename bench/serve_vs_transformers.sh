#!/usr/bin/env bash
# afd (deploy/local.yaml: 1 attention + 1 FFN node) against `transformers serve` on the same
# checkpoint, the same machine and the same `afd bench` load, one after the other in one run.
#   bash bench/serve_vs_transformers.sh            # the demo (LongCat-Flash); N=200 IN=64 OUT=32 CONC=8
#   MODEL=$(python bench/qwen3_moe_checkpoint.py /tmp/q3) CB=1 OUTDIR=docs/bench/serve-qwen3 \
#       bash bench/serve_vs_transformers.sh       # Qwen3-MoE, transformers with --continuous-batching
# Results: $OUTDIR/{afd,transformers}.json and a table on stdout (copied to docs/benchmarks/serving-vs-transformers.md).
# transformers serve rejects `ignore_eos`, so neither server gets it: both stop at the same EOS tokens,
# since afd's greedy tokens equal transformers' on the same checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
N=${N:-200}; IN=${IN:-64}; OUT=${OUT:-32}; CONC=${CONC:-8}; OUTDIR=${OUTDIR:-docs/bench/serve}
HF_PORT=${HF_PORT:-8010}
mkdir -p "$OUTDIR"
$BIN/python -m pip install --quiet "transformers[serving]"  # FastAPI extras transformers serve needs
MODEL=${MODEL:-$($BIN/python -c "from afd.model.demo import ensure_demo_checkpoint; print(ensure_demo_checkpoint())")}
CB=${CB:-0}

wait_health() {  # url, seconds
  for _ in $(seq 1 "$2"); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done
  echo "server at $1 did not come up" >&2; return 1
}
bench() {  # name, base url
  $BIN/afd bench --base-url "$2" --model "$MODEL" --tokenizer "$MODEL" --num-prompts "$N" \
    --random-input-len "$IN" --random-output-len "$OUT" --max-concurrency "$CONC" --seed 0 \
    --save-result --result-dir "$OUTDIR" --result-filename "$1.json" --disable-tqdm --no-ignore-eos
}

$BIN/afd launch deploy/local.yaml --model "$MODEL" > "${TMPDIR:-/tmp}/afd-bench-launch.log" 2>&1 &
LAUNCH=$!
trap 'kill $LAUNCH 2>/dev/null || true; kill ${HF:-} 2>/dev/null || true' EXIT
wait_health http://127.0.0.1:8000 120
bench afd http://127.0.0.1:8000
kill -TERM $LAUNCH; wait $LAUNCH || true

# transformers serve: its continuous batching has no MLA latent cache (it fails on LongCat-Flash), so
# there it runs in its default mode, one generate() per request; CB=1 (a GQA model) turns it on.
CB_FLAG=(); [ "$CB" = 1 ] && CB_FLAG=(--continuous-batching)
$BIN/transformers serve "$MODEL" --device cpu --dtype float32 --port "$HF_PORT" "${CB_FLAG[@]}" > "${TMPDIR:-/tmp}/afd-bench-transformers.log" 2>&1 &
HF=$!
wait_health "http://127.0.0.1:$HF_PORT" 120
bench transformers "http://127.0.0.1:$HF_PORT"
kill -TERM $HF; wait $HF || true

$BIN/python - "$OUTDIR" <<'PY'
import json, sys
rows = {name: json.load(open(f"{sys.argv[1]}/{name}.json")) for name in ("afd", "transformers")}
keys = ["completed", "failed", "duration", "request_throughput", "output_throughput", "median_ttft_ms",
        "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "median_e2el_ms"]
print("| metric | afd 1A1F | transformers serve | afd / transformers |")
print("|---|---|---|---|")
for k in keys:
    a, t = rows["afd"][k], rows["transformers"][k]
    ratio = f"{a / t:.2f}" if isinstance(a, (int, float)) and t else "-"
    print(f"| {k} | {a:.2f} | {t:.2f} | {ratio} |" if isinstance(a, float) else f"| {k} | {a} | {t} | {ratio} |")
PY
