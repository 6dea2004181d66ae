#!/usr/bin/env bash
# The RULER sweep behind benchmarks/results/ruler/ (issue 28's harness on SmolLM2-135M), as a
# queue of `python -m benchmarks.bench_ruler` runs appending to one JSONL file; the report is
# `python -m benchmarks.ruler_report`. Each run prefills a sample once and applies every press
# x ratio to the cached KV. Run it alone in the background (about 90 minutes on 2 cores):
#
#     nohup bash benchmarks/ruler_sweep.sh > ruler_sweep.log 2>&1 &
#
# SAMPLES (default 2) and LENGTH (default 4096) may be set in the environment; OUT is the file.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/ruler/sweep4k.jsonl}
N=${SAMPLES:-2}
LEN=${LENGTH:-4096}
ALL=none,recency,streaming,h2o,snapkv,tova,scissorhands,pyramidkv,adakv
RATIOS=0.25,0.5,0.75,0.9
run() { python -m benchmarks.bench_ruler --length "$LEN" --samples "$N" --seed 0 --out "$OUT" "$@" | grep '^{' || true; }

# 1. Every press at kvpress's ratios, question-agnostic, pages of 16 (the retrieval tasks first).
for task in niah_single niah_multikey variable_tracking niah_multivalue; do
  run --task "$task" --press "$ALL" --ratio "$RATIOS"
done
# 2. Every KV format at full budget and with SnapKV keeping 50%.
for fmt in int8 fp8 int4 kivi2; do
  for task in niah_single niah_multikey; do
    run --task "$task" --press none,snapkv --ratio 0.5 --kv-format "$fmt"
  done
done
# 3. Query-aware: the question is in the prefill, the press sees it.
for task in niah_single niah_multikey; do
  run --task "$task" --press none,streaming,h2o,snapkv,tova --ratio 0.5,0.9 --mode aware
done
# 4. The page size: token granularity against pages of 64.
for ps in 1 64; do
  run --task niah_single --press none,streaming,h2o,snapkv --ratio 0.5,0.9 --page-size "$ps"
done
# 5. Demote-and-fetch instead of drop (exact: the bytes moved are the price).
run --task niah_single --press snapkv,streaming --ratio 0.5,0.9 --residency demote
# 6. The remaining tasks.
for task in niah_multiquery common_words; do
  run --task "$task" --press "$ALL" --ratio "$RATIOS"
done
