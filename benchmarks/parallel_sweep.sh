#!/usr/bin/env bash
# benchmarks/hf_deepspeed_compare.py over several workloads at once, one workload per GPU (each runs every arm in
# turn on its GPU, so the arms of a workload are compared on one device), all GPUs in parallel.
#   OUT=DIR ARMS=bf16,coat STEPS=40 bash benchmarks/parallel_sweep.sh padded:8 packed:8 padded:2 packed:2
# A job is BATCHING:MICRO_BATCHES[:ARMS] (e.g. padded:1,2 or packed:8:coat,coat_graphs; ARMS with "+" between arms
# also works); job i runs on GPU i. Extra compare flags: EXTRA="...".
# Writes DIR/<batching>_mb<micro>/ (results.md, results.json, logs) and prints every results.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/sweep}
ARMS=${ARMS:-bf16,bf16_compile,torchao,coat,coat_graphs}
STEPS=${STEPS:-40}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
"$PY" -c "from launch import corpus; corpus.load()" || exit 1  # build the corpus cache once, before the jobs share it
i=0
for job in "$@"; do
  IFS=: read -r batching micro arms <<< "$job"
  dir="$OUT/${batching}_mb${micro//,/_}${arms:+_${arms//,/_}}"
  CUDA_VISIBLE_DEVICES=$i "$PY" benchmarks/hf_deepspeed_compare.py --arms "${arms:-$ARMS}" --micro-batches "$micro" \
      --batching "$batching" --data corpus --steps "$STEPS" --curve-arms none --port-base $((29600 + 100 * i)) \
      --out "$dir" ${EXTRA:-} > "$dir.log" 2>&1 &
  i=$((i + 1))
done
wait
for job in "$@"; do
  IFS=: read -r batching micro arms <<< "$job"
  dir="$OUT/${batching}_mb${micro//,/_}${arms:+_${arms//,/_}}"
  echo "## $batching, micro-batch $micro${arms:+, $arms}"
  cat "$dir/results.md" 2>/dev/null || tail -5 "$dir.log"
  echo
done
