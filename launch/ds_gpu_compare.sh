#!/usr/bin/env bash
# DeepSpeed ZeRO-2 bf16, Llama 1.1B (TinyLlama shape), seq 2048, global batch 8 sequences per step:
#   torch AdamW (fused) on GPU 0 and CoatFP8AdamW on GPU 1 at the same time (one GPU each, same data and seed),
#   then CoatFP8AdamW on both GPUs (4 sequences per GPU: the same global batches, so the curves compare step by step).
# Usage: bash launch/ds_gpu_compare.sh OUT_DIR [STEPS] [MODEL] [SEQ_LEN]     (MODEL=tiny SEQ_LEN=64 for a CPU smoke run)
# Writes OUT_DIR/<run>.log and <run>.csv (step, loss, step_s, tokens_per_s) and prints each run's SUMMARY line.
set -uo pipefail
OUT=${1:?usage: ds_gpu_compare.sh OUT_DIR [STEPS] [MODEL] [SEQ_LEN]}
STEPS=${2:-200}
MODEL=${3:-tinyllama-1b}
SEQ=${4:-2048}
LR=${LR:-3e-4}
PY=${PYTHON:-python3}
RUN_TIMEOUT=${RUN_TIMEOUT:-170}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
# coat_kernels lives in kernels/: make it importable without installing the package
mkdir -p /tmp/coat_path && ln -sfn "$PWD/kernels" /tmp/coat_path/coat_kernels
export PYTHONPATH=/tmp/coat_path:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}  # 9.0a breaks DeepSpeed's op builder
COMMON=(--model "$MODEL" --seq-len "$SEQ" --global-batch 8 --steps "$STEPS" --lr "$LR" --seed 1234)

run() {  # run NAME GPUS NPROC PORT CONFIG
  local name=$1 gpus=$2 nproc=$3 port=$4 config=$5 rc=0
  echo "== $name: CUDA_VISIBLE_DEVICES=$gpus torchrun --nproc_per_node $nproc launch/train_ds.py --ds-config $config ${COMMON[*]}"
  CUDA_VISIBLE_DEVICES=$gpus timeout "$RUN_TIMEOUT" "$PY" -m torch.distributed.run --nproc_per_node "$nproc" \
    --master_port "$port" launch/train_ds.py --ds-config "$config" --label "$name" --csv "$OUT/$name.csv" \
    "${COMMON[@]}" > "$OUT/$name.log" 2>&1 || rc=$?
  echo "== $name: exit $rc"
  grep -E "^\[train_ds\] rank|^SUMMARY" "$OUT/$name.log" || tail -n 30 "$OUT/$name.log"
}

nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > "$OUT/gpus.txt" 2>/dev/null && cat "$OUT/gpus.txt"
run adamw_1gpu 0 1 29611 configs/ds_zero2_adamw_bf16.json &
run coat_1gpu 1 1 29612 configs/ds_zero2_coat.json &
wait
run coat_2gpu 0,1 2 29613 configs/ds_zero2_coat.json
"$PY" launch/ds_curves.py "$OUT" 20 2>&1 | tee "$OUT/curves.txt"
