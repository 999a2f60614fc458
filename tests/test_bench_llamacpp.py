"""llama.cpp as a bench peer (``measure.llamacpp``): the one-line refusal where llama-cpp-python is
missing, its rows counted (never classed) against hf-ar, and, where llama-cpp-python is installed,
its runner on a tiny GGUF written here (a 2-layer Llama, random weights, a 32-token vocabulary)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from layerskip.cli.bench import main as bench_main
from layerskip.errors import LayerskipError
from layerskip.measure import llamacpp
from layerskip.measure.bench import PromptResult, summarise
from layerskip.measure.report import markdown_report

VOCAB = 32
EOS = 2


@pytest.fixture
def no_llama_cpp(monkeypatch):
    """Import of llama_cpp fails, as where llama-cpp-python is not installed."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", None)


def test_missing_package_is_one_line_naming_the_extra(no_llama_cpp, tmp_path, capsys):
    code = bench_main(["--model", "smollm2-135m", "--methods", "hf-ar,llama.cpp", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert 'pip install -e ".[llamacpp]"' in err
    assert not (tmp_path / "out" / "results.json").exists()  # refused before any model loaded


def test_missing_package_in_the_api(no_llama_cpp):
    with pytest.raises(LayerskipError, match=r"llama-cpp-python.*pip install -e \"\.\[llamacpp\]\""):
        llamacpp.require()


def test_gguf_needed_for_a_model_that_is_not_one(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp, "require", lambda: None)  # as if installed
    with pytest.raises(LayerskipError, match="pass --gguf PATH"):
        llamacpp.check_request(["hf-ar", "llama.cpp"], str(tmp_path), None, False, {})
    with pytest.raises(LayerskipError, match="runs llama.cpp greedily"):
        llamacpp.check_request(["llama.cpp"], "smollm2-135m", None, True, {})
    with pytest.raises(LayerskipError, match="add one to --methods"):
        llamacpp.check_request(["hf-ar"], "smollm2-135m", "x.gguf", False, {})
    with pytest.raises(LayerskipError, match="cannot read --gguf file"):
        llamacpp.check_request(["llama.cpp"], "smollm2-135m", str(tmp_path / "missing.gguf"), False, {})


def test_rows_are_counted_not_classed():
    """A llama.cpp row equal to hf-ar's counts as equal; its figures carry no rounding/defect classes,
    and the report says it was not compared token for token."""
    label = llamacpp.label("Q4_K_M")
    rows = [
        PromptResult("p1", "qa", "hf-ar", 8, 1.0, True),
        PromptResult("p2", "qa", "hf-ar", 8, 1.0, True),
        PromptResult("p1", "qa", "llama.cpp", 8, 0.5, True, computes_with=label),
        PromptResult("p2", "qa", "llama.cpp", 8, 0.5, False, computes_with=label),
    ]
    summary = summarise(rows)
    overall = summary["llama.cpp"]["overall"]
    assert overall["identical_fraction"] == 0.5
    assert overall["computes_with"] == label
    assert not {"n_identical", "n_rounding", "n_defect"} & set(overall)
    report = markdown_report({"methods": summary, "per_prompt": []})
    assert "1 of 2 equal, not classed" in report
    assert "Not compared token for token" in report


def write_tiny_gguf(path: Path) -> Path:
    """A 2-layer Llama GGUF with float32 random weights and a 32-token SentencePiece-style vocabulary."""
    gguf = pytest.importorskip("gguf")
    hidden, ffn, heads, layers = 16, 32, 2, 2
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"\u2581t{i}".encode() for i in range(VOCAB - 3)]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [1] * (VOCAB - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(EOS)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int, ones: bool = False) -> None:
        value = np.ones(shape, np.float32) if ones else rng.normal(0, 0.5, shape).astype(np.float32)
        writer.add_tensor(name, value)

    tensor("token_embd.weight", VOCAB, hidden)
    for block in range(layers):
        tensor(f"blk.{block}.attn_norm.weight", hidden, ones=True)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensor(f"blk.{block}.{name}.weight", hidden, hidden)
        tensor(f"blk.{block}.ffn_norm.weight", hidden, ones=True)
        tensor(f"blk.{block}.ffn_gate.weight", ffn, hidden)
        tensor(f"blk.{block}.ffn_up.weight", ffn, hidden)
        tensor(f"blk.{block}.ffn_down.weight", hidden, ffn)
    tensor("output_norm.weight", hidden, ones=True)
    tensor("output.weight", VOCAB, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    pytest.importorskip("llama_cpp")
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_runner_generates_greedily_from_token_ids(tiny_gguf):
    peer = llamacpp.GGUFPeer(tiny_gguf, context=64)
    plain = llamacpp.LlamaCppRunner(peer, threads=1, eos_token_ids=(), expected_vocab=VOCAB)
    lookup = llamacpp.LlamaCppRunner(peer, threads=1, eos_token_ids=(), lookup_tokens=4, expected_vocab=VOCAB)
    try:
        assert plain.quantisation == "ALL_F32"
        prompt = [1, 5, 6, 7, 5, 6]
        tokens, stats = plain(prompt, 12)
        assert stats is None and len(tokens) == 12 and all(0 <= t < VOCAB for t in tokens)
        assert plain(prompt, 12)[0] == tokens  # each call from an empty cache: the same greedy output
        assert len(lookup(prompt, 12)[0]) == 12
        # A stop at EOS keeps the EOS token, as HF generate does.
        stopping = llamacpp.LlamaCppRunner(peer, threads=1, eos_token_ids=(tokens[2],))
        try:
            assert stopping(prompt, 12)[0] == tokens[: tokens.index(tokens[2]) + 1]
        finally:
            stopping.close()
    finally:
        plain.close()
        lookup.close()


def test_runner_refuses_a_call_past_its_context(tiny_gguf):
    runner = llamacpp.LlamaCppRunner(llamacpp.GGUFPeer(tiny_gguf, context=16), 1, ())
    try:
        with pytest.raises(LayerskipError, match="do not fit llama.cpp's context of 16"):
            runner([1, 5, 6, 7], 12)
    finally:
        runner.close()


def test_runner_refuses_another_vocabulary(tiny_gguf):
    with pytest.raises(LayerskipError, match="32 tokens and the model 49,152"):
        llamacpp.LlamaCppRunner(llamacpp.GGUFPeer(tiny_gguf, 64), 1, (), expected_vocab=49152)
