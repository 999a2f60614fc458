"""Distributed search on a real PostgreSQL server: two workers, one study, nothing lost or duplicated;
and a worker killed with ``kill -9`` mid-trial, resumed by the same command (as for SQLite and journal
files in tests/test_search_cli.py).

Needs ``LAYERSKIP_TEST_POSTGRES_URL=postgresql://user:password@host:port/database`` (``.ci/run``
starts a throwaway server and sets it); without it, or when no server answers there, the test
is skipped and says why.
"""

from __future__ import annotations

import functools
import os
import socket
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from search_fixtures import (
    counted,
    kill_9_then_resume,
    load_storage,
    save_tiny_llama,
    search_in_process,
    start_search,
    trial_numbers,
    wait_all,
)

from layerskip.drafts.policy.skip_policy import SkipPolicy

URL_ENV = "LAYERSKIP_TEST_POSTGRES_URL"


@pytest.fixture(scope="module")
def postgres_url() -> str:
    url = os.environ.get(URL_ENV)
    if not url:
        pytest.skip(f"{URL_ENV} is not set (.ci/run starts a throwaway PostgreSQL server and sets it)")
    parts = urlsplit(url)
    if not parts.scheme.startswith("postgresql"):
        pytest.fail(f"{URL_ENV} must be a postgresql:// URL, got scheme '{parts.scheme}'")
    host, port = parts.hostname or "127.0.0.1", parts.port or 5432
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as exc:
        pytest.skip(f"no PostgreSQL server answers at {host}:{port} ({URL_ENV}): {exc}")
    return url


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


def test_two_workers_on_postgresql(postgres_url, tiny_llama, tmp_path):
    import optuna

    name = f"layerskip-test-{uuid.uuid4().hex[:12]}"  # a fresh study even on a reused database
    workers = [
        start_search(
            tiny_llama,
            "--storage",
            postgres_url,
            "--study-name",
            name,
            "--n-trials",
            "4",
            "--worker",
            str(w),
            "--out",
            str(tmp_path / f"p{w}.json"),
        )
        for w in (0, 1)
    ]
    storage = None
    try:
        for code, out, err in wait_all(workers):
            assert code == 0, f"exit {code}\nstdout:\n{out}\nstderr:\n{err}"
        storage = load_storage(postgres_url)
        study = optuna.load_study(study_name=name, storage=storage)
        assert counted(study) == list(range(8)), [t.state for t in study.get_trials(deepcopy=False)]
        assert trial_numbers(study) == list(range(8)), [
            (t.number, t.state.name, t.user_attrs.get("worker"), t.system_attrs)
            for t in study.get_trials(deepcopy=False)
        ]
        for w in (0, 1):
            policy = SkipPolicy.load(tmp_path / f"p{w}.json")
            assert policy.model.fingerprint == study.user_attrs["model_fingerprint"]
            assert policy.provenance["study"] == name
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
        try:
            optuna.delete_study(study_name=name, storage=storage or load_storage(postgres_url))
        except Exception:  # noqa: BLE001 - the study may never have been created; cleanup only
            pass


def _delete_study(url: str, name: str) -> None:
    import optuna

    try:
        optuna.delete_study(study_name=name, storage=load_storage(url))
    except Exception:  # noqa: BLE001 - the study may never have been created; cleanup only
        pass


def test_kill_9_then_the_same_command_resumes_on_postgresql(postgres_url, tiny_llama, tmp_path, capsys):
    """Killed in the middle of a trial: nothing completed is lost, the killed worker's trial is marked FAIL
    at once by the resume (host:pid of a process that no longer runs; no waiting for the heartbeat grace
    period), no trial stays RUNNING, and --out is whole after the resume."""
    name = f"layerskip-kill-{uuid.uuid4().hex[:12]}"  # a fresh study even on a reused database
    try:
        kill_9_then_resume(
            functools.partial(search_in_process, capsys), tiny_llama, postgres_url, name, tmp_path / "p.json"
        )
    finally:
        _delete_study(postgres_url, name)


def test_run_study_workers_share_a_postgresql_study(postgres_url, tiny_llama, tmp_path):
    """``layerskip.search.run_study`` on the same URL, one worker after the other: one study, the
    second worker's trials numbered after the first's, its policy from the whole study."""
    from layerskip.search import run_study

    name = f"layerskip-api-{uuid.uuid4().hex[:12]}"
    fast = dict(reference_tokens=8, max_new_tokens=8, confirm_top=1, draft_tokens=[2, 3], no_progress=True)
    try:
        first = run_study(tiny_llama, "builtin", n_prompts=2, storage=postgres_url, study_name=name, worker=0,
                          n_trials=3, **fast)  # fmt: skip
        assert first.trials == 3
        second = run_study(tiny_llama, "builtin", n_prompts=2, storage=postgres_url, study_name=name, worker=1,
                           n_trials=3, **fast)  # fmt: skip
        assert second.trials == 6 and first.trials == 6  # counted in the study, now
        assert trial_numbers(second.study) == list(range(6))
        assert second.policy.provenance["study"] == name
    finally:
        _delete_study(postgres_url, name)
