#!/bin/bash
# Round 6: SmolLM2 batches of mixed lengths, 2-16 rows (old/new/old): old = 217df10, new = the end-move prices.
R=/tmp/d6/runs6
mkdir -p $R
for model in smollm2-135m; do
for tag in old new old2; do
  wt=/work/wt/new; [ "$tag" = "new" ] && wt=/work/wt/c1
  cd $wt
  echo "$(date -u +%T) start batch $model $tag ($(git -C $wt rev-parse --short HEAD)) load $(cut -d' ' -f1 /proc/loadavg)" >> $R/times.log
  TRACE_OUT=$R/steps-$model-$tag.jsonl LAYERSKIP_CALIBRATION_CACHE=/tmp/d6/cal-$model-$tag HF_HUB_OFFLINE=1 PYTHONPATH=$wt /work/main/.venv/bin/python /tmp/d6/step_trace.py --model $model --prompts /work/shared/data/spec_bench/question.jsonl --max-new-tokens 128 --policy auto --no-progress --out $R/batch-$model-$tag --n-prompts 16 --batch-size 2,4,8,16 --batch-layouts mixed --ignore-eos --batch-repeats 2 > $R/batch-$model-$tag.log 2>&1
  echo "$(date -u +%T) done batch $model $tag rc $?" >> $R/times.log
done
done
