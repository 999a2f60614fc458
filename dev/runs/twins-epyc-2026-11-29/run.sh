cd /work/main
export HF_HUB_OFFLINE=1
B=".venv/bin/python scripts/bench.py --prompts ../shared/data/spec_bench/question.jsonl --per-category 2 --max-new-tokens 128 --no-progress --methods hf-ar,hf-pld,self-spec --policy auto"
for m in smollm2-135m twins/smollm2-135m-offgrid gemma3-270m twins/gemma3-270m-offgrid; do
  n=$(basename $m)
  rm -rf /tmp/exp/cal-s55-$n
  LAYERSKIP_CALIBRATION_CACHE=/tmp/exp/cal-s55-$n $B --model $m --out results/s55/$n > results/s55/$n.log 2>&1
done
