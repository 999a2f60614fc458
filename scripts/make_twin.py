"""Make an off-grid twin of a model: its decoder weights moved off any 4-bit grid (hf/twin.py).

The embedded models come from 4-bit GGUF files, which flatters an int4 draft; a twin is what a
full-precision model of the same shape looks like to the draft. Measure both with the same bench
command to see what your own full-precision model can expect:

    python scripts/make_twin.py --model smollm2-135m --out twins/smollm2-135m-offgrid
    python scripts/bench.py --model twins/smollm2-135m-offgrid --methods hf-ar,self-spec,hf-pld --policy auto --out DIR
"""

from layerskip.cli.twin import main

if __name__ == "__main__":
    raise SystemExit(main())
