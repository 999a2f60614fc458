"""One verify forward over a flattened token tree, and keeping the accepted path's K/V.

The tree forward is checked against a brute force: for every root-to-leaf path, a plain causal
forward (HF's own masks, no cache) over prefix + pending + path; the tree's hidden state at each
node must equal the path forward's at that node. The prefix (9 tokens) and the tree's deepest
path (7 nodes) are both longer than the sliding window (4) of Mistral / Gemma 2 / Gemma 3, so
the window is applied to prefix keys and to ancestors, by position.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from oracles import row_lengths
from tiny_models import ARCHS, SLIDING_WINDOW, random_prompt, tiny_model

from layerskip.errors import LayerskipError
from layerskip.hf import adapters
from layerskip.hf import tree as hf_tree
from layerskip.hf.cache import RollbackCache
from layerskip.hf.forward import block_hidden, full_hidden, stack_forward
from layerskip.hf.tree import block_depths, block_visibility

ATOL = 1e-5

# A tree of 14 nodes in depth-first order: a 7-deep first branch (longer than the window), a
# fork under node 1, a second root child with two leaves, a third with a 3-deep chain.
PARENTS = [-1, 0, 1, 2, 3, 4, 5, 1, 7, -1, 9, 9, -1, 12]
TOKENS = [5, 9, 17, 3, 3, 40, 22, 5, 8, 100, 77, 1, 5, 64]
PROMPT_LENGTH = 10  # 9 committed + the pending token

# Every architecture with the attention implementations it runs (Gemma 2's logit soft-capping
# rules out sdpa); the default for each tiny config comes first.
CASES = [(arch, impl) for arch in ARCHS for impl in ("sdpa", "eager") if not (arch == "gemma2" and impl == "sdpa")]
SLIDING = ["mistral", "gemma2", "gemma3_text"]


@functools.cache
def _model(arch: str, impl: str) -> torch.nn.Module:
    model = tiny_model(arch, attn_implementation=impl)
    assert model.config._attn_implementation == impl
    return model


def _paths(parents: list[int]) -> list[list[int]]:
    """Root-to-leaf paths as node indices."""
    leaves = [i for i in range(len(parents)) if i not in parents]
    paths = []
    for leaf in leaves:
        path, node = [], leaf
        while node != -1:
            path.append(node)
            node = parents[node]
        paths.append(path[::-1])
    return paths


def _prefilled(model: torch.nn.Module, prefix: list[int]) -> RollbackCache:
    cache = RollbackCache(adapters.sliding_windows(model))
    full_hidden(model, torch.tensor([prefix]), cache, 1)
    return cache


def tree_hidden(model: torch.nn.Module, ids: torch.Tensor, parents: list[int], cache: RollbackCache) -> torch.Tensor:
    """One row's tree block through the verify forward: ``[n+1, H]``."""
    return block_hidden(model, ids, cache, [parents])[0]


def _tree_forward(model: torch.nn.Module, prompt: list[int]) -> tuple[torch.Tensor, RollbackCache]:
    prefix, pending = prompt[:-1], prompt[-1]
    cache = _prefilled(model, prefix)
    hidden = tree_hidden(model, torch.tensor([[pending, *TOKENS]]), PARENTS, cache)
    return hidden, cache


def _path_hidden(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Plain causal forward, no cache: hidden states ``[1 + len(tokens), H]`` of pending + tokens."""
    ids = torch.tensor([[*prompt, *tokens]])
    return stack_forward(model, ids)[0, len(prompt) - 1 :]


# -- the tree's structure --------------------------------------------------------------------------


def test_depths_and_visibility() -> None:
    parents = [-1, 0, -1, 2, 2]
    assert block_depths(parents) == [0, 1, 2, 1, 2, 2]
    visible = block_visibility(parents)
    expected = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [1, 0, 0, 1, 1, 0],
        [1, 0, 0, 1, 0, 1],
    ]
    assert visible.int().tolist() == expected


@pytest.mark.parametrize("parents", [[0], [-1, 2, -1], [-2]])
def test_parents_must_come_first(parents: list[int]) -> None:
    with pytest.raises(ValueError):
        block_depths(parents)


# -- the forward against the brute force -----------------------------------------------------------


@pytest.mark.parametrize("arch,impl", CASES)
def test_tree_forward_matches_each_path(arch: str, impl: str) -> None:
    model = _model(arch, impl)
    prompt = random_prompt(length=PROMPT_LENGTH)
    with torch.inference_mode():
        hidden, cache = _tree_forward(model, prompt)
        assert hidden.shape == (len(TOKENS) + 1, model.config.get_text_config().hidden_size)
        assert row_lengths(cache) == [PROMPT_LENGTH - 1 + len(TOKENS) + 1]
        for path in _paths(PARENTS):
            expected = _path_hidden(model, prompt, [TOKENS[i] for i in path])  # [1 + len(path), H]
            rows = [0, *(i + 1 for i in path)]
            torch.testing.assert_close(hidden[rows], expected, atol=ATOL, rtol=ATOL, msg=f"{arch} {impl} path {path}")


@pytest.mark.parametrize("arch,impl", [("llama", "sdpa"), ("gemma2", "eager"), ("mistral", "sdpa")])
def test_tree_forward_in_bf16(arch: str, impl: str) -> None:
    """The eager mask is additive in the model's dtype: bf16 runs, within bf16 rounding of the paths."""
    model = tiny_model(arch, attn_implementation=impl).to(torch.bfloat16)
    prompt = random_prompt(length=PROMPT_LENGTH)
    with torch.inference_mode():
        hidden, _ = _tree_forward(model, prompt)
        assert hidden.dtype == torch.bfloat16
        for path in _paths(PARENTS):
            expected = _path_hidden(model, prompt, [TOKENS[i] for i in path])
            # |hidden| <= ~4, so 2 bf16 ulps there are 0.03 (fp32 holds 1e-5: see above).
            torch.testing.assert_close(hidden[[0, *(i + 1 for i in path)]], expected, atol=0.05, rtol=0.0)


@pytest.mark.parametrize("arch", SLIDING)
def test_tree_forward_without_the_window_is_caught(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The brute force would catch a tree mask that forgot the window (the check can fail)."""
    model = _model(arch, "eager")
    windows = adapters.sliding_windows(model)
    assert SLIDING_WINDOW in windows
    monkeypatch.setattr(hf_tree.adapters, "sliding_windows", lambda m: [None] * len(windows))
    prompt = random_prompt(length=PROMPT_LENGTH)
    with torch.inference_mode():
        hidden, _ = _tree_forward(model, prompt)
        path = _paths(PARENTS)[0]
        expected = _path_hidden(model, prompt, [TOKENS[i] for i in path])
    assert (hidden[[0, *(i + 1 for i in path)]] - expected).abs().max() > 1e-3


@pytest.mark.parametrize("chain", [[4, 8, 15, 16, 23, 42], []], ids=["chain", "root-only"])
def test_a_chain_is_the_plain_verify_block(chain: list[int]) -> None:
    """A tree with one child per node is a chain (none: a plain step): the same hidden states as ``full_hidden``."""
    model = _model("gemma3_text", "sdpa")
    prompt = random_prompt(length=PROMPT_LENGTH)
    with torch.inference_mode():
        tree_cache = _prefilled(model, prompt[:-1])
        tree = tree_hidden(model, torch.tensor([[prompt[-1], *chain]]), list(range(-1, len(chain) - 1)), tree_cache)
        plain_cache = _prefilled(model, prompt[:-1])
        plain = full_hidden(model, torch.tensor([[prompt[-1], *chain]]), plain_cache, len(chain) + 1)
    torch.testing.assert_close(tree, plain, atol=ATOL, rtol=ATOL)


def test_refuses_what_it_cannot_mask() -> None:
    model = _model("llama", "sdpa")
    cache = _prefilled(model, [1, 2, 3])
    with pytest.raises(ValueError):
        tree_hidden(model, torch.tensor([[4, 5, 6]]), [-1, 0, 1], cache)
    flash = tiny_model("llama")
    flash.config._attn_implementation = "flash_attention_2"  # a fresh model: only its config is read
    with pytest.raises(LayerskipError, match="sdpa"):
        hf_tree.block_masks(flash, [3], [[-1]], 2, torch.device("cpu"))


# -- keeping the accepted path ---------------------------------------------------------------------

# Accepted paths (node indices) of partial acceptance: inside the first branch (rows in place,
# nothing copied), through the fork under node 1, the second and third root children, and none.
ACCEPTED = {"first-branch": [0, 1, 2], "fork": [0, 1, 7, 8], "second": [9, 11], "third": [12, 13], "none": []}


@pytest.mark.parametrize("accepted", list(ACCEPTED))
@pytest.mark.parametrize("arch,impl", [case for case in CASES if case[1] == "sdpa" or case[0] == "gemma2"])
def test_keep_path_then_continue(arch: str, impl: str, accepted: str) -> None:
    """After ``keep_paths`` the cache is the one a plain decode of the accepted path would hold: the
    next forwards (a chain block, then one token) give the same hidden states as a fresh cache
    that only ever saw prefix + pending + path."""
    model = _model(arch, impl)
    prompt = random_prompt(length=PROMPT_LENGTH)
    path = ACCEPTED[accepted]
    start = PROMPT_LENGTH - 1
    with torch.inference_mode():
        _, cache = _tree_forward(model, prompt)
        cache.keep_paths([start], [[0, *(i + 1 for i in path)]])
        kept = start + 1 + len(path)
        assert row_lengths(cache) == [kept]
        fresh = _prefilled(model, [*prompt, *(TOKENS[i] for i in path)])
        for ids in ([7, 70, 33], [12]):  # a 3-token block, then a single token
            block = torch.tensor([ids])
            got = full_hidden(model, block, cache, len(ids))
            want = full_hidden(model, block, fresh, len(ids))
            torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL, msg=f"{arch} {accepted}")
        # The K/V themselves are the fresh cache's, row for row.
        for mine, theirs in zip(cache.layers, fresh.layers, strict=True):
            torch.testing.assert_close(mine.keys, theirs.keys, atol=ATOL, rtol=ATOL)
            torch.testing.assert_close(mine.values, theirs.values, atol=ATOL, rtol=ATOL)


def test_keep_path_copies_only_what_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model("llama", "sdpa")
    selected: list[int] = []
    original = torch.Tensor.index_select

    def counting(self: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        selected.append(len(index))
        return original(self, dim, index)

    with torch.inference_mode():
        _, cache = _tree_forward(model, random_prompt(length=PROMPT_LENGTH))
        monkeypatch.setattr(torch.Tensor, "index_select", counting)
        cache.keep_paths([9], [[0, 1, 2, 3]])  # the first branch: already contiguous
        assert selected == []
        _, cache = _tree_forward(model, random_prompt(length=PROMPT_LENGTH))
        cache.keep_paths([9], [[0, 1, 2, 8, 9]])  # fork under node 1: two rows move, per K and V of each layer
        assert selected == [2] * 2 * adapters.num_layers(model)


@pytest.mark.parametrize("rows", [[], [0, 0], [2, 1], [-1, 3]])
def test_keep_path_rejects_unordered_rows(rows: list[int]) -> None:
    cache = RollbackCache([None])
    with pytest.raises(ValueError):
        cache.keep_paths([0], [rows])


def test_keep_path_beyond_the_block_is_a_bug() -> None:
    model = _model("llama", "sdpa")
    with torch.inference_mode():
        _, cache = _tree_forward(model, random_prompt(length=PROMPT_LENGTH))
        with pytest.raises(RuntimeError, match="reaches row"):
            cache.keep_paths([9], [[0, len(TOKENS) + 1]])


@pytest.mark.parametrize(
    "arch,impl", [("llama", "sdpa"), ("gemma3_text", "sdpa"), ("gemma2", "eager"), ("gpt2", "sdpa")]
)
def test_rows_of_other_lengths_and_trees_in_one_block(arch: str, impl: str) -> None:
    """Rows at different lengths, one with the tree, one with a short chain padded by fillers and one
    with nothing drafted, verified in one forward: each row's hidden states and kept K/V are what it
    gets alone."""
    model = _model(arch, impl)
    prompts = [random_prompt(length=PROMPT_LENGTH), random_prompt(length=6), random_prompt(length=13)]
    width = len(TOKENS) + 1
    chain = [7, 8, 9]
    blocks = [
        [prompts[0][-1], *TOKENS],
        [prompts[1][-1], *chain, *[chain[-1]] * (width - 1 - len(chain))],
        [prompts[2][-1]] * width,
    ]
    parents = [PARENTS, list(range(-1, width - 2)), None]
    paths = [[0, 1, 8, 9], [0, 1, 2], [0]]
    with torch.inference_mode():
        cache = RollbackCache(adapters.sliding_windows(model), rows=3)
        block_hidden(model, torch.tensor([[p[0]] for p in prompts]), cache)  # the buffers take their shapes
        cache.reserve(64)
        for b, prompt in enumerate(prompts):  # then each row alone through its view
            full_hidden(model, torch.tensor([prompt[1:-1]]), cache.row_view(b), 1)
        cache.set_lengths([len(p) - 1 for p in prompts])
        starts = list(cache.lengths)
        together = block_hidden(model, torch.tensor(blocks), cache, parents)
        cache.keep_paths(starts, paths)
        after = block_hidden(model, torch.tensor([[5], [6], [7]]), cache)  # one more token per row
        for b, prompt in enumerate(prompts):
            alone_cache = _prefilled(model, prompt[:-1])
            alone = block_hidden(model, torch.tensor([blocks[b]]), alone_cache, [parents[b]])[0]
            torch.testing.assert_close(together[b], alone, atol=ATOL, rtol=ATOL, msg=f"{arch} row {b}")
            alone_cache.keep_paths([starts[b]], [paths[b]])
            next_alone = block_hidden(model, torch.tensor([[5 + b]]), alone_cache)[0]
            torch.testing.assert_close(after[b], next_alone, atol=ATOL, rtol=ATOL, msg=f"{arch} row {b} after")


GROUPED = [arch for arch in ARCHS if arch not in ("gemma2", "gpt_neox", "gpt_neox_serial", "gpt2")]


@pytest.mark.parametrize("arch", GROUPED)
def test_wide_verify_reads_grouped_heads_in_place(arch, monkeypatch):
    """A verify of several positions over rows of different lengths (a mask) reads each K/V head
    in place for its query group, not copied once per group (HF's ``repeat_kv``, which dominated
    sixteen rows' verify at long contexts), to the bit what HF's own sdpa path gives; the model
    names ``sdpa`` again afterwards."""
    import transformers.integrations.sdpa_attention as hf_sdpa

    model = _model(arch, "sdpa")
    assert model.config.num_attention_heads > model.config.num_key_value_heads
    prompts = [random_prompt(length=PROMPT_LENGTH), random_prompt(length=6, seed=1), random_prompt(length=13, seed=2)]
    blocks = torch.tensor([[p[-1], *TOKENS[:4]] for p in prompts])  # [3, 5]

    def verify() -> torch.Tensor:
        cache = RollbackCache(adapters.sliding_windows(model), rows=3)
        block_hidden(model, torch.tensor([[p[0]] for p in prompts]), cache)
        cache.reserve(32)
        for b, prompt in enumerate(prompts):
            full_hidden(model, torch.tensor([prompt[1:-1]]), cache.row_view(b), 1)
        cache.set_lengths([len(p) - 1 for p in prompts])
        return block_hidden(model, blocks, cache)

    with torch.inference_mode():
        with monkeypatch.context() as patch:
            patch.setattr(adapters, "grouped_attention", lambda model: contextlib.nullcontext())
            hf_own = verify()

        def no_copies(*args, **kwargs):
            raise AssertionError("K/V heads copied per query group")

        monkeypatch.setattr(hf_sdpa, "repeat_kv", no_copies)
        in_place = verify()
    assert torch.equal(in_place, hf_own)
    assert model.config._attn_implementation == "sdpa"
