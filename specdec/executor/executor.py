"""Executor: how the engine core reaches its worker(s). The core only ever calls these."""
from __future__ import annotations

from abc import ABC, abstractmethod

from specdec.engine.scheduler_output import SchedulerOutput
from specdec.worker.model_runner_output import ModelRunnerOutput


class Executor(ABC):
    @property
    @abstractmethod
    def num_kv_blocks(self) -> int:
        """KV blocks each worker's cache holds (the scheduler's block pool has as many)."""

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
