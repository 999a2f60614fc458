"""A model by hub id (``org/name``), with no network: from a hub cache laid out as the hub client lays it out.

The cache is written here (``write_hub_cache``) and checked against the client's own reading of
it (``try_to_load_from_cache``, ``scan_cache_dir``), so the loader is tested against the layout
a real download leaves, not against our idea of it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from cli_helpers import assert_bad_input, run_script
from huggingface_hub import constants
from huggingface_hub import errors as hub_errors
from huggingface_hub.utils import _http as hub_http
from search_fixtures import generate_in_process
from tiny_models import save_checkpoint, tiny_model

from layerskip.errors import LayerskipError
from layerskip.hf.models import hub_error, is_hub_id, load_model

REPO_ID = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_cache(hub_cache: Path, repo_id: str, checkpoint: Path, commit: str = COMMIT) -> Path:
    """Lay a ``save_pretrained`` directory out as the hub client caches a download of ``repo_id``:
    ``models--org--name/blobs/<hash>``, ``snapshots/<commit>/<file>`` linking to its blob, and
    ``refs/main`` naming the commit. Returns the snapshot directory."""
    repo = hub_cache / constants.REPO_ID_SEPARATOR.join(["models", *repo_id.split("/")])
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(checkpoint.iterdir()):
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        (repo / "blobs" / digest).write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", digest))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("checkpoint") / "tiny-llama"
    save_checkpoint(tiny_model("llama"), directory)
    return directory


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, checkpoint: Path) -> Path:
    """An ``HF_HOME`` whose hub cache holds ``REPO_ID`` (and nothing else)."""
    home = tmp_path_factory.mktemp("hf-home")
    write_hub_cache(home / "hub", REPO_ID, checkpoint)
    return home


@pytest.fixture
def hub_cache(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process reads ``hf_home``'s hub cache, offline: what HF_HOME and HF_HUB_OFFLINE=1 set
    at start-up (the hub client reads both when imported, so they are patched where it keeps them)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hf_home / "hub"


def test_the_cache_is_laid_out_as_the_hub_client_expects(hf_home: Path, checkpoint: Path) -> None:
    cache = hf_home / "hub"
    found = huggingface_hub.try_to_load_from_cache(REPO_ID, "config.json", cache_dir=cache)
    assert found == str(cache / f"models--tiny-org--tiny-llama/snapshots/{COMMIT}/config.json")
    info = huggingface_hub.scan_cache_dir(cache)
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    (revision,) = repo.revisions
    assert (repo.repo_id, repo.repo_type, revision.commit_hash, revision.refs) == (REPO_ID, "model", COMMIT, {"main"})
    assert {f.file_name for f in revision.files} == {p.name for p in checkpoint.iterdir()}


def test_hub_id_shapes() -> None:
    assert is_hub_id("meta-llama/Llama-3.2-1B") and is_hub_id("gpt2")
    assert not is_hub_id("/abs/path/model") and not is_hub_id("a/b/c") and not is_hub_id("model.gguf/")


def test_load_model_by_hub_id_offline(hub_cache: Path, checkpoint: Path) -> None:
    loaded = load_model(REPO_ID)
    assert loaded.name == REPO_ID and loaded.model.layerskip_name == REPO_ID
    assert loaded.instruct is False  # no chat template
    local = load_model(str(checkpoint)).model
    ids = torch.tensor([[3, 5, 7, 64, 65]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, local(ids).logits)
    assert loaded.tokenizer("hello world")["input_ids"] == [64, 65]


def test_an_id_missing_from_the_cache_offline(hub_cache: Path) -> None:
    with pytest.raises(LayerskipError) as caught:
        load_model("tiny-org/not-cached")
    message = str(caught.value)
    assert "unknown model 'tiny-org/not-cached'" in message and "HF_HUB_OFFLINE=0" in message
    assert str(hub_cache) in message and "\n" not in message


def test_a_cache_holding_only_the_config(hub_cache: Path, checkpoint: Path, tmp_path: Path) -> None:
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_bytes((checkpoint / "config.json").read_bytes())
    write_hub_cache(Path(hub_cache), "tiny-org/partial", partial, commit="f" * 40)
    with pytest.raises(LayerskipError, match=r"cannot load model 'tiny-org/partial' from the hub cache"):
        load_model("tiny-org/partial")


def test_unreachable_hub_online(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Online with no network (a closed local port as the hub): an uncached id fails in one line
    saying the hub cannot be reached (not that the model is unknown), with the client's retry
    chatter hidden; a cached id still loads from the cache."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    closed = "http://127.0.0.1:9"
    monkeypatch.setattr(constants, "ENDPOINT", closed)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", closed + "/{repo_id}/resolve/{revision}/{filename}")
    # The client retries an uncached file for ~20 s (1, 2, 4, 8, 8 s): skip the waits.
    monkeypatch.setattr(hub_http, "time", SimpleNamespace(sleep=lambda seconds: None), raising=False)
    capfd.readouterr()
    with pytest.raises(LayerskipError, match=r"the hub cannot be reached \(.+\) and it is not in the hub cache"):
        load_model("tiny-org/not-cached")
    assert "Retrying" not in capfd.readouterr().err
    assert load_model(REPO_ID).name == REPO_ID


def _http_error(cls: type, status: int) -> Exception:
    response = SimpleNamespace(headers={}, request=None, status_code=status)
    return cls(f"{status} Client Error", response=response)


@pytest.mark.parametrize(
    ("error", "offline", "expected"),
    [
        (hub_errors.LocalEntryNotFoundError("not cached"), True, "the hub is off (HF_HUB_OFFLINE=1)"),
        (hub_errors.LocalEntryNotFoundError("no connection"), False, "the hub cannot be reached"),
        (_http_error(hub_errors.GatedRepoError, 403), False, "is gated on the hub"),
        (_http_error(hub_errors.RepositoryNotFoundError, 404), False, "the hub has no such model, or it is private"),
        (_http_error(hub_errors.RemoteEntryNotFoundError, 404), False, "has no config.json"),
        (_http_error(hub_errors.HfHubHTTPError, 500), False, "the hub refused"),
    ],
)
def test_each_hub_failure_gets_its_own_line(error: Exception, offline: bool, expected: str) -> None:
    message = str(hub_error("org/name", error, "/cache/hub", offline))
    assert expected in message and "\n" not in message
    assert "pass a local directory" in message


def test_generate_script_by_hub_id(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's "done when": scripts/generate.py --model org/name works offline from HF_HOME's cache."""
    monkeypatch.setenv("HF_HOME", str(hf_home))  # run_script passes this process's environment on
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = run_script("generate.py", "--model", REPO_ID, "--prompt", "hi", "--max-new-tokens", "4", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["model"] == REPO_ID and report["new_tokens"] == 4


def test_generate_refuses_an_unknown_id_in_one_line(hub_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same ``main`` and one-line error path as the script (in this process: no interpreter start-up)."""
    refused = generate_in_process(capsys, "--model", "tiny-org/unknown", "--prompt", "hi")
    assert_bad_input(refused, "unknown model 'tiny-org/unknown'", "HF_HUB_OFFLINE=0", str(hub_cache))


@pytest.mark.parametrize("damage", ["truncated-weights", "no-tokenizer"])
def test_a_damaged_snapshot_in_the_hub_cache(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    """An interrupted download leaves a short blob; a repository without tokenizer files leaves none:
    one line naming the file in the snapshot and how to get it whole."""
    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint, damaged)
    if damage == "truncated-weights":
        weights = damaged / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-4096])
    else:
        (damaged / "tokenizer.json").unlink()
        (damaged / "tokenizer_config.json").unlink()
    snapshot = write_hub_cache(tmp_path / "hub", "tiny-org/damaged", damaged)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    result = generate_in_process(capsys, "--model", "tiny-org/damaged", "--prompt", "hi")
    if damage == "truncated-weights":
        expected = (f"{snapshot / 'model.safetensors'} is truncated or damaged", "hf download tiny-org/damaged")
    else:
        expected = (f"missing from {snapshot}", "tokenizer.json and tokenizer_config.json", "HF_HUB_OFFLINE=0")
    assert_bad_input(result, *expected)


def test_local_models_and_prompt_files_reach_for_no_network(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI no longer forces offline mode, so nothing local may reach for a network while online:
    not a local model, not a prompt file (datasets would ping its download counter)."""
    import socket

    import datasets

    from layerskip.data import load_prompts

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", True)
    lookups: list[str] = []

    def no_network(host, *args, **kwargs):
        lookups.append(str(host))
        raise OSError("no network in this test")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    prompts = tmp_path / "prompts.csv"
    prompts.write_text("text,category\nhello world,qa\n")
    assert [p.text for p in load_prompts(str(prompts))] == ["hello world"]
    assert datasets.config.HF_UPDATE_DOWNLOAD_COUNTS is True  # restored
    assert load_model(str(checkpoint)).name == "tiny-llama"
    assert lookups == []
