"""SkipPolicy: JSON round trip, schema errors, validation against a model, DraftSettings, atomic writes."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest
from tiny_models import LAYERS, tiny_model

from layerskip import fileio
from layerskip.drafts.builder import check_policy_fits
from layerskip.drafts.policy.skip_policy import FORMAT, VERSION, DraftSettings, ModelIdentity, SkipPolicy
from layerskip.errors import LayerskipError


@pytest.fixture(scope="module")
def llama():
    model = tiny_model("llama")
    model.layerskip_name = "tiny-llama"
    return model


def _full_policy(model) -> SkipPolicy:
    return SkipPolicy(
        skip_attention=(3, 0, 3),
        skip_mlp=(2,),
        draft=DraftSettings(max_draft_tokens=6, adaptive=True, initial_threshold=0.5, lookup_max_ngram=3),
        provenance={"method": "optuna", "trials": 12},
        measured={"speedup": 1.4},
    ).with_model(model)


def test_constructor_sorts_and_dedups() -> None:
    policy = SkipPolicy(skip_attention=[3, 1, 3], skip_mlp=(2, 2, 0))
    assert policy.skip_attention == (1, 3) and policy.skip_mlp == (0, 2)
    assert policy.bypasses_anything and not SkipPolicy().bypasses_anything


def test_early_exit_and_skip_layers() -> None:
    policy = SkipPolicy.early_exit(30, 26)
    assert policy.skip_attention == policy.skip_mlp == (26, 27, 28, 29)
    assert SkipPolicy.skip_layers([4, 1]).skip_attention == (1, 4) == SkipPolicy.skip_layers([4, 1]).skip_mlp
    assert SkipPolicy.early_exit(4, 2, draft=DraftSettings(max_draft_tokens=2)).draft.max_draft_tokens == 2


def test_save_load_round_trip(tmp_path: Path, llama) -> None:
    policy = _full_policy(llama)
    identity = policy.model
    assert identity == ModelIdentity("tiny-llama", "llama", LAYERS, identity.fingerprint, identity.weights_sample)
    assert identity.fingerprint and identity.weights_sample
    path = policy.save(tmp_path / "sub" / "policy.json")  # parent directories are created
    assert path == tmp_path / "sub" / "policy.json"
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and data["version"] == VERSION
    assert data["skip_attention"] == [0, 3] and data["skip_mlp"] == [2]
    loaded = SkipPolicy.load(path)
    assert loaded == policy
    assert SkipPolicy.from_dict(policy.to_dict()) == policy
    check_policy_fits(llama, loaded)
    # Overwriting keeps one file, no temporaries left beside it.
    SkipPolicy(skip_mlp=(1,)).save(path)
    assert SkipPolicy.load(path).skip_mlp == (1,)
    assert sorted(p.name for p in path.parent.iterdir()) == ["policy.json"]


def test_minimal_policy_file_uses_defaults(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format": FORMAT, "version": VERSION, "skip_attention": [1]}))
    policy = SkipPolicy.load(path)
    assert policy.skip_attention == (1,) and policy.skip_mlp == ()
    assert policy.draft == DraftSettings() and policy.model == ModelIdentity()


def test_float_field_accepts_an_int() -> None:
    data = SkipPolicy().to_dict()
    data["draft"]["initial_threshold"] = 1
    assert SkipPolicy.from_dict(data).draft.initial_threshold == 1


def _with(**changes) -> dict:
    data = SkipPolicy(skip_attention=(1,)).to_dict()
    data.update(changes)
    return data


def _draft(**changes) -> dict:
    data = SkipPolicy().to_dict()
    data["draft"].update(changes)
    return data


BAD_DICTS = {
    "not a dict": [1, 2],
    "no format": {"version": 1},
    "wrong format": _with(format="something-else"),
    "wrong version": _with(version=2),
    "version as string": _with(version="1"),
    "bool index": _with(skip_attention=[True]),
    "string index": _with(skip_mlp=["3"]),
    "float index": _with(skip_mlp=[1.5]),
    "skip list not a list": _with(skip_attention=3),
    "draft not an object": _with(draft=[4]),
    "unknown draft field": _draft(max_tokens=4),
    "draft int as string": _draft(max_draft_tokens="4"),
    "draft int as bool": _draft(max_draft_tokens=True),
    "draft bool as int": _draft(adaptive=1),
    "draft float as string": _draft(initial_threshold="0.5"),
    "model not an object": _with(model="llama"),
    "model num_layers as string": _with(model={"num_layers": "30"}),
    "unknown model field": _with(model={"layers": 30}),
    "provenance not an object": _with(provenance=[1]),
    "invalid draft values": _draft(max_draft_tokens=0),
    "unknown top-level key": _with(skip_atention=[1]),  # misspelt: its setting would be silently lost
    "negative vocabulary row": _with(draft_vocabulary=[5, -1]),
}


@pytest.mark.parametrize("name", list(BAD_DICTS))
def test_from_dict_rejects_bad_input(name: str) -> None:
    with pytest.raises(LayerskipError) as info:
        SkipPolicy.from_dict(BAD_DICTS[name], source="policy file x.json")
    assert "x.json" in str(info.value) or name == "invalid draft values"


@pytest.mark.parametrize(
    "text",
    ["", "{", "not json at all", "{'format': 'layerskip-policy'}", "[1, 2", "\ud800".encode("utf-8", "surrogatepass")],
    ids=["empty", "truncated", "text", "single-quotes", "unclosed-list", "bad-utf8"],
)
def test_load_rejects_files_that_are_not_json(tmp_path: Path, text: str | bytes) -> None:
    path = tmp_path / "bad.json"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    with pytest.raises(LayerskipError, match="bad.json"):
        SkipPolicy.load(path)


def test_load_rejects_json_that_is_not_a_policy(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(LayerskipError, match="not a layerskip policy"):
        SkipPolicy.load(path)


def test_load_missing_path_or_directory(tmp_path: Path) -> None:
    with pytest.raises(LayerskipError, match="not found"):
        SkipPolicy.load(tmp_path / "missing.json")
    with pytest.raises(LayerskipError, match="is a directory"):
        SkipPolicy.load(tmp_path)


def test_unknown_top_level_key_is_named() -> None:
    with pytest.raises(LayerskipError, match=r"unknown key\(s\) \['skip_atention'\]"):
        SkipPolicy.from_dict(_with(skip_atention=[1]))


def test_check_policy_fits_vocabulary_rows_out_of_range(llama) -> None:
    rows = llama.get_output_embeddings().weight.shape[0]
    check_policy_fits(
        llama, SkipPolicy(skip_attention=(1,), draft=DraftSettings(draft_vocab_size=2), draft_vocabulary=(0, rows - 1))
    )
    policy = SkipPolicy(skip_attention=(1,), draft=DraftSettings(draft_vocab_size=2), draft_vocabulary=(0, rows))
    with pytest.raises(LayerskipError, match=rf"token id\(s\) \[{rows}\] but this model's head has {rows} rows"):
        check_policy_fits(llama, policy)


# -- check_policy_fits-------------------------------------------------------------------------------


def test_check_policy_fits_accepts_a_matching_or_anonymous_policy(llama) -> None:
    check_policy_fits(llama, _full_policy(llama))
    check_policy_fits(llama, SkipPolicy(skip_attention=(0,)))  # no model identity: only indices are checked
    check_policy_fits(llama, SkipPolicy.early_exit(LAYERS, 1))
    check_policy_fits(llama, SkipPolicy(skip_attention=tuple(range(LAYERS)), skip_mlp=(0, 1, 2)))  # one MLP left


def test_check_policy_fits_another_architecture(llama) -> None:
    gpt2 = tiny_model("gpt2")
    policy = SkipPolicy(skip_mlp=(1,)).with_model(gpt2, "tiny-gpt2")
    with pytest.raises(LayerskipError, match="'gpt2' model .*'llama'"):
        check_policy_fits(llama, policy)


def test_check_policy_fits_another_layer_count(llama) -> None:
    deeper = tiny_model("llama", num_hidden_layers=6)
    policy = SkipPolicy(skip_mlp=(1,)).with_model(deeper)
    with pytest.raises(LayerskipError, match="6-layer model .* has 4 layers"):
        check_policy_fits(llama, policy)
    written = SkipPolicy(skip_mlp=(1,), model=ModelIdentity(architecture="llama", num_layers=7))
    with pytest.raises(LayerskipError, match="7-layer"):
        check_policy_fits(llama, written)


def test_check_policy_fits_another_fingerprint(llama) -> None:
    wider = tiny_model("llama", intermediate_size=96)  # same architecture and depth, other shapes
    policy = SkipPolicy(skip_mlp=(1,)).with_model(wider)
    with pytest.raises(LayerskipError, match="weight shapes differ"):
        check_policy_fits(llama, policy)
    # Same shapes, other weights: the sample of their values tells them apart.
    with pytest.raises(LayerskipError, match="same shape .* weights differ"):
        check_policy_fits(llama, SkipPolicy(skip_mlp=(1,)).with_model(tiny_model("llama", seed=5)))


@pytest.mark.parametrize(
    "policy",
    [SkipPolicy(skip_attention=(LAYERS,)), SkipPolicy(skip_mlp=(99,)), SkipPolicy(skip_attention=(-1,))],
    ids=["attention-4", "mlp-99", "negative"],
)
def test_check_policy_fits_index_out_of_range(llama, policy: SkipPolicy) -> None:
    with pytest.raises(LayerskipError, match=r"valid 0\.\.3"):
        check_policy_fits(llama, policy)


def test_check_policy_fits_everything_bypassed(llama) -> None:
    with pytest.raises(LayerskipError, match="every sublayer"):
        check_policy_fits(llama, SkipPolicy.early_exit(LAYERS, 0))
    with pytest.raises(LayerskipError, match="every sublayer"):
        check_policy_fits(llama, SkipPolicy.skip_layers(list(range(LAYERS))).with_model(llama))


def test_check_policy_fits_checks_draft_settings(llama) -> None:
    policy = SkipPolicy(skip_mlp=(1,), draft=DraftSettings(max_draft_tokens=0))
    with pytest.raises(LayerskipError, match="max_draft_tokens"):
        check_policy_fits(llama, policy)


# -- DraftSettings ---------------------------------------------------------------------------------

BAD_DRAFTS = {
    "max_draft_tokens 0": dict(max_draft_tokens=0),
    "threshold above 1": dict(initial_threshold=1.5),
    "threshold negative": dict(initial_threshold=-0.1),
    "target 0": dict(target_acceptance=0.0),
    "target above 1": dict(target_acceptance=1.2),
    "negative draft vocab": dict(draft_vocab_size=-1),
    "negative ngram": dict(lookup_max_ngram=-1),
    "negative lookup tokens": dict(lookup_max_tokens=-2),
    "min ngram above max": dict(lookup_max_ngram=2, lookup_min_ngram=3),
    "min ngram 0": dict(lookup_max_ngram=2, lookup_min_ngram=0),
    "no drafter at all": dict(use_skip_draft=False),
    "lookup confidence 1": dict(lookup_max_ngram=2, lookup_confidence=1.0),
    "lookup confidence negative": dict(lookup_max_ngram=2, lookup_confidence=-0.1),
}


@pytest.mark.parametrize("name", list(BAD_DRAFTS))
def test_draft_settings_validation(name: str) -> None:
    settings = DraftSettings(**BAD_DRAFTS[name])
    with pytest.raises(LayerskipError):
        settings.validate()
    with pytest.raises(LayerskipError):  # the same settings in a file are refused on load
        SkipPolicy.from_dict(SkipPolicy(draft=settings).to_dict())


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        dict(max_draft_tokens=1, initial_threshold=0.0, target_acceptance=1.0),
        dict(lookup_max_ngram=3, lookup_min_ngram=3, use_skip_draft=False),
        dict(lookup_max_ngram=1, lookup_min_ngram=1, lookup_max_tokens=0, draft_vocab_size=100),
        dict(lookup_max_ngram=3, lookup_confidence=0.25),
    ],
)
def test_draft_settings_valid(kwargs: dict) -> None:
    DraftSettings(**kwargs).validate()


def test_describe_mentions_the_settings() -> None:
    text = SkipPolicy(skip_attention=(1,), draft=DraftSettings(adaptive=True, lookup_max_ngram=3)).describe()
    assert "attn skip [1]" in text and "adaptive" in text and "lookup n=2..3" in text


def test_fraction_bypassed(llama) -> None:
    assert SkipPolicy().fraction_bypassed(llama) == 0
    half = SkipPolicy.early_exit(LAYERS, 2).fraction_bypassed(llama)
    everything = SkipPolicy.early_exit(LAYERS, 0).fraction_bypassed(llama)
    assert 0 < half < everything < 1  # embeddings, norms and the head are never bypassed
    assert half == pytest.approx(everything / 2)


# -- atomic writes ---------------------------------------------------------------------------------


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "policy.json"
    SkipPolicy(skip_mlp=(1,)).save(path)
    original = path.read_text()

    def failing_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(fileio.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        SkipPolicy(skip_mlp=(2,)).save(path)
    monkeypatch.undo()
    assert path.read_text() == original
    assert [p.name for p in tmp_path.iterdir()] == ["policy.json"]


def test_failed_first_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "new.json"

    class Unserialisable:
        pass

    with pytest.raises(TypeError):
        SkipPolicy(provenance={"bad": Unserialisable()}).save(path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(LayerskipError, match="not found"):
        SkipPolicy.load(path)


def test_write_is_a_rename_of_a_complete_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The target only ever appears via os.replace of a fully written temporary in the same directory."""
    path = tmp_path / "policy.json"
    seen = []
    real_replace = os.replace

    def spying_replace(src: str, dst: str) -> None:
        assert Path(src).parent == path.parent and Path(src).name != path.name
        assert not path.exists()
        seen.append(json.loads(Path(src).read_text()))
        real_replace(src, dst)

    monkeypatch.setattr(fileio.os, "replace", spying_replace)
    SkipPolicy(skip_attention=(2,)).save(path)
    assert seen and seen[0]["skip_attention"] == [2]
    assert json.loads(path.read_text()) == seen[0]


def test_a_write_never_replaces_a_fifo_a_device_or_a_link(tmp_path: Path) -> None:
    """Only a regular file or a new path is replaced. A FIFO or a device node is refused and left;
    through a link to a file, the file is written and the link stays (a system's link such as
    /dev/stdout is never replaced by a file)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for target in (fifo, Path("/dev/null")):
        with pytest.raises(LayerskipError, match="is not a regular file"):
            SkipPolicy(skip_mlp=(1,)).save(target)
        with pytest.raises(LayerskipError, match="--save-policy .* is not a regular file"):
            fileio.check_output_file(target, "--save-policy")
    assert stat.S_ISFIFO(fifo.stat().st_mode) and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    (tmp_path / "real").mkdir()
    real, link = tmp_path / "real" / "policy.json", tmp_path / "link.json"
    real.write_text("{}")
    link.symlink_to(real)
    fileio.check_output_file(link, "--save-policy")
    SkipPolicy(skip_mlp=(1,)).save(link)
    assert link.is_symlink() and SkipPolicy.load(real).skip_mlp == (1,)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link.json", "real"]


# -- values out of range, and files an editor or a shell can produce ------------------------------

OUT_OF_RANGE = {
    "repeated vocabulary ids": (_with(draft_vocabulary=[5, 5, 5, 5]), "repeats token id(s) [5, 5, 5]"),
    "huge max_draft_tokens": (_draft(max_draft_tokens=10**9), "between 1 and 64 (got 1000000000)"),
    "huge draft_vocab_size": (_draft(draft_vocab_size=10**12), "more rows than any model's vocabulary"),
    "huge lookup run": (_draft(lookup_max_ngram=2, lookup_max_tokens=10**6), "lookup_max_tokens must be at most 64"),
    "huge verify padding": (_draft(min_verify_block=10**6), "min_verify_block must be between 0"),
    "unknown exit kind": (_with(exit={"adapter": "a.safetensors", "kind": "conv"}), "'conv' is not an adapter kind"),
}


@pytest.mark.parametrize("name", list(OUT_OF_RANGE))
def test_values_out_of_range_are_refused_on_load(name: str) -> None:
    data, fragment = OUT_OF_RANGE[name]
    with pytest.raises(LayerskipError, match="x.json") as info:
        SkipPolicy.from_dict(data, source="policy file x.json")
    assert fragment in str(info.value)
    if name == "unknown exit kind":
        assert "linear, layer" in str(info.value)


def test_head_values_are_checked_against_the_model(llama) -> None:
    rows = llama.get_output_embeddings().weight.shape[0]
    skip = dict(skip_attention=(1,))
    with pytest.raises(LayerskipError, match=f"draft_vocab_size {rows + 1} is more than this model's {rows}"):
        check_policy_fits(llama, SkipPolicy(**skip, draft=DraftSettings(draft_vocab_size=rows + 1)))
    check_policy_fits(llama, SkipPolicy(**skip, draft=DraftSettings(draft_vocab_size=rows)))  # the full head
    # The on-the-fly default head size is chosen per device before any model is known.
    on_the_fly = SkipPolicy.adaptive_selection(DraftSettings(draft_vocab_size=rows + 1))
    check_policy_fits(llama, on_the_fly)
    # Fixed for this model (generate --save-policy), that size is the full head it means.
    assert replace(on_the_fly, on_the_fly=None).with_model(llama).draft.draft_vocab_size == 0
    assert SkipPolicy(draft=DraftSettings(draft_vocab_size=8)).with_model(llama).draft.draft_vocab_size == 8
    few_ids = SkipPolicy(**skip, draft=DraftSettings(draft_vocab_size=8), draft_vocabulary=(1, 2, 3))
    with pytest.raises(LayerskipError, match="lists 3 token ids but draft.draft_vocab_size is 8"):
        check_policy_fits(llama, few_ids)
    repeated = SkipPolicy(**skip, draft=DraftSettings(draft_vocab_size=4), draft_vocabulary=(1, 2, 2, 3))
    with pytest.raises(LayerskipError, match=r"repeats token id\(s\) \[2\]"):
        check_policy_fits(llama, repeated)


def test_a_million_bad_entries_make_a_short_error(tmp_path: Path, llama) -> None:
    many = list(range(1000, 1000 + 10**6))
    cases = [
        (_with(skip_attention=many), lambda policy: check_policy_fits(llama, policy), "and 999995 more"),
        (_with(draft_vocabulary=[-1] * 10**6), lambda policy: None, "and 999995 more"),
        (_with(draft_vocabulary=[7] * 10**6), lambda policy: None, "and 999994 more"),
        (
            _with(draft_vocabulary=many, draft={"draft_vocab_size": 2}),
            lambda p: check_policy_fits(llama, p),
            "999995 more",
        ),
    ]
    for data, use, fragment in cases:
        path = tmp_path / "many.json"
        path.write_text(json.dumps(data))
        with pytest.raises(LayerskipError) as info:
            use(SkipPolicy.load(path))
        assert fragment in str(info.value) and len(str(info.value)) < 400, str(info.value)[:400]


def test_a_key_given_twice_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "twice.json"
    path.write_text('{"format": "layerskip-policy", "version": 1, "skip_mlp": [1], "draft": '
                    '{"max_draft_tokens": 4, "max_draft_tokens": 8}}')  # fmt: skip
    with pytest.raises(LayerskipError, match="gives key 'max_draft_tokens' twice"):
        SkipPolicy.load(path)


def test_a_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(SkipPolicy(skip_mlp=(1,)).to_dict()).encode())
    assert SkipPolicy.load(path).skip_mlp == (1,)


def test_links_that_lead_nowhere_are_named(tmp_path: Path) -> None:
    loop_a, loop_b, dangling = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "gone.json"
    loop_a.symlink_to(loop_b)
    loop_b.symlink_to(loop_a)
    dangling.symlink_to(tmp_path / "deleted.json")
    with pytest.raises(LayerskipError, match="is a loop of symbolic links"):
        SkipPolicy.load(loop_a)
    with pytest.raises(LayerskipError, match="symbolic link to .*deleted.json, which does not exist"):
        SkipPolicy.load(dangling)
