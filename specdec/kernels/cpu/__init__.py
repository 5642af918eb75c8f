"""C++ CPU kernels (``csrc/*.cpp``) built on first use by ``cpp_build``, their Python wrappers, and
the weight formats (``woq_format``) with the reference linears they compute."""
