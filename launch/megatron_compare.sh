#!/usr/bin/env bash
# Side-by-side GPT pretraining with coat_megatron.pretrain_gpt: BF16 `local` vs `coat` on one GPU each (run at the
# same time on GPUs 0 and 1, same batch, data and seed), then `coat` with TP=2 + sequence parallelism on both GPUs;
# `transformer_engine` (BF16 and FP8 tensorwise) only when TE imports.
# Usage: bash launch/megatron_compare.sh OUT_DIR [TRAIN_ITERS]
# Model: GPT ~370M (24 layers, hidden 1024, 16 heads, SwiGLU FFN 2816, RMSNorm, RoPE, vocab 32000), seq 1024,
# micro-batch 8 (8192 tokens/iteration), Megatron's attention core with selective recompute of core_attn in every arm.
set -euo pipefail
OUT=${1:?usage: megatron_compare.sh OUT_DIR [TRAIN_ITERS]}
ITERS=${2:-200}
mkdir -p "$OUT"
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1

COMMON=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 2816
  --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 8
  --train-iters "$ITERS" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 20
  --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02 --seed 1234
  --bf16 --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope
  --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0
  --recompute-granularity selective
  --no-gradient-accumulation-fusion --no-rope-fusion --no-masked-softmax-fusion --no-bias-swiglu-fusion
  --no-bias-dropout-fusion --no-persist-layer-norm
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
  --log-interval 10 --log-throughput --eval-iters 0 --eval-interval 100000)

run() {  # run NAME GPUS NPROC PORT ARGS...
  local name=$1 gpus=$2 nproc=$3 port=$4; shift 4
  echo "== $name: CUDA_VISIBLE_DEVICES=$gpus torchrun --nproc_per_node $nproc -m coat_megatron.pretrain_gpt $*"
  local rc=0
  CUDA_VISIBLE_DEVICES=$gpus python3 -m torch.distributed.run --nproc_per_node "$nproc" --master_port "$port" \
    -m coat_megatron.pretrain_gpt "${COMMON[@]}" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  echo "== $name: exit $rc"
}

if python3 -c "import transformer_engine.pytorch" 2>/dev/null; then
  run te_bf16 0 1 29501 --transformer-impl transformer_engine &
  run te_fp8_tensorwise 1 1 29502 --transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe tensorwise &
  wait
else
  echo "== transformer_engine arms skipped: transformer_engine is not importable" | tee "$OUT/te_skipped.txt"
fi
run local_bf16_tp1 0 1 29501 --transformer-impl local &
run coat_tp1 1 1 29502 --transformer-impl coat --coat-attention megatron &
wait
run coat_tp2_sp 0,1 2 29503 --transformer-impl coat --coat-attention megatron --tensor-model-parallel-size 2 \
  --sequence-parallel
for f in "$OUT"/*.log; do echo "--- $f"; grep -E "iteration +[0-9]+/|peak memory|memory \\(MB\\)|Error|error" "$f" | tail -25; done
