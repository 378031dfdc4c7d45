"""The fit check inside swift: the memory plan of the run swift launched, before any weight is read.

It runs in ``SftArguments._init_fsdp``'s hook (:mod:`.arguments`), where swift has read the model's config.json
(``args.model_dir``) and nothing else. Every rank plans the same world from the same arguments, so every rank
refuses with the same line, with no process group needed. The budget is ``TWINKLE_DEVICE_MEMORY`` (or the
``--fsdp`` JSON's ``"twinkle": {"device_memory": ...}``), else the first GPU's memory; on CPU with neither
there is nothing to check against and the plan is not run. ``TWINKLE_SKIP_PLAN=1`` launches anyway.
"""

from __future__ import annotations

import logging
import os

import torch

from twinkle_strategy import config
from twinkle_strategy.errors import ParallelConfigError, PlanInputError
from twinkle_strategy.integrations.swift.errors import SwiftPluginError
from twinkle_strategy.integrations.swift.parts.options import PLAN_OPTIONS, env_var
from twinkle_strategy.planning import LoraShape, PlanRequest, parse_size, plan_memory, verdict_line
from twinkle_strategy.planning.report import gib

logger = logging.getLogger("twinkle_strategy.integrations.swift.plugin")
_PARSE = {"device_memory": lambda v: parse_size(v, what="device_memory"), "skip_plan": config.parse_bool,
          "routing_skew": float}


def plan_options(fsdp_options: dict | None = None, environ=None) -> dict:
    """``device_memory`` (bytes or None), ``skip_plan`` and ``routing_skew``; the ``--fsdp`` JSON wins."""
    environ = os.environ if environ is None else environ
    options = dict(PLAN_OPTIONS)
    for name in PLAN_OPTIONS:
        for where, raw in ((f"environment variable {env_var(name)}", environ.get(env_var(name))),
                           (f'--fsdp "twinkle": {{"{name}": ...}}', (fsdp_options or {}).get(name))):
            if raw is None:
                continue
            try:
                options[name] = _PARSE[name](raw)
            except (PlanInputError, ValueError) as exc:
                raise SwiftPluginError(f"{where}={raw!r}: {exc}") from exc
    return options


def launched_world(environ=None) -> tuple[int, int]:
    """(nodes, processes per node) of the job swift started (torchrun's variables; one process without them)."""
    environ = os.environ if environ is None else environ
    world = int(environ.get("WORLD_SIZE", "1"))
    local = int(environ.get("LOCAL_WORLD_SIZE", world))
    return max(world // max(local, 1), 1), local


def plan_request(args, strategy_config, *, device_type: str, device_memory: int | None, routing_skew: float,
                 environ=None) -> PlanRequest:
    """The plan's question for swift's parsed arguments (``--model``'s config.json, its tuner and batch shape)."""
    nnodes, nproc = launched_world(environ)
    lora = None
    if args.tuner_type == "lora":
        lora = LoraShape(rank=args.lora_rank, alpha=args.lora_alpha, target_modules=tuple(args.target_modules),
                         target_parameters=tuple(getattr(args, "target_parameters", None) or ()))
    dtype = args.torch_dtype
    dtype = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
    return PlanRequest(model_path=args.model_dir, strategy=strategy_config, nnodes=nnodes, nproc_per_node=nproc,
                       dtype=dtype, lora=lora, micro_batch=args.per_device_train_batch_size,
                       max_length=args.max_length, gradient_checkpointing=bool(args.gradient_checkpointing),
                       routing_skew=routing_skew, device_memory=device_memory, device_type=device_type)


# The plan's fixes are named as the Python API names them; swift's users set them so (``--flag value`` or a variable).
_SWIFT_FLAGS = {"micro_batch": "--per_device_train_batch_size", "gradient_checkpointing": "--gradient_checkpointing",
                "sequence_parallel_size": "--sequence_parallel_size"}


def swift_spelling(option: str, value) -> str:
    """A fix as swift sft takes it: ``--per_device_train_batch_size 2``, ``NNODES=2``, ``TWINKLE_EP_SIZE=4``."""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    if option in _SWIFT_FLAGS:
        return f"{_SWIFT_FLAGS[option]} {text}"
    return f"NNODES={text}" if option == "nnodes" else f"{env_var(option)}={text}"


def check_fit(args, strategy_config, *, device_type: str, fsdp_options: dict | None = None) -> int | None:
    """Refuse (SwiftPluginError, one line: the peak, the budget, the first fix) a run whose plan does not fit its
    devices; returns the planned peak in bytes, or None where nothing was checked."""
    options = plan_options(fsdp_options)
    if options["skip_plan"]:
        return None
    budget = options["device_memory"]
    if budget is None and device_type == "cuda" and torch.cuda.is_available():
        budget = torch.cuda.get_device_properties(0).total_memory
    if budget is None:
        return None
    try:
        plan = plan_memory(plan_request(args, strategy_config, device_type=device_type, device_memory=budget,
                                        routing_skew=options["routing_skew"]))
    except ParallelConfigError as exc:  # the launch's own message (it names torchrun), plus swift's setting
        raise ParallelConfigError(f"{exc}; with swift sft: NPROC_PER_NODE (and NNODES)") from exc
    except PlanInputError as exc:
        raise SwiftPluginError(f"the memory plan of this run: {exc} ({env_var('skip_plan')}=1 skips it)") from exc
    if not plan.fits:
        first = next((f for f in plan.fixes if f.fits), None)
        fix = (f"first fix: {first.spelled(swift_spelling)} (peak {gib(first.peak)})" if first
               else "no single change makes it fit")
        raise SwiftPluginError(
            f"the memory plan's step peak {gib(plan.peak)} per device exceeds the budget {gib(budget)} "
            f"({env_var('device_memory')}, else the GPU's memory); {fix}; twinkle-sft plan shows every part; "
            f"{env_var('skip_plan')}=1 launches anyway")
    if int(os.environ.get("RANK", "0")) == 0:
        logger.info("twinkle swift plugin: memory plan: %s", verdict_line(plan, spelling=swift_spelling))
    return plan.peak
