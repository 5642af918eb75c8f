"""What every benchmark result carries: the command, the machine, versions, the date; tables."""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
from pathlib import Path

import torch

SCHEMA_VERSION = 1


def median(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def command_line(args) -> str:
    """Rebuild ``specdec bench ...`` from the parsed arguments: every benchmark option (so the
    sizes show even at their defaults) and every engine option not at its default."""
    parser = getattr(args, "bench_parser", None)
    words = ["specdec", "bench", args.bench_command]
    if parser is None:
        return " ".join(words)
    # argparse keeps no public list of a parser's options or groups
    engine_dests = {a.dest for g in parser._action_groups if g.title == "engine" for a in g._group_actions}
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help",):
            continue
        value = getattr(args, action.dest, None)
        if value is None or (value == action.default and (action.dest in engine_dests or action.nargs == 0)):
            continue
        flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
        if action.nargs == 0:  # store_true / store_false
            words.append(flag)
        elif isinstance(value, (list, tuple)):
            words.append(flag)
            words.extend(str(v) for v in value)
        else:
            words.extend([flag, str(value)])
    return " ".join(shlex.quote(w) for w in words)


def _cpu_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The model name, with the family and model numbers where /proc/cpuinfo gives them (a VM's
    name can be as generic as "AMD EPYC", and CPU generations differ: Zen 4 is family 25)."""
    fields = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip() and fields:  # the first processor's block is enough
                    break
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return name


def _cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return sorted(set(flags) & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"})


def machine_info(bandwidth_bytes_per_s: float | None, device: torch.device | None = None) -> dict:
    info = {
        "cpu": _cpu_name(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_flags": _cpu_flags(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "bandwidth_gb_per_s": None if bandwidth_bytes_per_s is None else bandwidth_bytes_per_s / 1e9,
        "device": str(device) if device is not None else "cpu",
        # OpenMP's wait policy decides how a busy, shared machine treats the thread pool
        "env": {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")
                if k in os.environ},
    }
    info["cpu_info"] = cpu_info()
    if device is None or device.type == "cpu":
        info["cpu_kernels"] = cpu_kernels()
    if device is not None and device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def cpu_info() -> dict:
    from specdec.worker.device import cpu_info as read_cpu_info

    return read_cpu_info()


def cpu_kernels() -> dict[str, str]:
    """The CPU kernel choices the engine makes here (``layers.cpu_kernel_choice.cpu_kernel_choices``)."""
    from specdec.layers.cpu_kernel_choice import cpu_kernel_choices

    return cpu_kernel_choices()


def cpu_header(args) -> str:
    """What a run prints first: the CPU (vendor, family / model, name, the ISA features the kernels use)
    and, for a CPU run, the kernel each linear format, dtype and the attention take here."""
    from specdec.worker.device import describe_cpu

    lines = [f"CPU: {describe_cpu(cpu_info())}"]
    device = str(getattr(args, "device", None) or "auto")
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        lines += [f"  {name}: {kernel}" for name, kernel in cpu_kernels().items()]
    return "\n".join(lines)


def _git_revision() -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{rev}{'+dirty' if dirty else ''}" if rev else None


def versions() -> dict:
    import transformers

    try:
        from importlib.metadata import version

        specdec_version = version("specdec")
    except Exception:  # noqa: BLE001 - not installed as a distribution: source tree
        specdec_version = "source"
    return {
        "specdec": specdec_version, "specdec_git": _git_revision(), "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
    }


def result_header(args, kind: str, bandwidth: float | None, device=None) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "command": command_line(args),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(bandwidth, device),
        "versions": versions(),
    }


def run_benchmark(args, measure, render, plot_name: str | None = None) -> int:
    """What every ``specdec bench`` command does: measure, print the table, write --output-json,
    draw --plot with ``specdec.bench.plots.<plot_name>`` (commands without a plot pass None)."""
    print(cpu_header(args), flush=True)
    result = measure(args)
    print(render(result))
    write_json(result, args.output_json)
    if plot_name and args.plot:
        from specdec.bench import plots

        getattr(plots, plot_name)(result, args.plot)
    return 0


def write_json(result: dict, path: str | None) -> None:
    if not path:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=_jsonable) + "\n")


def _jsonable(value):
    if isinstance(value, float):
        return value
    if hasattr(value, "as_dict"):
        return value.as_dict()
    return str(value)


def fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # nan
            return "-"
        if value != 0 and abs(value) < 0.1:
            return f"{value:.2g}"
        return f"{value:.{digits}f}"
    return str(value)


def format_table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table (reads fine in a terminal too)."""
    cells = [[str(h) for h in headers]] + [[fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
