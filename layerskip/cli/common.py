"""What every command-line tool shares: one-line errors with exit code 2, model options."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch

from layerskip.drafts.policy import SkipPolicy
from layerskip.drafts.policy_spec import ON_THE_FLY, load_policies, load_policy  # noqa: F401  (the CLI's names)
from layerskip.engine.threads import available_cpus
from layerskip.errors import LayerskipError
from layerskip.hf import adapters

EXIT_BAD_INPUT = 2


def run_cli(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run ``main``; a LayerskipError becomes ``error: ...`` on stderr and exit code 2, no traceback."""
    # Never reach for a model hub. transformers read the variable at import, before this runs,
    # so the constant is set too (only when the user has not asked for online mode).
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # keep error output to one line
    if os.environ.setdefault("HF_HUB_OFFLINE", "1") == "1":
        import huggingface_hub.constants

        huggingface_hub.constants.HF_HUB_OFFLINE = True
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


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="embedded name (smollm2-135m, gemma3-270m), a local HF directory or a .gguf file",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])


def int_list(text: str) -> tuple[int, ...]:
    """An argparse type: ``"2,4,8"`` -> ``(2, 4, 8)``."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def float_list(text: str) -> tuple[float, ...]:
    """An argparse type: ``"0,0.5"`` -> ``(0.0, 0.5)``."""
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got '{text}'") from None


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


def read_prompt(text: str | None, path: str | None) -> str:
    if path is not None:
        try:
            return open(path, encoding="utf-8").read()
        except OSError as exc:
            raise LayerskipError(f"cannot read prompt file {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise LayerskipError(f"cannot read prompt file {path}: it is not UTF-8 text") from None
    if text is None:
        raise LayerskipError("no prompt given; pass --prompt TEXT or --prompt-file PATH")
    return text


def check_policies(policies: dict[str, SkipPolicy | None], model: object) -> None:
    """Every policy can drive ``model``; the error names the policy that cannot."""
    for label, policy in policies.items():
        if policy is None:
            continue
        try:
            policy.validate_for(model)
        except LayerskipError as exc:
            raise LayerskipError(f"policy {label}: {exc}") from None


def check_fits(model: torch.nn.Module, prompt_tokens: int, new_tokens: int, what: str = "the prompt") -> None:
    """Refuse a prompt that, with the tokens to generate, runs past the model's positions: past
    them, rotary models write garbage and learned-position models (GPT-2) fail with an IndexError."""
    limit = adapters.max_positions(model)
    if limit is not None and prompt_tokens + new_tokens > limit:
        raise LayerskipError(
            f"{what} has {prompt_tokens} tokens; with {new_tokens} new tokens that is {prompt_tokens + new_tokens}, "
            f"past the model's {limit} positions; shorten the prompt or lower the number of new tokens"
        )


def check_seed(seed: int | None, flag: str = "--seed") -> None:
    """torch seeds are 64-bit: a larger or negative number fails deep inside with an overflow."""
    if seed is not None and not 0 <= seed < 2**63:
        raise LayerskipError(f"{flag} must be between 0 and {2**63 - 1} (got {seed})")
