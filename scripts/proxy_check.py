"""How well does the cheap proxy predict measured speedup? Confirms N trials of a study spread
over its predicted-speedup range by real generation and prints the rank correlation.

    python scripts/proxy_check.py --model smollm2-135m --storage sqlite:///results/search/smollm2.db \
        --study-name smollm2-speedup --n 8
"""

from __future__ import annotations

import sys

import numpy as np
import optuna
from optuna.trial import TrialState

from layerskip.cli.common import model_parser, run_cli
from layerskip.data import load_prompts
from layerskip.hf.models import load_model
from layerskip.hf.prompting import encode_prompt, eos_token_ids
from layerskip.search.confirmation import confirm_window
from layerskip.search.objective import prepare_calibration
from layerskip.search.space import trial_policy
from layerskip.search.study import confirmations, open_storage, record_confirmation


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Rank correlation (no ties correction needed for continuous timings); None if < 3 points."""
    if len(xs) < 3:
        return None
    ranks = [np.argsort(np.argsort(values, kind="stable")) for values in (xs, ys)]
    return float(np.corrcoef(*ranks)[0, 1])


def _main(argv: list[str] | None) -> int:
    parser = model_parser(__doc__, raw=True)
    parser.add_argument("--storage", required=True)
    parser.add_argument("--study-name", required=True)
    parser.add_argument("--n", type=int, default=8, help="trials to confirm (spread over predicted speedup)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    study = optuna.load_study(study_name=args.study_name, storage=open_storage(args.storage))
    attrs = study.user_attrs
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    calib = attrs["calibration"]
    prompts = [p for p in load_prompts(calib["source"]) if p.id in set(calib["prompts"])]
    ids = [encode_prompt(loaded.tokenizer, p.text, calib["chat"]) for p in prompts]
    calibration = prepare_calibration(
        loaded.model,
        ids,
        calib["reference_tokens"],
        [2],
        eos_token_ids(loaded.model, loaded.tokenizer),
        calib,
        progress=False,
    )
    trials = sorted(
        study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=lambda t: t.user_attrs["predicted_speedup"]
    )
    step = max(1, len(trials) // args.n)
    chosen = trials[::step][: args.n]
    done = confirmations(study)
    missing = [trial for trial in chosen if trial.number not in done]
    if missing:  # measured together in one interleaved window (layerskip.search.confirmation)
        policies = {trial.number: trial_policy(study, trial) for trial in missing}
        measured = confirm_window(loaded.model, calibration, policies, args.max_new_tokens)
        for trial in missing:
            record_confirmation(study, trial, measured[trial.number])
    done = confirmations(study)
    pairs = [
        (t.user_attrs["predicted_speedup"], done[t.number]["speedup"], t.number) for t in trials if t.number in done
    ]
    print("| trial | predicted | measured |\n|---|---|---|")
    for predicted, measured, number in sorted(pairs):
        print(f"| {number} | {predicted:.2f}x | {measured:.2f}x |")
    rho = spearman([p for p, _, _ in pairs], [m for _, m, _ in pairs])
    print(
        f"\nSpearman rank correlation over {len(pairs)} confirmed trials: {rho:.2f}" if rho is not None else "too few"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(_main))
