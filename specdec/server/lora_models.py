"""LoRAModels: the adapters a server answers to by ``model=``, besides the base model.

Each adapter is a model of its own in ``/v1/models`` (``parent``: the base model). Adapters
come from ``--lora-modules name=path`` at start-up and, with ``--enable-lora-runtime-updates``,
from ``/v1/load_lora_adapter``, which reads only folders inside an ``--lora-allowed-dir``:
a path with ``..``, outside those folders or leading out of them through a symlink is refused
(the endpoint must not let a client make the server read arbitrary files). Every adapter is
validated against the model when it is added (``EngineCore.validate_lora``): a bad one is a 400.
Ids are never reused, so a name unloaded and loaded again from other files gets its own prefix-cache
entries.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

from specdec.lora.request import LoRARequest
from specdec.server.protocol import APIError


MAX_NAME_CHARS = 256


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates
        return False
    return True


def parse_lora_modules(specs: list[str]) -> list[tuple[str, str]]:
    """``name=path`` items (vLLM's ``--lora-modules``) -> [(name, path)]."""
    out = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules takes name=path items, got {spec!r}")
        out.append((name.strip(), path.strip()))
    return out


class LoRAModels:
    def __init__(self, base_name: str, validate: Callable[[LoRARequest], None], forget: Callable[[int], None],
                 new_id: Callable[[], int], allowed_dirs: list[str] | None = None):
        self.base_name = base_name
        self._validate = validate  # EngineCore.validate_lora: thread-safe
        self._forget = forget  # EngineCore.remove_lora
        self.allowed_dirs = [os.path.realpath(d) for d in allowed_dirs or []]
        self.adapters: dict[str, LoRARequest] = {}
        self._new_id = new_id  # LoRARegistry.new_id: unique across the engine
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        with self._lock:
            return list(self.adapters)

    def lookup(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self.adapters.get(name)

    def add(self, name: str, path: str) -> LoRARequest:
        """Validate and register an adapter (a ``ValueError`` naming the problem)."""
        if not name or name == self.base_name:
            raise ValueError(f"lora_name {name!r} must be non-empty and differ from the base model's name")
        with self._lock:
            if name in self.adapters:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        request = LoRARequest(name, self._new_id(), path)
        self._validate(request)
        with self._lock:
            if name in self.adapters:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
            self.adapters[name] = request
        return request

    def load(self, name, path) -> LoRARequest:
        """``/v1/load_lora_adapter``: ``add`` for a path inside the allowed folders (400 otherwise)."""
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise APIError(400, "lora_name and lora_path must be non-empty strings", param="lora_name")
        if len(name) > MAX_NAME_CHARS or not _is_utf8(name):
            raise APIError(400, f"lora_name must be valid text of at most {MAX_NAME_CHARS} characters",
                           param="lora_name")
        self.check_allowed(path)
        try:
            return self.add(name, path)
        except ValueError as e:
            raise APIError(400, str(e), param="lora_path") from None

    def unload(self, name) -> None:
        with self._lock:
            request = self.adapters.pop(name, None) if isinstance(name, str) else None
        if request is None:
            raise APIError(404, f"no LoRA adapter named {str(name)[:200]!r} is loaded", param="lora_name",
                           code="model_not_found")
        self._forget(request.lora_int_id)

    def check_allowed(self, path: str) -> None:
        if "\x00" in path or not _is_utf8(path):
            raise APIError(400, "lora_path must be valid text without NUL characters", param="lora_path")
        if ".." in Path(path).parts:
            raise APIError(400, "lora_path must not contain '..'", param="lora_path")
        try:
            real = os.path.realpath(path)  # follows symlinks: one leading out of an allowed folder is outside
        except (OSError, ValueError) as e:
            raise APIError(400, f"lora_path cannot be resolved: {e}", param="lora_path") from None
        for allowed in self.allowed_dirs:
            if os.path.commonpath([real, allowed]) == allowed and real != allowed:
                return
        raise APIError(400, "lora_path is not inside a folder this server allows adapters from (--lora-allowed-dir)",
                       param="lora_path")
