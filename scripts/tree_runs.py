"""Run one script on several checkouts in turn: ``rounds`` rounds, each tree in a fresh process
per round (the trees alternating, so a change in the machine's load falls on all of them), each
writing its rows as JSON to ``--out``. Shared by the ``--compare`` modes of the overhead scripts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def run_trees(compare: str, rounds: int, script: str, argv: list[str], tag: str) -> dict[str, list]:
    """``compare``: "name=checkout,name=checkout". Returns name -> the rows of each round, in order."""
    trees = dict(item.split("=", 1) for item in compare.split(","))
    ext_root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "specdec" / "torch_extensions"
    runs: dict[str, list] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(rounds):
            for name, path in trees.items():
                out = Path(tmp) / f"{name}-{round_}.json"
                # each tree builds its C++ kernels into a folder of its own (one shared folder would
                # rebuild them at every switch)
                env = dict(os.environ, PYTHONPATH=str(Path(path).resolve()), OMP_NUM_THREADS="1",
                           TORCH_EXTENSIONS_DIR=str(Path(ext_root) / f"{tag}-{name}"))
                subprocess.run([sys.executable, script, *argv, "--out", str(out)], env=env, check=True,
                               stdout=subprocess.DEVNULL)
                runs[name].append(json.loads(out.read_text()))
                print(f"round {round_ + 1}/{rounds}: {name} done", flush=True)
    return runs
