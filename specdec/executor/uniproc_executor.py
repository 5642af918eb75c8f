"""One worker in the engine's own process: direct calls, no copies, no serialisation."""
from __future__ import annotations

from specdec.engine.scheduler_output import SchedulerOutput
from specdec.executor.executor import Executor
from specdec.worker.model_runner_output import ModelRunnerOutput
from specdec.worker.worker import Worker


class UniprocExecutor(Executor):
    def __init__(self, worker: Worker):
        self.driver_worker = worker

    @property
    def num_kv_blocks(self) -> int:
        return self.driver_worker.num_kv_blocks

    @property
    def runtime_plan(self):
        return self.driver_worker.plan

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_worker.execute(sched)

    def finish_requests(self, num_tokens: dict[str, int]) -> None:
        self.driver_worker.finish_requests(num_tokens)

    def collective_rpc(self, method: str, *args):
        return getattr(self.driver_worker, method)(*args)

    def gather_rpc(self, method: str, *args) -> list:
        return [getattr(self.driver_worker, method)(*args)]
