"""Self-distilled exit adapters: training lowers held-out KL, resumes from its checkpoint, and the
CLI trains, writes usable policies and refuses bad input in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_bad_input, run_in_process, run_script
from tiny_models import save_checkpoint, tiny_model

from layerskip.distill import train as train_module
from layerskip.distill.corpus import Document, split_documents
from layerskip.distill.teacher import TeacherData, chunk_documents, collect
from layerskip.distill.train import Student, TrainSettings, evaluate, rank_rows, train_adapter
from layerskip.drafts.model.exit_adapter import ExitAdapter, ExitSpec
from layerskip.drafts.policy.skip_policy import SkipPolicy
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.errors import LayerskipError

LAYER = 1


def _teacher(model: torch.nn.Module, chunks: int, seed: int) -> TeacherData:
    """Teacher data over random token chunks (the teacher's law at every position is what is learnt)."""
    generator = torch.Generator().manual_seed(seed)
    pieces = [("tiny", torch.randint(0, 128, (32,), generator=generator).tolist()) for _ in range(chunks)]
    return collect(model, pieces, [LAYER], top_k=16, progress=False)


@pytest.fixture(scope="module")
def tiny_data() -> tuple[torch.nn.Module, TeacherData, TeacherData]:
    model = tiny_model("llama")
    torch.manual_seed(0)
    return model, _teacher(model, 48, seed=1), _teacher(model, 12, seed=2)


@pytest.mark.parametrize("kind", ["linear", "layer"])
def test_training_lowers_held_out_kl(tiny_data, kind: str) -> None:
    model, train, held_out = tiny_data
    rows = rank_rows(train, 128, 0)
    student = Student(model, LAYER, rows)
    adapter = ExitAdapter.fresh(model, ExitSpec(layer=LAYER, kind=kind, rank=16))
    before = evaluate(student, adapter.module if kind == "layer" else None, held_out)["all"]
    settings = TrainSettings(epochs=15, batch_chunks=8, learning_rate=1e-2 if kind == "linear" else 3e-3, hard_weight=0)
    flags = [p.requires_grad for p in model.parameters()]
    result = train_adapter(model, adapter, rows, train, held_out, settings, progress=False)
    assert [p.requires_grad for p in model.parameters()] == flags  # the model is restored as it was
    after = evaluate(student, adapter.module, held_out)["all"]
    assert after.kl < (0.9 if kind == "linear" else 0.97) * before.kl, (before, after)
    assert result.best_loss == pytest.approx(after.kl, rel=1e-4)


def test_resumed_training_continues_from_its_checkpoint(tiny_data, tmp_path: Path, monkeypatch) -> None:
    model, train, held_out = tiny_data
    rows = rank_rows(train, 128, 64)
    settings = TrainSettings(epochs=3, batch_chunks=8, evals_per_epoch=2, patience=100)
    whole = ExitAdapter.fresh(model, ExitSpec(layer=LAYER, rank=8))
    torch.manual_seed(0)
    whole.module.load_state_dict(ExitAdapter.fresh(model, ExitSpec(layer=LAYER, rank=8)).module.state_dict())
    start = {k: v.clone() for k, v in whole.module.state_dict().items()}
    full = train_adapter(model, whole, rows, train, held_out, settings, progress=False)

    interrupted = ExitAdapter.fresh(model, ExitSpec(layer=LAYER, rank=8))
    interrupted.module.load_state_dict(start)
    saves = []
    original = train_module.save_state

    def save_then_die(path: Path, state: dict) -> None:
        original(path, state)
        saves.append(state["step"])
        if len(saves) == 2:
            raise KeyboardInterrupt  # killed right after its second checkpoint

    monkeypatch.setattr(train_module, "save_state", save_then_die)
    checkpoint = tmp_path / "exit.pt"
    with pytest.raises(KeyboardInterrupt):
        train_adapter(model, interrupted, rows, train, held_out, settings, checkpoint, progress=False)
    monkeypatch.setattr(train_module, "save_state", original)
    resumed = ExitAdapter.fresh(model, ExitSpec(layer=LAYER, rank=8))
    resumed.module.load_state_dict(start)
    again = train_adapter(model, resumed, rows, train, held_out, settings, checkpoint, progress=False)
    assert again.steps == full.steps
    assert [e["step"] for e in again.evaluations] == [e["step"] for e in full.evaluations]  # none repeated
    for name, value in whole.module.state_dict().items():
        torch.testing.assert_close(resumed.module.state_dict()[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("damage", ["truncated", "another-shape"])
def test_a_damaged_checkpoint_is_warned_about_and_trained_again(tiny_data, tmp_path: Path, capsys, damage) -> None:
    """A kill -9 can leave a checkpoint cut short; one from another adapter does not fit either."""
    model, train, held_out = tiny_data
    rows = rank_rows(train, 128, 64)
    settings = TrainSettings(epochs=1, batch_chunks=8, evals_per_epoch=2, patience=100)
    start = ExitAdapter.fresh(model, ExitSpec(layer=LAYER, rank=8)).module.state_dict()

    def adapter() -> ExitAdapter:
        fresh = ExitAdapter.fresh(model, ExitSpec(layer=LAYER, rank=8))
        fresh.module.load_state_dict(start)
        return fresh

    checkpoint = tmp_path / "exit-L1-linear.pt"
    whole = adapter()
    full = train_adapter(model, whole, rows, train, held_out, settings, checkpoint, progress=False)
    if damage == "truncated":
        checkpoint.write_bytes(checkpoint.read_bytes()[:1000])
    else:
        state = torch.load(checkpoint, weights_only=True)
        torch.save({**state, "module": {"weight": torch.zeros(3)}, "best_state": None}, checkpoint)
    capsys.readouterr()

    again = adapter()
    result = train_adapter(model, again, rows, train, held_out, settings, checkpoint, progress=False)

    assert f"warning: checkpoint {checkpoint} is unreadable" in capsys.readouterr().err
    assert result.steps == full.steps  # trained again from the start, not resumed
    for name, value in whole.module.state_dict().items():
        torch.testing.assert_close(again.module.state_dict()[name], value, rtol=1e-5, atol=1e-6)
    assert torch.load(checkpoint, weights_only=True)["finished"]  # replaced by a whole checkpoint


class _Planted:
    """Unpickling this creates ``marker``: a stand-in for the code a planted checkpoint would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


def test_a_planted_pickle_under_out_never_runs(tmp_path: Path, capsys) -> None:
    """Whoever can write into --out/checkpoints/ must not get code run by the next train-exit there:
    the teacher cache and the adapter checkpoint are read as tensors only, a pickle of anything else
    is refused with a warning, and the run goes on (collecting and training again)."""
    from layerskip.cli.train_exit import main

    model_dir = _tiny_checkpoint(tmp_path)
    data = tmp_path / "text.jsonl"
    rows = [{"category": "prose", "turns": [" ".join(f"w{(i * 5 + j) % 62}" for j in range(60))]} for i in range(8)]
    data.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    out = tmp_path / "exits"
    argv = [
        "--model", str(model_dir), "--data", str(data), "--layers", "1", "--positions", "200", "--chunk-tokens",
        "16", "--draft-vocab", "0", "--epochs", "1", "--continuations", "0", "--out", str(out), "--quiet",
        "--precision", "model", "--no-cost",
    ]  # fmt: skip
    assert main(argv) == 0
    planted = sorted((out / "checkpoints").glob("*.pt"))
    assert [p.name.split("-")[0] for p in planted] == ["exit", "teacher"]
    markers = []
    for path in planted:
        markers.append(tmp_path / f"ran-{path.stem}")
        torch.save({"data": _Planted(markers[-1]), "module": _Planted(markers[-1])}, path)
    capsys.readouterr()

    assert main(argv) == 0

    assert not [m.name for m in markers if m.exists()], "a planted checkpoint's code ran"
    err = capsys.readouterr().err
    for path in planted:
        assert f"{path} is unreadable (it holds Python objects, not only tensors; refused unread" in err, err
    assert main(argv) == 0  # what the run wrote in their place is read back, tensors only
    assert "warning" not in capsys.readouterr().err


def test_corpus_split_holds_out_whole_domains() -> None:
    documents = [Document(domain, f"{domain} {i}") for domain in ("a", "b", "code") for i in range(10)]
    split = split_documents(documents, ["code"], validation_fraction=0.2)
    assert {d.domain for d in split.held_out} == {"code"}
    assert {d.domain for d in split.validation} == {"a", "b"} and len(split.validation) == 4
    assert not set(map(id, split.train)) & set(map(id, split.validation))
    with pytest.raises(LayerskipError, match="held-out domain"):
        split_documents(documents, ["nope"])


def test_chunks_keep_small_domains() -> None:
    from tiny_models import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    documents = [Document("big", " ".join(f"w{i % 60}" for i in range(400))), Document("small", "hello world " * 10)]
    chunks = chunk_documents(tokenizer, documents, chunk_tokens=16, max_positions=64)
    assert {domain for domain, _ in chunks} == {"big", "small"}
    assert all(len(ids) == 16 for _, ids in chunks)


def _tiny_checkpoint(root: Path) -> Path:
    path = root / "tiny-llama"
    save_checkpoint(tiny_model("llama", vocab_size=66), path)
    return path


def test_cli_trains_writes_policies_and_resumes(tmp_path: Path, capsys) -> None:
    model_dir = _tiny_checkpoint(tmp_path)
    data = tmp_path / "text.jsonl"
    words = [" ".join(f"w{(i * 7 + j) % 62}" for j in range(90)) for i in range(24)]
    rows = [{"category": "prose" if i % 3 else "other", "turns": [w]} for i, w in enumerate(words)]
    data.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    out = tmp_path / "exits"
    args = [
        "--model", str(model_dir), "--data", str(data), "--holdout", "other", "--layers", "0,1",
        "--kinds", "linear,layer", "--positions", "1200", "--chunk-tokens", "16", "--draft-vocab", "0",
        "--epochs", "2", "--out", str(out), "--quiet", "--precision", "model", "--continuations", "4",
        "--continuation-tokens", "12",
    ]  # fmt: skip
    result = run_script("train_exit.py", *args)
    assert result.returncode == 0, result.stderr
    assert "held-out agreement" in result.stderr
    report = json.loads((out / "report.json").read_text())
    assert {(e["layer"], e["kind"]) for e in report["exits"]} == {
        (0, "linear"),
        (0, "layer"),
        (1, "linear"),
        (1, "layer"),
    }
    assert report["domains"]["held_out"] == ["other", "other:own"]  # its text, and the model continuing it
    assert (out / "agreement.png").stat().st_size > 0 and (out / "report.csv").is_file()
    policy = SkipPolicy.load(out / "exit-L1-layer.json")
    from layerskip.hf.models import load_model
    from layerskip.machine import this_machine

    assert policy.tuned_machine == this_machine("cpu")  # its precision and measured cost are this machine's

    model = load_model(str(model_dir)).model
    tokens, _ = Decoder.for_policy(model, policy).decode([2, 3, 4, 5], DecodeSettings(max_new_tokens=8))
    assert len(tokens) == 8
    # Re-running the same command reuses the teacher's data and every finished checkpoint.
    from layerskip.cli.train_exit import main

    again = run_in_process(main, capsys, *args)
    assert again.returncode == 0, again.stderr
    assert "teacher positions" not in again.stderr
    assert json.loads((out / "report.json").read_text())["exits"][0]["steps"] == report["exits"][0]["steps"]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--layers", "1", "--kinds", "mlp"], "unknown adapter kind"),
        (["--layers", "-1"], "--layers"),
        (["--layers", "1", "--positions", "0"], "--positions must be > 0"),
        (["--layers", "1", "--seed", "-3"], "--seed"),
        (["--layers", "1", "--data", "/no/such/file.jsonl"], "not found"),
        (["--layers", "1", "--reuse-kv", "--precision", "int4"], "--reuse-kv"),
    ],
)
def test_cli_bad_input_is_one_line_before_loading(tmp_path: Path, capsys, args: list[str], fragment: str) -> None:
    from layerskip.cli.train_exit import main

    result = run_in_process(main, capsys, "--model", "/no/such/model", "--out", str(tmp_path / "o"), *args)
    assert_bad_input(result, fragment)
    assert not (tmp_path / "o").exists()


def test_cli_out_where_no_directory_can_be_is_one_line_before_loading(tmp_path: Path, capsys) -> None:
    from layerskip.cli.train_exit import main

    (tmp_path / "file").write_text("mine")
    cases = [
        (["--out", str(tmp_path / "file" / "exits")], "is a file, not a directory"),
        (["--out", str(tmp_path / "file")], "--out"),
        (["--out", str(tmp_path / "exits"), "--max-draft-tokens", "100"], "--max-draft-tokens must be at most 64"),
    ]
    if Path("/proc/self").is_dir():  # procfs: its permission bits let root write, yet nothing can be made there
        cases.append((["--out", "/proc/layerskip-exits"], "directory /proc is not writable"))
    for extra, fragment in cases:
        assert_bad_input(run_in_process(main, capsys, "--model", "/no/such/model", "--layers", "1", *extra), fragment)
    assert (tmp_path / "file").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_search_chooses_among_trained_exits(tmp_path: Path, capsys) -> None:
    """A study offered trained exits (--exit-adapters) scores them with their adapters and exports one."""
    model_dir = _tiny_checkpoint(tmp_path)
    data = tmp_path / "text.jsonl"
    rows = [{"category": "prose", "turns": [" ".join(f"w{(i * 5 + j) % 62}" for j in range(60))]} for i in range(12)]
    data.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    exits = tmp_path / "exits"
    from layerskip.cli.train_exit import main as train_main
    from layerskip.search.cli import main as search_main

    trained = run_in_process(
        train_main, capsys, "--model", str(model_dir), "--data", str(data), "--layers", "1,2", "--positions", "400",
        "--chunk-tokens", "16", "--draft-vocab", "0", "--epochs", "1", "--continuations", "0", "--out", str(exits),
        "--quiet", "--precision", "model",
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    # Nothing is held out: said so, not shown as an agreement of 0.000 -> 0.000.
    assert "nothing held out" in trained.stderr and "held-out agreement" not in trained.stderr
    out = tmp_path / "policy.json"
    result = run_in_process(
        search_main, capsys, "--model", str(model_dir), "--prompts", str(data), "--n-prompts", "2", "--n-trials", "5",
        "--reference-tokens", "8", "--max-new-tokens", "8", "--confirm-top", "1", "--exit-adapters", str(exits),
        "--exit-thresholds", "0.2,0.6", "--storage", f"sqlite:///{tmp_path / 'study.db'}", "--out", str(out),
        "--no-progress", "--no-chat",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    import optuna

    study = optuna.load_study(study_name="tiny-llama-speedup", storage=f"sqlite:///{tmp_path / 'study.db'}")
    chosen = {t.params.get("exit") for t in study.trials}
    assert chosen & {"L1-linear", "L2-linear"}, chosen  # exit drafts were tried
    for trial in study.trials:
        if trial.params.get("exit", "none") != "none" and trial.state.name == "COMPLETE":
            assert trial.user_attrs["policy"]["exit"]["layer"] in (1, 2)
    policy = SkipPolicy.load(out)
    if policy.exit is not None:  # an exported exit policy finds its adapter from where it was written
        assert policy.exit_adapter_path().is_file()


def test_projected_speedup_formula() -> None:
    from layerskip.drafts.rules.costs import expected_tokens
    from layerskip.measure.frontier import projected_speedup

    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    # A free draft that is always right, verified at the cost of one step: k + 1 tokens per step at k = 8.
    assert projected_speedup(1.0, 0.0, lambda n: 1.0) == (9.0, 8)
    # A draft as costly as a step that is never right never pays.
    best, _ = projected_speedup(0.0, 1.0, lambda n: 1.0)
    assert best < 1.0
