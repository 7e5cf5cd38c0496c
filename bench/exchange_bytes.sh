#!/usr/bin/env bash
# Bytes of the MoE exchange per layout.exchange_dtype (docs/benchmarks/exchange-bytes.md): `afd serve demo`
# (1A1F, fp32) for each of same, int8 and fp8, one request (a 16-token prompt, 17 tokens out, so 32 tokens
# through the forward steps), then the attention node's afd_exchange_bytes_total{direction}.
# Run from the repository root with afd's environment on PATH: bash bench/exchange_bytes.sh
set -euo pipefail
cd "$(dirname "$0")/.."
for x in same int8 fp8; do
  python -m afd serve demo --exchange-dtype $x --port 8391 >/tmp/xq-serve-$x.log 2>&1 &
  pid=$!
  until curl -sf localhost:8391/health >/dev/null; do sleep 0.5; done
  curl -s localhost:8391/v1/completions -H 'Content-Type: application/json' \
    -d '{"prompt": [5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20], "max_tokens": 17, "ignore_eos": true}' >/dev/null
  echo "exchange_dtype $x:"; curl -s localhost:8391/metrics | grep '^afd_exchange_bytes_total' | sed 's/{.*direction="\([a-z_]*\)".*} / \1 /'
  kill -INT $pid; wait $pid || true  # the server exits non-zero on SIGINT
done
