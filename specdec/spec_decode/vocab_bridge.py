"""A bridge between two vocabularies by the bytes each token stands for, for a draft model with
another tokenizer than its target (``cross_tokenizer.py`` drafts through it).

Each token's bytes: byte-level BPE tokens (GPT-2, Llama 3, Qwen, SmolLM) undo GPT-2's
``bytes_to_unicode`` map; SentencePiece tokens turn '▁' into a space and ``<0xNN>`` into byte NN;
other tokenizers (word level) take the token's UTF-8. Added tokens (chat markers, end of text)
are their content, and meet only added tokens of the other vocabulary with the same content.

The intersection ``I`` pairs draft ids with target ids one to one (``draft_ids[i]`` <->
``target_ids[i]``): the draft tokens whose bytes equal a target token's. Where several tokens
of one vocabulary share their bytes (a SentencePiece byte token and a plain one), the one its
tokenizer produces (not a byte fallback) wins; the others stay outside ``I``, which only costs
acceptance.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode``: printable stand-in character -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def tokenizer_kind(tokenizer) -> str:
    """"byte_level", "sentencepiece" or "text": how the tokenizer's decoder turns tokens into text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"a draft with another tokenizer needs fast (tokenizers-backed) tokenizers; "
                         f"{type(tokenizer).__name__} is not one")
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = {p.get("type") for p in parts}
    if "ByteLevel" in types:
        return "byte_level"
    if "Metaspace" in types or any(p.get("type") == "Replace" and "▁" in json.dumps(p.get("pattern")) for p in parts):
        return "sentencepiece"
    return "text"


def token_bytes(token: str, kind: str) -> bytes:
    """The bytes a (non-added) token stands for, under its tokenizer's ``kind``."""
    if kind == "byte_level":
        table = _unicode_to_byte()
        if all(c in table for c in token):
            return bytes(table[c] for c in token)
    elif kind == "sentencepiece":
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return bytes([int(token[3:5], 16)])
        return token.replace("▁", " ").encode("utf-8")
    return token.encode("utf-8")


def _is_byte_fallback(token: str) -> bool:
    return len(token) == 6 and token.startswith("<0x") and token.endswith(">")


def vocabulary_bytes(tokenizer, vocab_size: int) -> tuple[list[bytes], list[tuple[bool, bytes] | None]]:
    """(bytes of each id < ``vocab_size`` (b"" where the tokenizer has none), the key each id is
    matched by: (is an added token, bytes), None for ids that match nothing)."""
    kind = tokenizer_kind(tokenizer)
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    data: list[bytes] = [b""] * vocab_size
    keys: list[tuple[bool, bytes] | None] = [None] * vocab_size
    for token, i in tokenizer.get_vocab().items():
        if not 0 <= i < vocab_size:
            continue
        is_added = i in added
        data[i] = added[i].encode("utf-8") if is_added else token_bytes(token, kind)
        if data[i]:
            keys[i] = (is_added, data[i])
    return data, keys


def _preference(tokenizer, vocab_size: int) -> list[int]:
    """Ids in the order they claim a shared key: plain tokens before byte fallbacks, then by id."""
    names = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    return sorted(range(len(names)), key=lambda i: (_is_byte_fallback(names[i] or ""), i))


@dataclass(frozen=True)
class VocabBridge:
    target_ids: torch.Tensor  # [n] int64, ascending: the target side of I
    draft_ids: torch.Tensor  # [n] int64: draft_ids[i] has the bytes of target_ids[i]
    target_bytes: list[bytes]  # [target vocab]: the bytes of each target id (b"": none)
    draft_bytes: list[bytes]  # [draft vocab]: the bytes of each draft id
    target_to_draft: dict[int, int]  # I as a map
    draft_tokenizer: object

    @classmethod
    def build(cls, target_tokenizer, draft_tokenizer, target_vocab_size: int, draft_vocab_size: int) -> VocabBridge:
        target_bytes, target_keys = vocabulary_bytes(target_tokenizer, target_vocab_size)
        draft_bytes, draft_keys = vocabulary_bytes(draft_tokenizer, draft_vocab_size)
        by_key: dict[tuple[bool, bytes], int] = {}
        for t in _preference(target_tokenizer, target_vocab_size):
            if target_keys[t] is not None:
                by_key.setdefault(target_keys[t], t)
        pairs: dict[int, int] = {}
        for d in _preference(draft_tokenizer, draft_vocab_size):
            t = by_key.get(draft_keys[d]) if draft_keys[d] is not None else None
            if t is not None and t not in pairs:
                pairs[t] = d
        if not pairs:
            raise ValueError("the draft model's tokenizer shares no token with the target's: it cannot draft for it")
        target_ids = sorted(pairs)
        return cls(torch.tensor(target_ids, dtype=torch.int64),
                   torch.tensor([pairs[t] for t in target_ids], dtype=torch.int64),
                   target_bytes, draft_bytes, pairs, draft_tokenizer)

    @property
    def size(self) -> int:
        return len(self.target_ids)

    def draft_token_for(self, target_id: int) -> int:
        """The draft token fed for a drafted target token: its partner in I, or for a token outside I
        (a grammar's fallback may draft one) the draft's first token of its bytes."""
        draft_id = self.target_to_draft.get(target_id)
        if draft_id is None:
            ids, _ = self.encode_bytes(self.target_bytes[target_id])
            draft_id = ids[0] if ids else int(self.draft_ids[0])
        return draft_id

    @cached_property
    def draft_byte_tokens(self) -> dict[int, int]:
        """byte -> the draft token of that single byte (byte-level and byte-fallback vocabularies)."""
        out: dict[int, int] = {}
        for d, data in enumerate(self.draft_bytes):
            if len(data) == 1:
                out.setdefault(data[0], d)
        return out

    def encode_bytes(self, data: bytes) -> tuple[list[int], int]:
        """(the draft tokenizer's ids for ``data[:stop]``, stop): runs of valid UTF-8 go through the
        tokenizer (added tokens in them recognised, none inserted), a byte that is no part of a
        character becomes the draft's token of that byte (skipped where it has none), and an
        incomplete trailing character waits for its last byte (``stop`` leaves it out)."""
        ids, pos = [], 0
        while pos < len(data):
            try:
                text, end = data[pos:].decode("utf-8"), len(data)
            except UnicodeDecodeError as e:
                if e.reason == "unexpected end of data" and pos + e.end == len(data):
                    text, end = data[pos:pos + e.start].decode("utf-8"), pos + e.start
                    if text:
                        ids += self.draft_tokenizer.encode(text, add_special_tokens=False)
                    return ids, end
                text, end = data[pos:pos + e.start].decode("utf-8"), pos + e.end
                if text:
                    ids += self.draft_tokenizer.encode(text, add_special_tokens=False)
                ids += [self.draft_byte_tokens[b] for b in data[pos + e.start:end] if b in self.draft_byte_tokens]
                pos = end
                continue
            ids += self.draft_tokenizer.encode(text, add_special_tokens=False)
            pos = end
        return ids, len(data)
