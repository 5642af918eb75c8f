"""``kernel_isa``: a test of the C++ CPU kernels runs once per instruction set this CPU runs
(AVX-512 and AVX2 on an AVX-512 machine, AVX2 alone on an AVX2 one), each built for it through
``SPECDEC_CPU_ISA``."""
import pytest

from specdec.kernels.cpu import woq_cpu


@pytest.fixture(params=woq_cpu.cpu_isas() or ["none"])
def kernel_isa(request, monkeypatch):
    if request.param != "none":
        monkeypatch.setenv(woq_cpu.ISA_ENV, request.param)
    return request.param
