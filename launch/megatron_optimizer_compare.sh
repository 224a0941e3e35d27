#!/usr/bin/env bash
# Optimizers side by side under Megatron (megatron.training through coat_megatron.pretrain_gpt), one GPU, the same
# TransformerEngine BF16 layers, data, seed and flags in every arm; only the optimizer's options differ:
#   bf16_s0, bf16_s1, bf16_s2  Megatron's default: fp32 main params, fp32 main grads, fp32 moments (TE FusedAdam);
#                              seeds 0, 1, 2 (initialisation and data order) give BF16's seed spread
#   te_fp8                     --use-precision-aware-optimizer --main-grads-dtype bf16 --exp-avg-dtype fp8
#                              --exp-avg-sq-dtype fp8 (TE FusedAdam: E4M3 moments, one scale per shard; bf16 params
#                              with 16-bit master remainders)
#   te_bf16                    the same with --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16
#   coat                       --coat-optimizer --use-precision-aware-optimizer --main-grads-dtype bf16 (COAT's FP8
#                              moments, per-group dynamic range expansion, master remainders)
#   coat_fp32_grads            --coat-optimizer with Megatron's fp32 main params and grads (COAT as before)
# Model: the loss-parity Llama of 152M parameters (hidden 1024, 12 layers, 16 heads / 4 KV heads, FFN 2816, RMSNorm,
# RoPE, untied LM head), seq 512, micro-batch = global batch 8, lr 6e-4 (100 warm-up iterations, cosine to 6e-5),
# betas (0.9, 0.95), weight decay 0.1, clip 1.0, on the stdlib corpus (python -m launch.megatron_data), validation
# every 100 iterations on 32 batches; Megatron's fusions that need apex off in every arm. Runs one arm at a time
# (the optimizer's own time is measured: Megatron's
# `optimizer` timer, --timing-log-level 1). Needs TransformerEngine.
# PARALLEL=N runs N arms at once, spread over the visible GPUs (the model is small: one arm leaves a GPU mostly idle).
# Losses and memory are those of the arm alone; the timings are not (arms share GPUs and host cores), so the script
# writes OUT_DIR/concurrent.txt and the report says so: time the optimizers in a separate run with PARALLEL=1.
# Usage: [ARMS="..."] [ITERS=2000] [PARALLEL=1] bash launch/megatron_optimizer_compare.sh OUT_DIR
# Report: python -m launch.megatron_optimizer_report OUT_DIR   (also run at the end)
set -euo pipefail
OUT=${1:?usage: megatron_optimizer_compare.sh OUT_DIR}
ITERS=${ITERS:-2000}
ARMS=${ARMS:-"bf16_s0 te_fp8 te_bf16 coat coat_fp32_grads bf16_s1 bf16_s2"}
mkdir -p "$OUT"
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1
python3 -c "import transformer_engine.pytorch" || { echo "TransformerEngine is needed (TE FusedAdam arms)" >&2; exit 2; }

DATA_LINE=$(python3 -m launch.megatron_data --out "$OUT/data")
read -r -a DATA_ARGS <<< "$DATA_LINE"
COMMON=(--num-layers 12 --hidden-size 1024 --num-attention-heads 16 --group-query-attention --num-query-groups 4
  --ffn-hidden-size 2816 --seq-length 512 --max-position-embeddings 512
  --micro-batch-size 8 --global-batch-size 8 --train-iters "$ITERS"
  --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 100
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02
  --bf16 --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope
  --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0
  --transformer-impl transformer_engine --use-distributed-optimizer
  --no-gradient-accumulation-fusion --no-rope-fusion --no-masked-softmax-fusion --no-bias-swiglu-fusion
  --no-bias-dropout-fusion --no-persist-layer-norm
  --eval-interval 100 --eval-iters 32 --log-interval 10 --log-throughput
  --timing-log-level 1 --timing-log-option max
  "${DATA_ARGS[@]}")
PRECISION_AWARE=(--use-precision-aware-optimizer --main-grads-dtype bf16)

arm_args() {
  case $1 in
    bf16_s0) echo "--seed 1234" ;;
    bf16_s1) echo "--seed 1235" ;;
    bf16_s2) echo "--seed 1236" ;;
    te_fp8) echo "--seed 1234 ${PRECISION_AWARE[*]} --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8" ;;
    te_bf16) echo "--seed 1234 ${PRECISION_AWARE[*]} --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16" ;;
    coat) echo "--seed 1234 --coat-optimizer ${PRECISION_AWARE[*]}" ;;
    coat_fp32_grads) echo "--seed 1234 --coat-optimizer" ;;
    *) echo "unknown arm $1" >&2; return 1 ;;
  esac
}

PARALLEL=${PARALLEL:-1}
NGPUS=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")
if (( PARALLEL > 1 )); then
  echo "$PARALLEL arms at a time on $NGPUS GPU(s): timings are not those of an arm alone" > "$OUT/concurrent.txt"
else
  rm -f "$OUT/concurrent.txt"
fi

run_arm() {  # run_arm ARM SLOT: one training run on GPU SLOT % NGPUS
  local arm=$1 slot=$2 args rc=0
  args=$(arm_args "$arm")
  echo "== $arm: CUDA_VISIBLE_DEVICES=$((slot % NGPUS)) torchrun --nproc_per_node 1" \
       "-m coat_megatron.pretrain_gpt ... $args"
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$((slot % NGPUS)) python3 -m torch.distributed.run --nproc_per_node 1 \
    --master_port $((29531 + slot)) -m coat_megatron.pretrain_gpt "${COMMON[@]}" $args > "$OUT/$arm.log" 2>&1 || rc=$?
  echo "== $arm: exit $rc"
}

slot=0
for arm in $ARMS; do
  arm_args "$arm" > /dev/null
  if (( PARALLEL > 1 )); then
    run_arm "$arm" "$slot" &
    slot=$((slot + 1))
    if (( slot % PARALLEL == 0 )); then wait; slot=0; fi
  else
    run_arm "$arm" 0
  fi
done
wait
python3 -m launch.megatron_optimizer_report "$OUT" || true
