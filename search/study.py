"""Optuna studies by storage URL: create or resume, check they belong to this model and machine, run, confirm.

Storage URLs: ``sqlite:///path.db`` (default), a journal file ``path.log`` (or
``journal:path``), ``postgresql://user:pass@host/db`` for many workers on many machines.
Re-running the same command resumes the study; several processes may work on one study at
once; ``total_trials`` caps the trials of all workers together.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import random
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from layerskip.drafts.policy.skip_policy import SkipPolicy
from layerskip.errors import LayerskipError
from layerskip.machine import Machine, code_version
from layerskip.search.confirmation import Confirmation, decide
from layerskip.search.space import exportable, trial_policy

COUNTED_STATES = (TrialState.COMPLETE, TrialState.PRUNED)
CONFIRMED_PREFIX = "confirmed:"
WINDOW_ATTR = "confirmation_window"  # the last window of finalists measured together, and its decision
HEARTBEAT_SECONDS = 30
WORKER_ATTR = "worker"  # "host:pid" of the process running a trial
MACHINE_ATTR = "machine"  # study and trial attribute: the machine costs were measured on (layerskip.machine)
CODE_ATTR = "code"  # trial attribute: the git commit of the code that measured it (layerskip.machine.code_version)
SERVER_SCHEMES = ("postgresql://", "postgresql+psycopg2://", "postgresql+psycopg://", "mysql://", "mysql+pymysql://")


def local_storage_file(url: str) -> Path | None:
    """The file a SQLite or journal storage URL names; None for a database server."""
    if url.startswith("sqlite:///"):
        return Path(url.removeprefix("sqlite:///")).expanduser()
    if url.startswith("journal:") or url.endswith(".log"):
        return Path(url.removeprefix("journal:")).expanduser()
    return None


def check_storage_url(url: str) -> None:
    """One-line LayerskipError for a URL no storage can be opened from; touches nothing."""
    path = local_storage_file(url)
    if path is not None:
        kind = "SQLite" if url.startswith("sqlite:///") else "journal"
        if not path.parent.is_dir():
            raise LayerskipError(f"directory {path.parent} of {kind} storage {url} does not exist; create it first")
    elif not url.startswith(SERVER_SCHEMES):
        raise LayerskipError(
            f"unsupported storage URL '{url}'; use sqlite:///path.db, a journal file path.log, or postgresql://..."
        )


def _with_installed_driver(url: str) -> str:
    """Name the PostgreSQL driver that is installed when the URL names none.

    SQLAlchemy 2.1 reads a bare ``postgresql://`` as psycopg 3 (2.0 as psycopg2); the project's
    extras install psycopg2-binary, so pick whichever of the two is importable.
    """
    if not url.startswith("postgresql://"):
        return url
    installed = [driver for driver in ("psycopg2", "psycopg") if importlib.util.find_spec(driver) is not None]
    return f"postgresql+{installed[0]}://" + url.removeprefix("postgresql://") if len(installed) == 1 else url


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """An Optuna storage for ``url``; one-line LayerskipError if the URL is bad or unreachable."""
    check_storage_url(url)
    path = local_storage_file(url)
    if path is not None and not url.startswith("sqlite:///"):
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    # Heartbeats (stale-trial detection for killed workers) are flagged experimental by Optuna.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    try:
        return _rdb_storage(url)
    except ImportError as exc:
        # Optuna re-raises the driver's ModuleNotFoundError as a bare ImportError: name the module.
        missing = getattr(exc.__cause__, "name", None) or exc.name or "its driver module"
        # A bare mysql:// URL means SQLAlchemy's default driver, MySQLdb (package mysqlclient).
        drivers = {"mysql://": "mysqlclient", "mysql+pymysql://": "pymysql"}
        package = drivers.get(url.split("://")[0] + "://", "psycopg2-binary")
        raise LayerskipError(
            f"storage {_redact(url)} needs a database driver ({missing} is not installed); pip install {package}"
        ) from None
    except Exception as exc:  # sqlalchemy raises OperationalError / ArgumentError subclasses
        raise LayerskipError(f"cannot open storage {_redact(url)}: {_first_line(exc)}") from None


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _rdb_storage(url: str, attempts: int = 6) -> optuna.storages.RDBStorage:
    """Open (and on first use, create) a database storage.

    Optuna creates its tables and stamps their version when it first opens a database; two
    workers starting together on a new database race there and one fails with a duplicate
    key or table. The schema is complete once the winner is done, so the loser tries again.
    """
    from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(
                _with_installed_driver(url),
                engine_kwargs={"pool_pre_ping": True} if not url.startswith("sqlite") else None,
                heartbeat_interval=HEARTBEAT_SECONDS,
                grace_period=3 * HEARTBEAT_SECONDS,
            )
        except (IntegrityError, ProgrammingError, OperationalError) as exc:
            racing = not isinstance(exc, OperationalError) or "locked" in str(exc) or "already exists" in str(exc)
            if not racing or attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1) + random.random() * 0.2)
    raise AssertionError("unreachable")


def _redact(url: str) -> str:
    """Hide a password in a database URL before printing it."""
    if "://" in url and "@" in url:
        scheme, rest = url.split("://", 1)
        credentials, host = rest.rsplit("@", 1)
        user = credentials.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}"
    return url


def existing_study_attrs(storage: optuna.storages.BaseStorage, name: str) -> dict[str, Any] | None:
    """The user attributes of study ``name`` if it exists, else None (reads only).

    A storage that cannot be read (a damaged SQLite page, an unreadable journal) is one line
    here, before any work, rather than a traceback from deep inside Optuna later."""
    try:
        summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
    except Exception as exc:  # sqlalchemy and the journal raise many types
        raise LayerskipError(
            f"cannot read the study storage ({type(exc).__name__}: {_first_line(exc)[:200]}); it may be damaged: "
            "restore it from a backup or use another --storage"
        ) from None
    return next((dict(summary.user_attrs) for summary in summaries if summary.study_name == name), None)


def check_local_storage(url: str) -> None:
    """``check_storage_url``; and a SQLite or journal storage must be writable (file and directory:
    both write files beside it) and a SQLite file intact, or a study fails only when it first writes,
    after calibration."""
    check_storage_url(url)
    path = local_storage_file(url)
    if path is None:
        return
    if path.exists() and not os.access(path, os.W_OK):
        raise LayerskipError(f"storage {path} is read-only; make it writable or copy it somewhere writable")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise LayerskipError(f"storage {path}: directory {path.parent} is not writable; choose a writable directory")
    if url.startswith("sqlite:///") and path.is_file() and path.stat().st_size > 0:
        _check_sqlite_intact(path)


def _check_sqlite_intact(path: Path) -> None:
    """SQLite's own quick check (read-only; reads every page, milliseconds for a study's size)."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as connection:
            problems = [row[0] for row in connection.execute("PRAGMA quick_check").fetchall()]
    except sqlite3.DatabaseError as exc:
        problems = [str(exc)]
    if problems != ["ok"]:
        problems = [" ".join(str(problem).split()) for problem in problems]  # SQLite's reports span lines
        raise LayerskipError(
            f"SQLite storage {path} is damaged ({problems[0][:160]}); restore it from a backup or use another --storage"
        )


def check_study_matches(attrs: dict[str, Any] | None, name: str, identity: dict[str, Any]) -> None:
    """An existing study must have been made for the same model and objective."""
    if attrs is None:
        return
    for key in ("model_fingerprint", "model_weights_sample", "objective", "model_architecture"):
        if key in attrs and key in identity and attrs[key] != identity[key]:
            raise LayerskipError(
                f"study '{name}' was created for model {attrs.get('model_name', '?')} with {key}={attrs[key]!r} "
                f"but this run has {identity[key]!r} (model {identity.get('model_name', '?')}); "
                "use another --study-name"
            )


def open_study(
    storage: optuna.storages.BaseStorage,
    name: str,
    objective: str,
    seed: int,
    metadata: dict[str, Any],
    warm_starts: list[dict[str, Any]],
) -> optuna.Study:
    """Create or resume the study; record what it is for; enqueue the ``warm_starts`` (parameters)
    in order, each unless the study already holds a trial with the same parameters."""
    directions = ["maximize", "minimize"] if objective == "pareto" else ["maximize"]
    pruner = optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=2)
    optuna.logging.set_verbosity(logging.WARNING)
    study = optuna.create_study(
        storage=storage, study_name=name, directions=directions, pruner=pruner, load_if_exists=True
    )
    # The trials already in the study offset the seed, so a resumed run explores anew; constant_liar
    # keeps parallel workers from sampling the same point while trials run.
    seed += counted_trials(study)
    study.sampler = optuna.samplers.TPESampler(seed=seed, constant_liar=True, n_startup_trials=8)
    if "model_fingerprint" not in study.user_attrs:  # a new study
        for key, value in metadata.items():
            study.set_user_attr(key, value)
    # A warm start that a killed or interrupted run left FAIL (or never reached) is run again;
    # one already evaluated, queued or running elsewhere is not.
    for params in warm_starts:
        if not has_twin(study, params):
            study.enqueue_trial(params)
    runs = [*study.user_attrs.get("runs", []), metadata.get("command", "")]
    study.set_user_attr("runs", runs[-50:])
    return study


TWIN_STATES = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.WAITING, TrialState.RUNNING)


def has_twin(study: optuna.Study, params: dict[str, Any]) -> bool:
    """Whether a trial with exactly ``params`` is evaluated, queued or running (FAIL ones do not count)."""
    trials = study.get_trials(deepcopy=False, states=TWIN_STATES)
    return any(trial.system_attrs.get("fixed_params", trial.params) == params for trial in trials)


def counted_trials(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=COUNTED_STATES))


def warn_if_made_elsewhere(attrs: dict[str, Any] | None, study_name: str, here: Machine) -> None:
    """A study resumed on another machine mixes costs measured on both: one warning line."""
    made_on = Machine.from_dict((attrs or {}).get(MACHINE_ATTR))
    if made_on is not None and (differences := made_on.differences(here)):
        print(
            f"warning: study '{study_name}' was made on another machine ({'; '.join(differences)}); its trials' "
            "costs were measured there and do not compare with this machine's; for a policy tuned here, start a "
            "new study (another --study-name)",
            file=sys.stderr,
        )


def run_trials(
    study: optuna.Study,
    objective: Callable[[optuna.Trial], Any],
    n_trials: int,
    total_trials: int | None,
    timeout: float | None,
    progress: bool = True,
    here: Machine | None = None,
) -> None:
    """Run up to ``n_trials`` here, stopping when all workers together reach ``total_trials``.

    Each trial records the process that runs it and, given ``here``, the machine its costs are
    measured on and the code that measured them: an exported policy says it was tuned there
    (workers of one study may run on different machines, from different commits). Ctrl-C stops
    the run and records the trial it interrupted as FAIL (see ``_InterruptGuard``).
    """
    told: list[int] = []  # the trials this process ran to an end (any state)
    callbacks: list[Callable[[optuna.Study, FrozenTrial], None]] = [lambda study, trial: told.append(trial.number)]
    if total_trials is not None:
        callbacks.append(optuna.study.MaxTrialsCallback(total_trials, states=COUNTED_STATES))
    deadline = None if timeout is None else time.monotonic() + timeout
    failed = fail_trials_of_dead_workers(study)
    if failed:
        print(f"trial(s) {failed} were left RUNNING by a process that no longer runs: marked FAIL", file=sys.stderr)
    with _InterruptGuard(objective, here) as guarded:
        while len(told) < n_trials:
            if total_trials is not None and counted_trials(study) >= total_trials:
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            try:
                study.optimize(
                    guarded,
                    n_trials=n_trials - len(told),
                    timeout=left,
                    callbacks=callbacks,
                    show_progress_bar=progress,
                    gc_after_trial=False,
                )
                return
            except ValueError as exc:
                # SQLite cannot lock rows, so two workers may both claim one enqueued warm-start
                # trial; the one that tells second gets this error. Its work is a duplicate:
                # drop it and run the trials this worker still owes.
                if "Cannot tell a COMPLETE trial" not in str(exc):
                    raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def fail_trials_of_dead_workers(study: optuna.Study) -> list[int]:
    """Mark FAIL the RUNNING trials of processes on this machine that no longer exist (a worker
    killed with ``kill -9``, an out-of-memory kill, a closed terminal), so a resumed study has no
    trial stuck RUNNING. Heartbeats do this for SQLite and PostgreSQL only after their grace period
    (90 s), and a journal file has none. Trials of other machines, or of live processes, are left
    alone. A trial is marked with its worker when its objective starts, so a process killed in the
    moment between Optuna creating a trial and starting it leaves an unmarked trial: heartbeats
    fail that one on SQLite and PostgreSQL; on a journal it stays RUNNING (it is never counted).
    Returns the trial numbers failed."""
    host = socket.gethostname()
    failed = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker_host, _, pid = str(trial.user_attrs.get(WORKER_ATTR, "")).rpartition(":")
        if worker_host != host or not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            study.tell(trial.number, state=TrialState.FAIL)
        except (ValueError, RuntimeError):  # finished meanwhile (another worker got there first)
            continue
        failed.append(trial.number)
    return failed


def _not_interrupt(record: logging.LogRecord) -> bool:
    """A logging filter: drop Optuna's "Trial N failed" traceback when the failure is the user's Ctrl-C."""
    return not (record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt))


class _InterruptGuard:
    """Ctrl-C during ``study.optimize``: stop at a safe point and record the interrupted trial as FAIL.

    A KeyboardInterrupt raised wherever the signal lands can hit Optuna while it writes to the
    storage (the trial then stays RUNNING for good, or the write fails with another error), or
    land in a finalizer, where Python drops it. So the first Ctrl-C is only noted; the objective
    sees the trial through ``_CheckedTrial``, which raises it at the trial's next call (suggest,
    report, user attribute) or when the next objective starts: inside the objective, where
    Optuna marks the trial FAIL. A second Ctrl-C interrupts at once. Should optimize end another
    way after a Ctrl-C, the run still ends as interrupted.
    """

    def __init__(self, objective: Callable[[optuna.Trial], Any], here: Machine | None = None) -> None:
        self.objective = objective
        self.stamps = {} if here is None else {MACHINE_ATTR: here.to_dict(), CODE_ATTR: code_version()}
        self.pending = False
        self.previous: Any = None
        self.installed = False
        self.logger = logging.getLogger("optuna.study._optimize")

    def check(self) -> None:
        if self.pending:
            raise KeyboardInterrupt

    def __call__(self, trial: optuna.Trial) -> Any:
        self.check()
        # A later run can tell whether this process died.
        trial.set_user_attr(WORKER_ATTR, f"{socket.gethostname()}:{os.getpid()}")
        for key, value in self.stamps.items():
            trial.set_user_attr(key, value)
        return self.objective(_CheckedTrial(trial, self))  # type: ignore[arg-type]

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True
        # os.write, not print: the handler may run while the main thread is printing to stderr.
        os.write(2, b"\nCtrl-C: stopping this trial at its next step (press Ctrl-C again to stop at once)\n")

    def __enter__(self) -> _InterruptGuard:
        self.logger.addFilter(_not_interrupt)
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._on_sigint)
            self.installed = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.installed:
            signal.signal(signal.SIGINT, signal.default_int_handler if self.previous is None else self.previous)
        self.logger.removeFilter(_not_interrupt)
        if self.pending and not isinstance(exc, KeyboardInterrupt):
            raise KeyboardInterrupt from None


class _CheckedTrial:
    """An Optuna trial whose every method first raises a Ctrl-C that ``_InterruptGuard`` noted."""

    def __init__(self, trial: optuna.Trial, guard: _InterruptGuard) -> None:
        self._trial = trial
        self._guard = guard

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._trial, name)
        if not callable(value):
            return value

        def checked(*args: Any, **kwargs: Any) -> Any:
            self._guard.check()
            return value(*args, **kwargs)

        return checked


def draft_kind(policy: SkipPolicy) -> str:
    """What kind of draft a policy makes: "exit" (a trained exit), "skip" (bypassed sublayers),
    "hybrid" (a skip draft with prompt lookup in front) or "lookup" (prompt lookup alone)."""
    if not policy.draft.use_skip_draft:
        return "lookup"
    if policy.exit is not None:
        return "exit"
    return "hybrid" if policy.draft.lookup_max_ngram else "skip"


def finalists(study: optuna.Study, objective: str, top_k: int) -> list[FrozenTrial]:
    """Trials worth confirming by real generation: the best predicted speedups (of the Pareto set)
    among trials the search may export (``layerskip.search.space.exportable``), then the best
    predicted trial of every other ``draft_kind``. The cheap score prices different drafts with
    timings taken at different moments, so a kind that predicts a little lower may well be faster;
    only measuring it beside the others tells."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    pool = study.best_trials if objective == "pareto" else complete
    pool = [t for t in pool if exportable(trial_policy(study, t))]
    ranked = sorted(pool, key=lambda t: t.user_attrs.get("predicted_speedup", 0.0), reverse=True)
    chosen = ranked[:top_k]
    kinds = {draft_kind(trial_policy(study, t)) for t in chosen}
    for trial in ranked[top_k:]:
        kind = draft_kind(trial_policy(study, trial))
        if kind not in kinds:
            kinds.add(kind)
            chosen.append(trial)
    return chosen


def record_confirmation(study: optuna.Study, trial: FrozenTrial, confirmation: Confirmation) -> None:
    # Finished trials are immutable in Optuna, so measured figures live on the study, keyed by trial number.
    study.set_user_attr(f"{CONFIRMED_PREFIX}{trial.number}", asdict(confirmation))


def confirmations(study: optuna.Study) -> dict[int, dict[str, Any]]:
    return {
        int(key.removeprefix(CONFIRMED_PREFIX)): value
        for key, value in study.user_attrs.items()
        if key.startswith(CONFIRMED_PREFIX)
    }


def confirmation_window(study: optuna.Study) -> dict[str, Any] | None:
    """The last confirmation window: its trials, settings, figures and decision (None before the first)."""
    window = study.user_attrs.get(WINDOW_ATTR)
    return window if isinstance(window, dict) else None


Measure = Callable[[Mapping[int, SkipPolicy]], Mapping[int, Confirmation]]


def confirm_finalists(
    study: optuna.Study, trials: list[FrozenTrial], measure: Measure, settings: dict[str, Any]
) -> tuple[dict[str, Any] | None, bool]:
    """Measure ``trials`` together in one window (``measure``: ``layerskip.search.confirmation.confirm_window``
    bound to the model, calibration and ``settings``), record every figure and which one is chosen.

    The last window's choice joins them when it is no longer a finalist: a resumed search measures
    its winner again beside the newcomers rather than comparing figures from two windows. A window
    of the same trials and ``settings`` as the last one is not measured again. Returns the window
    (None if nothing was ever measured) and whether it was measured now."""
    last = confirmation_window(study)
    by_number = {t.number: t for t in trials}
    if last is not None and last["decision"]["chosen"] not in by_number:
        for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if trial.number == last["decision"]["chosen"] and exportable(trial_policy(study, trial)):
                by_number[trial.number] = trial
    if not by_number:
        return last, False
    confirmed = confirmations(study)
    if (
        last is not None
        and sorted(last["trials"]) == sorted(by_number)
        and last.get("settings") == settings
        and all(number in confirmed for number in by_number)
    ):
        return last, False
    measured = measure({number: trial_policy(study, trial) for number, trial in by_number.items()})
    figures = {number: asdict(confirmation) for number, confirmation in measured.items()}
    for number, trial in by_number.items():
        record_confirmation(study, trial, measured[number])
    decision = decide(figures)
    assert decision is not None
    window = {
        "trials": list(by_number),
        "settings": settings,
        "decision": asdict(decision),
        "note": decision.describe(figures),
    }
    study.set_user_attr(WINDOW_ATTR, window)
    return window, True
