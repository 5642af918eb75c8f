"""EngineCore: the step loop. plan -> schedule -> execute -> commit -> outputs.

The core owns the scheduler (and through it the KV block pool), the speculation policy
and output processing; everything on the device sits behind the executor. Each step leaves
a public ``StepRecord`` that the policy, the metrics and any benchmark observe.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from specdec.config import EngineConfig
from specdec.engine.builder import resolve_model_info
from specdec.engine.kv_cache_manager import KVCacheManager
from specdec.engine.output_processor import OutputProcessor
from specdec.engine.request import Request, RequestStatus
from specdec.engine.request_groups import RequestGroup, RequestGroups
from specdec.engine.scheduler import Scheduler
from specdec.engine.step_record import StepRecord
from specdec.engine.step_timings import StepTimings
from specdec.executor.uniproc_executor import UniprocExecutor
from specdec.lora.registry import LoRARegistry
from specdec.lora.request import LoRARequest
from specdec.outputs import RequestOutput
from specdec.profiling import profile_range
from specdec.sampling_params import SamplingParams
from specdec.spec_decode.controller import SpecController
from specdec.spec_decode.metrics import SpecDecodeMetrics
from specdec.structured_output.backend import backend_key, get_backend
from specdec.structured_output.params import StructuredOutputsParams
from specdec.worker.shared_weights import SharedWeights
from specdec.worker.worker import Worker


class EngineCore:
    def __init__(self, config: EngineConfig, target_weights: SharedWeights | None = None):
        """``target_weights``: take the target's weights from it, or load them and leave them
        there, so several engines of one process run on one copy (``worker/shared_weights.py``)."""
        self.config = config
        if config.tensor_parallel_size > 1:
            from specdec.executor.multiproc_executor import check_not_bootstrapping

            check_not_bootstrapping()
            if target_weights is not None:
                raise ValueError("target_weights (one copy of the weights for several engines) needs "
                                 f"tensor_parallel_size 1, got {config.tensor_parallel_size}")
        info = resolve_model_info(config)
        self.tokenizer = info.tokenizer
        self.model_path = info.model_path
        self.model_config = info.model_config
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.eos_token_ids = info.eos_token_ids
        self.generation_defaults = info.generation_defaults
        worker_args = (info.model_path, info.model_config, info.vocab_size, info.max_model_len, info.eos_token_ids,
                       info.kv_groups)
        if config.tensor_parallel_size > 1:
            from specdec.executor.multiproc_executor import MultiprocExecutor

            self.executor = MultiprocExecutor(config, worker_args)
        else:
            self.executor = UniprocExecutor(Worker(config, *worker_args, target_weights=target_weights))
        self.runtime_plan = self.executor.runtime_plan
        self.device, self.dtype = self.runtime_plan.device, self.runtime_plan.dtype
        self.kv = KVCacheManager.from_layout(self.runtime_plan.kv_layout, config.enable_prefix_caching)
        self.output = OutputProcessor(self.tokenizer, self.max_model_len)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                   config.enable_chunked_prefill, stop_checker=self.output,
                                   max_loras=config.max_loras if config.enable_lora else None)
        self.lora_registry = LoRARegistry(self.model_config, config.max_lora_rank) if config.enable_lora else None
        spec = config.speculative_config
        self.spec_controller = SpecController.build(spec, self.max_model_len) if spec else None
        if self.spec_controller is not None and self.spec_controller.adaptive and config.spec_cost_calibration:
            rpc = self.executor.collective_rpc
            self.spec_controller.calibrate(lambda kind, n: rpc("time_forward", kind, n),
                                           lambda batch, rows: rpc("time_verify_forward", batch, rows),
                                           rpc("verification_batch_sizes", config.max_num_seqs,
                                               self.spec_controller.max_k + 1))
        self.spec_metrics = SpecDecodeMetrics(method=spec.method if spec else "none")
        self.groups = RequestGroups(self.output)
        self.step_timings = StepTimings()
        self.step_observers: list[Callable[[StepRecord], None]] = [self.spec_metrics.observe_step,
                                                                    self.step_timings.observe]
        if self.spec_controller is not None:
            self.step_observers.append(self.spec_controller.observe)
        # True while a caller runs a fixed set of requests to the end (LLM.generate): nothing will
        # join the batch, so "auto" plans for the batch's completion, not for tokens per second
        self.closed_batch = False
        # True while the caller reads finished outputs only (LLM.generate; vLLM's FINAL_ONLY): a
        # running request's text is not re-decoded every step
        self.final_outputs_only = False

    # ---- the step ----
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        with profile_range("step"):
            plan = self.spec_controller.plan(self.scheduler.running, self._batch_is_closed()) \
                if self.spec_controller is not None else None
            sched = self.scheduler.schedule(plan)
            if sched.is_empty:
                return []
            result = self.executor.execute(sched)
            updated, num_emitted = self.scheduler.update_from_output(sched, result)
            self._release([r for r in updated if r.is_finished])
            record = StepRecord(sched, result, num_emitted, time.perf_counter() - started)
            for observe in self.step_observers:
                observe(record)
            return self.groups.outputs(updated, time.monotonic(), self.final_outputs_only)

    def _batch_is_closed(self) -> bool:
        return self.closed_batch and not self.scheduler.waiting

    def _release(self, finished: list[Request]) -> None:
        """Finished requests leave the worker and the policy."""
        if not finished:
            return
        self.executor.finish_requests({r.request_id: r.num_tokens for r in finished})
        if self.spec_controller is not None:
            for r in finished:
                self.spec_controller.forget(r)

    # ---- requests in and out ----
    def compile_grammar(self, params: StructuredOutputsParams):
        """Compile (or find in the cache) a request's grammar; a ``ValueError`` naming the field
        if it does not compile. Thread-safe: a server may call it before queueing the request."""
        key = backend_key(self.config, self.model_path, self.vocab_size, self.eos_token_ids)
        return get_backend(key, lambda: self.tokenizer).compile(params)

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

    def validate_lora(self, lora_request: LoRARequest | None) -> None:
        """Read and check a request's adapter (once per adapter id): a ``ValueError`` naming the
        problem. Thread-safe: a server may call it before queueing the request."""
        if lora_request is None:
            return
        if self.lora_registry is None:
            raise ValueError("lora_request needs an engine started with enable_lora=True")
        self.lora_registry.validate(lora_request)

    def remove_lora(self, adapter_id: int) -> None:
        """Forget an adapter: its id must be validated again before a new request uses it (requests
        already queued finish with it; the worker's slots are reused least recently used first)."""
        if self.lora_registry is not None:
            self.lora_registry.forget(adapter_id)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, lora_request: LoRARequest | None = None) -> None:
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids)
        self.validate_lora(lora_request)
        if params.structured_outputs is not None:
            self.compile_grammar(params.structured_outputs)
        children = []
        for i in range(params.n):
            children.append(Request(
                request_id if params.n == 1 else f"{request_id}#{i}", list(prompt_token_ids), params,
                self.eos_token_ids, seed=None if params.seed is None else params.seed + i,
                output_logprobs=[] if params.logprobs is not None else None, lora_request=lora_request))
        self.groups.add(RequestGroup(request_id, prompt, children))
        for child in children:
            self.scheduler.add_request(child)

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self.groups.pop(rid)
            if group is None:
                continue
            aborted = [c for c in group.children if not c.is_finished]
            for child in aborted:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
            self._release(aborted)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- observers and controls ----
    def add_step_observer(self, observer: Callable[[StepRecord], None]) -> None:
        self.step_observers.append(observer)

    def remove_step_observer(self, observer: Callable[[StepRecord], None]) -> None:
        self.step_observers.remove(observer)

    def set_speculation_policy(self, policy: SpecController) -> SpecController:
        """Plan the following steps' drafts with ``policy`` (``plan`` / ``observe`` / ``forget``,
        e.g. ``SpecController.fixed(k)``); returns the policy it replaces, which learns nothing
        from those steps. One "auto" engine then compares "auto" with fixed K on the same machine
        state (``specdec bench autok``). The policy may plan up to the slots the config reserves."""
        spec = self.config.speculative_config
        if spec is None or not 0 <= policy.max_k <= spec.num_spec_slots:
            slots = spec.num_spec_slots if spec is not None else 0
            raise ValueError(f"a speculation policy of this engine may plan 0..{slots} drafts per request "
                             f"(the slots its speculative_config reserves), got {policy.max_k}")
        previous = self.spec_controller
        self.step_observers.remove(previous.observe)
        self.spec_controller = policy
        self.step_observers.append(policy.observe)
        return previous

    def set_max_num_seqs(self, max_num_seqs: int) -> None:
        """Run at most ``max_num_seqs`` requests at once from the next step on (benchmarks sweep the
        batch size on one engine); the KV cache and graphs were sized for ``config.max_num_seqs``."""
        if not isinstance(max_num_seqs, int) or not 1 <= max_num_seqs <= self.config.max_num_seqs:
            raise ValueError(f"max_num_seqs must be in 1..{self.config.max_num_seqs} (the engine's "
                             f"config.max_num_seqs), got {max_num_seqs!r}")
        self.scheduler.max_num_seqs = max_num_seqs

    def get_metrics(self) -> dict:
        out = self.spec_metrics.as_dict()
        groups = self.kv.group_usage()
        out.update(
            # the fraction of the KV cache's bytes in use (vLLM's kv_cache_usage_perc); blocks of every
            # group's pool, and each group's own (hybrid models: full attention, each sliding window)
            kv_cache_usage=self.kv.usage, num_kv_blocks=sum(g.num_blocks for g in groups),
            num_free_kv_blocks=sum(g.num_free_blocks for g in groups),
            kv_cache_groups={g.name: {"num_blocks": g.num_blocks, "num_free_blocks": g.num_free_blocks,
                                      "usage": g.usage} for g in groups},
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting), num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv.pool.num_cache_queries, prefix_cache_hits=self.kv.pool.num_cache_hits,
            step_timings=self.step_timings.as_dict(),
        )
        return out
