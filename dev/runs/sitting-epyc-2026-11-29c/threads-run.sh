#!/bin/bash
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=/tmp/diag/seq; PY=/work/main/.venv/bin/python
for tag in old new; do
  if [ $tag = old ]; then dir=/work/wt/old; else dir=/work/main; fi
  echo "$(date -u +%T) start $tag $(cat /proc/loadavg)" >> $OUT/times.log
  (cd $dir && LAYERSKIP_CALIBRATION_CACHE=$OUT/cal-$tag PYTHONPATH=$dir $PY /tmp/diag/thrlog.py --model smollm2-135m \
     --prompts /work/shared/data/spec_bench/question.jsonl --max-new-tokens 128 --policy auto --no-progress \
     --out $OUT/$tag --n-prompts 16 --batch-size 1,2,4,8,16 --batch-layouts similar --ignore-eos --batch-repeats 2 > $OUT/$tag.log 2>&1)
  echo "$(date -u +%T) end $tag $(cat /proc/loadavg)" >> $OUT/times.log
done
