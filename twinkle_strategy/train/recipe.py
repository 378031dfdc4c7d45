"""Training recipes: omegaconf structured configs loaded from YAML, with ``key=value`` overrides.

The schema is the dataclasses below; OmegaConf runs in struct mode, so a typo
(``strategy.memory_efficent_init``) or a wrong type (``train.max_steps=ten``)
is an error naming the key, raised before any process is started.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import yaml
from twinkle_strategy.config import StrategyConfig
from twinkle_strategy.errors import StrategyConfigError, TwinkleError
from twinkle_strategy.parallel import ParallelDims
from twinkle_strategy.sequence import check_sequence_parallel
from twinkle_strategy.sources.model_ids import HubConvention, hub_for_bare_ids, qualified_model_id
from twinkle_strategy.sources.tiny import DEMO_NUM_EXPERTS, qwen3_moe_config, sized_config
from twinkle_strategy.train.arguments import TrainingArguments
from twinkle_strategy.train.data import TRUNCATION_STRATEGIES
from twinkle_strategy.train.errors import RecipeError

# target_modules that PEFT turns into LoRA on an MoE model's fused expert weights.
EXPERT_MODULE_NAMES = frozenset({"all-linear", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"})


class TunerType(str, enum.Enum):
    """What training changes (``tuner.type``, swift's ``--tuner_type``)."""

    LORA = "lora"  # a PEFT LoRA adapter; the base stays frozen
    FULL = "full"  # every parameter


@dataclasses.dataclass
class ModelConfig:
    # local dir, ms://org/name, hf://org/name, tiny://demo (the embedded tiny MoE), or a bare org/name
    # (ModelScope, or the Hugging Face Hub with use_hf, as swift takes it).
    path: str = MISSING
    dtype: str = "bfloat16"  # float32 | bfloat16 | float16
    # swift's --use_hf: the hub of a bare org/name; null: the environment's USE_HF (unset: ModelScope).
    use_hf: bool | None = None


@dataclasses.dataclass
class DataConfig:
    # JSONL files with "messages" or "query"/"response" rows; swift's "path#N" uses N examples of a file.
    # A single path may be written as a plain string.
    dataset: list[str] = MISSING
    max_length: int = 2048
    # A row longer than max_length, as swift's --truncation_strategy: delete (swift's default: skipped, with the
    # bad rows' warning) | right (its first max_length tokens) | left (its last).
    truncation_strategy: str = "delete"
    # Both train each example with its own attention, in one row per micro-batch without padding (packing.py):
    packing: bool = False  # group examples into packs of up to max_length tokens (one pack = one item)
    padding_free: bool = False  # concatenate each micro-batch's examples instead of padding them
    strict: bool = False  # true: stop at the first bad row; false (swift's default): skip bad rows with a warning


@dataclasses.dataclass
class TunerConfig:
    type: str = "lora"  # a TunerType: lora | full
    lora_rank: int = 8
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    use_dora: bool = False
    lora_bias: bool = False
    target_modules: list[str] = dataclasses.field(default_factory=lambda: ["all-linear"])
    # Fused expert weights (transformers v5 MoE); [] to leave the experts frozen.
    target_parameters: list[str] = dataclasses.field(
        default_factory=lambda: ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


@dataclasses.dataclass
class LaunchConfig:
    nnodes: int = 1
    nproc_per_node: int = 1
    # Run `nnodes` torchrun agents on this machine (simulated nodes, for demos and tests).
    simulated_nodes: bool = False
    # torchrun's --max-restarts: a failed run restarts in place and resumes from its newest complete checkpoint.
    max_restarts: int = 0
    # The memory plan (twinkle-sft plan) runs before every launch against the device memory found here, or this
    # size (e.g. 80GiB; needed on CPU, where none is found); a run it says will not fit is refused.
    device_memory: str | None = None
    host_memory: str | None = None  # host RAM per node for the plan's init verdict (e.g. 1TB)
    routing_skew: float = 1.0  # the plan's busiest EP rank receives this many times its balanced share
    skip_plan: bool = False  # launch without checking the plan's fit


@dataclasses.dataclass
class Recipe:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    tuner: TunerConfig = dataclasses.field(default_factory=TunerConfig)
    # The library's own option set: every StrategyConfig field is a recipe key under strategy.
    strategy: StrategyConfig = dataclasses.field(default_factory=StrategyConfig)
    train: TrainingArguments = dataclasses.field(default_factory=TrainingArguments)
    launch: LaunchConfig = dataclasses.field(default_factory=LaunchConfig)


def _reason(exc: OmegaConfBaseException) -> str:
    # omegaconf messages end with a "full_key: ..." block; keep the first line and name the key.
    first = str(exc).strip().splitlines()[0]
    key = getattr(exc, "full_key", None)
    return f"{key}: {first}" if key and key not in first else first


def load_recipe(yaml_path: str | None = None, overrides: list[str] | None = None) -> Recipe:
    """Schema <- YAML file <- ``key=value`` overrides; validated, returned as a :class:`Recipe` object."""
    schema = OmegaConf.structured(Recipe)
    OmegaConf.set_struct(schema, True)
    try:
        merged = schema
        if yaml_path is not None:
            if not os.path.isfile(yaml_path):
                raise RecipeError(f"recipe file {yaml_path!r} does not exist")
            merged = OmegaConf.merge(merged, _dataset_as_list(OmegaConf.load(yaml_path)))
        if overrides:
            bad = [o for o in overrides if "=" not in o]
            if bad:
                raise RecipeError(f"override {bad[0]!r} is not of the form key=value (e.g. train.max_steps=10)")
            merged = OmegaConf.merge(merged, _dataset_as_list(OmegaConf.from_dotlist(overrides)))
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise RecipeError(f"recipe is missing required key(s) {missing}; set them in the YAML or as key=value")
        recipe: Recipe = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        where = f" in {yaml_path}" if yaml_path else ""
        raise RecipeError(f"invalid recipe{where}: {_reason(exc)}") from exc
    except yaml.YAMLError as exc:  # a value omegaconf could not even parse, e.g. key=[a, b without ']'
        problem = " ".join(str(exc).split())
        raise RecipeError(f"invalid recipe: {problem}; check the YAML file and each key=value (quote odd values)") \
            from exc
    except StrategyConfigError as exc:  # StrategyConfig.__post_init__: name the recipe key
        raise RecipeError(f"strategy.{exc.key}: {exc.reason}", key=f"strategy.{exc.key}", reason=exc.reason) \
            from exc
    except ValueError as exc:  # raised by dataclass __post_init__ checks (e.g. TrainingArguments)
        if isinstance(exc, TwinkleError):
            raise
        raise RecipeError(f"invalid recipe: {exc}") from exc
    # A bare org/name becomes ms:// or hf:// here, once, so every later step (checks, workers) sees its hub.
    recipe.model.path = qualified_model_id(recipe.model.path, use_hf=recipe.model.use_hf)
    validate_recipe(recipe)
    return recipe


def command_line_hubs(use_hf: bool | None) -> HubConvention:
    """swift's convention for bare model ids (ModelScope unless --use_hf true / USE_HF=1), worded in its flags."""
    return HubConvention(bare_ids=hub_for_bare_ids(use_hf),
                         to_hugging_face="--model hf://{id}, or --use_hf true (USE_HF=1) for a bare id",
                         to_modelscope="--model ms://{id}, or --use_hf false for a bare id")


def _dataset_as_list(config):
    """``data.dataset: file.jsonl`` is the common case of a list of one; the schema wants a list."""
    data = config.get("data") if isinstance(config, DictConfig) else None
    if isinstance(data, DictConfig) and isinstance(data.get("dataset"), str):
        data.dataset = [data.dataset]
    return config


def validate_recipe(recipe: Recipe, world_size: int | None = None) -> None:
    """Checks that need no process group: tuner type, dtype, and parallel sizes against the launch."""
    if recipe.launch.max_restarts < 0:
        raise RecipeError(f"launch.max_restarts={recipe.launch.max_restarts}; use 0 (no restarts) or more")
    if recipe.tuner.type not in tuple(TunerType):
        raise RecipeError(f"tuner.type={recipe.tuner.type!r}; use 'lora' or 'full'")
    tuner = recipe.tuner
    # PEFT maps "all-linear" and the experts' module names to their fused tensors on an MoE model (transformers v5).
    experts_by_module = [m for m in tuner.target_modules if m in EXPERT_MODULE_NAMES]
    on_experts = list(tuner.target_parameters) or (experts_by_module if _num_experts(recipe.model.path) else [])
    if tuner.type == TunerType.LORA and on_experts:
        # PEFT wraps fused expert tensors in ParamWrapper, which does not take these options (it refuses them
        # when the adapter is made), whichever way lora_experts computes LoRA on the experts: refused here first.
        unsupported = [(f"tuner.lora_dropout={tuner.lora_dropout}", "set tuner.lora_dropout=0", tuner.lora_dropout > 0),
                       ("tuner.use_dora=true", "set tuner.use_dora=false", tuner.use_dora),
                       ("tuner.lora_bias=true", "set tuner.lora_bias=false", tuner.lora_bias)]
        if tuner.target_parameters:
            where, narrow = f"tuner.target_parameters={on_experts}", "set tuner.target_parameters=[]"
        else:
            where = f"tuner.target_modules={on_experts} (PEFT puts it on the fused expert weights)"
            narrow = "set tuner.target_modules=[q_proj,k_proj,v_proj,o_proj]"
        for option, fix, bad in unsupported:
            if bad:
                key = option.split("=")[0]
                reason = (f"{option} cannot be used with {where} (LoRA on fused expert weights): {fix}, or "
                          f"{narrow} to train attention/linear layers only")
                raise RecipeError(reason, key=key, reason=reason)
    if recipe.train.merge_lora and tuner.type != TunerType.LORA:
        reason = (f"true needs tuner.type=lora (got {tuner.type!r}): a full run's checkpoints are whole models "
                  "already; set it to false")
        raise RecipeError(f"train.merge_lora={reason}", key="train.merge_lora", reason=reason)
    if not recipe.data.dataset:
        raise RecipeError("data.dataset is empty; name one or more JSONL files")
    if recipe.data.truncation_strategy not in TRUNCATION_STRATEGIES:
        split = " ('split' is swift's for pre-training)" if recipe.data.truncation_strategy == "split" else ""
        reason = f"{recipe.data.truncation_strategy!r}{split}; use delete (swift's default), right or left"
        raise RecipeError(f"data.truncation_strategy: {reason}", key="data.truncation_strategy", reason=reason)
    if recipe.model.dtype not in ("float32", "bfloat16", "float16"):
        raise RecipeError(f"model.dtype={recipe.model.dtype!r}; use float32, bfloat16 or float16")
    if world_size is None:
        world_size = planned_world_size(recipe)
    # The model's own limits first, then the world size: a fix for the world (launch.nproc_per_node=...) is
    # computed for sizes the model accepts, so applying it passes every check (issue 31: ep_size 3 in a world
    # of 1 once suggested 3 processes, which then failed on the demo's 8 experts).
    num_experts = _num_experts(recipe.model.path)
    _check_experts(recipe, num_experts, world_size)
    _check_sequence_parallel_model(recipe)
    where = (f"nodes x processes per node = {recipe.launch.nnodes} x {recipe.launch.nproc_per_node}"
             if "WORLD_SIZE" not in os.environ and "NPROC_PER_NODE" not in os.environ else "the launch's world size")
    _check_world_size(recipe, world_size, where, num_experts)
    try:
        ParallelDims(world_size=world_size, ep_size=recipe.strategy.ep_size, ep_fsdp_size=recipe.strategy.ep_fsdp_size)
    except TwinkleError as exc:
        reason = f"{exc} ({where} = {world_size})"
        raise RecipeError(f"strategy.ep_size: {reason}", key="strategy.ep_size", reason=reason) from exc


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_experts(recipe: Recipe, num_experts: int | None, world_size: int) -> None:
    """Every EP rank holds the same number of experts: ep_size divides the model's experts."""
    ep = recipe.strategy.ep_size
    if num_experts is None or ep <= 1 or num_experts % ep == 0:
        return
    # Choices that also divide this run's world, so the one picked passes the world-size check too.
    choices = [d for d in _divisors(num_experts) if world_size % d == 0]
    reason = (f"{recipe.model.path} has {num_experts} experts, not divisible by ep_size {ep}; "
              f"choose ep_size among {choices}")
    raise RecipeError(f"strategy.ep_size: {reason}", key="strategy.ep_size", reason=reason)


def _check_sequence_parallel_model(recipe: Recipe) -> None:
    """sequence_parallel_size against the model (whole attention heads per rank, attention layers only)."""
    sp, key = recipe.strategy.sequence_parallel_size, "strategy.sequence_parallel_size"
    config = _model_config(recipe.model.path) if sp > 1 else None
    if config is not None:
        try:
            check_sequence_parallel(config, sp)
        except TwinkleError as exc:
            raise RecipeError(f"{key}: {exc}", key=key, reason=str(exc)) from exc


def _check_world_size(recipe: Recipe, world_size: int, where: str, num_experts: int | None) -> None:
    """ep_size and sequence_parallel_size each divide the world size. They are carved independently (see
    parallel.py), so ep x sp may exceed the world: the world needs a multiple of lcm(ep, sp), not of ep x sp."""
    ep, sp = recipe.strategy.ep_size, recipe.strategy.sequence_parallel_size
    if world_size % ep == 0 and world_size % sp == 0:
        return
    nnodes = int(os.environ.get("NNODES", recipe.launch.nnodes))
    # The setting the launch reads: swift's NPROC_PER_NODE, when set, wins over the recipe's launch section.
    setting = "NPROC_PER_NODE" if "NPROC_PER_NODE" in os.environ else "launch.nproc_per_node"
    per_node = processes_per_node_for(nnodes=nnodes, ep_size=ep, sequence_parallel_size=sp,
                                      ep_fsdp_size=recipe.strategy.ep_fsdp_size)
    ep_choices = [d for d in _divisors(world_size) if num_experts is None or num_experts % d == 0]
    sp_choices = [d for d in _divisors(world_size) if _model_takes_sequence_parallel(recipe, d)]
    # (name, size, the other sizes' choices) of each size that does not divide the world, ep first.
    misfits = [(name, size, choices) for name, size, choices in
               (("ep_size", ep, ep_choices), ("sequence_parallel_size", sp, sp_choices)) if world_size % size]
    other = [(name, size) for name, size in (("ep_size", ep), ("sequence_parallel_size", sp))
             if size > 1 and name != misfits[0][0]]
    if not other:
        needs = f"{misfits[0][0]} {misfits[0][1]} needs a multiple of {misfits[0][1]} processes"
    else:
        # Both are in use: say that each divides the world (not that the world holds ep x sp), naming the other
        # one's key and flag too, since changing either size, or the world, is a fix.
        (name, size), flag = other[0], {"ep_size": "--expert_parallel_size",
                                        "sequence_parallel_size": "--sequence_parallel_size"}[other[0][0]]
        needs = (f"{misfits[0][0]} {misfits[0][1]} and {name} {size} (strategy.{name}, {flag}) must each divide the "
                 "number of processes (SP groups sit inside the data-parallel and EP ranks, so ep x sp may exceed "
                 "it)")
    alternatives = " and ".join(f"{name} among {choices}" for name, _, choices in misfits)
    reason = f"{needs}, this run has {world_size} ({where}); set {setting}={per_node}, or {alternatives}"
    key = f"strategy.{misfits[0][0]}"
    raise RecipeError(f"{key}: {reason}", key=key, reason=reason)


def processes_per_node_for(*, nnodes: int, ep_size: int, sequence_parallel_size: int,
                           ep_fsdp_size: int | None = None) -> int:
    """The fewest processes per node whose world (``nnodes`` x it) ep_size and sequence_parallel_size both
    divide (and equals ep_size x ep_fsdp_size when that is set, if some count can)."""
    need = math.lcm(ep_size, sequence_parallel_size)
    fits = [p for p in range(1, need * (ep_fsdp_size or 1) + 1) if (nnodes * p) % need == 0]
    exact = [p for p in fits if ep_fsdp_size is not None and nnodes * p == ep_size * ep_fsdp_size]
    return (exact or fits)[0]


def _model_takes_sequence_parallel(recipe: Recipe, sp: int) -> bool:
    config = _model_config(recipe.model.path) if sp > 1 else None
    try:
        if config is not None:
            check_sequence_parallel(config, sp)
    except TwinkleError:
        return False
    return True


def _model_config(path: str):
    """The model's transformers config, from its config.json (tiny://demo: the demo's), or None if not at hand."""
    if path.startswith("tiny://"):
        return sized_config(qwen3_moe_config) if path in ("tiny://", "tiny://demo") else None
    if not os.path.isfile(os.path.join(path, "config.json")):
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def planned_world_size(recipe: Recipe) -> int:
    """The world size this run will have: torchrun's WORLD_SIZE inside a worker; otherwise the swift-style
    NPROC_PER_NODE x NNODES environment if set, else launch.nproc_per_node x launch.nnodes."""
    env = os.environ
    if "WORLD_SIZE" in env:
        return int(env["WORLD_SIZE"])
    return int(env.get("NPROC_PER_NODE", recipe.launch.nproc_per_node)) * int(env.get("NNODES", recipe.launch.nnodes))


def _num_experts(path: str) -> int | None:
    """The model's number of routed experts, from its config.json (tiny://: the embedded demo's)."""
    if path.startswith("tiny://"):
        return DEMO_NUM_EXPERTS
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return None
    with open(config) as f:
        cfg = json.load(f)
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if isinstance(cfg.get(key), int):
            return cfg[key]
    return None
