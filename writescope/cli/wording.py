"""How a command words an error it refuses with: the Python API's argument names as the
command's flags, and a memory plan's refusal with the flags that change it."""

from __future__ import annotations

from typing import Mapping

from writescope.errors import ArgError

# what a memory plan's refusal tells each command's user to change (its own flags; the API's
# argument names are the default of writescope.budget.plan.MemoryPlan.problem)
PLAN_FLAGS = {
    "generate": ("--vram-budget", "--batch or --max-model-len (without it the plan is for the prompt's tokens plus --max-new-tokens, or the model's limit where the prompt's length is not known before loading)",
                 "--policy", "--prefill-chunk-tokens"),
    "plan": ("--vram-budget", "--batch, --context or --max-new-tokens", "--policy", "--prefill-chunk-tokens"),
    "bench": ("--vram-budget", "--batch or --context (the plan is for the largest of each)", "--policies"),
    "profile": ("--vram-budget", "--batch or --context", "--policy"),
    "serve": ("--vram-budget", "--max-num-seqs or --max-model-len", "--policy", "--prefill-chunk-tokens"),
}


def worded(e: Exception, command: str, flags: Mapping[str, str]) -> str:
    """The message of ``e`` for ``writescope COMMAND``: a plan that does not fit names the
    command's flags (:data:`PLAN_FLAGS`); an :class:`ArgError` its API argument names as
    ``flags`` maps them (others become ``--name-with-dashes``); any other error its own text."""
    from writescope.budget.plan import PlanDoesNotFit, PlanFlags

    if isinstance(e, PlanDoesNotFit) and command in PLAN_FLAGS:
        e = e.plan.problem(PlanFlags(*PLAN_FLAGS[command]))
    return e.worded({"synthetic=True": "--synthetic", **flags}) if isinstance(e, ArgError) else str(e)
