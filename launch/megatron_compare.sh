#!/usr/bin/env bash
# Side-by-side GPT pretraining with coat_megatron.pretrain_gpt: same data, seed, flags and launcher in every arm, only
# the layer spec (and the arm's own options below) differs. Report: python -m launch.megatron_report OUT_DIR.
# Usage: [ARMS="..."] [MODEL=gpt370m|gpt1b|gpt7b8l|llama2_7b] [MICROS="4 max"] [DATA=corpus|mock] [NGPUS=n]
#        [LR_WARMUP_ITERS=20] [RUN_TIMEOUT=seconds] [DRY_RUN=1] bash launch/megatron_compare.sh OUT_DIR [TRAIN_ITERS]
# Arms (ARMS picks a subset; default: the TE arms when TE imports, then local_bf16_tp1 coat_tp1 coat_graph_tp1):
#   te_bf16_tp1            TransformerEngine BF16 (--transformer-impl transformer_engine)         needs TE
#   te_fp8_delayed_tp1     TE FP8, hybrid format, delayed scaling (amax history 1024, max)        needs TE
#   te_fp8_tensorwise_tp1  TE FP8, hybrid format, current (tensorwise) scaling                    needs TE
#   te_fp8_blockwise_tp1   TE FP8, E4M3, blockwise scaling (1x128 activations, 128x128 weights)   needs TE
#   te_memstack_tp1        te_fp8_blockwise_tp1 with TE's memory savers: FP8 weights only (--fp8-param-gather),
#                          precision-aware optimizer with bf16 moments and bf16 main gradients (TE FusedAdam;
#                          fp32 main params, which Megatron keeps for FP8 weights), the SwiGLU input saved in FP8
#                          (Megatron's fused SwiGLU), and --recompute-modules layernorm (selective), which changes
#                          nothing in TE's dense spec, whose norms are fused into the next linear   needs TE
#   te_bf16_graph_tp1      te_bf16_tp1 as one CUDA graph per iteration (--cuda-graph-impl full_iteration)
#   local_bf16_tp1         Megatron's `local` BF16 spec
#   coat_tp1               `coat` FP8 layers + COAT FP8 optimizer (--coat-optimizer), default attention
#   coat_graph_tp1         coat_tp1 as one CUDA graph per iteration (--cuda-graph-impl full_iteration)
#   coat_pa_tp1            coat_tp1 under Megatron's precision-aware optimizer: bf16 main gradients, exact fp32
#                          masters kept as the bf16 weights + 16-bit remainders      needs TE (Megatron checks it)
#   coat_note_tp1, coat_graph_note_tp1   the two above with TransformerEngine hidden (launch.without_te)
#   coat_torchadam_tp1     `coat` layers, Megatron's Adam
#   local_coatadam_tp1     `local` BF16 spec + COAT FP8 optimizer
#   coat_teattn_tp1        coat_tp1 with TE's attention core (--coat-attention te)               needs TE
#   X_tpN_sp               arm X_tp1 at TP=N + sequence parallelism, e.g. coat_tp2_sp, te_bf16_tp4_sp   N GPUs
#   X_dpN                  arm X_tp1 data parallel on N GPUs (distributed optimizer), e.g. coat_dp2,
#                          te_fp8_delayed_dp8; the global batch is N x the micro-batch           N GPUs
#   X_tpT_dpD              arm X_tp1 at TP=T + sequence parallelism x DP=D, T, D >= 2, e.g. coat_tp2_dp2  T x D GPUs
# Checked before the first run, each failing with its reason: arm names; iteration counts (Megatron's LR scheduler
# asserts --lr-warmup-iters < --train-iters: LR_WARMUP_ITERS, default 20, must be below TRAIN_ITERS and MAX_ITERS);
# layouts (TP must divide the model's heads and FFN; an arm's GPU count must divide the GPUs visible; arms needing
# more GPUs than visible are skipped). RUN_TIMEOUT: each training run is stopped after that many seconds.
# MICROS: the micro-batch sizes to run (global batch = micro-batch, one micro-batch per step). "max": the largest that
# fits, predicted from the same arm's runs at the fixed sizes (peak memory linear in the micro-batch: the slope
# between the two largest sizes that finished; with one size, its peak above the memory held between iterations, which
# underestimates arms whose state grows after the first step: give two sizes, e.g. MICROS="4 16 max"), tried, and
# lowered (by 1/8; by 1 below 16) while it runs out of memory; "max:N": the same search from N. ITERS iterations at
# fixed sizes, MAX_ITERS (default 30) at "max". RESUME=1: runs whose log in OUT_DIR ran to its end are kept, not run
# again (a command stopped by a time limit continues where it was). 1-GPU arms run NGPUS at a time (one per GPU);
# N-GPU arms alone, skipped where fewer than N GPUs are visible. DRY_RUN=1: print each run's command instead of
# running it.
# MODEL=gpt370m (default): 24 layers, hidden 1024, 16 heads, SwiGLU FFN 2816, seq 1024; gpt1b: 16 layers, hidden
# 2048, 16 heads, FFN 5632 (~0.95B parameters), seq 1024; gpt7b8l: Llama-2-7B's layer shape (hidden 4096, 32 heads,
# FFN 11008) cut to 8 layers, seq 2048; llama2_7b: the same with Llama-2-7B's 32 layers. All: RMSNorm, RoPE, untied
# embeddings, distributed optimizer, no activation recompute, Megatron's fusions off in every arm (its fused SwiGLU
# too, except in te_memstack, whose FP8 SwiGLU input store needs it). EXTRA_ARGS: more pretrain_gpt flags for every
# arm. Each log ends with the optimizer-state bytes, the peak memory and the memory held between iterations.
set -euo pipefail
OUT=${1:?usage: megatron_compare.sh OUT_DIR [TRAIN_ITERS]}
ITERS=${2:-200}
MAX_ITERS=${MAX_ITERS:-30}
LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-20}
NGPUS=${NGPUS:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1
fail() { echo "megatron_compare.sh: $*" >&2; exit 2; }

SEQ=1024
case ${MODEL:-gpt370m} in
  gpt370m) LAYERS=24 HIDDEN=1024 HEADS=16 FFN=2816 ;;
  gpt1b) LAYERS=16 HIDDEN=2048 HEADS=16 FFN=5632 ;;
  gpt7b8l) LAYERS=8 HIDDEN=4096 HEADS=32 FFN=11008 SEQ=2048 ;;
  llama2_7b) LAYERS=32 HIDDEN=4096 HEADS=32 FFN=11008 SEQ=2048 ;;
  *) fail "unknown MODEL ${MODEL}" ;;
esac
DEFAULT_ARMS="local_bf16_tp1 coat_tp1 coat_graph_tp1"
TE_ARMS="te_bf16_tp1 te_fp8_delayed_tp1 te_fp8_tensorwise_tp1 te_fp8_blockwise_tp1 te_memstack_tp1 coat_pa_tp1"
if python3 -c "import transformer_engine.pytorch" 2>/dev/null; then
  DEFAULT_ARMS="$TE_ARMS $DEFAULT_ARMS"; TE_SKIPPED=0
else
  TE_SKIPPED=1
fi
ARMS=${ARMS:-$DEFAULT_ARMS}

GRAPH="--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad"
BLOCKWISE="--transformer-impl transformer_engine --fp8-format e4m3 --fp8-recipe blockwise"
FP8_INPUT_STORE=--activation-func-fp8-input-store  # coat_megatron's flag for the TransformerConfig field
arm_layout() {  # "BASE TP DP" of an arm: BASE the one-GPU arm it runs at TP x DP; BASE = ARM for one-GPU arms
  if [[ $1 =~ ^(.+)_tp([0-9]+)_dp([0-9]+)$ ]]; then echo "${BASH_REMATCH[1]}_tp1 ${BASH_REMATCH[2]} ${BASH_REMATCH[3]}"
  elif [[ $1 =~ ^(.+)_tp([0-9]+)_sp$ ]]; then echo "${BASH_REMATCH[1]}_tp1 ${BASH_REMATCH[2]} 1"
  elif [[ $1 =~ ^(.+)_dp([0-9]+)$ ]]; then echo "${BASH_REMATCH[1]}_tp1 1 ${BASH_REMATCH[2]}"
  else echo "$1 1 1"; fi
}
arm_gpus() { local base tp dp; read -r base tp dp <<< "$(arm_layout "$1")"; echo $((tp * dp)); }

one_gpu_args() {
  case $1 in
    te_bf16_tp1) echo "--transformer-impl transformer_engine" ;;
    te_bf16_graph_tp1) echo "--transformer-impl transformer_engine $GRAPH" ;;
    te_fp8_delayed_tp1) echo "--transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe delayed
                              --fp8-amax-history-len 1024 --fp8-amax-compute-algo max" ;;
    te_fp8_tensorwise_tp1) echo "--transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe tensorwise" ;;
    te_fp8_blockwise_tp1) echo "$BLOCKWISE" ;;
    te_memstack_tp1) echo "$BLOCKWISE --fp8-param-gather --use-precision-aware-optimizer --exp-avg-dtype bf16
                           --exp-avg-sq-dtype bf16 --main-grads-dtype bf16 $FP8_INPUT_STORE
                           --recompute-granularity selective --recompute-modules layernorm" ;;
    local_bf16_tp1) echo "--transformer-impl local" ;;
    coat_tp1 | coat_note_tp1) echo "--transformer-impl coat --coat-optimizer" ;;
    coat_graph_tp1 | coat_graph_note_tp1) echo "--transformer-impl coat --coat-optimizer $GRAPH" ;;
    coat_pa_tp1) echo "--transformer-impl coat --coat-optimizer --use-precision-aware-optimizer
                       --main-grads-dtype bf16" ;;
    coat_teattn_tp1) echo "--transformer-impl coat --coat-optimizer --coat-attention te" ;;
    coat_torchadam_tp1) echo "--transformer-impl coat" ;;
    local_coatadam_tp1) echo "--transformer-impl local --coat-optimizer" ;;
    *) echo "unknown arm $1" >&2; return 1 ;;
  esac
}

arm_args() {  # an arm's own flags, its layout's included
  local base tp dp args
  read -r base tp dp <<< "$(arm_layout "$1")"
  if [[ $base == "$1" ]]; then one_gpu_args "$1"; return; fi
  if (( tp * dp < 2 )) || { [[ $1 =~ _tp[0-9]+_dp[0-9]+$ ]] && (( tp < 2 || dp < 2 )); }; then
    echo "unknown arm $1 (N-GPU arms: X_tpN_sp, X_dpN, X_tpT_dpD with N, T, D >= 2)" >&2; return 1
  fi
  args=$(one_gpu_args "$base") || return 1
  if (( tp > 1 )); then echo "$args --tensor-model-parallel-size $tp --sequence-parallel"; else echo "$args"; fi
}

check_iterations() {  # check_iterations COUNT NAME: Megatron's LR scheduler asserts lr_warmup_steps < lr_decay_steps
  [[ $1 =~ ^[0-9]+$ ]] || fail "$2=$1 is not a number of iterations"
  (( $1 > LR_WARMUP_ITERS )) || fail "$2=$1: Megatron's LR scheduler asserts --lr-warmup-iters < --train-iters (the " \
    "decay length defaults to the run's length), here $LR_WARMUP_ITERS < $1: run more than $LR_WARMUP_ITERS" \
    "iterations, or lower LR_WARMUP_ITERS"
}

check_arm() {  # an arm's name and layout against the model and the GPUs visible
  local base tp dp
  arm_args "$1" > /dev/null || exit 2
  read -r base tp dp <<< "$(arm_layout "$1")"
  (( HEADS % tp == 0 && FFN % tp == 0 )) || fail "$1: TP=$tp does not divide MODEL=${MODEL:-gpt370m}'s $HEADS" \
    "attention heads and FFN width $FFN"
  (( tp * dp > NGPUS || NGPUS % (tp * dp) == 0 )) || fail "$1: its $((tp * dp)) GPUs (TP=$tp x DP=$dp) do not" \
    "divide the $NGPUS GPUs visible (NGPUS=$((tp * dp)) runs it on the first $((tp * dp)))"
}

[[ $LR_WARMUP_ITERS =~ ^[0-9]+$ ]] || fail "LR_WARMUP_ITERS=$LR_WARMUP_ITERS is not a number of iterations"
for micro in ${MICROS:-8}; do
  [[ $micro =~ ^([1-9][0-9]*|max|max:[1-9][0-9]*)$ ]] || fail "MICROS: $micro is not a micro-batch size, max or max:N"
  if [[ $micro == max* ]]; then check_iterations "$MAX_ITERS" MAX_ITERS; else check_iterations "$ITERS" TRAIN_ITERS; fi
done
for arm in $ARMS; do check_arm "$arm"; done  # every arm checked before the first run

mkdir -p "$OUT"
(( TE_SKIPPED )) && echo "== transformer_engine arms skipped: transformer_engine is not importable" \
  | tee "$OUT/te_skipped.txt"
COMMON=(--num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" --ffn-hidden-size "$FFN"
  --seq-length "$SEQ" --max-position-embeddings "$SEQ"
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters "$LR_WARMUP_ITERS"
  --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02 --seed 1234
  --bf16 --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope
  --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0
  --use-distributed-optimizer
  --no-gradient-accumulation-fusion --no-rope-fusion --no-masked-softmax-fusion
  --no-bias-dropout-fusion --no-persist-layer-norm
  --log-interval 5 --log-throughput)
case ${DATA:-corpus} in
  corpus)
    DATA_LINE=$(python3 -m launch.megatron_data --out "$OUT/data")
    read -r -a DATA_ARGS <<< "$DATA_LINE"
    COMMON+=("${DATA_ARGS[@]}" --eval-iters 20) ;;
  mock) COMMON+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --eval-iters 0) ;;
  *) fail "unknown DATA ${DATA}" ;;
esac
# shellcheck disable=SC2206
COMMON+=(${EXTRA_ARGS:-})  # e.g. EXTRA_ARGS="--profile --use-pytorch-profiler --profile-step-start 30 ..."
echo "== every run: ${COMMON[*]}"

run() {  # run LOG GPUS NPROC PORT MICRO ITERS ARM: one training run; its exit status
  local log=$1 gpus=$2 nproc=$3 port=$4 micro=$5 iters=$6 arm=$7 module=coat_megatron.pretrain_gpt base tp dp
  [[ $arm == *_note_* ]] && module=launch.without_te
  local args; args=$(arm_args "$arm")
  # Megatron's fused SwiGLU stays off except where the arm saves its input in FP8 (only the fused one does)
  [[ $args == *"$FP8_INPUT_STORE"* ]] || args="--no-bias-swiglu-fusion $args"
  read -r base tp dp <<< "$(arm_layout "$arm")"
  local global=$((micro * dp))  # one micro-batch per data-parallel rank
  echo "== $(basename "$log" .log): CUDA_VISIBLE_DEVICES=$gpus torchrun --nproc_per_node $nproc -m $module" \
       "--micro-batch-size $micro --global-batch-size $global --train-iters $iters" $args
  [[ ${DRY_RUN:-0} == 1 ]] && return 0
  local rc=0 limit=()
  [[ -n ${RUN_TIMEOUT:-} ]] && limit=(timeout --kill-after 30 "$RUN_TIMEOUT")
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$gpus "${limit[@]}" python3 -m torch.distributed.run --nproc_per_node "$nproc" \
    --master_port "$port" -m "$module" "${COMMON[@]}" --micro-batch-size "$micro" --global-batch-size "$global" \
    --train-iters "$iters" --eval-interval "$iters" $args > "$log" 2>&1 || rc=$?
  echo "== $(basename "$log" .log): exit $rc"
  return $rc
}
# what a run that does not fit says (cuBLAS, cuDNN and NCCL report a failed allocation their own way): the report's
OOM=$(python3 -c "from launch.megatron_report import OUT_OF_MEMORY; print(OUT_OF_MEMORY)")

finished() {  # finished LOG: the run wrote its closing memory report
  grep -qs "\[coat_megatron\] rank 0 memory allocated after training" "$1"
}

run_arm() {  # run_arm ARM GPUS NPROC PORT: every size in MICROS
  local arm=$1 gpus=$2 nproc=$3 port=$4 micro sizes=()
  for micro in ${MICROS:-8}; do
    if [[ $micro != max* ]]; then
      local log="$OUT/${arm}_mb${micro}.log"
      if [[ ${RESUME:-0} == 1 ]] && finished "$log"; then
        echo "== ${arm}_mb${micro}: kept (RESUME=1)"
      else
        run "$log" "$gpus" "$nproc" "$port" "$micro" "$ITERS" "$arm" || true
      fi
      # "max" is predicted from the fixed sizes that ran to their end
      if [[ ${DRY_RUN:-0} == 1 ]] || finished "$log"; then sizes+=("$log"); fi
      continue
    fi
    if [[ ${RESUME:-0} == 1 ]] && finished "$OUT/${arm}_mbmax.log"; then
      echo "== ${arm}_mbmax: kept (RESUME=1)"
      continue
    fi
    if [[ $micro == max:* ]]; then
      micro=${micro#max:}
    elif [[ ${DRY_RUN:-0} == 1 ]]; then
      echo "== ${arm}_mbmax: the largest micro-batch, predicted from ${sizes[*]##*/}, then the same command"
      continue
    else
      (( ${#sizes[@]} )) && micro=$(python3 -m launch.megatron_report --predict-max "${sizes[@]}") || {
        echo "== $arm: no prediction of the largest micro-batch (needs a run of a fixed size that finished)"
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

report() { [[ ${DRY_RUN:-0} == 1 ]] || python3 -m launch.megatron_report "$OUT" || true; }
slot=0
for arm in $ARMS; do
  gpus=$(arm_gpus "$arm")
  if (( gpus > 1 )); then
    wait; slot=0
    if (( NGPUS < gpus )); then echo "== $arm skipped: needs $gpus GPUs, $NGPUS visible"; continue; fi
    run_arm "$arm" "$(seq -s, 0 $((gpus - 1)))" "$gpus" 29511
  else
    { run_arm "$arm" "$slot" 1 $((29501 + slot)); report > /dev/null; } &
    slot=$((slot + 1))
    if (( slot >= NGPUS )); then wait; slot=0; fi
  fi
done
wait
report
