"""Executor: how the engine core reaches its worker(s). The core only ever calls these."""
from __future__ import annotations

from abc import ABC, abstractmethod

from collections.abc import Callable
from typing import Any

from specdec.engine.scheduler_output import SchedulerOutput
from specdec.worker.model_runner_output import ModelRunnerOutput
from specdec.worker.plan import RuntimePlan


class Executor(ABC):
    @property
    @abstractmethod
    def num_kv_blocks(self) -> int:
        """KV blocks each worker's cache holds (the scheduler's block pool has as many)."""

    @property
    @abstractmethod
    def runtime_plan(self) -> RuntimePlan:
        """The driver's plan: device, dtypes, backends, graphs, KV blocks."""

    @abstractmethod
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; the driver's result."""

    @abstractmethod
    def finish_requests(self, num_tokens: dict[str, int]) -> None:
        """Requests that ended (id -> final token count): workers drop their state."""

    @abstractmethod
    def collective_rpc(self, method: str, *args):
        """Call ``Worker.<method>(*args)`` on every worker; the driver's return value
        (start-up calibration, benchmark controls)."""

    @abstractmethod
    def gather_rpc(self, method: str, *args) -> list:
        """``Worker.<method>(*args)`` of every worker, in rank order (per-rank figures)."""

    def control_proposer(self, name: str, payload: Any = None) -> Any:
        """Send every worker's proposer the control ``name`` its speculative method defines
        (``spec_decode/methods.py``; every method has "reset_history": forget what finished
        requests taught it); the driver's return value. A ``ValueError`` names the controls the
        method has."""
        return self.collective_rpc("control_proposer", name, payload)

    def apply_model(self, fn: Callable[[Any], Any]) -> list:
        """``fn(target model)`` on every worker, in rank order (the model is each rank's shard;
        with several ranks ``fn`` and its result must pickle)."""
        return self.gather_rpc("apply_model", fn)
