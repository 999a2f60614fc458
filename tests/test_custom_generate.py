"""``model.generate(custom_generate=...)``: our engine behind HF's own API.

Every output is compared with plain ``model.generate`` on the same arguments; every argument we
cannot honour exactly must fail in one line that names it.
"""

from __future__ import annotations

import threading

import pytest
import torch
from oracles import is_bypassed
from test_sampling import E2E_SEEDS, E2E_TV_BOUND, E2E_VOCAB, _e2e_model, _exact_laws, tv
from tiny_models import ARCHS, random_prompt, tiny_model, tiny_tokenizer
from transformers import RepetitionPenaltyLogitsProcessor

import layerskip
from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.engine import step_kinds as kinds_module
from layerskip.errors import LayerskipError
from layerskip.hf import adapters
from layerskip.integration.decoders import CACHE_ATTRIBUTE, MAX_DECODERS

PATH = layerskip.custom_generate_path()
POLICY = SkipPolicy.skip_layers([1, 2], draft=DraftSettings(max_draft_tokens=3))
HYBRID = SkipPolicy(skip_mlp=(2,), draft=DraftSettings(lookup_max_ngram=2, lookup_min_ngram=1))
NEW = 20


def _ids(length: int = 8) -> torch.Tensor:
    return torch.tensor([random_prompt(length=length)])


def _ours(model, ids=None, policy=POLICY, **kwargs):
    if ids is not None:
        kwargs["input_ids"] = ids
    return model.generate(custom_generate=PATH, trust_remote_code=True, skip_policy=policy, **kwargs)


def _both(model, ids, **kwargs):
    """(plain generate, ours) on the same arguments."""
    return model.generate(ids, **kwargs), _ours(model, ids, **kwargs)


# -- greedy equals plain generate ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_generate_on_every_architecture(arch: str) -> None:
    model = tiny_model(arch)
    plain, ours = _both(model, _ids(), max_new_tokens=NEW, do_sample=False)
    assert ours.tolist() == plain.tolist()
    assert not is_bypassed(model)


def test_callable_form_and_hybrid_policy() -> None:
    model = tiny_model("llama")
    ids = _ids()
    plain = model.generate(ids, max_new_tokens=NEW)
    ours = model.generate(
        ids, custom_generate=layerskip.self_speculative_generate, skip_policy=HYBRID, max_new_tokens=NEW
    )
    assert ours.tolist() == plain.tolist()


def test_policy_file_and_on_the_fly(tmp_path) -> None:
    model = tiny_model("qwen2")
    ids = _ids()
    plain = model.generate(ids, max_new_tokens=NEW)
    path = POLICY.save(tmp_path / "p.json")
    for spec in (str(path), path, "on-the-fly", f"on-the-fly:{path}"):
        out = _ours(model, ids, policy=spec, max_new_tokens=NEW, return_dict_in_generate=True)
        assert out.sequences.tolist() == plain.tolist(), spec
    assert isinstance(out.skip_sets, dict) and out.skip_sets  # on-the-fly reports the sets it drafted with


def test_plain_is_the_engine_without_a_draft() -> None:
    """``skip_policy="plain"``, the command line's word, was looked for as a file."""
    model = tiny_model("llama")
    ids = _ids()
    out = _ours(model, ids, policy="plain", max_new_tokens=NEW, return_dict_in_generate=True)
    assert out.sequences.tolist() == model.generate(ids, max_new_tokens=NEW).tolist()
    assert out.stats.drafted == 0


def test_prepared_decoder_is_reused() -> None:
    model = tiny_model("llama")
    for _ in range(2):
        _ours(model, _ids(), max_new_tokens=4)
    decoders = model.__dict__[CACHE_ATTRIBUTE]
    assert len(decoders) == 1
    _ours(model, _ids(), policy=HYBRID, max_new_tokens=4)
    assert len(decoders) == 2
    for depth in range(1, 4):  # a sweep over new policies keeps at most MAX_DECODERS drafts
        _ours(model, _ids(), policy=SkipPolicy.early_exit(4, depth), max_new_tokens=2)
    assert len(decoders) == MAX_DECODERS and list(decoders.values())[-1].draft.policy == SkipPolicy.early_exit(4, 3)


# -- generate's arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_length=20),
        dict(max_new_tokens=1),
        dict(max_new_tokens=NEW, repetition_penalty=1.5),
        dict(max_new_tokens=NEW, no_repeat_ngram_size=2),
        dict(max_new_tokens=NEW, bad_words_ids=[[115], [80]]),
        dict(max_new_tokens=NEW, suppress_tokens=[115]),
        dict(max_new_tokens=NEW, prefix_allowed_tokens_fn=lambda batch, ids: list(range(0, 128, 3))),
        dict(max_new_tokens=NEW, max_time=0.0),
    ],
    ids=[
        "max_length",
        "one-token",
        "repetition_penalty",
        "no_repeat_ngram",
        "bad_words",
        "suppress",
        "prefix_fn",
        "max_time",
    ],
)
def test_length_and_processor_arguments_match_generate(kwargs: dict) -> None:
    model = tiny_model("llama")
    plain, ours = _both(model, _ids(), **kwargs)
    assert ours.tolist() == plain.tolist()


def test_eos_ids_min_new_tokens_and_pad() -> None:
    model = tiny_model("llama")
    ids = _ids()
    reference = model.generate(ids, max_new_tokens=NEW)[0, ids.shape[1] :].tolist()
    first, second = reference[6], reference[3]
    for kwargs in (
        dict(eos_token_id=first),
        dict(eos_token_id=[first, second], pad_token_id=0),
        dict(eos_token_id=[first, second], min_new_tokens=5),
    ):
        plain, ours = _both(model, ids, max_new_tokens=NEW, **kwargs)
        assert ours.tolist() == plain.tolist(), kwargs
        assert plain.shape[1] < ids.shape[1] + NEW  # it did stop early


def test_generation_config_and_user_processor_and_criteria() -> None:
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria

    class Ban(LogitsProcessor):
        """Bans the token that followed the last one last time (depends on the history)."""

        def __call__(self, input_ids, scores):
            return scores.index_fill(1, (input_ids[:, -1] * 7) % 128, -float("inf"))

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 19, dtype=torch.bool)

    model = tiny_model("llama")
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False)
    plain, ours = _both(
        model,
        _ids(),
        generation_config=config,
        logits_processor=LogitsProcessorList([Ban()]),
        stopping_criteria=[StopAfter()],
    )
    assert ours.tolist() == plain.tolist()
    assert plain.shape[1] == 19


def test_stopping_criteria_that_answer_a_bool_or_read_the_scores() -> None:
    """A criterion may answer a Python bool (plain generate accepts it), and it gets the scores plain
    generate gives it: every token's processed scores so far with output_scores, else None."""
    from transformers import StoppingCriteria

    class StopAtLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids.shape[1] >= 17  # a Python bool

    class StopOnScores(StoppingCriteria):
        """Stops when the scores' best token is ``target``; notes what it was given at each call."""

        def __init__(self, target: int) -> None:
            self.target, self.seen = target, []

        def __call__(self, input_ids, scores, **kwargs):
            if scores is None:
                self.seen.append(None)
                return False
            self.seen.append((input_ids.shape[1], len(scores), [row.clone() for row in scores]))
            return bool(scores[-1][0].argmax() == self.target)

    model = tiny_model("llama")
    ids = _ids()
    plain, ours = _both(model, ids, max_new_tokens=NEW, stopping_criteria=[StopAtLength()])
    assert ours.tolist() == plain.tolist() and plain.shape[1] == 17

    reference = model.generate(ids, max_new_tokens=NEW)[0, ids.shape[1] :].tolist()
    target = reference[7]
    first = reference.index(target)
    dicts = dict(max_new_tokens=NEW, return_dict_in_generate=True, output_scores=True)
    plain_stop, our_stop = StopOnScores(target), StopOnScores(target)
    plain = model.generate(ids, stopping_criteria=[plain_stop], **dicts)
    ours = _ours(model, ids, stopping_criteria=[our_stop], **dicts)
    assert ours.sequences.tolist() == plain.sequences.tolist()
    assert plain.sequences.shape[1] == ids.shape[1] + first + 1  # it stopped on the scores
    assert [(n, count) for n, count, _ in our_stop.seen] == [(n, count) for n, count, _ in plain_stop.seen]
    assert all(n - ids.shape[1] == count for n, count, _ in our_stop.seen)  # one row per token so far
    for (_, _, mine), (_, _, theirs) in zip(our_stop.seen, plain_stop.seen):
        for row, expected in zip(mine, theirs):
            torch.testing.assert_close(row, expected, rtol=1e-4, atol=1e-4)

    plain_stop, our_stop = StopOnScores(target), StopOnScores(target)  # no output_scores: None, as plain generate
    model.generate(ids, max_new_tokens=4, stopping_criteria=[plain_stop])
    _ours(model, ids, max_new_tokens=4, stopping_criteria=[our_stop])
    assert our_stop.seen == plain_stop.seen == [None] * 4


def test_attention_mask_and_left_padding() -> None:
    model = tiny_model("llama")
    ids = _ids()
    plain, ours = _both(model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW)
    assert ours.tolist() == plain.tolist()
    padded = torch.cat([torch.zeros(1, 3, dtype=ids.dtype), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=ids.dtype), torch.ones_like(ids)], dim=1)
    out = _ours(model, padded, attention_mask=mask, max_new_tokens=NEW)
    assert out[0, :3].tolist() == [0, 0, 0] and out[0, 3:].tolist() == plain[0].tolist()


def test_return_dict_in_generate_has_sequences_and_stats() -> None:
    model = tiny_model("llama")
    ids = _ids()
    plain = model.generate(ids, max_new_tokens=NEW, return_dict_in_generate=True)
    ours = _ours(model, ids, max_new_tokens=NEW, return_dict_in_generate=True)
    assert ours.sequences.tolist() == plain.sequences.tolist()
    assert ours.stats.new_tokens == NEW and ours.stats.drafted > 0
    assert 0 < ours.acceptance_rate <= 1 and ours.mean_accepted > 1
    assert ours.skip_sets == {}  # a fixed policy: no on-the-fly sets


def test_a_batch_and_several_return_sequences(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("llama")
    batch = torch.tensor([random_prompt(), random_prompt(seed=1)])
    reference = model.generate(batch, max_new_tokens=NEW)[:, batch.shape[1] :].tolist()
    eos = [reference[0][5], reference[1][9]]  # both rows stop early, at different lengths
    plain, ours = _both(model, batch, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    assert ours.tolist() == plain.tolist()
    assert ours.shape[1] < batch.shape[1] + NEW and (ours[:, -1] == 0).any()  # the row that ended first: padded
    # Left-padded rows of different lengths: each row gets what it gets alone.
    short, long = random_prompt(length=5, seed=2), random_prompt(length=9, seed=3)
    padded = torch.tensor([[0] * 4 + short, long])
    mask = torch.tensor([[0] * 4 + [1] * 5, [1] * 9])
    out = _ours(model, padded, attention_mask=mask, max_new_tokens=NEW)
    for row, prompt in zip(out.tolist(), (short, long)):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=NEW)[0, len(prompt) :].tolist()
        assert row[9:] == alone
    # A batch picks its kind of step by measured time, and each kind draws differently: a seed
    # fixes the text only where the kinds are fixed too (concepts.md#what-a-seed-fixes).
    monkeypatch.setattr(
        kinds_module.StepKinds, "choose", lambda self: self.kinds[sum(self.steps.values()) % len(self.kinds)]
    )
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(_ours(model, batch[:1], max_new_tokens=NEW, do_sample=True, num_return_sequences=3))
    assert runs[0].shape == (3, batch.shape[1] + NEW) and runs[0].tolist() == runs[1].tolist()
    assert len({tuple(row) for row in runs[0].tolist()}) > 1  # three draws, not one copied


def test_output_scores_and_logits_match_generate() -> None:
    model = tiny_model("llama")
    ids = _ids()
    common = dict(
        max_new_tokens=NEW, repetition_penalty=1.5, return_dict_in_generate=True, output_scores=True, output_logits=True
    )
    plain, ours = _both(model, ids, **common)
    assert ours.sequences.tolist() == plain.sequences.tolist() and ours.stats.accepted > 0
    for mine, theirs in ((ours.scores, plain.scores), (ours.logits, plain.logits)):
        assert len(mine) == len(theirs) == NEW
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert any(not torch.equal(a, b) for a, b in zip(ours.scores, ours.logits))  # the penalty is in the scores
    torch.manual_seed(0)
    sampled = _ours(
        model, ids, max_new_tokens=NEW, do_sample=True, top_k=20, return_dict_in_generate=True, output_scores=True
    )
    new = sampled.sequences[0, ids.shape[1] :].tolist()
    for token, row in zip(new, sampled.scores, strict=True):  # warped as generate warps: top-k kept, token among them
        assert row.shape == (1, 128) and torch.isfinite(row).sum() == 20 and torch.isfinite(row[0, token])
    with pytest.raises(LayerskipError, match="output_scores"):
        _ours(model, torch.cat([ids, ids]), max_new_tokens=4, return_dict_in_generate=True, output_scores=True)


# -- text: streamers, stop strings, pipeline (a model whose vocabulary is the tiny tokenizer's) --------


def _text_model():
    return tiny_model("llama", vocab_size=len(tiny_tokenizer().get_vocab()))


def test_streamers_receive_the_result(capsys: pytest.CaptureFixture) -> None:
    from transformers import TextIteratorStreamer, TextStreamer

    model, tokenizer = _text_model(), tiny_tokenizer()
    ids = tokenizer("hello world w3 w7", return_tensors="pt").input_ids
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    result: dict = {}
    worker = threading.Thread(
        target=lambda: result.update(out=_ours(model, ids, max_new_tokens=NEW, streamer=streamer))
    )
    worker.start()
    streamed = "".join(streamer)
    worker.join()
    text = tokenizer.decode(result["out"][0, ids.shape[1] :])
    assert streamed.split() == text.split() and len(text.split()) == NEW
    assert result["out"].tolist() == model.generate(ids, max_new_tokens=NEW).tolist()
    _ours(model, ids, max_new_tokens=NEW, streamer=TextStreamer(tokenizer, skip_prompt=True))
    assert capsys.readouterr().out.split() == text.split()


def test_stop_strings_need_the_directory_form() -> None:
    """transformers gives a custom_generate callable no tokenizer; stop strings say so in one line
    (they are compared with plain generate on SmolLM2, whose tokenizer HF's StopStringCriteria reads)."""
    model, tokenizer = _text_model(), tiny_tokenizer()
    with pytest.raises(LayerskipError, match="stop_strings") as caught:
        model.generate(
            _ids(),
            custom_generate=layerskip.self_speculative_generate,
            skip_policy=POLICY,
            stop_strings=["w3"],
            tokenizer=tokenizer,
        )
    assert "\n" not in str(caught.value)


def test_pipeline() -> None:
    from transformers import pipeline

    model, tokenizer = _text_model(), tiny_tokenizer()
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    plain = pipe("hello world w3 w7", max_new_tokens=NEW, do_sample=False)
    ours = pipe(
        "hello world w3 w7",
        max_new_tokens=NEW,
        do_sample=False,
        custom_generate=PATH,
        trust_remote_code=True,
        skip_policy=POLICY,
    )
    assert ours == plain


# -- sampling -------------------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible() -> None:
    model = tiny_model("gemma2")
    ids = _ids()
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(_ours(model, ids, max_new_tokens=NEW, do_sample=True, temperature=0.9, top_p=0.95, top_k=20))
    assert runs[0].tolist() == runs[1].tolist()
    torch.manual_seed(11)
    with_penalty = _ours(model, ids, max_new_tokens=NEW, do_sample=True, repetition_penalty=1.3)
    assert with_penalty.shape[1] == ids.shape[1] + NEW


def _history_bias():
    """A logits processor that depends on the history: a random bias row picked by the last token."""
    from transformers import LogitsProcessor

    bias = torch.randn(E2E_VOCAB, E2E_VOCAB, generator=torch.Generator().manual_seed(4)) * 2.0

    class HistoryBias(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores + bias[input_ids[:, -1]]

    return HistoryBias()


def _processed_laws(model, prompt: list[int], processor) -> tuple[torch.Tensor, torch.Tensor]:
    """The laws of tokens 1 and 2 after ``processor`` (plain generate's sampling distribution)."""
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        p1 = processor(ids, model(input_ids=ids).logits[:, -1]).softmax(-1)[0]
        batch = torch.tensor([[*prompt, x] for x in range(E2E_VOCAB)])
        p2 = processor(batch, model(input_ids=batch).logits[:, -1]).softmax(-1)
    return p1, p1 @ p2


@pytest.mark.parametrize("processed", [False, True, "repetition"], ids=["plain", "history-processor", "repetition"])
def test_sampling_follows_the_model(processed: bool | str) -> None:
    """As tests/test_sampling.py's end-to-end check, through ``model.generate``; with a processor the
    output must follow the processed distribution, though the draft proposes from unprocessed logits."""
    from transformers import LogitsProcessorList

    model = _e2e_model()
    prompt = random_prompt(E2E_VOCAB, 6)
    p1, p2, q2 = _exact_laws(model, prompt)
    extra = {}
    if processed:
        # A user's processor that reads the history, or the repetition penalty a chat model's config carries.
        processor = RepetitionPenaltyLogitsProcessor(3.0) if processed == "repetition" else _history_bias()
        unprocessed = p2
        p1, p2 = _processed_laws(model, prompt, processor)
        assert tv(p2, unprocessed) > 2 * E2E_TV_BOUND  # a plug-in that ignored the processor would fail
        extra["logits_processor"] = LogitsProcessorList([processor])
    policy = SkipPolicy.early_exit(adapters.num_layers(model), 1, draft=DraftSettings(max_draft_tokens=1))
    first, second = torch.zeros(E2E_VOCAB), torch.zeros(E2E_VOCAB)
    seeds = E2E_SEEDS
    accepted = 0
    for seed in range(seeds):
        torch.manual_seed(seed)
        out = model.generate(
            torch.tensor([prompt]),
            custom_generate=layerskip.self_speculative_generate,
            skip_policy=policy,
            max_new_tokens=3,
            do_sample=True,
            top_k=0,
            return_dict_in_generate=True,
            **extra,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        first[tokens[0]] += 1
        second[tokens[1]] += 1
        accepted += out.stats.accepted
    assert 0 < accepted < seeds
    assert tv(p2, q2) > 2 * E2E_TV_BOUND
    assert tv(first / seeds, p1) < E2E_TV_BOUND
    assert tv(second / seeds, p2) < E2E_TV_BOUND


def test_top_p_zero_is_taken_as_plain_generate_takes_it() -> None:
    """transformers keeps only the most likely token at top_p=0.0; so does the plug-in (it refused it)."""
    model = tiny_model("llama")
    torch.manual_seed(0)
    plain = model.generate(_ids(), max_new_tokens=NEW, do_sample=True, top_p=0.0)
    ours = _ours(model, _ids(), max_new_tokens=NEW, do_sample=True, top_p=0.0)
    assert ours.tolist() == plain.tolist() == model.generate(_ids(), max_new_tokens=NEW, do_sample=False).tolist()


def test_sampling_warpers_become_the_engine_transform() -> None:
    """The temperature -> top-k -> top-p tail is our Sampling (target and draft alike); any other
    processor, or a warper after one, runs on the verify's logits instead."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from layerskip.integration.generate_args import _split_processors
    from layerskip.sampling import Sampling

    penalty, warpers = (
        RepetitionPenaltyLogitsProcessor(1.2),
        [
            TemperatureLogitsWarper(0.7),
            TopKLogitsWarper(20),
            TopPLogitsWarper(0.9),
        ],
    )
    assert _split_processors([penalty, *warpers], True) == ([penalty], warpers, Sampling(0.7, 20, 0.9))
    min_p = MinPLogitsWarper(0.1)
    assert _split_processors([penalty, *warpers, min_p], True) == ([penalty, *warpers, min_p], [], Sampling())
    assert _split_processors([penalty], False) == ([penalty], [], None)


# -- refused, in one line naming the argument ------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(num_beams=2), "num_beams"),
        (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
        (dict(output_hidden_states=True, return_dict_in_generate=True), "output_hidden_states"),
        (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
        (dict(guidance_scale=2.0), "guidance_scale"),
        (dict(synced_gpus=True), "synced_gpus"),
        (dict(skip_policy=None), "skip_policy"),
        (dict(skip_policy=3), "skip_policy"),
        (dict(skip_policy="missing.json"), "missing.json"),
        (dict(token_type_ids=torch.zeros(1, 8, dtype=torch.long)), "token_type_ids"),
        (dict(attention_mask=torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1]])), "attention_mask"),
    ],
)
def test_refused_arguments(kwargs: dict, name: str) -> None:
    model = tiny_model("llama")
    arguments = dict(custom_generate=PATH, trust_remote_code=True, skip_policy=POLICY, max_new_tokens=4)
    arguments.update(kwargs)
    if "input_ids" not in arguments:
        arguments["input_ids"] = _ids()
    with pytest.raises((LayerskipError, ValueError)) as caught:
        model.generate(**arguments)
    message = str(caught.value)
    assert name in message and "\n" not in message, message


def test_a_missing_policy_file_names_the_plugins_argument() -> None:
    with pytest.raises(LayerskipError, match="not found") as error:
        _ours(tiny_model("llama"), _ids(), policy="missing.json", max_new_tokens=4)
    assert "skip_policy=" in str(error.value) and "--policy" not in str(error.value)


def test_batch_refusals() -> None:
    from transformers import TextStreamer

    model = tiny_model("llama")
    batch = torch.tensor([random_prompt(), random_prompt(seed=1)])
    with pytest.raises((LayerskipError, ValueError), match="(?i)streamer"):  # HF's streamer says it first
        _ours(model, batch, max_new_tokens=4, streamer=TextStreamer(tiny_tokenizer()))


def test_assistant_model_is_refused() -> None:
    model = tiny_model("llama")
    with pytest.raises(LayerskipError, match="assistant_model"):
        _ours(model, _ids(), max_new_tokens=4, assistant_model=tiny_model("llama", seed=3))


# -- the real model --------------------------------------------------------------------------------------


def test_smollm2_greedy_streamed_and_stopped(smollm2) -> None:
    from transformers import TextIteratorStreamer

    model, tokenizer = smollm2.model, smollm2.tokenizer
    messages = [{"role": "user", "content": "Explain photosynthesis."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    common = dict(max_new_tokens=24, do_sample=False)
    plain = model.generate(**inputs, **common)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    result: dict = {}

    def run() -> None:
        result["out"] = _ours(
            model, inputs["input_ids"], policy="policies/smollm2-135m-fp32-skip.json", streamer=streamer, **common
        )

    worker = threading.Thread(target=run)
    worker.start()
    streamed = "".join(streamer)
    worker.join()
    assert result["out"].tolist() == plain.tolist()
    assert streamed == tokenizer.decode(plain[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    stop = streamed.split()[5]
    plain, ours = (
        fn(**inputs, stop_strings=[stop], tokenizer=tokenizer, **common)
        for fn in (model.generate, lambda **kw: _ours(model, policy="policies/smollm2-135m-fp32-skip.json", **kw))
    )
    assert ours.tolist() == plain.tolist() and plain.shape[1] < inputs["input_ids"].shape[1] + 24


# -- the bench's hf-custom method ---------------------------------------------------------------------------


def test_bench_hf_custom_method_runs() -> None:
    from layerskip.data import Prompt
    from layerskip.measure.bench import BenchConfig, build_methods, run_benchmark, summarise

    model = tiny_model("llama")
    methods = build_methods(model, ["hf-custom", "self-spec"], (), {"p": POLICY})
    assert [m.name for m in methods] == ["hf-ar", "hf-custom", "self-spec"]
    prompts = [Prompt(id="a", category="qa", text="")]
    rows = run_benchmark(model, methods, prompts, [random_prompt()], BenchConfig(max_new_tokens=12, warmup_tokens=2))
    custom = next(r for r in rows if r.method == "hf-custom")
    assert custom.identical and custom.new_tokens == 12 and custom.stats.drafted > 0
    assert summarise(rows)["hf-custom"]["overall"]["mean_accepted"] > 1
