"""llama.cpp as a peer in the bench, through llama-cpp-python (optional: ``pip install -e ".[llamacpp]"``).

Two methods run a GGUF file in llama.cpp: ``llama.cpp`` (plain greedy decoding) and
``llama.cpp-lookup`` (llama-cpp-python's own prompt-lookup decoding, ``LlamaPromptLookupDecoding``,
with the draft length and n-gram size HF's ``hf-pld`` gets). Each gets what the other methods get:
the prompt's token ids (fed as ids, not text), the same CPU thread count as HF's methods, greedy
choice (temperature 0, top-k 1), ``max_new_tokens``, and a stop at the same EOS ids, the EOS
token kept as HF ``generate`` keeps it. The file is the one the HF model was loaded from (an
embedded model's GGUF, or a ``.gguf`` model path), or ``--gguf PATH``.

What they compute is not what HF computes. llama.cpp multiplies the GGUF's quantised weights
(Q4_1, Q4_K_M ...) with activations it quantises to 8 bits, and keeps its KV cache in 16 bits;
HF runs the model in float32 (an embedded model's weights dequantised from the same file). Their
outputs are therefore not expected to equal ``hf-ar``'s token for token: the bench counts those
that do, and classes none of their divergences (``measure.divergence`` classes rounding between
two computations of one model, which this is not). The methods are refused for sampled runs and
for HF logits processors (``--repetition-penalty`` ...), which llama.cpp would not apply alike.
"""

from __future__ import annotations

import atexit
import contextlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerskip.errors import LayerskipError
from layerskip.stats import GenerationStats

METHODS = ("llama.cpp", "llama.cpp-lookup")
INSTALL = 'pip install -e ".[llamacpp]"'
LOOKUP_NGRAM = 2  # HF prompt lookup's default max_matching_ngram_size, as hf-pld runs it


def wanted(names: Sequence[str]) -> list[str]:
    """The llama.cpp methods among ``names``."""
    return [name for name in names if name in METHODS]


def require() -> Any:
    """The ``llama_cpp`` module; where it is missing (or its library does not load), one line saying how to get it."""
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # noqa: F401  (0.3's prompt lookup)
    except ImportError:
        raise LayerskipError(
            f"methods {' and '.join(METHODS)} need llama-cpp-python, which is not installed; run: {INSTALL}"
        ) from None
    except OSError as exc:  # the package is there, its compiled library is not loadable
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise LayerskipError(
            f"llama-cpp-python is installed but its library does not load ({detail}); reinstall it: {INSTALL}"
        ) from None
    return llama_cpp


def check_request(
    names: Sequence[str], model: str, gguf: str | None, sampled: bool, generation: dict[str, Any] | None
) -> None:
    """What a run with llama.cpp methods needs, checked before any model is loaded: the package,
    greedy decoding without HF processors, and a GGUF file to run (the model's own, or ``--gguf``)."""
    chosen = wanted(names)
    if not chosen:
        if gguf is not None:
            raise LayerskipError(f"--gguf is the file of methods {' and '.join(METHODS)}; add one to --methods")
        return
    require()
    asked = f"--methods {','.join(chosen)}"
    if sampled:
        raise LayerskipError(f"{asked}: the bench runs llama.cpp greedily; drop --temperature, --top-p, --top-k")
    if generation:
        raise LayerskipError(
            f"{asked}: llama.cpp applies no HF logits processors; drop {', '.join(sorted(generation))} "
            "(--generation-config and its flags)"
        )
    from layerskip.hf.models import EMBEDDED

    if gguf is not None:
        gguf_path(model, gguf)  # a file, or one line saying what it is instead
    elif model not in EMBEDDED and Path(model).suffix != ".gguf":
        raise LayerskipError(
            f"{asked}: llama.cpp runs a GGUF file, and model '{model}' is not one; pass --gguf PATH "
            "(this model quantised, e.g. a .Q4_K_M.gguf)"
        )


def gguf_path(model: str, gguf: str | None) -> Path:
    """The GGUF file the llama.cpp methods run: ``--gguf``, else the file the model was loaded from."""
    from layerskip.fileio import check_regular_file
    from layerskip.hf.models import EMBEDDED

    fix = "pass the path of a .gguf file"
    if gguf is not None:
        return check_regular_file(gguf, "--gguf file", fix, limit=2**62)
    if model in EMBEDDED:
        return EMBEDDED[model].locate_gguf()  # the model loaded from it, so it is there
    return check_regular_file(model, "GGUF file", fix, limit=2**62)


@dataclass(frozen=True)
class GGUFPeer:
    """Where the llama.cpp methods' model comes from: the file, and the context their KV cache
    holds (the longest prompt, the new tokens and a draft's worth more)."""

    path: Path
    context: int


class LlamaCppRunner:
    """A bench ``Runner`` over one llama.cpp model: (prompt ids, max new tokens) -> (new tokens, None).

    The model is loaded here, once, outside the timed calls (as the HF model is). Every call starts
    from an empty KV cache: llama-cpp-python would otherwise reuse the cache of a prompt it has just
    seen (its prefix match), which no other method does."""

    def __init__(
        self,
        peer: GGUFPeer,
        threads: int,
        eos_token_ids: Sequence[int],
        lookup_tokens: int | None = None,
        expected_vocab: int | None = None,
    ) -> None:
        llama_cpp = require()
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = None
        if lookup_tokens is not None:
            draft = LlamaPromptLookupDecoding(max_ngram_size=LOOKUP_NGRAM, num_pred_tokens=lookup_tokens)
        log = io.StringIO()  # llama.cpp's notes on the context it made (its log callback writes to sys.stderr)
        try:
            with contextlib.redirect_stderr(log):
                self.llm = llama_cpp.Llama(
                    model_path=str(peer.path),
                    n_ctx=peer.context,
                    n_threads=threads,
                    n_threads_batch=threads,
                    draft_model=draft,
                    # A draft model makes llama-cpp-python keep every position's logits, but it sizes
                    # that buffer by this argument (n_batch rows without it): past them it fails.
                    logits_all=draft is not None,
                    verbose=False,
                )
        except ValueError as exc:  # "Failed to load model from file: ...": the log may say why
            why = next((line.strip() for line in reversed(log.getvalue().splitlines()) if line.strip()), str(exc))
            raise LayerskipError(f"llama.cpp cannot load GGUF file {peer.path} ({why}); pass a GGUF it reads") from None
        atexit.register(self.close)  # before interpreter teardown, when its __del__ would fail
        self.eos = frozenset(eos_token_ids)
        self.context = peer.context
        self.lookup_tokens = lookup_tokens or 0
        if expected_vocab is not None and self.llm.n_vocab() != expected_vocab:
            vocab = self.llm.n_vocab()
            self.close()
            raise LayerskipError(
                f"GGUF file {peer.path} has {vocab:,} tokens and the model {expected_vocab:,}: the prompts' token ids "
                "would mean other words; pass --gguf with the same model"
            )

    @property
    def quantisation(self) -> str:
        """The GGUF's weight type as llama.cpp names it (``Q4_K_M``), or 'GGUF' where it does not say."""
        from gguf import LlamaFileType

        file_type = self.llm.metadata.get("general.file_type")
        try:
            return LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
        except (TypeError, ValueError):
            return "GGUF"

    def __call__(self, ids: list[int], max_new: int) -> tuple[list[int], GenerationStats | None]:
        tokens: list[int] = []
        if max_new <= 0:
            return tokens, None
        needed = len(ids) + max_new + self.lookup_tokens + 1
        if needed > self.context:  # llama-cpp-python would fail mid-call
            raise LayerskipError(
                f"a prompt of {len(ids)} tokens and {max_new} new tokens do not fit llama.cpp's context of "
                f"{self.context} tokens; build the GGUFPeer with a context of at least {needed}"
            )
        self.llm.reset()  # no prefix reuse from the previous call
        steps = self.llm.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)
        try:
            for token in steps:
                tokens.append(int(token))
                if token in self.eos or len(tokens) >= max_new:
                    break
        finally:
            steps.close()
        return tokens, None

    def close(self) -> None:
        self.llm.close()


def label(quantisation: str) -> str:
    """What a llama.cpp row computes with, as results record it (``PromptResult.computes_with``)."""
    return f"{quantisation} GGUF in llama.cpp"
