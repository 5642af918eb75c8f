"""Benchmarks (``specdec bench ...``): ratios measured side by side, next to the machine's roofline."""
