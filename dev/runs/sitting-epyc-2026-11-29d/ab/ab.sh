for pair in "new2 /work/wt/new2" "new /work/wt/new" "new2b /work/wt/new2"; do
  set -- $pair
  cd $2
  TRACE_OUT=/tmp/diag/ab-$1.jsonl LAYERSKIP_CALIBRATION_CACHE=/tmp/diag/cal-ab-$1 HF_HUB_OFFLINE=1 PYTHONPATH=$2 /work/main/.venv/bin/python /tmp/diag/steptrace.py --model smollm2-135m --prompts /work/shared/data/spec_bench/question.jsonl --max-new-tokens 128 --policy auto --no-progress --out /tmp/diag/ab-out-$1 --force --n-prompts 16 --batch-size 4,16 --batch-layouts similar --ignore-eos --batch-repeats 2 > /tmp/diag/ab-$1.log 2>&1
  echo "$(date -u +%T) done $1" >> /tmp/diag/ab.times
done
