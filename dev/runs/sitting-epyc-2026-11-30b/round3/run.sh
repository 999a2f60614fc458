#!/bin/bash
# Round 3: batches (both models, old/new/old): old = 2067caa, new = 217df10.
R=/tmp/d3/runs3
mkdir -p $R
for model in smollm2-135m gemma3-270m; do
for tag in old new old2; do
  wt=/work/wt/old; [ "$tag" = "new" ] && wt=/work/wt/new
  cd $wt
  echo "$(date -u +%T) start batch $model $tag ($(git -C $wt rev-parse --short HEAD)) load $(cut -d' ' -f1 /proc/loadavg)" >> $R/times.log
  TRACE_OUT=$R/steps-$model-$tag.jsonl LAYERSKIP_CALIBRATION_CACHE=/tmp/d3/cal-$model-$tag HF_HUB_OFFLINE=1 PYTHONPATH=$wt /work/main/.venv/bin/python /tmp/d3/step_trace.py --model $model --prompts /work/shared/data/spec_bench/question.jsonl --max-new-tokens 128 --policy auto --no-progress --out $R/batch-$model-$tag --n-prompts 16 --batch-size 1,2,4,8,16 --batch-layouts similar --ignore-eos --batch-repeats 2 > $R/batch-$model-$tag.log 2>&1
  echo "$(date -u +%T) done batch $model $tag rc $?" >> $R/times.log
done
done
