#!/bin/bash
# Round 2: batches (both models, old/new/old), then one prompt at a time (both models, old/new/old).
R=/tmp/d2/runs2
mkdir -p $R
for model in smollm2-135m gemma3-270m; do
for tag in old new old2; do
  wt=/work/wt/old; [ "$tag" = "new" ] && wt=/work/wt/new2
  cd $wt
  echo "$(date -u +%T) start batch $model $tag ($(git -C $wt rev-parse --short HEAD)) load $(cut -d' ' -f1 /proc/loadavg)" >> $R/times.log
  TRACE_OUT=$R/steps-$model-$tag.jsonl LAYERSKIP_CALIBRATION_CACHE=/tmp/d2/cal2-$model-$tag HF_HUB_OFFLINE=1 PYTHONPATH=$wt /work/main/.venv/bin/python /tmp/d2/step_trace.py --model $model --prompts /work/shared/data/spec_bench/question.jsonl --max-new-tokens 128 --policy auto --no-progress --out $R/batch-$model-$tag --n-prompts 16 --batch-size 1,2,4,8,16 --batch-layouts similar --ignore-eos --batch-repeats 2 > $R/batch-$model-$tag.log 2>&1
  echo "$(date -u +%T) done batch $model $tag rc $?" >> $R/times.log
done
done
for model in smollm2-135m gemma3-270m; do
for tag in old new old2; do
  wt=/work/wt/old; [ "$tag" = "new" ] && wt=/work/wt/new2
  cd $wt
  echo "$(date -u +%T) start one $model $tag ($(git -C $wt rev-parse --short HEAD)) load $(cut -d' ' -f1 /proc/loadavg)" >> $R/times.log
  LAYERSKIP_CALIBRATION_CACHE=/tmp/d2/cal3-$model-$tag HF_HUB_OFFLINE=1 PYTHONPATH=$wt /work/main/.venv/bin/python scripts/bench.py --model $model --prompts /work/shared/data/spec_bench/question.jsonl --max-new-tokens 128 --policy auto --no-progress --out $R/one-$model-$tag --per-category 5 --methods self-spec > $R/one-$model-$tag.log 2>&1
  echo "$(date -u +%T) done one $model $tag rc $?" >> $R/times.log
done
done
