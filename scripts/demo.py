"""`make demo`: a short policy search on the embedded default model, then generation with the
policy it found, compared with Hugging Face generate on the same prompt.

Everything lands in results/demo/ (study database, policy, plots). Re-running resumes the study.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from layerskip.cli.generate import main as generate_main
from layerskip.data import builtin_prompts
from layerskip.search.cli import main as search_main

OUT = Path("results/demo")


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    print(
        "== 1. searching a skip policy for smollm2-135m (16 trials: ranked sublayer bypasses, int4 or fp32 "
        "draft weights, truncated head, prompt lookup in front or not) ==",
        flush=True,
    )
    code = search_main(
        [
            *"--model smollm2-135m --n-trials 16 --n-prompts 3 --reference-tokens 32 --max-new-tokens 48".split(),
            *"--confirm-top 2 --lookup 0,3 --draft-precision model,int4 --draft-vocab 4096,16384".split(),
            # Every trial drafts with bypassed sublayers (lookup may lead where the context repeats),
            # so the exported policy bypasses something; the verdict says if it beats plain decoding.
            "--require-skip-draft",
            *["--storage", f"sqlite:///{OUT / 'study.db'}", "--study-name", "demo"],
            *["--out", str(OUT / "policy.json"), "--plots", str(OUT / "plots")],
        ]
    )
    if code:
        return code
    print(f"\n== 2. generating with {OUT / 'policy.json'} vs HF generate ==", flush=True)
    prompt = builtin_prompts()[6].text  # a summarisation prompt: where drafting from context pays
    policy = str(OUT / "policy.json")
    return generate_main(
        ["--model", "smollm2-135m", "--policy", policy, "--prompt", prompt, "--max-new-tokens", "96", "--compare"]
    )


if __name__ == "__main__":
    raise SystemExit(main())
