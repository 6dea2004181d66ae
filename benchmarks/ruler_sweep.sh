#!/usr/bin/env bash
# The RULER sweep behind benchmarks/results/ruler/ (issue 28's harness on SmolLM2-135M), as a
# queue of `python -m benchmarks.bench_ruler` runs appending to one JSONL file; the report is
# `python -m benchmarks.ruler_report`. Each run prefills a sample once and applies every press
# x ratio to the cached KV. Run it alone in the background (about 90 minutes on 2 cores):
#
#     nohup bash benchmarks/ruler_sweep.sh > ruler_sweep.log 2>&1 &
#
# SAMPLES (default 2) and LENGTH (default 4096) may be set in the environment; OUT is the file
# (default benchmarks/results/ruler/4k/sweep.jsonl at 4096 tokens);
# STAGES (default "1 2 3 4 5 6 7") picks the stages below.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${SAMPLES:-2}
LEN=${LENGTH:-4096}
OUT=${OUT:-benchmarks/results/ruler/$((LEN / 1024))k/sweep.jsonl}
ALL=none,recency,streaming,h2o,snapkv,tova,scissorhands,pyramidkv,adakv
RATIOS=0.25,0.5,0.75,0.9
STAGES=" ${STAGES:-1 2 3 4 5 6 7} "
stage() { [[ "$STAGES" == *" $1 "* ]]; }
run() { python -m benchmarks.bench_ruler --length "$LEN" --samples "$N" --seed 0 --out "$OUT" "$@" | grep '^{' || true; }

# 1. Every press at kvpress's ratios, question-agnostic, pages of 16 (the retrieval tasks first).
if stage 1; then
  for task in niah_single niah_multikey variable_tracking niah_multivalue; do
    run --task "$task" --press "$ALL" --ratio "$RATIOS"
  done
fi
# 2. Every KV format at full budget and with SnapKV keeping 50% (the single needle; the
#    2026-12-05 run also has int8 on the multi-key needle).
if stage 2; then
  for fmt in int8 fp8 int4 kivi2; do
    for task in niah_single; do
      run --task "$task" --press none,snapkv --ratio 0.5 --kv-format "$fmt"
    done
  done
fi
# 3. Query-aware: the question is in the prefill, the press sees it.
if stage 3; then
  for task in niah_single niah_multikey; do
    run --task "$task" --press none,streaming,h2o,snapkv,tova --ratio 0.5,0.9 --mode aware
  done
fi
# 4. The page size: token granularity against pages of 64.
if stage 4; then
  for ps in 1 64; do
    run --task niah_single --press none,streaming,h2o,snapkv --ratio 0.5,0.9 --page-size "$ps"
  done
fi
# 5. Demote-and-fetch instead of drop (exact: the bytes moved are the price).
if stage 5; then
  run --task niah_single --press snapkv,streaming --ratio 0.5,0.9 --residency demote
fi
# 6. The remaining tasks, with the presses that stage 1 separates (their answers are 48-64
#    tokens long: the whole press list would double the sweep's time).
if stage 6; then
  for task in niah_multiquery common_words; do
    run --task "$task" --press none,streaming,h2o,snapkv --ratio 0.5,0.9
  done
fi
# 7. Query-aware page retrieval (issue 31): every decoded token reads only the pages its query
#    selects (one selection per kv head, every layer sparse); --ratio is the fraction of the
#    KV bytes NOT read per step (0.9: 10% read; the JSON's read_fraction is measured).
if stage 7; then
  for task in niah_single niah_multikey; do
    run --task "$task" --press none,retrieval --ratio 0.8,0.9,0.95,0.98,0.99 --dense-layers 0
  done
fi
