#!/bin/bash
set -u
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=/work/main/results/s1129c; PY=/work/main/.venv/bin/python
new=/work/wt/new
for m in smollm2-135m gemma3-270m; do
  echo "$(date -u +%T) start batch3-$m d9dd750 $(cat /proc/loadavg)" >> $OUT/times.log
  (cd $new && LAYERSKIP_CALIBRATION_CACHE=$OUT/cal-batch3-$m PYTHONPATH=$new $PY scripts/bench.py --model $m \
     --prompts /work/shared/data/spec_bench/question.jsonl --max-new-tokens 128 --policy auto --no-progress \
     --out $OUT/batch3-$m --n-prompts 16 --batch-size 1,2,4,8,16 --batch-layouts similar --ignore-eos --batch-repeats 2 > $OUT/batch3-$m.log 2>&1)
  echo "$(date -u +%T) end batch3-$m $(cat /proc/loadavg)" >> $OUT/times.log
done
