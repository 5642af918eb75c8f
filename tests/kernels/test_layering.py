"""``specdec/kernels`` is the bottom layer: no module in it imports a package above it, at module
level or inside a function (kernels take tensors; the layers that own a layout or metadata adapt)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ABOVE = ("layers", "worker", "spec_decode", "engine", "executor", "server", "models", "structured_output",
         "bench", "training", "distributed", "lora", "tool_parsers", "llm", "config", "cli")


def imported_modules(source: str) -> list[str]:
    """Every absolute module name an import statement in ``source`` names (``from a import b``
    gives ``a`` and ``a.b``, since ``b`` may be a module)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def upward(names: list[str]) -> list[str]:
    return sorted({n for n in names if n.split(".")[:1] == ["specdec"] and len(n.split(".")) > 1
                   and n.split(".")[1] in ABOVE})


def test_the_check_sees_imports_inside_functions_and_from_forms():
    source = ("import torch\nfrom specdec.kernels.cpu import woq_cpu\n"
              "def f():\n    from specdec.layers.attention import AttentionMetadata\n"
              "import specdec.worker.device\nfrom specdec import spec_decode\n")
    assert upward(imported_modules(source)) == ["specdec.layers.attention", "specdec.layers.attention.AttentionMetadata",
                                                "specdec.spec_decode", "specdec.worker.device"]


def test_kernels_import_nothing_above_them():
    paths = sorted((ROOT / "specdec" / "kernels").rglob("*.py"))
    assert {"triton", "cpu"} <= {p.parent.name for p in paths}  # the walk saw both kinds
    offenders = {p.relative_to(ROOT).as_posix(): bad for p in paths
                 if (bad := upward(imported_modules(p.read_text())))}
    assert not offenders, offenders
