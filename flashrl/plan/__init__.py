"""The run plan: what a config decides about a run's processes, worked out once (docs/design.md §2).

* `plan_run(config)` -> `RunPlan`: every env runner's engine options (the weight-sync route, the
  colocated share and sleep mode, context and sequences in flight), the learners' placement, and the
  memory estimates; the driver starts the run from it and ``--dry-run`` renders it.
* `flashrl.plan.architectures`: the models' shapes; `flashrl.plan.memory`: the memory formulas.

It sits in the core, below the algorithms: it reads the config by attribute and imports no algorithm.
"""

from flashrl.plan.run_plan import LearnerPlacement, RunnerEngine, RunPlan, plan_run, runner_engine_options

__all__ = ["LearnerPlacement", "RunPlan", "RunnerEngine", "plan_run", "runner_engine_options"]
