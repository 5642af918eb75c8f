"""The method registry: each method one entry that validates its config, describes its needs and
builds its proposer; config validation reads it; benchmark-only methods register from bench/,
and the serving core imports nothing from bench/ or training/."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.config import SpeculativeConfig
from specdec.spec_decode import methods
from specdec.spec_decode.methods import SpecMethod, get_method, method_names

ROOT = Path(__file__).resolve().parents[2]
SERVING_CORE = ("engine", "executor", "worker", "spec_decode", "models", "layers", "kernels", "server")


def test_the_builtin_methods_describe_what_they_need():
    assert {"draft_model", "eagle", "eagle3", "ngram", "suffix"} <= set(method_names())
    draft, eagle, ngram = get_method("draft_model"), get_method("eagle3"), get_method("ngram")
    assert draft.needs_model and draft.has_draft_model and draft.supports_tree and draft.supports_draft_vocab
    assert eagle.needs_target_hidden and not eagle.graph_capturable and not eagle.supports_draft_vocab
    assert draft.draft_kv_cache and eagle.draft_kv_cache and not ngram.draft_kv_cache
    assert not (ngram.needs_model or ngram.has_draft_model or ngram.supports_tree) and ngram.graph_capturable


def test_config_validation_asks_the_registry(monkeypatch):
    with pytest.raises(ValueError, match=r"method must be one of \('draft_model', 'eagle'.*got 'nope'"):
        SpeculativeConfig(method="nope")
    with pytest.raises(ValueError, match="model .* is required for method 'eagle'"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="prompt_lookup_min"):  # ngram's own check
        SpeculativeConfig(method="ngram", prompt_lookup_min=3, prompt_lookup_max=2)
    checked = []
    custom = SpecMethod("custom", lambda spec, runner, vocab, parts: None, supports_tree=True,
                        validate=lambda spec: checked.append(spec.tree_topk))
    monkeypatch.setitem(methods._REGISTRY, "custom", custom)
    SpeculativeConfig(method="custom", tree_topk=2)  # a registered method is a valid method, trees included
    assert checked == [2]
    with pytest.raises(ValueError, match="tree_topk > 1 needs method .*'custom'.*got 'ngram'"):
        SpeculativeConfig(method="ngram", tree_topk=2)


def test_controls_name_the_ones_a_method_has():
    class Recorder:
        def reset_history(self):
            self.reset = True

    proposer = Recorder()
    get_method("suffix").control(proposer, "reset_history")
    assert proposer.reset
    with pytest.raises(ValueError, match=r"method 'suffix' has no proposer control 'set_acceptance'; it has \['reset_history'\]"):
        get_method("suffix").control(proposer, "set_acceptance", 0.5)


def test_replay_registers_itself_from_bench_only():
    code = ("import specdec.llm, specdec.server.app, specdec.cli; from specdec.spec_decode.methods import method_names; "
            "assert 'replay' not in method_names(), method_names(); import specdec.bench; "
            "assert 'replay' in method_names(); from specdec.config import SpeculativeConfig; "
            "SpeculativeConfig(method='replay', acceptance=0.5)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
    import specdec.bench  # noqa: F401

    replay = get_method("replay")
    assert replay.build.__module__ == "specdec.bench.replay" and "specdec.bench.replay" in methods.registering_modules()
    with pytest.raises(ValueError, match="acceptance must be in"):
        SpeculativeConfig(method="replay", acceptance=1.5)


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_the_serving_core_imports_nothing_from_bench_or_training():
    offenders = []
    for layer in SERVING_CORE:
        for path in sorted((ROOT / "specdec" / layer).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            bad = [n for n in _imports(path) if n.split(".")[:2] in (["specdec", "bench"], ["specdec", "training"])
                   or n in ("specdec.bench", "specdec.training")]
            if bad:
                offenders.append(f"{rel}: {sorted(set(bad))}")
    assert not offenders, offenders
    assert len(list((ROOT / "specdec" / "worker").rglob("*.py"))) > 3  # the walk saw the package


def test_nothing_outside_the_registry_branches_on_a_method_name():
    import specdec.bench  # noqa: F401  (replay too)

    names = "|".join(method_names())
    branch = re.compile(rf"""method\s*(==|!=)\s*["']({names})["']|method\s+(not\s+)?in\s*[(\[{{].*["']({names})["']""")
    hits = []
    for layer in SERVING_CORE + ("config.py", "cli.py", "llm.py"):
        base = ROOT / "specdec" / layer
        for path in [base] if base.is_file() else sorted(base.rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "specdec/spec_decode/methods.py":
                continue
            hits += [f"{rel}: {line.strip()}" for line in path.read_text().splitlines() if branch.search(line)]
    # models/default.py picks the method for a shipped draft folder from what the folder holds
    assert all(h.startswith("specdec/models/default.py") for h in hits), hits
    assert branch.search('if spec.method == "ngram":') and branch.search("m.method in ('eagle', 'x')")
