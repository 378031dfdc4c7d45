"""``twinkle-sft plan`` and the fit check before every launch: a recipe as a memory plan.

The plan (:mod:`twinkle_strategy.planning`) needs the model's config.json on this machine and nothing
else: no weight, no process group, no GPU. Before a launch it runs against the device memory found
here (``launch.device_memory`` when set; none is found on CPU, so there only that key turns it on), and a
run that will not fit is refused in one line: the peak, the budget, the first fix.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from twinkle_strategy.errors import TwinkleError
from twinkle_strategy.planning import (
    LoraShape,
    MemoryPlan,
    PlanCache,
    PlanRequest,
    parse_size,
    plan_memory,
    table,
    to_json,
)
from twinkle_strategy.planning.plan import Spelling
from twinkle_strategy.planning.report import gib
from twinkle_strategy.sources.model_ids import HF_PREFIX, MS_PREFIX, cached_model_path
from twinkle_strategy.train.flags import SWIFT_FLAGS, flag_for, split_argv
from twinkle_strategy.train.log_lines import PLANNED_PEAK_ENV
from twinkle_strategy.train.recipe import Recipe, TunerType
from twinkle_strategy.train.run import prepare_model_path


def local_model_dir(path: str) -> str:
    """Where the model's config.json is on this machine (a hub id: its local cache)."""
    if path.startswith((HF_PREFIX, MS_PREFIX)):
        cached = cached_model_path(path)
        if cached is None:
            raise TwinkleError(f"{path} is not in the local cache: the plan reads its config.json; download the "
                               "model (or just its config.json) first and pass its directory")
        return cached
    return path


def request_from_recipe(recipe: Recipe, *, device_memory: int | None = None) -> PlanRequest:
    launch, tuner = recipe.launch, recipe.tuner
    lora = None
    if tuner.type == TunerType.LORA:
        lora = LoraShape(rank=tuner.lora_rank, alpha=tuner.lora_alpha, target_modules=tuple(tuner.target_modules),
                         target_parameters=tuple(tuner.target_parameters))
    nproc = int(os.environ.get("NPROC_PER_NODE", launch.nproc_per_node))
    nnodes = int(os.environ.get("NNODES", launch.nnodes))
    device_type = recipe.strategy.device_type or ("cuda" if _cuda_memory() else "cpu")
    return PlanRequest(model_path=local_model_dir(recipe.model.path), strategy=recipe.strategy, nnodes=nnodes,
                       nproc_per_node=nproc, dtype=recipe.model.dtype, lora=lora,
                       micro_batch=recipe.train.per_device_train_batch_size, max_length=recipe.data.max_length,
                       gradient_checkpointing=recipe.train.gradient_checkpointing,
                       routing_skew=launch.routing_skew,
                       device_memory=device_memory if device_memory is not None
                       else parse_size(launch.device_memory, what="launch.device_memory"),
                       host_memory=parse_size(launch.host_memory, what="launch.host_memory"), device_type=device_type)


def _cuda_memory() -> int | None:
    """The memory of this machine's first GPU, if it has one (the launch's devices are assumed alike)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return None


# The plan's fixes are named as the Python API names them (StrategyConfig fields, PlanRequest arguments); a
# twinkle-sft user sets them as recipe keys, on the command line as key=value.
_RECIPE_KEYS = {"micro_batch": "train.per_device_train_batch_size", "gradient_checkpointing": "train.gradient_checkpointing",
                "nnodes": "launch.nnodes"}
# What the run reads before the recipe (request_from_recipe, cli.py): a user who set it there sets it there again.
_ENVIRONMENT_KEYS = {"launch.nnodes": "NNODES", "launch.nproc_per_node": "NPROC_PER_NODE"}


def recipe_key(option: str) -> str:
    """The recipe key that sets a fix's option: ``launch.nnodes``, ``strategy.ep_size``."""
    return _RECIPE_KEYS.get(option, f"strategy.{option}")


def _value_text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def recipe_spelling(option: str, value) -> str:
    """A fix as a recipe override: ``train.per_device_train_batch_size=2``, ``strategy.ep_size=4``."""
    return f"{recipe_key(option)}={_value_text(value)}"


@dataclasses.dataclass(frozen=True)
class UserSpelling:
    """A fix spelled the way this command line set things (issue 47): the user who typed ``--nnodes 1`` reads
    ``--nnodes 2``, not ``launch.nnodes=2``. An option the user set by a flag is spelled as that flag; one set by
    a recipe or a ``key=value`` as its key; one the user did not set, as a flag when the command line is flags
    alone (no recipe, no ``key=value``), else as its key. ``NNODES`` / ``NPROC_PER_NODE`` in the environment, which
    the run reads before the recipe, are spelled as that variable."""

    flags: dict[str, str]  # recipe key -> the flag this command line set it with, as typed (``--nnodes``)
    flags_only: bool  # no YAML recipe and no key=value override: the user speaks flags

    @classmethod
    def of_argv(cls, argv: list[str]) -> UserSpelling:
        positionals, flag_values = split_argv(argv)
        return cls(flags={SWIFT_FLAGS[name][0]: f"--{name}" for name, _ in flag_values},
                   flags_only=not any(p not in ("-h", "--help") for p in positionals))

    def __call__(self, option: str, value) -> str:
        key, text = recipe_key(option), _value_text(value)
        variable = _ENVIRONMENT_KEYS.get(key)
        if variable is not None and variable in os.environ:
            return f"{variable}={text}"
        flag = self.flags.get(key) or (flag_for(key) if self.flags_only else None)
        return f"{flag} {text}" if flag else f"{key}={text}"


def check_fit_before_launch(recipe: Recipe, *, spelling: Spelling = recipe_spelling) -> str | None:
    """The refusal line when the plan says ``recipe`` will not fit its devices, else None (and the plan's peak
    goes to the workers' environment for the step log). Skipped with launch.skip_plan, and on a machine with no
    device memory found unless launch.device_memory is set."""
    if recipe.launch.skip_plan:
        return None
    budget = parse_size(recipe.launch.device_memory, what="launch.device_memory") or _cuda_memory()
    if budget is None:
        return None
    plan = plan_memory(request_from_recipe(recipe, device_memory=budget), cache=PlanCache.default())
    os.environ[PLANNED_PEAK_ENV] = str(plan.peak)
    if plan.fits:
        return None
    first = next((f for f in plan.fixes if f.fits), None)
    fix = (f"first fix: {first.spelled(spelling)} (peak {gib(first.peak)})" if first
           else "no single change fits: see twinkle-sft plan")
    return (f"the memory plan's step peak {gib(plan.peak)} per device exceeds the budget {gib(budget)} "
            f"(launch.device_memory, --device_memory); {fix}; twinkle-sft plan shows every part; --skip_plan true "
            "launches anyway")


def plan_command(argv: list[str], parse) -> int:
    """``twinkle-sft plan RECIPE [flags] [key=value] [--json]``: print the plan; 0 if it fits (or no budget)."""
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    try:
        recipe = parse(argv)
        recipe.model.path = prepare_model_path(recipe.model.path, recipe.data.dataset)
        plan: MemoryPlan = plan_memory(request_from_recipe(recipe), cache=PlanCache.default())
    except TwinkleError as exc:
        print(f"twinkle-sft plan: error: {exc}", file=sys.stderr)
        return 2
    spelling = UserSpelling.of_argv(argv)
    print(json.dumps(to_json(plan, spelling=spelling), indent=1) if as_json else table(plan, spelling=spelling))
    return 0 if plan.fits is not False else 1
