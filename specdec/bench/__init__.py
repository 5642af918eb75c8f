"""Benchmarks (``specdec bench ...``): ratios measured side by side, next to the machine's roofline."""

from specdec.bench import replay  # noqa: F401 (registers the benchmark-only "replay" method)
