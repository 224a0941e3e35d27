#!/usr/bin/env bash
# Side-by-side GPT pretraining with coat_megatron.pretrain_gpt, same batch, data and seed in every arm.
# Usage: [ARMS="..."] [NGPUS=n] [DATA=corpus|mock] bash launch/megatron_compare.sh OUT_DIR [TRAIN_ITERS]
# DATA=corpus (default): the Python standard library corpus (launch/corpus.py) written as Megatron indexed
#   datasets by launch.megatron_data (train / validation split by file, its byte-level BPE of 8192 tokens through
#   HuggingFaceTokenizer), validation loss on 20 batches at the end; DATA=mock: Megatron's mock data, vocab 32000.
# Arms (ARMS picks a subset; default all, in this order):
#   local_bf16_tp1       BF16 `local` spec, Megatron's Adam (torch AdamW without TE/apex)   1 GPU
#   coat_tp1             `coat` FP8 layers + COAT FP8 optimizer (--coat-optimizer)          1 GPU
#   coat_torchadam_tp1   `coat` FP8 layers, Megatron's Adam (the earlier `coat` arm)        1 GPU
#   local_coatadam_tp1   BF16 `local` spec + COAT FP8 optimizer                             1 GPU
#   coat_teattn_tp1      coat_tp1 with TE's attention core (--coat-attention te)           1 GPU
#   coat_tp2_sp          `coat` layers + COAT optimizer, TP=2 + sequence parallelism        2 GPUs
# 1-GPU arms run NGPUS at a time (one per GPU); 2-GPU arms alone, skipped on one GPU. `transformer_engine`
# arms (BF16, FP8 delayed and FP8 tensorwise scaling) are added when TE imports. Every arm uses the distributed optimizer; each log
# ends with the optimizer-state bytes and the peak memory of every rank.
# MODEL=gpt370m (default): 24 layers, hidden 1024, 16 heads, SwiGLU FFN 2816; MODEL=gpt1b: 16 layers, hidden 2048,
# 16 heads, FFN 5632 (~0.95B parameters). Both: RMSNorm, RoPE, seq 1024, micro-batch 8 (8192
# tokens/iteration), selective recompute of core_attn. Attention core: the `coat` arms use the default
# --coat-attention auto (torch SDPA); `local` uses Megatron's unfused core.
set -euo pipefail
OUT=${1:?usage: megatron_compare.sh OUT_DIR [TRAIN_ITERS]}
ITERS=${2:-200}
NGPUS=${NGPUS:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
mkdir -p "$OUT"
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1

case ${MODEL:-gpt370m} in
  gpt370m) SIZE=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 2816) ;;
  gpt1b) SIZE=(--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 5632) ;;
  *) echo "unknown MODEL ${MODEL}" >&2; exit 2 ;;
esac
COMMON=("${SIZE[@]}"
  --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 8
  --train-iters "$ITERS" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 20
  --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02 --seed 1234
  --bf16 --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope
  --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0
  --recompute-granularity selective --use-distributed-optimizer
  --no-gradient-accumulation-fusion --no-rope-fusion --no-masked-softmax-fusion --no-bias-swiglu-fusion
  --no-bias-dropout-fusion --no-persist-layer-norm
  --log-interval 10 --log-throughput)
case ${DATA:-corpus} in
  corpus)
    DATA_LINE=$(python3 -m launch.megatron_data --out "$OUT/data")
    read -r -a DATA_ARGS <<< "$DATA_LINE"
    COMMON+=("${DATA_ARGS[@]}" --eval-iters 20 --eval-interval "$ITERS") ;;
  mock) COMMON+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --eval-iters 0 --eval-interval 100000) ;;
  *) echo "unknown DATA ${DATA}" >&2; exit 2 ;;
esac

ALL_ARMS="local_bf16_tp1 coat_tp1 coat_torchadam_tp1 local_coatadam_tp1 coat_tp2_sp"
if python3 -c "import transformer_engine.pytorch" 2>/dev/null; then
  ALL_ARMS="te_bf16_tp1 te_fp8_delayed_tp1 te_fp8_tensorwise_tp1 $ALL_ARMS"
else
  echo "== transformer_engine arms skipped: transformer_engine is not importable" | tee "$OUT/te_skipped.txt"
fi
ARMS=${ARMS:-$ALL_ARMS}

arm_args() {
  case $1 in
    te_bf16_tp1) echo "--transformer-impl transformer_engine" ;;
    te_fp8_delayed_tp1) echo "--transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe delayed
                              --fp8-amax-history-len 1024 --fp8-amax-compute-algo max" ;;
    te_fp8_tensorwise_tp1) echo "--transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe tensorwise" ;;
    local_bf16_tp1) echo "--transformer-impl local" ;;
    coat_tp1) echo "--transformer-impl coat --coat-optimizer" ;;
    coat_teattn_tp1) echo "--transformer-impl coat --coat-optimizer --coat-attention te" ;;
    coat_torchadam_tp1) echo "--transformer-impl coat" ;;
    local_coatadam_tp1) echo "--transformer-impl local --coat-optimizer" ;;
    coat_tp2_sp) echo "--transformer-impl coat --coat-optimizer
                       --tensor-model-parallel-size 2 --sequence-parallel" ;;
    *) echo "unknown arm $1" >&2; return 1 ;;
  esac
}

run() {  # run NAME GPUS NPROC PORT ARGS...
  local name=$1 gpus=$2 nproc=$3 port=$4; shift 4
  echo "== $name: CUDA_VISIBLE_DEVICES=$gpus torchrun --nproc_per_node $nproc -m coat_megatron.pretrain_gpt $*"
  local rc=0
  CUDA_VISIBLE_DEVICES=$gpus python3 -m torch.distributed.run --nproc_per_node "$nproc" --master_port "$port" \
    -m coat_megatron.pretrain_gpt "${COMMON[@]}" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  echo "== $name: exit $rc"
}

slot=0
for arm in $ARMS; do
  args=$(arm_args "$arm")
  if [[ $arm == *_tp2* ]]; then
    wait; slot=0
    if (( NGPUS < 2 )); then echo "== $arm skipped: needs 2 GPUs, $NGPUS visible"; continue; fi
    # shellcheck disable=SC2086
    run "$arm" 0,1 2 29511 $args
  else
    # shellcheck disable=SC2086
    run "$arm" "$slot" 1 $((29501 + slot)) $args &
    slot=$((slot + 1))
    if (( slot >= NGPUS )); then wait; slot=0; fi
  fi
done
wait
for f in "$OUT"/*.log; do
  echo "--- $f"
  grep -E "iteration +[0-9]+/|validation loss|optimizer state|peak memory|memory \\(MB\\)|Error|error" "$f" | tail -25
done
