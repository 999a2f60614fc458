#!/bin/bash
set -u
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=/work/main/results/s1129c; PY=/work/main/.venv/bin/python
new=/work/wt/new; old=/work/wt/issuehead
for m in smollm2-135m gemma3-270m; do
  echo "$(date -u +%T) start batch-$m 9a85ec3 $(cat /proc/loadavg)" >> $OUT/times.log
  (cd $new && LAYERSKIP_CALIBRATION_CACHE=$OUT/cal-batch-$m PYTHONPATH=$new $PY scripts/bench.py --model $m \
     --prompts /work/shared/data/spec_bench/question.jsonl --max-new-tokens 128 --policy auto --no-progress \
     --out $OUT/batch-$m --n-prompts 16 --batch-size 1,2,4,8,16 --batch-layouts similar --ignore-eos --batch-repeats 2 > $OUT/batch-$m.log 2>&1)
  echo "$(date -u +%T) end batch-$m $(cat /proc/loadavg)" >> $OUT/times.log
done
for m in smollm2-135m gemma3-270m; do
  for tag in old1 new old2; do
    case $tag in old*) dir=$old;; *) dir=$new;; esac
    echo "$(date -u +%T) start one-$m-$tag $(cat /proc/loadavg)" >> $OUT/times.log
    (cd $dir && LAYERSKIP_CALIBRATION_CACHE=$OUT/cal-one-$m-$tag PYTHONPATH=$dir $PY scripts/bench.py --model $m \
       --prompts /work/shared/data/spec_bench/question.jsonl --max-new-tokens 128 --per-category 5 --methods self-spec --policy auto --no-progress \
       --out $OUT/one-$m-$tag > $OUT/one-$m-$tag.log 2>&1)
    echo "$(date -u +%T) end one-$m-$tag $(cat /proc/loadavg)" >> $OUT/times.log
  done
done
