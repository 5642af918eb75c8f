"""Which machine kind a ``bench_results/*.json`` was measured on, from its ``machine`` block.

A CPU kind is its vendor, family and model (what decides which kernel wins: Zen 4 issues AVX-512 as
two 256-bit halves, Zen 5 at full width, Sapphire Rapids-class Xeons add AMX tiles), with the ISA
features the kernels use. The block comes in three generations: ``cpu_info`` (vendor, family, model,
ISA), the printed CPU header text (``"CPU: GenuineIntel family 6 model 167 (...); ISA: ..."``), or
only a CPU name and a few flags. Where family and model are missing, the file name or the CPU name
may say the kind (``zen4``, ``Zen 5``, ``icelake``); else the ISA flags group it. A result without
a machine block is "unknown"; a GPU result is its GPU.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ZEN4 = "AMD Zen 4 (EPYC family 25 model 17: AVX-512 as two 256-bit halves, avx512_bf16, VNNI)"
ZEN5 = "AMD Zen 5 (EPYC family 26: full-width AVX-512, avx512_bf16, VNNI)"
ICELAKE = "Intel Ice Lake class (AVX-512 and VNNI, no avx512_bf16, no AMX)"
UNKNOWN = "unknown (the result records no machine)"
NAME_HINTS = (("zen4", ZEN4), ("zen5", ZEN5), ("icelake", ICELAKE))  # in the file name or the CPU name
ICELAKE_MODELS = (106, 108)  # Intel family 6: Ice Lake server
AMX = ("amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class CpuIdentity:
    vendor: str | None    # "AMD" or "Intel"
    family: int | None
    model: int | None
    name: str             # the model name as recorded ("AMD EPYC", "Intel(R) Xeon(R) Processor")
    isa: frozenset[str]   # the kernel-relevant features recorded (avx2 ... amx_int8)


def _vendor(text: str) -> str | None:
    return "AMD" if "AMD" in text else "Intel" if "Intel" in text else None


def cpu_identity(machine: dict) -> CpuIdentity:
    info = machine.get("cpu_info") or {}
    header = machine.get("cpu_header") or ""  # the printed CPU line, when that is all a result kept
    text = " ".join(str(v) for v in (info.get("vendor"), header, machine.get("cpu")) if v)
    numbers = re.search(r"family (\d+) model (\d+)", header or machine.get("cpu") or "")
    family = info.get("family") if info.get("family") is not None else int(numbers[1]) if numbers else None
    model = info.get("model") if info.get("model") is not None else int(numbers[2]) if numbers else None
    named = re.search(r"model \d+ \((.*)\); ISA", header)
    name = info.get("model_name") or (named[1] if named else None) or machine.get("cpu") or "?"
    listed = re.search(r"ISA: ([^\n]*)", header)
    isa = set(info.get("isa") or []) | set(machine.get("cpu_flags") or []) | set(listed[1].split() if listed else [])
    return CpuIdentity(_vendor(text), family, model, name, frozenset(isa))


def isa_summary(isa: frozenset[str]) -> str:
    """The widest matmul path the flags allow."""
    if any(flag in isa for flag in AMX):
        return "AMX"
    if "avx512_bf16" in isa:
        return "AVX-512 with avx512_bf16"
    if "avx512f" in isa:
        return "AVX-512 without avx512_bf16"
    return "AVX2" if "avx2" in isa else "no AVX2 recorded"


def _known(cpu: CpuIdentity) -> str | None:
    if cpu.vendor == "AMD" and (cpu.family, cpu.model) == (25, 17):
        return ZEN4
    if cpu.vendor == "AMD" and cpu.family == 26:
        return ZEN5
    if cpu.vendor == "Intel" and cpu.family == 6 and any(flag in cpu.isa for flag in AMX):
        return f"Intel Xeon with AMX (family 6 model {cpu.model}: AMX bf16/int8 tiles, avx512_bf16, VNNI)"
    if cpu.vendor == "Intel" and cpu.family == 6 and cpu.model in ICELAKE_MODELS:
        return ICELAKE
    return None


def machine_kind(path: Path, data: dict) -> tuple[str, str]:
    """(the machine kind's label, how it was identified) for one result."""
    machine = data.get("machine")
    gpu = data.get("gpu") or (machine.get("gpu") if isinstance(machine, dict) else None)
    if gpu:
        return f"{gpu} (GPU)", "the GPU it records"
    if not machine:
        return UNKNOWN, "no machine block"
    cpu = cpu_identity(machine)
    if cpu.family is not None:
        numbers = f"{cpu.vendor or '?'} family {cpu.family} model {cpu.model}"
        return _known(cpu) or f"{numbers} ({cpu.name}; {isa_summary(cpu.isa)})", f"{numbers} recorded"
    hint = next((label for needle, label in NAME_HINTS
                 if needle in path.stem.lower() or needle in cpu.name.lower().replace(" ", "")), None)
    if hint:
        return hint, "the file or CPU name (its machine block lacks family/model)"
    why = f"flags only ({isa_summary(cpu.isa)}; family/model not recorded)"
    if cpu.vendor == "Intel" and "avx512f" in cpu.isa and "avx512_bf16" not in cpu.isa:
        return ICELAKE, why
    if cpu.vendor == "AMD" and "avx512_bf16" in cpu.isa:
        return "AMD EPYC with avx512_bf16, family/model not recorded (Zen 4 or Zen 5)", why
    return f"{cpu.name} ({isa_summary(cpu.isa)}), family/model not recorded", why
