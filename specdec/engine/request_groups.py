"""User requests and their outputs: a request with n > 1 fans out into n child requests that
share the prompt; its ``RequestOutput`` gathers the children's completions."""
from __future__ import annotations

from dataclasses import dataclass

from specdec.engine.output_processor import OutputProcessor
from specdec.engine.request import Request
from specdec.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    SpecDecodeStats,
)


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    children: list[Request]


class RequestGroups:
    def __init__(self, output: OutputProcessor):
        self.output = output
        self.groups: dict[str, RequestGroup] = {}
        self._of_child: dict[str, RequestGroup] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, group: RequestGroup) -> None:
        self.groups[group.request_id] = group
        for child in group.children:
            self._of_child[child.request_id] = group

    def pop(self, request_id: str) -> RequestGroup | None:
        group = self.groups.pop(request_id, None)
        if group is not None:
            for child in group.children:
                self._of_child.pop(child.request_id, None)
        return group

    def outputs(self, updated: list[Request], now: float, final_only: bool) -> list[RequestOutput]:
        """One output per group with an updated child (with ``final_only``: per group that finished)."""
        touched: dict[str, RequestGroup] = {}
        for req in updated:
            group = self._of_child.get(req.request_id)
            if group is not None and (req.is_finished or not final_only):
                touched[group.request_id] = group
        return [self._output(g, now) for g in touched.values()]

    def _output(self, group: RequestGroup, now: float) -> RequestOutput:
        completions = []
        stats = SpecDecodeStats()
        for i, child in enumerate(group.children):
            finished = child.is_finished
            text = self.output.final_text(child) if finished else self.output.running_text(child)
            cum = None
            if child.output_logprobs is not None:
                cum = sum(d[t] for d, t in zip(child.output_logprobs, child.output_token_ids))
            completions.append(CompletionOutput(
                i, text, list(child.output_token_ids), cum, child.output_logprobs,
                child.status.value if finished else None, child.stop_reason if finished else None))
            stats.num_drafts += child.num_drafts
            stats.num_draft_tokens += child.num_draft_tokens
            stats.num_accepted_tokens += child.num_accepted_tokens
        first = group.children[0]
        finished = all(c.is_finished for c in group.children)
        metrics = RequestMetrics(
            arrival_time=first.arrival_time, first_token_time=first.first_token_time,
            finished_time=now if finished else None, num_prompt_tokens=first.num_prompt_tokens,
            num_cached_tokens=first.num_cached_prompt_tokens,
            num_generated_tokens=sum(c.num_output_tokens for c in group.children),
            num_preemptions=sum(c.num_preemptions for c in group.children), spec_decode=stats)
        if finished:
            self.pop(group.request_id)
        return RequestOutput(group.request_id, group.prompt, first.prompt_token_ids, completions, finished, metrics)
