"""CPU thread counts chosen by measured time (engine.threads): the choice, its re-tries, and that
decoding stays lossless and leaves the caller's thread count as it was."""

from __future__ import annotations

import pytest
import torch
from compare import assert_same_tokens
from tiny_models import random_prompt, tiny_model

from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.engine.threads import PhaseThreads, ThreadTuner, candidate_counts
from layerskip.measure.bench import build_methods
from layerskip.measure.load import busy_processes


def test_candidate_counts() -> None:
    assert candidate_counts(1) == (1,)
    assert candidate_counts(2) == (2, 1)
    assert candidate_counts(4) == (4, 1)
    assert candidate_counts(16) == (16, 8, 1)


def _run(tuner: PhaseThreads, cost: dict[int, float], runs: int) -> list[int]:
    chosen = []
    for _ in range(runs):
        count = tuner.next()
        tuner.record(count, cost[count])
        chosen.append(count)
    return chosen


def test_warm_up_tries_every_count_then_keeps_the_fastest() -> None:
    tuner = PhaseThreads((2, 1), warmup=2, min_interval=8, max_interval=64)
    chosen = _run(tuner, {2: 1.0, 1: 3.0}, 200)
    assert chosen[:4] == [2, 2, 1, 1]
    rest = chosen[4:]
    assert rest.count(2) > 0.9 * len(rest)
    assert 1 in rest  # the slower count is re-tried now and then ...
    probes = [i for i, c in enumerate(rest) if c == 1]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == 64  # ... less and less often while the choice holds


def test_a_count_that_becomes_slow_is_left_at_once() -> None:
    """The machine gets busy: the chosen count slows down, and the tuner moves within a few runs."""
    tuner = PhaseThreads((2, 1), alpha=0.3, warmup=2, min_interval=8, max_interval=64)
    _run(tuner, {2: 1.0, 1: 1.5}, 100)
    assert tuner.next() == 2
    after = _run(tuner, {2: 6.0, 1: 1.5}, 20)
    switch = after.index(1)
    assert switch <= 3 and after[switch:].count(1) >= len(after[switch:]) - 1


def test_a_count_that_becomes_fast_again_is_found_by_a_re_try() -> None:
    tuner = PhaseThreads((2, 1), alpha=0.3, warmup=2, min_interval=4, max_interval=16)
    _run(tuner, {2: 6.0, 1: 1.5}, 60)
    after = _run(tuner, {2: 1.0, 1: 1.5}, 60)
    assert after[-20:].count(2) >= 18


@pytest.mark.parametrize("bad", [0, -1, "two", True, 1.5])
def test_bad_thread_settings_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="threads must be"):
        ThreadTuner(bad, torch.device("cpu"))  # type: ignore[arg-type]


def test_no_thread_setting_on_a_gpu_and_none_to_tune_on_one_core() -> None:
    assert not ThreadTuner("auto", torch.device("cuda")).enabled
    torch.set_num_threads(1)
    assert ThreadTuner("auto", torch.device("cpu")).phase_threads("verify").candidates == (1,)


def test_the_callers_thread_count_comes_back_even_after_an_error() -> None:
    torch.set_num_threads(2)
    tuner = ThreadTuner(1, torch.device("cpu"))
    with pytest.raises(RuntimeError), tuner.session():
        with tuner.phase("verify"):
            assert torch.get_num_threads() == 1
            raise RuntimeError("boom")
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("threads", ["auto", 1, 2])
def test_lossless_under_every_thread_setting(threads: int | str) -> None:
    """Two threads available, "auto" switches counts while decoding: the output is still plain decoding's."""
    model = tiny_model("llama")
    prompt = random_prompt(seed=3)
    policy = SkipPolicy(skip_attention=(0, 2), draft=DraftSettings(max_draft_tokens=4))
    settings = DecodeSettings(max_new_tokens=40)
    torch.set_num_threads(2)
    plain, _ = Decoder.for_policy(model, None, threads=1).decode(prompt, settings)
    decoder = Decoder.for_policy(model, policy, threads=threads)
    runs: dict[str, int] = {}
    for _ in range(2):
        tokens, stats = decoder.decode(prompt, settings)
        assert_same_tokens(tokens, plain)
        for key, n in stats.thread_runs.items():
            runs[key] = runs.get(key, 0) + n
        assert torch.get_num_threads() == 2
    phases = {key.split(":")[0] for key in runs}
    counts = {int(key.split(":")[1]) for key in runs}
    assert phases == {"draft", "verify"}
    assert counts == ({1, 2} if threads == "auto" else {threads})


def test_bench_thread_variants_are_named_and_hf_gets_counts_only() -> None:
    model = tiny_model("llama")
    policy = SkipPolicy(skip_attention=(0,))
    methods = build_methods(model, ["hf-ar", "ar", "self-spec"], (), {"p": policy}, threads=("auto", 1))
    names = [m.name for m in methods]
    assert names == ["hf-ar", "ar", "self-spec", "hf-ar@t1", "ar@t1", "self-spec@t1"]
    methods = build_methods(model, ["hf-ar", "self-spec"], (), {"p": policy}, threads=(2, "auto"))
    assert [m.name for m in methods] == ["hf-ar", "self-spec", "self-spec@auto"]


def test_hf_variant_runs_under_its_count_and_restores_it() -> None:
    model = tiny_model("llama")
    seen = []
    methods = build_methods(model, ["hf-ar"], (), {}, threads=("auto", 1))
    torch.set_num_threads(2)
    import layerskip.measure.bench as bench_module

    original = bench_module.hf_generate

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return original(*args, **kwargs)

    bench_module.hf_generate = spy
    try:
        for method in methods:
            method.run(random_prompt(seed=0), 3)
    finally:
        bench_module.hf_generate = original
    assert seen == [2, 1]
    assert torch.get_num_threads() == 2


def test_busy_processes_are_started_and_always_stopped() -> None:
    with pytest.raises(KeyboardInterrupt), busy_processes(2) as started:
        assert len(started) == 2 and all(p.poll() is None for p in started)
        raise KeyboardInterrupt
    assert all(p.poll() is not None for p in started)
    with pytest.raises(ValueError):
        with busy_processes(-1):
            pass


def test_the_verify_follows_the_drafts_count_and_learns_alone_without_draft_forwards() -> None:
    torch.set_num_threads(2)
    tuner = ThreadTuner("auto", torch.device("cpu"))
    with tuner.session():
        for _ in range(10):
            with tuner.phase("draft") as draft:
                draft.units = 3
            with tuner.phase("verify") as verify:  # the draft's count, but not a count on trial
                assert verify.trial == draft.trial
                assert verify.threads == (tuner.phase_threads("draft").best() if draft.trial else draft.threads)
        assert tuner.phase_threads("verify").uses == {}  # learnt nothing: the draft decides
        with tuner.phase("draft") as lookup:
            lookup.units = 0  # a lookup draft: no forwards, no signal; the verify tunes its own count
        with tuner.phase("verify"):
            pass
        assert sum(tuner.phase_threads("verify").uses.values()) == 1
    lookup_only = ThreadTuner("auto", torch.device("cpu"))  # never a draft forward: the verify learns
    with lookup_only.session():
        for _ in range(3):
            with lookup_only.phase("draft") as lookup:
                lookup.units = 0
            with lookup_only.phase("verify"):
                pass
    assert sum(lookup_only.phase_threads("verify").uses.values()) == 3


def test_the_prefill_runs_on_the_best_count_known_and_learns_nothing() -> None:
    torch.set_num_threads(2)
    tuner = ThreadTuner("auto", torch.device("cpu"))
    tuner.phase_threads("draft").record(1, 1.0)
    tuner.phase_threads("draft").record(2, 5.0)  # busy machine: one thread is faster
    with tuner.session():
        with tuner.phase("verify", learn=False) as prefill:  # no verify timed yet: the draft's best
            pass
        assert prefill.threads == 1
        tuner.phase_threads("verify").record(2, 1.0)
        with tuner.phase("verify", learn=False) as prefill:  # the verify's own best, once known
            pass
        assert prefill.threads == 2
    assert tuner.phase_threads("verify").uses == {2: 1}


def test_a_batch_tunes_its_threads_by_size_class() -> None:
    """Batches try every candidate count too, each size class (1, 2-3, 4-7, ...) learning its own;
    a count on trial says so, so a batch's chooser keeps its clock time out of its kinds' rates."""
    torch.set_num_threads(2)
    tuner = ThreadTuner("auto", torch.device("cpu"))
    assert tuner.phase_threads("draft", 8).candidates == (2, 1)
    assert tuner.phase_threads("draft", 8) is tuner.phase_threads("draft", 15)
    assert tuner.phase_threads("draft", 8) is not tuner.phase_threads("draft", 16)
    seen, trials = set(), 0
    with tuner.session():
        for _ in range(40):
            with tuner.phase("draft", 8) as draft:
                draft.units = 3
            with tuner.phase("verify", 8) as verify:
                assert verify.trial == draft.trial
                assert verify.threads == (tuner.phase_threads("draft", 8).best() if draft.trial else draft.threads)
            seen.add(draft.threads)
            trials += draft.trial
    assert seen == {1, 2} and 0 < trials < 40
    assert tuner.phase_threads("draft", 1).uses == {}  # one row's class learnt nothing from the batch


def test_a_step_without_a_draft_tunes_the_verifys_own_count() -> None:
    """A batch's plain and lookup steps run no draft forward: their verify neither keeps the count
    the last draft tried nor the draft's best (learnt from a few one-token forwards, and never
    re-tried while the batch takes plain steps: a 16-row batch kept one thread of two), but
    learns its own."""
    torch.set_num_threads(2)
    tuner = ThreadTuner("auto", torch.device("cpu"))
    draft, verify_threads = tuner.phase_threads("draft", 16), tuner.phase_threads("verify", 16)
    for _ in range(2):
        draft.record(1, 1e-12)  # one thread measured fastest for the draft
        draft.record(2, 1.0)
        verify_threads.record(1, 1.0)  # two for the verify
        verify_threads.record(2, 1e-12)
    with tuner.session():
        with tuner.phase("draft", 16) as drafted:
            drafted.units = 3
        with tuner.phase("verify", 16) as verify:  # this step's draft: its count
            assert verify.threads == drafted.threads == 1
        before = sum(verify_threads.uses.values())
        for _ in range(3):  # plain steps
            with tuner.phase("verify", 16) as verify:
                assert verify.threads == 2 and not verify.trial
        assert sum(verify_threads.uses.values()) == before + 3


def test_a_rare_draft_follows_the_verifys_count_and_tries_none() -> None:
    """Where a size class's verify has tuned itself more often than its draft ran (a batch taking
    mostly plain steps), the draft runs on the verify's best count, never a count on trial: a
    trial's slow count would fall on the rare drafting step. Where the draft runs as often, it
    tunes itself as before."""
    torch.set_num_threads(2)
    tuner = ThreadTuner("auto", torch.device("cpu"))
    verify_threads = tuner.phase_threads("verify", 16)
    for _ in range(3):
        verify_threads.record(2, 1e-12)  # two threads measured fastest for the verify
        verify_threads.record(1, 1.0)
    with tuner.session():
        for _ in range(4):  # a draft with no count of its own yet: the verify's best each time
            with tuner.phase("draft", 16) as drafted:
                drafted.units = 3
            assert drafted.threads == 2 and not drafted.trial
            with tuner.phase("verify", 16) as verify:
                assert verify.threads == 2 and not verify.trial
    one_row = ThreadTuner("auto", torch.device("cpu"))  # the draft the frequent phase: it warms up
    with one_row.session():
        counts = set()
        for _ in range(4):
            with one_row.phase("draft") as drafted:
                drafted.units = 3
            counts.add(drafted.threads)
            with one_row.phase("verify"):
                pass
    assert counts == {1, 2}
