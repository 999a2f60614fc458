"""What every command-line tool shares: one-line errors with exit code 2, model options."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable

import torch

from layerskip.drafts.builder import check_policy_fits
from layerskip.drafts.policy.skip_policy import SkipPolicy
from layerskip.drafts.policy.spec import AUTO, ON_THE_FLY, load_policies, load_policy  # noqa: F401  (the CLI's names)
from layerskip.engine.decoding import check_fits  # the engine's check, made before HF's generate runs
from layerskip.engine.threads import available_cpus
from layerskip.errors import LayerskipError
from layerskip.fileio import read_text
from layerskip.hf.models import LoadedModel
from layerskip.hf.prompting import encode_prompt
from layerskip.machine import Machine, code_version, this_machine
from layerskip.measure.report import csv_table

EXIT_BAD_INPUT = 2


def run_cli(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run ``main``; a LayerskipError becomes ``error: ...`` on stderr and exit code 2, no traceback."""
    # The hub is the user's to configure: a hub id loads through their cache and network
    # settings (offline only where they set HF_HUB_OFFLINE=1); embedded models, local
    # directories and .gguf files never reach for it.
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # keep error output to one line
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars would break the one-line stderr contract
    try:
        return main(argv)
    except LayerskipError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def model_parser(description: str | None, prog: str | None = None, raw: bool = False) -> argparse.ArgumentParser:
    """A tool's parser, with the model options every tool takes; ``raw`` keeps the description's own line breaks."""
    formatter = argparse.RawDescriptionHelpFormatter if raw else argparse.HelpFormatter
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=formatter)
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="embedded name (smollm2-135m, gemma3-270m), a local HF directory, a .gguf file, or a hub id "
        "(org/name: loaded through your hub cache; downloaded unless HF_HUB_OFFLINE=1)",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    return parser


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """Where a tool's prompts come from (``layerskip.data.load_prompts``)."""
    parser.add_argument(
        "--prompts",
        default="builtin",
        help="'builtin', 'code' (12 code prompts), a Spec-Bench-style JSONL, or a json/csv/parquet file",
    )
    parser.add_argument("--text-field", help="column holding the prompt text (json/csv/parquet)")


def add_chat_argument(parser: argparse.ArgumentParser) -> None:
    """``--chat`` / ``--no-chat``; None when neither is given: the model's kind decides."""
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the chat template (default: on for instruct models)",
    )


def _number_list(kind: type, what: str) -> Callable[[str], tuple]:
    """An argparse type: ``"2,4,8"`` -> ``(2, 4, 8)`` of ``kind``; ``what`` names them in a refusal."""

    def parse(text: str) -> tuple:
        try:
            return tuple(kind(part) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got '{text}'") from None

    return parse


int_list = _number_list(int, "integers")
float_list = _number_list(float, "numbers")


def thread_setting(text: str) -> int | str:
    """An argparse type: ``"auto"`` or a positive thread count.

    A count above the CPUs this process may use is a LayerskipError, which argparse lets through
    to ``run_cli`` (one line): torch would start that many threads, and they would spend their
    time waiting for each other (999 threads hung a 2-core machine)."""
    if text.strip() == "auto":
        return "auto"
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive thread count, got '{text}'")
    cpus = available_cpus()
    if count > cpus:
        raise LayerskipError(
            f"--threads {count} is more than the {cpus} CPU(s) this process may use; pass 1 to {cpus}, or 'auto'"
        )
    return count


def thread_settings(text: str) -> tuple[int | str, ...]:
    """An argparse type: ``"auto,1,2"`` -> ``("auto", 1, 2)`` (no duplicates)."""
    settings = tuple(thread_setting(part) for part in text.split(",") if part.strip())
    if not settings or len(set(settings)) != len(settings):
        raise argparse.ArgumentTypeError(f"expected distinct settings like 'auto,1,2', got '{text}'")
    return settings


THREADS_HELP = (
    "CPU threads of the draft and the verify: 'auto' (default) picks each phase's count by its "
    "measured time while generating, which keeps the draft fast when other processes share the CPU; "
    "a number fixes it"
)


def str_list(text: str) -> tuple[str, ...]:
    """An argparse type: ``"qa, rag"`` -> ``("qa", "rag")``."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def encode_prompts(
    loaded: LoadedModel, args: argparse.Namespace, texts: list[str], labels: list[str]
) -> list[list[int]]:
    """``texts`` as token ids for ``loaded`` (the chat template per ``--chat``, else the model's kind),
    each checked to fit with ``--max-new-tokens`` (``labels`` name them in the refusal)."""
    chat = loaded.instruct if args.chat is None else args.chat
    ids = [encode_prompt(loaded.tokenizer, text, chat) for text in texts]
    for label, prompt_ids in zip(labels, ids, strict=True):
        check_fits(loaded.model, len(prompt_ids), args.max_new_tokens, label)
    return ids


def csv_text(rows: list[dict[str, object]]) -> str:
    """``rows`` as CSV, the first row's keys as the header; no rows: empty."""
    return csv_table(rows, tuple(rows[0])) if rows else ""


def read_prompt(text: str | None, path: str | None) -> str:
    if path is not None:
        # The project's one reader: a FIFO (a read that never returns) or /dev/zero (one that never ends) is refused.
        return read_text(path, "prompt file", "pass a UTF-8 text file to --prompt-file")
    if text is None:
        raise LayerskipError("no prompt given; pass --prompt TEXT or --prompt-file PATH")
    return text


def check_policies(policies: dict[str, SkipPolicy | None], model: object) -> None:
    """Every policy can drive ``model``; the error names the policy that cannot."""
    for label, policy in policies.items():
        if policy is None:
            continue
        try:
            check_policy_fits(model, policy)
        except LayerskipError as exc:
            raise LayerskipError(f"policy {label}: {exc}") from None


def quick_search_command(model: str, dtype: str = "float32", device: str = "cpu") -> str:
    """The command that tunes a policy for the machine at hand: the search's quick preset."""
    parts = ["layerskip-search", "--model", model, "--preset", "quick"]
    parts += ["--dtype", dtype] if dtype != "float32" else []
    parts += ["--device", device] if device != "cpu" else []
    return shlex.join(parts)


def tuning_advice(policies: dict[str, SkipPolicy | None], here: Machine, tune_command: str) -> str | None:
    """At most one line on where ``policies`` were tuned: a warning when one was tuned on another
    machine than ``here`` (another CPU model or other kernel flags: its speedup may not hold), else a
    note when a policy file records no machine at all (written before policies recorded it), else None.
    Policies with no provenance (written by hand) or built in this process (``on-the-fly``, ``auto``:
    calibrated here) claim no tuning and get neither."""
    elsewhere: dict[str, str] = {}
    unrecorded = []
    for label, policy in policies.items():
        if policy is None or not policy.provenance or policy.provenance in ({"source": ON_THE_FLY}, {"source": AUTO}):
            continue
        tuned = policy.tuned_machine
        if tuned is None:
            unrecorded.append(label)
        elif differences := tuned.differences(here):
            elsewhere[label] = "; ".join(differences)
    advice = f"tune one for this machine (about 5 minutes on 2 cores): {tune_command}"
    if elsewhere:
        found = set(elsewhere.values())
        detail = found.pop() if len(found) == 1 else "; ".join(f"{label}: {d}" for label, d in elsewhere.items())
        if len(elsewhere) == 1:
            subject, its = f"policy {next(iter(elsewhere))} was", "its"
        else:
            subject, its = f"policies {', '.join(elsewhere)} were", "their"
        return f"warning: {subject} tuned on another machine ({detail}), so {its} speedup may not hold here; {advice}"
    if unrecorded:
        subject = f"policy {unrecorded[0]} does" if len(unrecorded) == 1 else f"policies {', '.join(unrecorded)} do"
        return f"note: {subject} not record the machine it was tuned on; if it runs slower than expected here, {advice}"
    return None


def warn_if_tuned_elsewhere(
    policies: dict[str, SkipPolicy | None], device: torch.device, args: argparse.Namespace
) -> None:
    """Print ``tuning_advice`` for the machine at hand (stderr), if there is any."""
    line = tuning_advice(policies, this_machine(device), quick_search_command(args.model, args.dtype, args.device))
    if line is not None:
        print(line, file=sys.stderr)


def command_line(program: str, argv: list[str] | None) -> str:
    """The command that repeats this run: ``program`` with the arguments it was given."""
    return shlex.join([*program.split(), *(sys.argv[1:] if argv is None else argv)])


def measured_run(script: str, argv: list[str] | None, loaded: LoadedModel, dtype: str) -> dict[str, object]:
    """What a measuring script (``scripts/SCRIPT``) records of its run: the command that repeats it,
    the model, its dtype and device, and the code that measured ("commit", "dirty")."""
    return {
        "command": command_line(f"python scripts/{script}", argv),
        "model": loaded.name,
        "dtype": dtype,
        "device": str(next(loaded.model.parameters()).device),
        **code_version(),
    }


def check_seed(seed: int | None, flag: str = "--seed") -> None:
    """torch seeds are 64-bit: a larger or negative number fails deep inside with an overflow."""
    if seed is not None and not 0 <= seed < 2**63:
        raise LayerskipError(f"{flag} must be between 0 and {2**63 - 1} (got {seed})")
