#!/bin/bash
# One sitting: old (1be6a58, the head) against new (main), alternating, machine otherwise idle.
set -u
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=/work/main/results/s0529
PY=/work/main/.venv/bin/python
declare -A TREE=([old]=/work/wt/old [new]=/work/wt/newhead)
run() {  # run NAME CODE MODEL ARGS...
  local name=$1 code=$2 model=$3; shift 3
  local dir=${TREE[$code]}
  echo "$(date -u +%T) start $name $(cat /proc/loadavg)" >> $OUT/times.log
  (cd $dir && LAYERSKIP_CALIBRATION_CACHE=$OUT/cal-$name PYTHONPATH=$dir $PY scripts/bench.py --model $model \
     --prompts /work/shared/data/spec_bench/question.jsonl --max-new-tokens 128 --policy auto --no-progress \
     --out $OUT/$name "$@" > $OUT/$name.log 2>&1)
  echo "$(date -u +%T) end $name rc=$? $(cat /proc/loadavg)" >> $OUT/times.log
}
ONE="--per-category 5 --methods self-spec"
BATCH="--n-prompts 16 --batch-size 1,2,4,8,16 --batch-layouts similar --ignore-eos --batch-repeats 2"
for m in smollm2-135m gemma3-270m; do
  run one-$m-old1 old $m $ONE
  run one-$m-new new $m $ONE
  run one-$m-old2 old $m $ONE
done
run batch-smollm2-135m-old old smollm2-135m $BATCH
run batch-smollm2-135m-new new smollm2-135m $BATCH
run batch-gemma3-270m-new new gemma3-270m $BATCH
run batch-gemma3-270m-old old gemma3-270m $BATCH
echo "$(date -u +%T) done" >> $OUT/times.log
