"""Compute kernels, each beside the pure-torch reference it is tested against.

``triton/``: GPU kernels (one source for CUDA and ROCm), tested on CPU under TRITON_INTERPRET=1.
``cpu/``: C++ CPU kernels (``cpu/csrc``) built on first use, and their Python wrappers.
This package sits below every other layer: it imports nothing from specdec outside it."""
