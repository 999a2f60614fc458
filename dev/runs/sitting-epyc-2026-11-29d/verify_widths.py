"""A batch's verify forward by width, with grouped K/V heads read in place and copied per group.

Usage: PYTHONPATH=. python verify_widths.py MODEL CONTEXT ROWS. Every row holds CONTEXT tokens
(ragged: lengths CONTEXT, CONTEXT-1, CONTEXT-2 in turn, so the forward takes a mask); medians of
5 calls after one warm-up, the two paths interleaved per width.
"""

import contextlib
import statistics
import sys
import time

import torch

from layerskip import load_model
from layerskip.engine.calibration import own_text
from layerskip.hf import adapters
from layerskip.hf.cache import model_cache
from layerskip.hf.forward import block_hidden

GROUPED = adapters.grouped_attention


def timed(model: torch.nn.Module, cache, tokens: torch.Tensor, lengths: list[int], grouped: bool) -> float:
    adapters.grouped_attention = GROUPED if grouped else (lambda model: contextlib.nullcontext())
    seconds = []
    for _ in range(6):
        cache.set_lengths(lengths)
        start = time.perf_counter()
        block_hidden(model, tokens, cache)
        seconds.append(time.perf_counter() - start)
    adapters.grouped_attention = GROUPED
    return 1000 * statistics.median(seconds[1:])


def main() -> None:
    name, length, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model = load_model(name).model
    text = own_text(model)
    context = (text * (length // len(text) + 1))[:length]
    with torch.inference_mode():
        cache = model_cache(model)
        block_hidden(model, torch.tensor([context]), cache)
        cache.keep_rows([0] * rows)
        cache.reserve(length + 8)
        for ragged in (False, True):
            lengths = [length - (i % 3 if ragged else 0) for i in range(rows)]
            for width in (1, 2, 4):
                tokens = torch.full((rows, width), context[-1])
                copied = timed(model, cache, tokens, lengths, grouped=False)
                in_place = timed(model, cache, tokens, lengths, grouped=True)
                kind = "ragged" if ragged else "common"
                print(
                    f"{name} {rows} rows at {length} tokens, {kind}, width {width}: "
                    f"copied {copied:.1f} ms, in place {in_place:.1f} ms",
                    flush=True,
                )


if __name__ == "__main__":
    main()
