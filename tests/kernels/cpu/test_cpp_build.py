"""Building a C++ kernel (``cpp_build.load_ops``) with a build folder a killed build left locked, and
with two processes building the same kernel at once. The kernel built here is a one-function C file
(no torch headers), so each build takes a second or two."""
import ctypes
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

from specdec.kernels.cpu import cpp_build

PROBE = 'extern "C" int specdec_probe(void) { return 42; }\n'
TIMEOUT = 120  # seconds: a build that waits on a dead build's lock never finishes


def _probe_source(tmp_path: Path) -> Path:
    csrc = tmp_path / "csrc"
    csrc.mkdir(exist_ok=True)
    (csrc / "probe.cpp").write_text(PROBE)
    return csrc


def _built_probe(directory: str, name: str) -> int:
    return ctypes.CDLL(os.path.join(directory, f"{name}.so")).specdec_probe()


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_build(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    csrc = _probe_source(tmp_path)
    directory = cpp_build.build_dir("specdec_probe_a")
    # torch's baton as a build killed mid-compile leaves it: an empty file no live process owns
    Path(directory, cpp_build.BATON).write_text("")
    result = []
    worker = threading.Thread(daemon=True, target=lambda: result.append(cpp_build.load_ops(
        "specdec_probe_a", "probe.cpp", "specdec_probe_a", ["-O1"], what="the probe", fallback="none", csrc=csrc)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worker.start()
        worker.join(TIMEOUT)
    alive = worker.is_alive()
    Path(directory, cpp_build.BATON).unlink(missing_ok=True)  # frees a hung build so the thread ends
    assert not alive, "the build waited on a lock no live build holds"
    assert any("interrupted build" in str(w.message) for w in caught)
    assert result and result[0] is not None
    assert _built_probe(directory, "specdec_probe_a") == 42
    assert not Path(directory, cpp_build.BATON).exists()


BUILDER = """
import ctypes, os, sys
from pathlib import Path
from specdec.kernels.cpu import cpp_build
print("ready", flush=True)
sys.stdin.readline()
ops = cpp_build.load_ops("specdec_probe_b", "probe.cpp", "specdec_probe_b", ["-O1"], what="the probe",
                         fallback="none", csrc=Path(sys.argv[1]))
lib = ctypes.CDLL(os.path.join(cpp_build.build_dir("specdec_probe_b"), "specdec_probe_b.so"))
print("built", ops is not None, lib.specdec_probe(), flush=True)
"""


def test_two_processes_building_one_kernel_at_once_both_load_it(tmp_path, monkeypatch):
    """Both start their build together (each waits for a line on stdin), over a lock a killed build left."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    csrc = _probe_source(tmp_path)
    Path(cpp_build.build_dir("specdec_probe_b"), cpp_build.BATON).write_text("")
    root = str(Path(cpp_build.__file__).parents[3])  # this checkout, ahead of any installed copy
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    builders = [subprocess.Popen([sys.executable, "-c", BUILDER, str(csrc)], env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for b in builders:
            assert b.stdout.readline().strip() == "ready"
        for b in builders:
            b.stdin.write("go\n")
            b.stdin.flush()
        outs = [b.communicate(timeout=TIMEOUT) for b in builders]
    finally:
        for b in builders:
            if b.poll() is None:
                b.kill()
    for b, (out, err) in zip(builders, outs):
        assert b.returncode == 0, err
        assert out.strip().splitlines()[-1] == "built True 42", err
