"""Worker: everything on the device. ``execute(SchedulerOutput) -> ModelRunnerOutput``.

One step, inside the worker: update the cached request states from the scheduler's output
-> draft (a chain or a token tree) -> one target forward over every scheduled row -> verify
(the rejection sampler for chains, the tree walk for trees) -> move an accepted tree path's
KV into place -> hand the target's hidden states to a proposer that drafts from them. The
worker keeps its own state of every request it has seen (``CachedRequestState``) until the
engine reports the request finished.
"""
from __future__ import annotations

import time

import torch

from specdec.config import EngineConfig
from specdec.engine.builder import load_tokenizer
from specdec.engine.scheduler_output import SchedulerOutput
from specdec.layers.logits_processor import process_target_logits
from specdec.layers.sampler import SamplingMetadata
from specdec.profiling import profile_range
from specdec.spec_decode.proposer import DraftProposal
from specdec.spec_decode.verifier import Verification
from specdec.structured_output.backend import backend_key, get_backend
from specdec.structured_output.grammar_state import GrammarState
from specdec.structured_output.reasoning_grammar import gated_state
from specdec.structured_output.masking import GRAMMAR_CLOCK, apply_bitmask, prune_proposal, verification_bitmask
from specdec.worker.model_runner_output import ModelRunnerOutput
from specdec.worker.request_state import CachedRequestState
from specdec.worker.setup import build_worker_parts
from specdec.worker.target_inputs import TargetInputs, prepare_target


MAX_FORCED_TOKENS = 64  # per request and step


class Worker:
    def __init__(self, cfg: EngineConfig, model_path: str, model_config, vocab_size: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...], target_weights=None, tp=None):
        parts = build_worker_parts(cfg, model_path, model_config, vocab_size, max_model_len, target_weights, tp)
        self.tp = tp  # TensorParallelGroup, or None on one device
        self.plan = parts.plan
        self.method = parts.method  # the speculative method's registry entry (None: no speculation)
        self.device = parts.device
        self.dtype = parts.dtype
        self.runner = parts.runner
        self.draft_runner = parts.draft_runner
        self.proposer = parts.proposer
        self.chain_verifier = parts.chain_verifier
        self.tree_verifier = parts.tree_verifier
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.requests: dict[str, CachedRequestState] = {}
        self._grammar_key = backend_key(cfg, model_path, vocab_size, eos_token_ids)
        self.forced_tokens = cfg.structured_outputs_forced_tokens
        self.lora = _lora_manager(cfg, self.runner.model, model_config, self.dtype) if cfg.enable_lora else None

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_blocks

    # ---- the step ----
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        reqs = self._update_states(sched)
        t0 = time.perf_counter()
        with profile_range("draft"):
            proposal = self._propose(reqs, sched)
            if proposal.draft_token_ids and any(r.grammar is not None for r in reqs):
                proposal = prune_proposal(reqs, proposal)
        t1 = time.perf_counter()
        lora_slots = self.lora.activate([r.lora_request for r in reqs]) if self.lora is not None else None
        inputs = prepare_target(self.runner, reqs, sched.num_scheduled_tokens, proposal, lora_slots)
        with profile_range("forward"):
            if self.proposer is not None and self.proposer.needs_target_hidden:
                logits, hidden = self.runner.forward_with_hidden(inputs.batch)
            else:
                logits, hidden = self.runner.forward(inputs.batch), None
        t2 = time.perf_counter()
        with profile_range("verify"):
            verification = self._verify(reqs, inputs.verified, proposal, logits)
        t3 = time.perf_counter()
        out = self._output(reqs, sched, proposal, inputs, verification, logits, hidden)
        out.draft_seconds, out.target_seconds, out.sampling_seconds = t1 - t0, t2 - t1, t3 - t2
        out.grammar_seconds = GRAMMAR_CLOCK.take()
        if self.tp is not None:
            out.comm_seconds = self.tp.take_comm_seconds()
        return out

    def _update_states(self, sched: SchedulerOutput) -> list[CachedRequestState]:
        for new in sched.new_requests:
            gen = None if new.seed is None else torch.Generator(device=self.device).manual_seed(new.seed)
            state = self.requests[new.request_id] = CachedRequestState(
                new.request_id, list(new.prompt_token_ids), new.sampling_params, self.eos_token_ids, gen,
                lora_request=new.lora_request)
            if new.sampling_params.structured_outputs is not None:
                state.grammar = self._grammar_state(new.sampling_params.structured_outputs)
        for rid in sched.preempted_req_ids:  # its blocks were freed: the draft KV is gone too
            state = self.requests.get(rid)
            if state is not None:
                state.num_draft_computed_tokens = 0
        reqs = [self.requests[rid] for rid in sched.request_ids]
        for req, computed, blocks, depth in zip(reqs, sched.num_computed_tokens, sched.block_ids, sched.tree_depths):
            req.num_computed_tokens = computed
            req.block_ids = blocks
            req.spec_depth = depth
        return reqs

    def _propose(self, reqs: list[CachedRequestState], sched: SchedulerOutput) -> DraftProposal:
        if self.proposer is None or not any(sched.num_spec_slots):
            return DraftProposal.empty(len(reqs))
        return self.proposer.propose(reqs, sched.num_spec_slots, sched.tree_budget)

    def _verify(self, reqs: list[CachedRequestState], verified: list[int], proposal: DraftProposal,
                logits: torch.Tensor) -> Verification | None:
        """logits [rows of the verified requests, V] -> the tokens each verified request emits."""
        if not verified:
            return None
        vreqs = [reqs[i] for i in verified]
        meta = SamplingMetadata.from_params([r.sampling_params for r in vreqs], [r.generator for r in vreqs],
                                            self.device)
        meta_rows = meta.expand([len(proposal.draft_token_ids[i]) + 1 for i in verified])
        histories = [proposal.row_histories(i) for i in verified]
        masks = self._grammar_masks(vreqs, histories, logits)
        logits = process_target_logits(logits, vreqs, histories, meta_rows)
        if masks is not None:  # greedy rows: masked only if their argmax is banned
            bitmask, full, lazy = masks
            # min_tokens may have banned the only token the grammar allows: mask again, with the fallback
            again = full if any(r.sampling_params.min_tokens > r.num_output_tokens for r in vreqs) else []
            with GRAMMAR_CLOCK.timed():
                apply_bitmask(logits, bitmask, again + lazy, fallback_uniform=True,
                              argmax_only=[False] * len(again) + [True] * len(lazy))
        verifier = self.tree_verifier if proposal.is_tree else self.chain_verifier
        return verifier.verify(logits, proposal, verified, meta)

    def _output(self, reqs, sched, proposal, inputs: TargetInputs, verification, logits, hidden) -> ModelRunnerOutput:
        num_reqs = len(reqs)
        out = ModelRunnerOutput(
            request_ids=sched.request_ids, sampled_token_ids=[[] for _ in reqs], num_draft_tokens=proposal.num_draft_tokens,
            num_accepted_tokens=[0] * num_reqs, num_draft_positions=proposal.num_positions,
            logprobs=[None] * num_reqs, num_forced_tokens=[0] * num_reqs, num_target_rows=len(inputs.batch.input_ids),
            expected_accepted=proposal.expected_accepted, num_draft_first_pass_rows=proposal.num_first_pass_rows)
        num_kept = list(sched.num_scheduled_tokens)
        if verification is not None:
            verified = inputs.verified
            first_slots = [reqs[i].num_computed_tokens + sched.num_scheduled_tokens[i] for i in verified]
            first_rows = [inputs.row_offsets[i] + sched.num_scheduled_tokens[i] for i in verified]
            verifier = self.tree_verifier if proposal.is_tree else self.chain_verifier
            verifier.move_accepted(self.runner, first_slots, [reqs[i].block_ids for i in verified], first_rows,
                                   verification, hidden)
            logprobs = self._logprobs_source(reqs, verified, logits)
            row = 0
            for k, i in enumerate(verified):
                tokens, accepted = verification.token_ids[k], verification.num_accepted[k]
                out.sampled_token_ids[i] = tokens
                out.num_accepted_tokens[i] = accepted
                num_kept[i] += accepted
                req = reqs[i]
                if logprobs is not None and req.sampling_params.logprobs is not None:
                    out.logprobs[i] = [_token_logprobs(logprobs[row + r], t, req.sampling_params.logprobs or 0)
                                       for r, t in zip(verification.scored_rows[k], tokens)]
                row += len(proposal.draft_token_ids[i]) + 1
                for t in tokens:
                    req.append_output_token(t)
                if req.grammar is not None:
                    with GRAMMAR_CLOCK.timed():
                        req.grammar.commit(tokens)
                        if self.forced_tokens:
                            out.num_forced_tokens[i] = self._append_forced(req, tokens, out.logprobs[i])
        if self.proposer is not None and self.proposer.needs_target_hidden:
            self.proposer.observe_target(reqs, inputs.starts, inputs.row_offsets, num_kept, hidden)
        return out

    @staticmethod
    def _grammar_masks(vreqs, histories, logits):
        """Mask now the verification rows of constrained requests that sample or want logprobs
        (the logprobs are then the constrained distribution's); returns (bitmask, those rows, the
        greedy rows, checked after the logits processors)."""
        if all(r.grammar is None for r in vreqs):
            return None
        with GRAMMAR_CLOCK.timed():
            bitmask, full, lazy = verification_bitmask(vreqs, histories, logits.shape[1])
            apply_bitmask(logits, bitmask, full, fallback_uniform=False)
        return bitmask, full, lazy

    def _grammar_state(self, params) -> GrammarState:
        backend = get_backend(self._grammar_key, lambda: load_tokenizer(self._grammar_key[0]))
        return gated_state(params, GrammarState(backend.compile(params), self.vocab_size, self.eos_token_ids))

    @staticmethod
    def _append_forced(req: CachedRequestState, tokens: list[int], logprobs: list | None) -> int:
        """Tokens the grammar forces (exactly one allowed: probability 1 under the mask) join the
        output without a target decision; the next step computes their KV with the newest token."""
        scratch = GrammarState.allocate(1, req.grammar.vocab_size)
        forced = 0
        while forced < MAX_FORCED_TOKENS:
            token = req.grammar.forced_token(scratch)
            if token is None:
                break
            req.grammar.commit([token])
            req.append_output_token(token)
            tokens.append(token)
            if logprobs is not None:
                logprobs.append({token: 0.0})
            forced += 1
        return forced

    @staticmethod
    def _logprobs_source(reqs, verified: list[int], logits: torch.Tensor) -> torch.Tensor | None:
        if all(reqs[i].sampling_params.logprobs is None for i in verified):
            return None
        return torch.log_softmax(logits, dim=-1)  # the target's raw distribution

    # ---- requests leaving ----
    def finish_requests(self, num_tokens: dict[str, int]) -> None:
        """Drop finished requests (id -> its final token count: a stop may have cut the last run)."""
        for rid, n in num_tokens.items():
            state = self.requests.pop(rid, None)
            if state is None:
                continue
            del state.output_token_ids[max(0, n - state.num_prompt_tokens):]
            if self.proposer is not None:
                self.proposer.on_request_finished(state)

    # ---- control (start-up calibration, benchmarks) ----
    def time_forward(self, kind: str, num_tokens: int) -> float:
        """Seconds of one ``kind`` ("target" or "draft") forward over ``num_tokens`` decode-like rows
        (0.0 without a draft model). Writes KV into free blocks: before any request is served."""
        from specdec.worker.calibrate import time_forward

        runner = self.runner if kind == "target" else self.draft_runner
        return time_forward(runner, num_tokens) if runner is not None else 0.0

    def num_request_states(self) -> int:
        return len(self.requests)

    def peak_memory_bytes(self) -> int:
        """This rank's peak memory: the device allocator's on GPUs, the process's RSS on CPUs."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def control_proposer(self, name: str, payload=None):
        """The speculative method's proposer control ``name`` (``SpecMethod.control``)."""
        if self.method is None:
            raise ValueError(f"proposer control {name!r}: this engine has no speculative_config")
        return self.method.control(self.proposer, name, payload)

    def apply_model(self, fn):
        """``fn(target model)`` on this rank (inspection: weight bytes, parameters)."""
        return fn(self.runner.model)


def _lora_manager(cfg: EngineConfig, model, model_config, dtype: torch.dtype):
    """Wrap the (quantized, sharded) target's linears in LoRA layers with ``max_loras`` slots."""
    from specdec.layers.lora import apply_lora
    from specdec.lora.manager import LoRAManager

    return LoRAManager(apply_lora(model, cfg.max_loras, cfg.max_lora_rank, dtype), model_config, cfg.max_lora_rank)


def _token_logprobs(lp: torch.Tensor, token: int, top: int) -> dict[int, float]:
    out = {token: float(lp[token])}
    if top:
        vals, ids = lp.topk(top)
        for v, t in zip(vals.tolist(), ids.tolist()):
            out.setdefault(t, v)
    return out
