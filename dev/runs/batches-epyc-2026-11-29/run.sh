cd /work/main
export HF_HUB_OFFLINE=1
for m in smollm2-135m gemma3-270m; do
  LAYERSKIP_CALIBRATION_CACHE=/tmp/exp/cal-b53-$m .venv/bin/python scripts/bench.py --model $m --prompts ../shared/data/spec_bench/question.jsonl --max-new-tokens 128 --ignore-eos --batch-size 2,4,8,16 --batch-layouts similar --batch-repeats 2 --policy auto --no-progress --out results/b53/$m > results/b53/$m.log 2>&1
done
