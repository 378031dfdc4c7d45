"""Will it fit? Per-rank device memory and host RAM of a run, planned in one process before it starts.

skeleton.py     the model on meta from config.json, LoRA as the run adds it, the launch's size checks
states.py       exact per-rank bytes: shards, gradients, AdamW state, gathered units, kept quantized bytes
activations.py  the step's activations, traced on fake tensors one layer of each kind at a time
plan.py         the peak and its parts, init RAM, communication
fixes.py        :func:`plan_memory`: the plan, and when it does not fit, the changes that make it fit, each re-planned
cache.py        plans kept on disk, keyed by config.json, the request, the code and the installed packages
report.py       the table and the JSON
"""

from twinkle_strategy.errors import PlanInputError
from twinkle_strategy.planning.cache import PlanCache
from twinkle_strategy.planning.fixes import plan_memory
from twinkle_strategy.planning.plan import MemoryPlan
from twinkle_strategy.planning.report import table, to_json, verdict_line
from twinkle_strategy.planning.request import LoraShape, PlanRequest, parse_size, strategy_request

__all__ = ["LoraShape", "MemoryPlan", "PlanCache", "PlanInputError", "PlanRequest", "parse_size", "plan_memory",
           "strategy_request", "table", "to_json", "verdict_line"]
