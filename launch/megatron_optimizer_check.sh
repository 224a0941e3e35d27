#!/usr/bin/env bash
# GPU check of --coat-optimizer under megatron.training, on one GPU (a function check, not a benchmark).
# Phase 1, three runs at once on the same GPU, ITERS iterations each, torch_dist checkpoints at ITERS/2 and ITERS:
#   coat_optimizer        `coat` layers + COAT FP8 optimizer (distributed optimizer)
#   coat_torchadam        `coat` layers + Megatron's Adam (no checkpoint: Megatron's torch-AdamW path cannot resume)
#   local_coat_optimizer  BF16 `local` layers + COAT FP8 optimizer
# Phase 2, resumed from the ITERS/2 checkpoints up to ITERS (at once): their losses from iteration ITERS/2+1 on
# should follow phase 1's closely (moments are stored in fp32 and quantized again on load):
#   coat_optimizer_resumed, coat_optimizer_resumed_model_only (--no-load-optim), local_coat_optimizer_resumed
# Usage: [CKPT=dir] bash launch/megatron_optimizer_check.sh OUT_DIR [ITERS]   (CKPT defaults to OUT_DIR/ckpt)
set -uo pipefail
OUT=${1:?usage: megatron_optimizer_check.sh OUT_DIR [ITERS]}
ITERS=${2:-20}
HALF=$((ITERS / 2))
CKPT=${CKPT:-$OUT/ckpt}
mkdir -p "$OUT"
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1

COMMON=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --ffn-hidden-size 2048
  --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 4
  --train-iters "$ITERS" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 5
  --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02 --seed 1234
  --bf16 --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope
  --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 --use-distributed-optimizer
  --no-gradient-accumulation-fusion --no-rope-fusion --no-masked-softmax-fusion --no-bias-swiglu-fusion
  --no-bias-dropout-fusion --no-persist-layer-norm
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
  --log-interval 1 --eval-iters 0 --eval-interval 100000)
COAT=(--transformer-impl coat --coat-attention megatron)

launch() {  # launch NAME PORT TIMEOUT ARGS...
  local name=$1 port=$2 limit=$3; shift 3
  echo "== $name: $*"
  timeout "$limit" python3 -m torch.distributed.run --nproc_per_node 1 --master_port "$port" \
    -m coat_megatron.pretrain_gpt "${COMMON[@]}" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $?"
}

launch coat_optimizer 29521 ${PHASE1_LIMIT:-140} "${COAT[@]}" --coat-optimizer --save "$CKPT/coat" --save-interval "$HALF" &
launch coat_torchadam 29522 ${PHASE1_LIMIT:-140} "${COAT[@]}" &
launch local_coat_optimizer 29523 ${PHASE1_LIMIT:-140} --transformer-impl local --coat-optimizer \
  --save "$CKPT/local" --save-interval "$HALF" &
wait
launch coat_optimizer_resumed 29524 ${PHASE2_LIMIT:-110} "${COAT[@]}" --coat-optimizer --load "$CKPT/coat" \
  --ckpt-step "$HALF" &
launch coat_optimizer_resumed_model_only 29525 ${PHASE2_LIMIT:-110} "${COAT[@]}" --coat-optimizer \
  --load "$CKPT/coat" --ckpt-step "$HALF" --no-load-optim &
launch local_coat_optimizer_resumed 29526 ${PHASE2_LIMIT:-110} --transformer-impl local --coat-optimizer \
  --load "$CKPT/local" --ckpt-step "$HALF" &
wait
for f in coat_optimizer coat_torchadam local_coat_optimizer coat_optimizer_resumed coat_optimizer_resumed_model_only \
         local_coat_optimizer_resumed; do
  echo "--- $f"
  grep -E "iteration +[0-9]+/|optimizer state|peak memory|successfully (saved|loaded)|Error|error" "$OUT/$f.log" \
    | sed -E 's/^ *\[[^]]*\] *//; s/ consumed samples.*lm loss:/ lm loss:/; s/\| loss scale: [^|]*//;
              s/\| number of.*//' | tail -24
done
