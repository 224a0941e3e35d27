#!/usr/bin/env bash
# Side-by-side GPT pretraining with coat_megatron.pretrain_gpt: same data, seed, flags and launcher in every arm, only
# the layer spec (and the arm's own options below) differs. Report: python -m launch.megatron_report OUT_DIR.
# Usage: [ARMS="..."] [MODEL=gpt370m|gpt1b|gpt7b8l] [MICROS="4 max"] [DATA=corpus|mock] [NGPUS=n]
#        bash launch/megatron_compare.sh OUT_DIR [TRAIN_ITERS]
# Arms (ARMS picks a subset; default: the TE arms when TE imports, then local_bf16_tp1 coat_tp1 coat_graph_tp1):
#   te_bf16_tp1            TransformerEngine BF16 (--transformer-impl transformer_engine)         needs TE
#   te_fp8_delayed_tp1     TE FP8, hybrid format, delayed scaling (amax history 1024, max)        needs TE
#   te_fp8_tensorwise_tp1  TE FP8, hybrid format, current (tensorwise) scaling                    needs TE
#   te_bf16_graph_tp1      te_bf16_tp1 as one CUDA graph per iteration (--cuda-graph-impl full_iteration)
#   local_bf16_tp1         Megatron's `local` BF16 spec
#   coat_tp1               `coat` FP8 layers + COAT FP8 optimizer (--coat-optimizer), default attention
#   coat_graph_tp1         coat_tp1 as one CUDA graph per iteration (--cuda-graph-impl full_iteration)
#   coat_note_tp1, coat_graph_note_tp1   the two above with TransformerEngine hidden (launch.without_te)
#   coat_torchadam_tp1     `coat` layers, Megatron's Adam
#   local_coatadam_tp1     `local` BF16 spec + COAT FP8 optimizer
#   coat_teattn_tp1        coat_tp1 with TE's attention core (--coat-attention te)               needs TE
#   X_tpN_sp               arm X_tp1 at TP=N + sequence parallelism, e.g. coat_tp2_sp, te_bf16_tp4_sp   N GPUs
#   X_dpN                  arm X_tp1 data parallel on N GPUs (distributed optimizer), e.g. coat_dp2,
#                          te_fp8_delayed_dp8; the global batch is N x the micro-batch           N GPUs
# MICROS: the micro-batch sizes to run (global batch = micro-batch, one micro-batch per step). "max": the largest
# that fits, predicted from the same arm's run at the first size (its peak and its memory between iterations, linear
# in the micro-batch), tried, and lowered (by 1/8; by 1 below 16) while it runs out of memory; "max:N": the same
# search from N. ITERS iterations at fixed sizes, MAX_ITERS (default 30) at "max". 1-GPU arms run NGPUS at a time
# (one per GPU); N-GPU arms alone, skipped where fewer than N GPUs are visible. DRY_RUN=1: print each run's command
# instead of running it.
# MODEL=gpt370m (default): 24 layers, hidden 1024, 16 heads, SwiGLU FFN 2816, seq 1024; gpt1b: 16 layers, hidden
# 2048, 16 heads, FFN 5632 (~0.95B parameters), seq 1024; gpt7b8l: Llama-2-7B's layer shape (hidden 4096, 32 heads,
# FFN 11008) cut to 8 layers, seq 2048. All: RMSNorm, RoPE, untied embeddings, distributed optimizer, no activation
# recompute, Megatron's fusions that need apex/TE off in every arm. EXTRA_ARGS: more pretrain_gpt flags for every arm.
# Each log ends with the optimizer-state bytes, the peak memory and the memory held between iterations.
set -euo pipefail
OUT=${1:?usage: megatron_compare.sh OUT_DIR [TRAIN_ITERS]}
ITERS=${2:-200}
MAX_ITERS=${MAX_ITERS:-30}
NGPUS=${NGPUS:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
mkdir -p "$OUT"
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1

SEQ=1024
case ${MODEL:-gpt370m} in
  gpt370m) SIZE=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 2816) ;;
  gpt1b) SIZE=(--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 5632) ;;
  gpt7b8l) SIZE=(--num-layers 8 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008); SEQ=2048 ;;
  *) echo "unknown MODEL ${MODEL}" >&2; exit 2 ;;
esac
COMMON=("${SIZE[@]}"
  --seq-length "$SEQ" --max-position-embeddings "$SEQ"
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 20
  --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02 --seed 1234
  --bf16 --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope
  --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0
  --use-distributed-optimizer
  --no-gradient-accumulation-fusion --no-rope-fusion --no-masked-softmax-fusion --no-bias-swiglu-fusion
  --no-bias-dropout-fusion --no-persist-layer-norm
  --log-interval 5 --log-throughput)
case ${DATA:-corpus} in
  corpus)
    DATA_LINE=$(python3 -m launch.megatron_data --out "$OUT/data")
    read -r -a DATA_ARGS <<< "$DATA_LINE"
    COMMON+=("${DATA_ARGS[@]}" --eval-iters 20) ;;
  mock) COMMON+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --eval-iters 0) ;;
  *) echo "unknown DATA ${DATA}" >&2; exit 2 ;;
esac

DEFAULT_ARMS="local_bf16_tp1 coat_tp1 coat_graph_tp1"
if python3 -c "import transformer_engine.pytorch" 2>/dev/null; then
  DEFAULT_ARMS="te_bf16_tp1 te_fp8_delayed_tp1 te_fp8_tensorwise_tp1 $DEFAULT_ARMS"
else
  echo "== transformer_engine arms skipped: transformer_engine is not importable" | tee "$OUT/te_skipped.txt"
fi
ARMS=${ARMS:-$DEFAULT_ARMS}
# shellcheck disable=SC2206
COMMON+=(${EXTRA_ARGS:-})  # e.g. EXTRA_ARGS="--profile --use-pytorch-profiler --profile-step-start 30 ..."

GRAPH="--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad"
arm_gpus() {  # the GPUs an arm runs on: N for X_tpN_sp and X_dpN, else 1
  if [[ $1 =~ _tp([0-9]+)_sp$ || $1 =~ _dp([0-9]+)$ ]]; then echo "${BASH_REMATCH[1]}"; else echo 1; fi
}

arm_args() {
  case $1 in
    te_bf16_tp1) echo "--transformer-impl transformer_engine" ;;
    te_bf16_graph_tp1) echo "--transformer-impl transformer_engine $GRAPH" ;;
    te_fp8_delayed_tp1) echo "--transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe delayed
                              --fp8-amax-history-len 1024 --fp8-amax-compute-algo max" ;;
    te_fp8_tensorwise_tp1) echo "--transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe tensorwise" ;;
    local_bf16_tp1) echo "--transformer-impl local" ;;
    coat_tp1 | coat_note_tp1) echo "--transformer-impl coat --coat-optimizer" ;;
    coat_graph_tp1 | coat_graph_note_tp1) echo "--transformer-impl coat --coat-optimizer $GRAPH" ;;
    coat_teattn_tp1) echo "--transformer-impl coat --coat-optimizer --coat-attention te" ;;
    coat_torchadam_tp1) echo "--transformer-impl coat" ;;
    local_coatadam_tp1) echo "--transformer-impl local --coat-optimizer" ;;
    *_tp[0-9]*_sp | *_dp[0-9]*)
      local n base args; n=$(arm_gpus "$1")
      base=${1%_tp"$n"_sp}; base=${base%_dp"$n"}
      if [[ $base == "$1" || $n -lt 2 ]]; then echo "unknown arm $1 (N-GPU arms: X_tpN_sp, X_dpN, N >= 2)" >&2; return 1; fi
      args=$(arm_args "${base}_tp1") || return 1
      if [[ $1 == *_sp ]]; then echo "$args --tensor-model-parallel-size $n --sequence-parallel"; else echo "$args"; fi ;;
    *) echo "unknown arm $1" >&2; return 1 ;;
  esac
}

run() {  # run LOG GPUS NPROC PORT MICRO ITERS ARM: one training run; its exit status
  local log=$1 gpus=$2 nproc=$3 port=$4 micro=$5 iters=$6 arm=$7 module=coat_megatron.pretrain_gpt
  [[ $arm == *_note_* ]] && module=launch.without_te
  local args; args=$(arm_args "$arm")
  local global=$micro
  [[ $arm =~ _dp([0-9]+)$ ]] && global=$((micro * BASH_REMATCH[1]))  # one micro-batch per data-parallel rank
  echo "== $(basename "$log" .log): CUDA_VISIBLE_DEVICES=$gpus torchrun --nproc_per_node $nproc -m $module" \
       "--micro-batch-size $micro --global-batch-size $global --train-iters $iters $args"
  [[ ${DRY_RUN:-0} == 1 ]] && return 0
  local rc=0
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$gpus python3 -m torch.distributed.run --nproc_per_node "$nproc" --master_port "$port" \
    -m "$module" "${COMMON[@]}" --micro-batch-size "$micro" --global-batch-size "$global" \
    --train-iters "$iters" --eval-interval "$iters" $args > "$log" 2>&1 || rc=$?
  echo "== $(basename "$log" .log): exit $rc"
  return $rc
}

# what a run that does not fit says (cuBLAS and cuDNN report a failed allocation their own way)
OOM="out of memory|OutOfMemoryError|ALLOC_FAILED|cudaErrorMemoryAllocation|CUDNN_STATUS_(ALLOC|INTERNAL|EXECUTION)"

run_arm() {  # run_arm ARM GPUS NPROC PORT: every size in MICROS
  local arm=$1 gpus=$2 nproc=$3 port=$4 first="" micro
  for micro in ${MICROS:-8}; do
    if [[ $micro != max* ]]; then
      first=${first:-$micro}
      run "$OUT/${arm}_mb${micro}.log" "$gpus" "$nproc" "$port" "$micro" "$ITERS" "$arm" || true
      continue
    fi
    if [[ $micro == max:* ]]; then
      micro=${micro#max:}
    else
      micro=$(python3 -m launch.megatron_report --predict-max "$OUT/${arm}_mb${first}.log" --micro "$first") || {
        echo "== $arm: no prediction of the largest micro-batch (needs a finished run at ${first:-a fixed size})"
        continue; }
    fi
    local tries=0
    while (( micro > 0 && tries < 5 )); do
      if run "$OUT/${arm}_mbmax.log" "$gpus" "$nproc" "$port" "$micro" "$MAX_ITERS" "$arm"; then break; fi
      grep -qiE "$OOM" "$OUT/${arm}_mbmax.log" || break
      mv "$OUT/${arm}_mbmax.log" "$OUT/${arm}_mb${micro}_oom.log"
      micro=$(( micro - (micro >= 16 ? micro / 8 : 1) )); tries=$((tries + 1))
    done
  done
}

for arm in $ARMS; do arm_args "$arm" > /dev/null; done  # every name checked before the first run
slot=0
for arm in $ARMS; do
  gpus=$(arm_gpus "$arm")
  if (( gpus > 1 )); then
    wait; slot=0
    if (( NGPUS < gpus )); then echo "== $arm skipped: needs $gpus GPUs, $NGPUS visible"; continue; fi
    run_arm "$arm" "$(seq -s, 0 $((gpus - 1)))" "$gpus" 29511
  else
    { run_arm "$arm" "$slot" 1 $((29501 + slot)); python3 -m launch.megatron_report "$OUT" > /dev/null || true; } &
    slot=$((slot + 1))
    if (( slot >= NGPUS )); then wait; slot=0; fi
  fi
done
wait
python3 -m launch.megatron_report "$OUT" || true
