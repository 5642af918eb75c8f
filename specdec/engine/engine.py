"""LLMEngine: the step loop. schedule -> propose -> run target -> verify -> commit."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdec.config import EngineConfig
from specdec.engine.builder import EngineParts, build_engine_parts
from specdec.engine.request import Request, RequestStatus
from specdec.engine.scheduler import SchedulerOutput
from specdec.layers.logits_processor import process_target_logits
from specdec.layers.sampler import SamplingMetadata
from specdec.outputs import CompletionOutput, RequestMetrics, RequestOutput, SpecDecodeStats
from specdec.sampling_params import SamplingParams
from specdec.spec import tree
from specdec.spec.proposer import DraftProposal


@dataclass
class _Group:
    """A user request; n > 1 fans out into n child requests sharing the prompt."""
    request_id: str
    prompt: str | None
    children: list[Request]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        parts: EngineParts = build_engine_parts(config)
        self.__dict__.update(vars(parts))  # device, dtype, tokenizer, runner, kv, scheduler, proposer, ...
        self.groups: dict[str, _Group] = {}
        self.child_to_group: dict[str, _Group] = {}
        # True while a caller runs a fixed set of requests to the end (LLM.generate): nothing will
        # join the batch, so "auto" plans for the batch's completion, not for tokens per second
        self.closed_batch = False
        # True while the caller reads finished outputs only (LLM.generate; vLLM's FINAL_ONLY): a
        # running request's text is not re-decoded every step (O(output length) per request per step)
        self.final_outputs_only = False

    # ---- requests in and out ----
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(prompt_token_ids)} tokens, longer than the model's context: "
                f"max_model_len is {self.max_model_len} (and at least one token must be generated)"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None) -> None:
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids)
        children = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(params.seed + i)
            children.append(Request(child_id, list(prompt_token_ids), params, self.eos_token_ids, generator=gen,
                                    output_logprobs=[] if params.logprobs is not None else None))
        group = _Group(request_id, prompt, children)
        self.groups[request_id] = group
        for child in children:
            self.child_to_group[child.request_id] = group
            self.scheduler.add_request(child)

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self.groups.pop(rid, None)
            if group is None:
                continue
            for child in group.children:
                self.child_to_group.pop(child.request_id, None)
                if not child.is_finished:
                    self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
                    self.proposer_finished(child)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ----
    def step(self) -> list[RequestOutput]:
        t_start = time.perf_counter()
        emitted_before = self.spec_metrics.num_emitted_tokens
        self.plan_speculation()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        t0 = time.perf_counter()
        proposal = self.propose(sched)
        t1 = time.perf_counter()
        logits, rows = self.run_target(sched, proposal)
        t2 = time.perf_counter()
        tokens, num_accepted = self.verify(sched, proposal, logits, rows)
        t3 = time.perf_counter()
        outputs = self.commit(sched, proposal, tokens, num_accepted, logits, rows)
        if self.proposer is not None and self.proposer.needs_target_hidden:
            self.proposer.observe_target(sched.requests, *self._target_rows, self.runner.last_hidden)
        self.record_step(sched, proposal, t1 - t0, t2 - t1, t3 - t2)
        if self.spec_controller is not None:
            self.spec_controller.observe_outcome(sched, proposal, self.spec_metrics.num_emitted_tokens - emitted_before,
                                                 time.perf_counter() - t_start)
        return outputs

    def plan_speculation(self) -> None:
        """Set how many drafts each running request wants this step (0 = decode normally)."""
        if self.spec_controller is None or self.proposer is None:
            for req in self.scheduler.running:
                req.num_spec_tokens_wanted = 0
            return
        self.spec_controller.plan(self.scheduler.running, self._batch_is_closed())

    def propose(self, sched: SchedulerOutput) -> DraftProposal:
        if self.proposer is None or not any(sched.num_spec_slots):
            return DraftProposal.empty(len(sched.requests))
        return self.proposer.propose(sched.requests, sched.num_spec_slots)

    def run_target(self, sched: SchedulerOutput, proposal: DraftProposal):
        feeds, starts, tables, logit_rows, sampled = [], [], [], [], []
        tree_positions, tree_masks = [], []
        for i, (req, n, drafts) in enumerate(zip(sched.requests, sched.num_scheduled_tokens, proposal.draft_token_ids)):
            start = req.num_computed_tokens
            feed = req.all_token_ids[start:start + n] + drafts
            completes = start + n == req.num_tokens
            feeds.append(feed)
            starts.append(start)
            tables.append(self.kv.get_block_ids(req.request_id))
            # a chunk that completes the prompt, a decode row, or K+1 verification rows
            logit_rows.append(list(range(n - 1, len(feed))) if completes else [])
            sampled.append(completes)
            positions, mask = None, None
            if proposal.is_tree and drafts:  # nodes at slots start + n + i, positions start + n - 1 + depth
                positions = list(range(start, start + n)) + [start + n - 1 + d for d in proposal.tree_depths[i]]
                mask = (start + n, tree.ancestor_mask(proposal.draft_parents[i], rows_before=n))
            tree_positions.append(positions)
            tree_masks.append(mask)
        batch = self.runner.prepare(feeds, starts, tables, logit_rows, tree_positions, tree_masks)
        self._target_rows = (starts, batch.attn.query_start_loc_cpu[:-1])  # where each request's rows are
        logits = self.runner.forward(batch)  # [num_rows, V]
        return logits, sampled

    def verify(self, sched, proposal, logits, sampled):
        """(tokens [R, max_k + 1], num_accepted [R]) for the sampled requests; for token trees
        also ``self._tree_verdicts`` (the accepted path per sampled request)."""
        self._tree_verdicts = None
        idx = [i for i, s in enumerate(sampled) if s]
        if not idx:
            return None, None
        reqs = [sched.requests[i] for i in idx]
        drafts = [proposal.draft_token_ids[i] for i in idx]
        meta = SamplingMetadata.from_params([r.sampling_params for r in reqs], [r.generator for r in reqs], self.device)
        num_draft = [len(d) for d in drafts]
        meta_rows = meta.expand([k + 1 for k in num_draft])
        logits = process_target_logits(logits, reqs, [proposal.row_histories(i) for i in idx], meta_rows)
        if proposal.is_tree:
            verdicts = tree.verify_trees(logits, [(proposal.draft_token_ids[i], proposal.draft_parents[i]) for i in idx],
                                         meta)
            self._tree_verdicts = verdicts
            width = max(len(v.tokens) for v in verdicts)
            tokens = torch.tensor([v.tokens + [-1] * (width - len(v.tokens)) for v in verdicts], dtype=torch.int64)
            return tokens, torch.tensor([len(v.path) for v in verdicts], dtype=torch.int64)
        draft_ids = torch.tensor([t for d in drafts for t in d], dtype=torch.int64, device=self.device)
        # requests that are not sampled (partial prefills) never carry drafts: q rows stay aligned
        return self.rejection_sampler(logits, draft_ids, num_draft, proposal.draft_probs, meta)

    def commit(self, sched, proposal, tokens, num_accepted, logits, sampled) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, _Group] = {}
        tokens_list = tokens.tolist() if tokens is not None else []
        accepted_list = num_accepted.tolist() if num_accepted is not None else []
        logprobs_rows = self._logprobs_source(sched, proposal, logits, sampled)
        positions = proposal.num_positions
        k = 0
        row = 0
        for i, (req, n) in enumerate(zip(sched.requests, sched.num_scheduled_tokens)):
            num_drafted = len(proposal.draft_token_ids[i])
            if not sampled[i]:
                req.num_computed_tokens += n  # a partial prefill chunk
                self.kv.cache_full_blocks(req)
                continue
            accepted = accepted_list[k]
            emitted = tokens_list[k][: accepted + 1]
            verdict = self._tree_verdicts[k] if self._tree_verdicts is not None else None
            k += 1
            if verdict is not None:
                self._compact_tree_path(req, n, verdict.path, self._target_rows[1][i])
            num_positions = positions[i]  # K, or a tree's depth
            if req.num_output_tokens:  # a decode/verify step (not a prompt's first token)
                self.spec_metrics.observe(num_drafted, accepted, num_positions)
            if num_drafted:
                req.num_drafts += 1
                req.num_draft_tokens += num_drafted
                req.num_accepted_tokens += accepted
                self.observe_acceptance(req, num_positions, accepted)
            num_computed = req.num_computed_tokens + n + accepted  # the fed token + accepted drafts
            status = None
            for j, token in enumerate(emitted):
                if req.output_logprobs is not None:
                    scored_by = row + (verdict.rows[j] if verdict is not None else j)
                    req.output_logprobs.append(self._token_logprobs(logprobs_rows, scored_by, token, req))
                status = self.output.append_token(req, token)
                self.spec_metrics.num_emitted_tokens += 1
                if status is not None:
                    break
            row += num_drafted + 1
            # a stop inside the accepted run keeps fewer tokens than were computed
            req.num_computed_tokens = min(num_computed, req.num_tokens)
            req.first_token_time = req.first_token_time or now
            req.last_token_time = now
            self.kv.cache_full_blocks(req)
            if status is not None:
                self.scheduler.finish(req, status)
                self.proposer_finished(req)
            else:
                self.kv.truncate(req, req.num_tokens)
            group = self.child_to_group.get(req.request_id)
            if group is not None and (status is not None or not self.final_outputs_only):
                touched[group.request_id] = group
        return [self._group_output(g, now) for g in touched.values()]

    def _compact_tree_path(self, req: Request, n: int, path: list[int], first_row: int) -> None:
        """Move the accepted tree nodes' KV (and, for EAGLE, their hidden states) to the
        consecutive positions they now hold: node i sat at position num_computed + n + i (a path
        through the first child at every depth is already in place)."""
        first = req.num_computed_tokens + n
        moves = [(first + node, first + j) for j, node in enumerate(path) if node != j]
        if not moves:
            return
        blocks = self.kv.get_block_ids(req.request_id)
        self.runner.move_kv([self.runner.slot_of(blocks, s) for s, _ in moves],
                            [self.runner.slot_of(blocks, d) for _, d in moves])
        hidden = self.runner.last_hidden
        if hidden is not None:
            with torch.inference_mode():
                src = torch.tensor([first_row + n + node for node in path], device=hidden.device)
                hidden[first_row + n:first_row + n + len(path)] = hidden[src]

    def _logprobs_source(self, sched, proposal, logits, sampled):
        reqs = [r for r, s in zip(sched.requests, sampled) if s]
        if logits is None or all(r.output_logprobs is None for r in reqs):
            return None
        return torch.log_softmax(logits, dim=-1)  # the target's raw distribution

    @staticmethod
    def _token_logprobs(logprobs, row: int, token: int, req: Request) -> dict[int, float]:
        lp = logprobs[row]
        out = {token: float(lp[token])}
        top = req.sampling_params.logprobs or 0
        if top:
            vals, ids = lp.topk(top)
            for v, t in zip(vals.tolist(), ids.tolist()):
                out.setdefault(t, v)
        return out

    def _group_output(self, group: _Group, now: float) -> RequestOutput:
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
            self.groups.pop(group.request_id, None)
            for c in group.children:
                self.child_to_group.pop(c.request_id, None)
        return RequestOutput(group.request_id, group.prompt, first.prompt_token_ids, completions, finished, metrics)

    # ---- speculation policy & bookkeeping ----
    def _batch_is_closed(self) -> bool:
        return self.closed_batch and not self.scheduler.waiting

    def observe_acceptance(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        if self.spec_controller is not None:
            self.spec_controller.observe_acceptance(req, num_drafted, num_accepted)

    def proposer_finished(self, req: Request) -> None:
        if self.proposer is not None:
            self.proposer.on_request_finished(req)
        if self.spec_controller is not None:
            self.spec_controller.forget(req)

    def record_step(self, sched: SchedulerOutput, proposal: DraftProposal, t_draft, t_target, t_sample) -> None:
        m = self.spec_metrics
        m.num_steps += 1
        m.time_drafting += t_draft
        m.time_target += t_target
        m.time_sampling += t_sample
        if self.spec_controller is not None:
            self.spec_controller.observe_step(sched, proposal, t_draft, t_target)

    def get_metrics(self) -> dict:
        out = self.spec_metrics.as_dict()
        out.update(
            kv_cache_usage=self.kv.usage, num_kv_blocks=self.kv.pool.num_blocks,
            num_free_kv_blocks=self.kv.pool.num_free_blocks, num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting), num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv.pool.num_cache_queries, prefix_cache_hits=self.kv.pool.num_cache_hits,
        )
        return out
