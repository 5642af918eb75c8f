"""Worker: everything on the device. ``execute(SchedulerOutput) -> ModelRunnerOutput``.

One step, inside the worker (vLLM v1's order): update the cached request states from the
scheduler's output -> one target forward over every scheduled row (prefill chunks, newest
tokens, the drafts proposed last step) -> verify (the rejection sampler for chains, the tree
walk for trees) -> move an accepted tree path's KV into place -> commit (grammar matchers,
forced tokens) -> propose the next drafts right away, from the hidden states just computed.
The drafts' token ids go back in the output (the scheduler schedules them next step, or a
prefix of them); their q stays here, in each request's ``next_drafts``. The worker keeps
its own state of every request it has seen (``CachedRequestState``) until the engine
reports the request finished.
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
from specdec.spec_decode.proposer import DraftProposal, TargetStates
from specdec.spec_decode.verifier import Verification
from specdec.structured_output.backend import backend_key, get_backend
from specdec.structured_output.stage import StructuredOutputStage
from specdec.worker.model_runner_output import ModelRunnerOutput
from specdec.worker.request_state import CachedRequestState, PendingDrafts
from specdec.worker.setup import build_worker_parts
from specdec.worker.target_inputs import TargetInputs, prepare_target


class Worker:
    def __init__(self, cfg: EngineConfig, model_path: str, model_config, vocab_size: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...], kv_groups=(), target_weights=None, tp=None):
        parts = build_worker_parts(cfg, model_path, model_config, vocab_size, max_model_len, target_weights, tp,
                                   kv_groups)
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
        self.max_model_len = max_model_len
        self.requests: dict[str, CachedRequestState] = {}
        key = backend_key(cfg, model_path, vocab_size, eos_token_ids)
        self.structured_output = StructuredOutputStage(
            lambda params: get_backend(key, lambda: load_tokenizer(key[0])).compile(params), vocab_size,
            eos_token_ids, cfg.structured_outputs_forced_tokens)
        self.lora = _lora_manager(cfg, self.runner.model, model_config, self.dtype) if cfg.enable_lora else None

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_blocks

    # ---- the step ----
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        reqs = self._update_states(sched)
        proposal = self._scheduled_drafts(reqs, sched)
        t0 = time.perf_counter()
        lora_slots = self.lora.activate([r.lora_request for r in reqs]) if self.lora is not None else None
        inputs = prepare_target(self.runner, reqs, sched.num_scheduled_tokens, proposal, lora_slots)
        with profile_range("forward"):
            if self.method is not None and self.method.needs_target_hidden:
                logits, hidden = self.runner.forward_with_hidden(inputs.batch)
            else:
                logits, hidden = self.runner.forward(inputs.batch), None
        t1 = time.perf_counter()
        with profile_range("verify"):
            verification = self._verify(reqs, inputs.verified, proposal, logits)
        t2 = time.perf_counter()
        out, num_kept = self._output(reqs, sched, proposal, inputs, verification, logits, hidden)
        t3 = time.perf_counter()
        with profile_range("draft"):
            self._propose_next(reqs, sched, inputs, num_kept, hidden, out)
        out.draft_seconds, out.target_seconds, out.sampling_seconds = time.perf_counter() - t3, t1 - t0, t2 - t1
        out.grammar_seconds = self.structured_output.take_seconds()
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
                state.grammar = self.structured_output.new_grammar(new.sampling_params.structured_outputs)
        for rid in sched.preempted_req_ids:  # its blocks were freed: the draft KV is gone too
            state = self.requests.get(rid)
            if state is not None:
                state.num_draft_computed_tokens = 0
                state.next_drafts = None
        reqs = [self.requests[rid] for rid in sched.request_ids]
        for req, computed, blocks, depth in zip(reqs, sched.num_computed_tokens, sched.block_ids, sched.tree_depths):
            req.num_computed_tokens = computed
            req.block_ids = blocks
            req.spec_depth = depth
        for req, group_blocks in zip(reqs, sched.group_block_ids):
            req.group_block_ids = group_blocks
        return reqs

    def _scheduled_drafts(self, reqs: list[CachedRequestState], sched: SchedulerOutput) -> DraftProposal:
        """The drafts each request verifies this step: the ones proposed for it last step, cut to
        the prefix the scheduler granted (the rest, and their q rows, are dropped here)."""
        if not any(sched.spec_token_ids):
            if self.proposer is not None:
                for req in reqs:
                    req.next_drafts = None
            return DraftProposal.empty(len(reqs))
        tokens, parents, probs, expected = [], [], [], []
        for req, scheduled in zip(reqs, sched.spec_token_ids):
            pending, req.next_drafts = req.next_drafts, None
            n = len(scheduled)
            if n and (pending is None or pending.token_ids[:n] != list(scheduled)):
                raise RuntimeError(f"request {req.request_id}: the scheduled drafts {list(scheduled)} are not the ones "
                                   f"this worker proposed ({None if pending is None else pending.token_ids})")
            tokens.append(list(scheduled))
            parents.append(pending.parents[:n] if n and pending.parents is not None else None)
            probs.append(pending.probs[:n] if n and pending.probs is not None else None)
            if n and pending.expected_accepted is not None:
                expected.append(pending.expected_accepted)
        if not any(tokens):
            return DraftProposal.empty(len(reqs))
        draft_parents = [p or [] for p in parents] if any(p is not None for p in parents) else None
        draft_probs = None
        given = [p for p in probs if p is not None]
        if given:  # rows of drafts drawn without a q (greedy requests) are never read
            draft_probs = torch.cat([p if p is not None else given[0].new_zeros(len(t), given[0].shape[1])
                                     for p, t in zip(probs, tokens) if t])
        return DraftProposal(tokens, draft_probs, draft_parents, sum(expected) if expected else None)

    def _verify(self, reqs: list[CachedRequestState], verified: list[int], proposal: DraftProposal,
                logits: torch.Tensor) -> Verification | None:
        """logits [rows of the verified requests, V] -> the tokens each verified request emits."""
        if not verified:
            return None
        vreqs = [reqs[i] for i in verified]
        if not proposal.is_tree and all(_argmax_only(r) for r in vreqs):
            return self.chain_verifier.verify_argmax(logits, proposal, verified)
        meta = SamplingMetadata.from_params([r.sampling_params for r in vreqs], [r.generator for r in vreqs],
                                            self.device)
        meta_rows = meta.expand([len(proposal.draft_token_ids[i]) + 1 for i in verified])
        histories = [proposal.row_histories(i) for i in verified]
        masks = self.structured_output.mask_verification_rows(logits, vreqs, histories)
        logits = process_target_logits(logits, vreqs, histories, meta_rows)
        self.structured_output.mask_after_processors(logits, masks, vreqs)
        verifier = self.tree_verifier if proposal.is_tree else self.chain_verifier
        return verifier.verify(logits, proposal, verified, meta)

    def _output(self, reqs, sched, proposal, inputs: TargetInputs, verification, logits,
                hidden) -> tuple[ModelRunnerOutput, list[int]]:
        """Commit the verification to the request states; (the output, per request the rows the
        target kept: its scheduled tokens and accepted drafts)."""
        num_reqs = len(reqs)
        out = ModelRunnerOutput(
            request_ids=sched.request_ids, sampled_token_ids=[[] for _ in reqs], num_draft_tokens=proposal.num_draft_tokens,
            num_accepted_tokens=[0] * num_reqs, num_draft_positions=proposal.num_positions,
            logprobs=[None] * num_reqs, num_forced_tokens=[0] * num_reqs, num_target_rows=len(inputs.batch.input_ids),
            expected_accepted=proposal.expected_accepted, draft_token_ids=[[] for _ in reqs])
        num_kept = list(sched.num_scheduled_tokens)
        if verification is not None:
            verified = inputs.verified
            first_slots = [reqs[i].num_computed_tokens + sched.num_scheduled_tokens[i] for i in verified]
            first_rows = [inputs.row_offsets[i] + sched.num_scheduled_tokens[i] for i in verified]
            verifier = self.tree_verifier if proposal.is_tree else self.chain_verifier
            verifier.move_accepted(self.runner, first_slots, [reqs[i].block_ids for i in verified], first_rows,
                                   verification, hidden, [reqs[i].group_block_ids for i in verified])
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
                req.append_output_tokens(tokens)
                if req.grammar is not None:
                    out.num_forced_tokens[i] = self.structured_output.commit(req, tokens, out.logprobs[i])
        for req, start, kept in zip(reqs, inputs.starts, num_kept):
            req.num_computed_tokens = start + kept
        return out, num_kept

    def _propose_next(self, reqs: list[CachedRequestState], sched: SchedulerOutput, inputs: TargetInputs,
                      num_kept: list[int], hidden: torch.Tensor | None, out: ModelRunnerOutput) -> None:
        """Draft for the next step, for every request that now decodes (one token without KV)
        and was granted slots; an EAGLE head also catches up on the rows every other request
        kept, since no features outlive the step."""
        if self.proposer is None:
            return
        ks = [self._num_next_drafts(req, k) if k else 0 for req, k in zip(reqs, sched.num_spec_slots)]
        target = None
        if self.method.needs_target_hidden:
            if hidden is None:
                raise RuntimeError(f"the {self.proposer.name} proposer needs the target's hidden states, which "
                                   "this target runner did not return")
            target = TargetStates(hidden, inputs.starts, inputs.row_offsets, num_kept)
        elif not any(ks):
            return
        # the grammar hooks only where a request has a grammar
        grammar = self.structured_output if any(r.grammar is not None for r in reqs) else None
        proposal = self.proposer.propose(reqs, ks, sched.tree_budget, grammar=grammar, target=target)
        if grammar is not None:
            proposal = grammar.prune(reqs, proposal)
        out.num_draft_first_pass_rows = proposal.num_first_pass_rows
        if self.method.has_draft_model:
            out.num_draft_passes = (max(proposal.num_positions, default=0) if proposal.num_model_passes is None
                                    else proposal.num_model_passes)
        first = 0
        for i, (req, drafts) in enumerate(zip(reqs, proposal.draft_token_ids)):
            if not drafts:
                continue
            probs = None if proposal.draft_probs is None else proposal.draft_probs[first:first + len(drafts)]
            first += len(drafts)
            parents = None if proposal.draft_parents is None else proposal.draft_parents[i]
            expected = None if proposal.expected_by_request is None else proposal.expected_by_request[i]
            drafts = list(drafts)  # one copy, read-only from here: the pending drafts and the output's
            req.next_drafts = PendingDrafts(drafts, parents, probs, expected)
            out.draft_token_ids[i] = drafts

    def _num_next_drafts(self, req: CachedRequestState, granted: int) -> int:
        """The drafts ``req`` may get now: the scheduler's grant, if the request decodes and has room
        for them (its output limit, the context, the KV slots it holds) and did not just end."""
        num_tokens = req.num_tokens
        if not granted or num_tokens - req.num_computed_tokens != 1:
            return 0
        params, output = req.sampling_params, req.output_token_ids
        last = output[-1] if output else None
        if last is not None and len(output) >= params.min_tokens and (
                last in params.stop_token_ids or (not params.ignore_eos and last in self.eos_token_ids)):
            return 0  # the commit will stop it
        slots = len(req.block_ids) * self.runner.block_size
        return max(0, min(granted, req.max_tokens - len(output) - 1, self.max_model_len - num_tokens,
                          slots - num_tokens))

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

    def time_verify_forward(self, num_reqs: int, rows_per_req: int) -> float:
        """Seconds of one target pass of ``num_reqs`` requests feeding ``rows_per_req`` rows each
        (random tokens, so a mixture-of-experts target routes them as real rows). Before serving."""
        from specdec.worker.calibrate import time_verify_forward

        return time_verify_forward(self.runner, num_reqs, rows_per_req, context=32, repeats=2)

    def verification_batch_sizes(self, max_num_seqs: int, max_rows: int) -> tuple[int, ...]:
        """Batch sizes the cost model times verification-shaped passes on; () for a dense target."""
        from specdec.worker.calibrate import verification_batch_sizes

        return verification_batch_sizes(self.runner, max_num_seqs, max_rows)

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


def _argmax_only(req: CachedRequestState) -> bool:
    """Whether ``req``'s next tokens are the argmax of the target's raw logits: greedy, and no
    penalty, min_tokens ban or grammar changes them."""
    params = req.sampling_params
    return params.is_greedy and req.grammar is None and not params.has_penalties \
        and params.min_tokens <= req.num_output_tokens


def _token_logprobs(lp: torch.Tensor, token: int, top: int) -> dict[int, float]:
    out = {token: float(lp[token])}
    if top:
        vals, ids = lp.topk(top)
        for v, t in zip(vals.tolist(), ids.tolist()):
            out.setdefault(t, v)
    return out
