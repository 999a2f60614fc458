#!/bin/bash
# One sitting: batches to the budget, then one prompt at a time; old = fe85e8d, new = 03932ff, run old, new, old.
# Each commit runs from its own worktree (/work/wt/old, /work/wt/new); each process its own calibration cache.
OUT=/work/main/dev/runs/sitting-epyc-2026-11-29d
Q=/work/shared/data/spec_bench/question.jsonl
run() {  # name commit-dir model args...
  local name=$1 dir=$2 model=$3; shift 3
  echo "$(date -u +%H:%M:%S) start $name $model load $(cut -d' ' -f1 /proc/loadavg)" >> $OUT/times.log
  (cd $dir && LAYERSKIP_CALIBRATION_CACHE=/tmp/sitting-d-cal/$name-$model HF_HUB_OFFLINE=1 PYTHONPATH=$dir \
    /work/main/.venv/bin/python scripts/bench.py --model $model --prompts $Q --max-new-tokens 128 --policy auto \
    --no-progress --out $OUT/$name-$model "$@" > $OUT/$name-$model.log 2>&1)
  echo "$(date -u +%H:%M:%S) end $name $model rc=$?" >> $OUT/times.log
}
BATCH="--n-prompts 16 --batch-size 1,2,4,8,16 --batch-layouts similar --ignore-eos --batch-repeats 2"
ONE="--per-category 5 --methods self-spec"
for m in smollm2-135m gemma3-270m; do
  run batch-old1 /work/wt/old $m $BATCH
  run batch-new /work/wt/new $m $BATCH
  run batch-old2 /work/wt/old $m $BATCH
done
for m in smollm2-135m gemma3-270m; do
  run one-old1 /work/wt/old $m $ONE
  run one-new /work/wt/new $m $ONE
  run one-old2 /work/wt/old $m $ONE
done
echo "$(date -u +%H:%M:%S) all done" >> $OUT/times.log
