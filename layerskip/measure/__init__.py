"""Measurement: latency, teacher-forced agreement, interleaved timing, benchmarks, profiles, reports, plots."""
