"""Helpers for the search CLI tests: a tiny Llama saved as a local HF directory, and CLI runners.

``save_tiny_llama`` writes a random 4-layer Llama (reusing ``tiny_models``) plus a byte-level BPE
tokenizer (~300 tokens, trained on a few sentences here, nothing downloaded) with
``save_pretrained``, so ``scripts/search.py --model DIR`` loads it like any HF checkpoint in
well under a second. Everything else runs the real scripts as subprocesses.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cli_helpers import REPO, run_in_process, run_script, script_env

SEARCH = REPO / "scripts" / "search.py"

TOKENIZER_VOCAB = 300
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]  # ids 0 and 1: eos/bos and pad
CORPUS = [
    "Write a short story about a robot who learns to paint.",
    "Translate the following sentence into French: the weather is nice today.",
    "Summarize the article in three sentences for a busy reader.",
    "What is the capital of France? Answer with one word.",
    "Explain how photosynthesis works to a ten year old child.",
    "Solve for x: 3x + 7 = 22. Show your reasoning step by step.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "The quick brown fox jumps over the lazy dog near the river bank.",
]

# Cheapest settings that still exercise calibration, trials, confirmation and export.
FAST_ARGS = [
    "--no-progress",
    "--n-prompts",
    "2",
    "--reference-tokens",
    "8",
    "--max-new-tokens",
    "8",
    "--confirm-top",
    "1",
    "--draft-tokens",
    "2,3",
]


def build_tokenizer():
    """A byte-level BPE ``PreTrainedTokenizerFast`` (any text encodes, no unknown tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=SPECIAL_TOKENS[0],
        bos_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[1],
    )


def save_tiny_llama(directory: Path, **overrides: Any) -> Path:
    """Save a tiny random LlamaForCausalLM and its tokenizer into ``directory`` (created)."""
    from tiny_models import tiny_model

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    config.update(overrides)
    model = tiny_model("llama", **config)
    model.generation_config.eos_token_id = eos
    model.generation_config.bos_token_id = eos
    model.generation_config.pad_token_id = pad
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def env() -> dict[str, str]:
    return script_env()


def search_command(model: Path | str, *args: str, fast: bool = True) -> list[str]:
    return [sys.executable, str(SEARCH), "--model", str(model), *(FAST_ARGS if fast else []), *args]


def run_search(model: Path | str, *args: str, timeout: float = 240, fast: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        search_command(model, *args, fast=fast), cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout
    )


def start_search(model: Path | str, *args: str, fast: bool = True) -> subprocess.Popen:
    return subprocess.Popen(
        search_command(model, *args, fast=fast),
        cwd=REPO,
        env=env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def run_generate(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_script("generate.py", *args, timeout=timeout)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def load_storage(url: str):
    """An Optuna storage for a URL as the CLI reads it (journal files by path)."""
    import optuna

    if url.endswith(".log"):
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(url))
    if url.startswith("sqlite:///"):
        return optuna.storages.RDBStorage(url)
    from layerskip.search.study import open_storage  # picks the installed PostgreSQL driver

    return open_storage(url)


def load_study(url: str, name: str):
    import optuna

    return optuna.load_study(study_name=name, storage=load_storage(url))


def trial_numbers(study, states: Sequence | None = None) -> list[int]:
    return sorted(t.number for t in study.get_trials(deepcopy=False, states=states))


def counted(study) -> list[int]:
    from optuna.trial import TrialState

    return trial_numbers(study, (TrialState.COMPLETE, TrialState.PRUNED))


def wait_all(processes: Sequence[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str, str]]:
    """Wait for every process; kill the rest if one overruns. (returncode, stdout, stderr) each."""
    deadline = time.monotonic() + timeout
    results = []
    for process in processes:
        try:
            out, err = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            out, err = process.communicate()
            raise AssertionError(f"search worker overran {timeout} s\nstdout:\n{out}\nstderr:\n{err}") from None
        results.append((process.returncode, out, err))
    return results


def search_in_process(capsys, model: Path | str, *args: str, fast: bool = True) -> subprocess.CompletedProcess:
    """``layerskip-search`` through its own ``main`` in this process (the same one-line error path as
    the script, without an interpreter start-up); ``capsys`` collects its output."""
    from layerskip.search.cli import main

    return run_in_process(main, capsys, "--model", str(model), *(FAST_ARGS if fast else []), *args)


def generate_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """``layerskip-generate`` through its own ``main`` in this process (see ``search_in_process``)."""
    from layerskip.cli.generate import main

    return run_in_process(main, capsys, *args)


def kill_9_then_resume(run: Any, model: Path | str, url: str, name: str, out: Path) -> None:
    """Kill -9 a search in the middle of a trial, then run the same command again (``run``, e.g.
    ``search_in_process`` bound to ``capsys``): nothing completed is lost, the killed worker's trial is
    marked FAIL (none stays RUNNING), and --out is untouched by the killed run and whole after the resume.
    Works for every storage kind: SQLite, journal file, PostgreSQL."""
    from optuna.trial import TrialState

    from layerskip.search.study import WORKER_ATTR, local_storage_file

    # A database server is polled through one storage (a new one per poll would open new connections);
    # a local file is reopened, since polling must not create it before the worker does.
    shared = None if local_storage_file(url) is not None else load_storage(url)

    def study():
        import optuna

        return optuna.load_study(study_name=name, storage=shared or load_storage(url))

    def in_a_trial_after_two() -> bool:
        """Two trials finished and a third one's objective is running (it has marked its worker)."""
        try:
            current = study()
        except (KeyError, ValueError, OSError):  # not created yet, or a record being appended
            return False
        running = current.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        return len(counted(current)) >= 2 and any(WORKER_ATTR in t.user_attrs for t in running)

    # Trials of 32 tokens, not 8: a tiny model's 8-token trial ended between the poll that saw it and
    # the kill often enough that four or five workers were started (36 s for this test).
    args = ["--storage", url, "--study-name", name, "--out", str(out), "--max-new-tokens", "32"]
    # A kill may still land just after a trial finished. Then the same command is started again (a
    # resume) and killed again, until a kill has caught a trial mid-run.
    for _attempt in range(5):
        worker = start_search(model, *args, "--n-trials", "10000")
        try:
            deadline = time.monotonic() + 180
            while not in_a_trial_after_two():
                assert worker.poll() is None, worker.communicate()
                assert time.monotonic() < deadline, "no trials finished in 180 s"
                # Not faster: each poll of a journal file replays the whole log, and polling every
                # 0.1 s starved the worker of CPU (36 s for this test on 2 cores, 6 s at 0.5 s).
                time.sleep(0.5)
            worker.send_signal(signal.SIGKILL)
            worker.communicate()
            if url.endswith(".log"):
                # A kill that lands while the worker appends leaves the journal's lock behind; Optuna
                # removes it after its 30 s grace period (the resume would wait that long). What is
                # tested is what the resume does with the study, so the stale lock goes now.
                from optuna.storages.journal._file import LOCK_FILE_SUFFIX

                Path(url + LOCK_FILE_SUFFIX).unlink(missing_ok=True)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.communicate()
        assert not out.exists()  # the killed run never reached its export
        current = study()
        running = current.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        unmarked = [t for t in running if WORKER_ATTR not in t.user_attrs]
        for trial in unmarked:
            # Killed between Optuna creating the trial and its objective marking its worker: the gap
            # that fail_trials_of_dead_workers documents (storage heartbeats close it after 90 s).
            # Close it here as they would, and kill again.
            current.tell(trial.number, state=TrialState.FAIL)
        if len(running) > len(unmarked):
            break
    else:
        raise AssertionError("five kills in a row all fell between trials")
    before = len(counted(study()))

    result = ok(run(model, *args, "--n-trials", "2"))

    resumed = study()
    states = [t.state for t in resumed.get_trials(deepcopy=False)]
    assert TrialState.RUNNING not in states, f"a trial of the killed worker stayed RUNNING: {states}"
    assert len(counted(resumed)) == before + 2, states
    assert trial_numbers(resumed) == list(range(len(states)))
    assert TrialState.FAIL in states and "marked FAIL" in result.stderr, result.stderr
    from layerskip.drafts.policy.skip_policy import SkipPolicy

    SkipPolicy.load(out)
