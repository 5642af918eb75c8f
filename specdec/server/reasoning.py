"""Reasoning parsers (``--reasoning-parser``): a reasoning model's thinking goes to
``reasoning_content`` (streamed as its own ``delta.reasoning_content``), the answer to
``content``, and an output constraint (``response_format``, a tool-call grammar) applies from
the end of the reasoning on (structured_output/reasoning_grammar.py).

Where the output starts is read from the end of the prompt (its last ``PROMPT_LOOKBACK``
tokens, which hold the generation prompt):

- ``open``: the prompt opened the reasoning (DeepSeek-R1's template ends in ``<think>\\n``):
  everything up to the end tag is reasoning, all of it if the end tag never comes;
- ``closed``: the prompt closed it (Qwen3's with ``enable_thinking: false`` ends in
  ``<think>\\n\\n</think>\\n\\n``): everything is content;
- neither: the parser's default, ``open`` for deepseek_r1 and gpt_oss, ``optional`` for qwen3
  (the output opens its reasoning with ``<think>`` or answers at once).

The reasoning and the content are returned without the whitespace that begins them (the
reasoning keeps what precedes its end tag: a stream has sent it before the tag arrives).
"""
from __future__ import annotations

from dataclasses import dataclass

from specdec.server.protocol import APIError
from specdec.structured_output import StructuredOutputsParams
from specdec.structured_output.reasoning_grammar import ReasoningGatedParams
from specdec.tool_parsers.base import held_back_prefix

OPEN, CLOSED, OPTIONAL = "open", "closed", "optional"
PROMPT_LOOKBACK = 16  # tokens: the generation prompt, not the turns before it


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start_tag: str  # what opens the reasoning (stripped from it)
    end_tag: str  # what ends it; the constraint starts after these tokens
    default_mode: str  # where the output starts when the prompt says nothing
    trim_suffix: str = ""  # text between the reasoning and end_tag that is neither
    skip_special_tokens: bool = True  # False: the tags are special tokens the text must keep


FORMATS = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", "<think>", "</think>", OPEN),
    "qwen3": ReasoningFormat("qwen3", "<think>", "</think>", OPTIONAL),
    # gpt-oss (harmony): an analysis message, then the final channel
    "gpt_oss": ReasoningFormat("gpt_oss", "<|channel|>analysis<|message|>", "<|channel|>final<|message|>", OPEN,
                               trim_suffix="<|end|><|start|>assistant", skip_special_tokens=False),
}


class ReasoningParser:
    def __init__(self, fmt: ReasoningFormat, tokenizer):
        self.format = fmt
        self.name = fmt.name
        self.skip_special_tokens = fmt.skip_special_tokens
        self.start_ids = _encode(tokenizer, fmt.start_tag)
        self.end_ids = _encode(tokenizer, fmt.end_tag)
        if not self.end_ids:
            raise ValueError(f"reasoning parser {fmt.name}: the tokenizer encodes {fmt.end_tag!r} as no tokens")

    def mode(self, prompt_ids: list[int]) -> str:
        tail = list(prompt_ids[-PROMPT_LOOKBACK:])
        start, end = _last_index(tail, self.start_ids), _last_index(tail, self.end_ids)
        if end >= 0 and end > start:
            return CLOSED
        if start >= 0:
            return OPEN
        return self.format.default_mode

    def gate(self, constraint: StructuredOutputsParams | None, mode: str) -> StructuredOutputsParams | None:
        """The constraint, applied from the end of the reasoning on (as is when it is closed)."""
        if constraint is None or mode == CLOSED:
            return constraint
        start = self.start_ids[0] if mode == OPTIONAL and len(self.start_ids) == 1 else None
        return ReasoningGatedParams.wrap(constraint, self.end_ids, start)

    def split(self, text: str, mode: str, final: bool) -> tuple[str | None, str]:
        """(reasoning or None, content) of an output; while not ``final``, text that may be the
        start of a tag is held back from both."""
        fmt = self.format
        if mode == CLOSED:
            return None, text
        body = text.lstrip()
        if body.startswith(fmt.start_tag):
            body = body[len(fmt.start_tag):].lstrip()
        elif mode == OPTIONAL:
            if not final and fmt.start_tag.startswith(body):
                return None, ""  # the tag may be starting
            return None, text
        elif not final and body and fmt.start_tag.startswith(body):
            return "", ""
        end = body.find(fmt.end_tag)
        if end < 0:
            if not final:
                body = body[:len(body) - max(held_back_prefix(body, fmt.trim_suffix + fmt.end_tag),
                                             held_back_prefix(body, fmt.end_tag))]
            return _trim(body, fmt.trim_suffix), ""
        return _trim(body[:end], fmt.trim_suffix), body[end + len(fmt.end_tag):].lstrip()


class ReasoningStream:
    """One streamed choice: feed the cumulative text, get the new reasoning and content parts
    (what was sent is never retracted) and the content so far (for a tool-call parser)."""

    def __init__(self, parser: ReasoningParser, mode: str):
        self.parser, self.mode = parser, mode
        self.sent_reasoning = ""
        self.sent_content = ""

    def update(self, text: str, final: bool) -> tuple[str, str, str]:
        reasoning, content = self.parser.split(text, self.mode, final)
        reasoning = reasoning or ""
        new_reasoning = _extension(self.sent_reasoning, reasoning)
        self.sent_reasoning += new_reasoning
        new_content = _extension(self.sent_content, content)
        self.sent_content += new_content
        return new_reasoning, new_content, content


def get_reasoning_parser(name: str, tokenizer) -> ReasoningParser:
    if name not in FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(FORMATS)}")
    return ReasoningParser(FORMATS[name], tokenizer)


def _extension(sent: str, now: str) -> str:
    return now[len(sent):] if len(now) > len(sent) and now.startswith(sent) else ""


def _trim(reasoning: str, suffix: str) -> str:
    return reasoning[:-len(suffix)] if suffix and reasoning.endswith(suffix) else reasoning


def _encode(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def _last_index(ids: list[int], seq: tuple[int, ...]) -> int:
    """Where the last occurrence of ``seq`` in ``ids`` starts, or -1."""
    n = len(seq)
    if not n:
        return -1
    for i in range(len(ids) - n, -1, -1):
        if tuple(ids[i:i + n]) == seq:
            return i
    return -1


# apply_chat_template's own arguments: a request may not set them through chat_template_kwargs
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize", "add_generation_prompt",
    "continue_final_message", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "padding",
    "truncation", "max_length", "return_tensors"})


def template_kwargs(req) -> dict:
    """The chat template's extra variables: ``chat_template_kwargs``, and ``enable_thinking``
    (a shortcut for the variable of that name); a 400 naming the field when they clash."""
    kwargs = dict(req.chat_template_kwargs or {})
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise APIError(400, f"chat_template_kwargs.{key} is set by the request itself, not a template variable",
                           param=f"chat_template_kwargs.{key}")
    if req.enable_thinking is not None:
        if kwargs.get("enable_thinking", req.enable_thinking) != req.enable_thinking:
            raise APIError(400, "enable_thinking and chat_template_kwargs.enable_thinking disagree",
                           param="enable_thinking")
        kwargs["enable_thinking"] = req.enable_thinking
    return kwargs
