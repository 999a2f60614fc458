"""Command-line front ends (installed as layerskip-generate, layerskip-bench)."""
