"""What the scheduler hands the executor each step: everything a worker needs to build its
inputs. Small and picklable, with no tensors and no ``Request`` objects, because a
multi-process executor sends it to every rank; the worker keeps per-request state between
steps (``specdec.worker.request_state``) and this carries only what changed or is granted."""
from __future__ import annotations

from dataclasses import dataclass, field

from specdec.lora.request import LoRARequest
from specdec.sampling_params import SamplingParams
from specdec.spec_decode.plan import TreeBudget


@dataclass
class NewRequestData:
    """A request the worker has not seen: scheduled for the first time this step."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int | None  # the request's own generator (None: the global one)
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)


@dataclass
class SchedulerOutput:
    request_ids: list[str] = field(default_factory=list)  # the batch, in order
    num_computed_tokens: list[int] = field(default_factory=list)  # per request: KV-cached tokens before this step
    num_scheduled_tokens: list[int] = field(default_factory=list)  # per request: prefill chunk or 1, no draft slots
    # per request: the drafts it verifies this step, fed after its scheduled tokens (what the worker
    # proposed at the end of the last step, or a prefix of it when slots ran out; a tree's nodes
    # are in topological order, so any prefix keeps every kept node's ancestors)
    spec_token_ids: list[list[int]] = field(default_factory=list)
    # per request: drafts the worker may propose at the end of this step, for the next (their KV
    # slots are reserved); 0 unless this step completes the request's prompt
    num_spec_slots: list[int] = field(default_factory=list)
    tree_depths: list[int] = field(default_factory=list)  # per request: those drafts' tree depth (0: the proposer's)
    num_output_tokens: list[int] = field(default_factory=list)  # per request, before this step
    block_ids: list[list[int]] = field(default_factory=list)  # per request: its KV blocks (target and draft caches)
    # per request: its blocks in the other KV cache groups (sliding-window layers of a hybrid model), () with one
    group_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)  # preempted in this step: their KV is gone
    tree_budget: TreeBudget | None = None

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens) + sum(len(d) for d in self.spec_token_ids)

    @property
    def is_empty(self) -> bool:
        return not self.request_ids
