"""The grammar engine (xgrammar): one compiler per tokenizer, compiled grammars cached.

xgrammar was chosen over llguidance by measured mask time on a 2-core CPU (the figures are in
the commit that added it); it also rolls a matcher back and forks it, which verifying drafted
tokens needs. A compiled grammar is reused by every request with the
same constraint (the most recent ones by constraint, the rest through the compiler's cache,
which is bounded in bytes).
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

from specdec.structured_output.params import StructuredOutputsParams

# the compiler's own cache: every distinct grammar a client sends lands in it, so it bounds a
# server's resident memory; an evicted grammar recompiles in milliseconds
CACHE_LIMIT_BYTES = 32 << 20
# compiled grammars kept by constraint, at most this many and bytes (the compiler's cache may
# have evicted them: this is on top of its bound)
RECENT_GRAMMARS, RECENT_GRAMMARS_BYTES = 64, 64 << 20
# JSON schemas with free whitespace: at most this many whitespace characters in a row (a
# model that likes blank lines would otherwise spend its whole budget on them)
MAX_WHITESPACE = 16

_backends: dict[tuple, GrammarBackend] = {}
_backends_lock = threading.Lock()


class GrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(eos_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=CACHE_LIMIT_BYTES)
        self._recent: OrderedDict[tuple, tuple[object, int]] = OrderedDict()  # key -> (compiled, bytes)
        self._recent_bytes = 0
        self._recent_lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of ``params``; a schema or grammar xgrammar refuses is a
        ``ValueError`` naming the field (``structured_outputs.json`` ...).

        Every request is compiled twice (the engine checks it, the worker builds its matcher),
        and the compiler's own cache is keyed by grammar text: a JSON schema would still be
        converted to EBNF each time (not free for a large schema and vocabulary). The
        most recent grammars are therefore kept by ``params.cache_key``; thread-safe (a server
        thread compiles while the engine steps)."""
        key = params.cache_key
        with self._recent_lock:
            hit = self._recent.get(key)
            if hit is not None:
                self._recent.move_to_end(key)
                return hit[0]
        compiled = self._compile(params)
        size = int(getattr(compiled, "memory_size_bytes", 0))
        with self._recent_lock:
            if key not in self._recent and size <= RECENT_GRAMMARS_BYTES:
                self._recent[key] = (compiled, size)
                self._recent_bytes += size
                while len(self._recent) > RECENT_GRAMMARS or self._recent_bytes > RECENT_GRAMMARS_BYTES:
                    self._recent_bytes -= self._recent.popitem(last=False)[1][1]
        return compiled

    def _compile(self, params: StructuredOutputsParams):
        kind = params.kind
        if params.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported by the xgrammar backend "
                             "(use disable_any_whitespace)")
        try:
            if kind == "json":
                return self.compiler.compile_grammar(json_schema_ebnf(
                    params.json, any_whitespace=not params.disable_any_whitespace,
                    strict_mode=params.disable_additional_properties, max_whitespace_cnt=MAX_WHITESPACE))
            if kind == "json_object":  # any object, with the same whitespace control as a schema
                return self.compiler.compile_json_schema('{"type": "object"}',
                                                         any_whitespace=not params.disable_any_whitespace)
            if kind == "regex":
                return self.compiler.compile_regex(params.regex)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(params.choice))
            return self.compiler.compile_grammar(params.grammar)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / its own
            hint = ""
            if kind == "grammar" and _LARK_RULE.search(params.grammar) and "::=" not in params.grammar:
                hint = " (this looks like a Lark grammar; only EBNF is supported: root ::= ...)"
            raise ValueError(f"structured_outputs.{kind}: {_first_line(e)}{hint}") from None


# xgrammar 0.2.9 writes the characters of a length-bounded string (minLength / maxLength) as
# this class, which admits raw control characters (invalid JSON); its unbounded strings use the
# second one, which excludes them
_BOUNDED_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\\r\n]'


def json_schema_ebnf(schema: str, **options) -> str:
    """A JSON schema's grammar as EBNF, with JSON's own string characters everywhere."""
    import xgrammar as xgr

    return json_strings_fixed(str(xgr.Grammar.from_json_schema(schema, **options)))


def json_strings_fixed(ebnf: str) -> str:
    """xgrammar EBNF made from JSON schemas (directly or inside structural tags), with the
    bounded-string character class replaced by JSON's own."""
    return ebnf.replace(_BOUNDED_STRING_CHARS, _JSON_STRING_CHARS)


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the given strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def backend_key(cfg, model_path: str, vocab_size: int, eos_token_ids) -> tuple:
    """The key under which an engine and its workers find one backend: (tokenizer path,
    vocab size, EOS ids)."""
    from specdec.engine.builder import tokenizer_path

    return tokenizer_path(cfg, model_path), vocab_size, tuple(eos_token_ids)


def get_backend(key: tuple, tokenizer_loader) -> GrammarBackend:
    """The process's backend for ``key`` = (tokenizer path, vocab size, EOS ids), built once
    (the engine and an in-process worker share it, and with it the compile cache)."""
    with _backends_lock:
        backend = _backends.get(key)
        if backend is None:
            backend = _backends[key] = GrammarBackend(tokenizer_loader(), key[1], key[2])
        return backend


_LARK_RULE = re.compile(r"^\??[a-z_][a-z0-9_]*\s*:", re.MULTILINE)  # "start: ...", "?value: ..."


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    # xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: "
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", text.splitlines()[0])[:500]
