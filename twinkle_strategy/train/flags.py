"""twinkle-sft's command line: ``swift sft``-style flags and ``key=value`` overrides, read into a Recipe.

Each flag maps to one recipe key (every ``StrategyConfig`` option and ``TrainingArguments`` field is one, named as
swift names it where swift has one); :func:`parse` reads a command line, :func:`check_value` says what a bad value
is in one line naming the key and the flag. Launching is :mod:`twinkle_strategy.train.cli`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import re
import typing

from twinkle_strategy import config
from twinkle_strategy.errors import TwinkleError, did_you_mean
from twinkle_strategy.train.arguments import TrainingArguments
from twinkle_strategy.train.recipe import Recipe, RecipeError, load_recipe
from twinkle_strategy.train.swift_flags import SWIFT_FLAGS_NOT_TAKEN

# swift sft flag -> recipe key, help
SWIFT_FLAGS: dict[str, tuple[str, str]] = {
    "model": ("model.path", "model dir, org/name (ModelScope; the Hugging Face Hub with --use_hf true), "
                            "ms://org/name, hf://org/name or tiny://demo"),
    "use_hf": ("model.use_hf", "true: a bare --model org/name comes from the Hugging Face Hub, false: from "
                               "ModelScope; unset: the USE_HF environment variable, else ModelScope (as swift)"),
    "torch_dtype": ("model.dtype", "float32 | bfloat16 | float16"),
    "dataset": ("data.dataset", "JSONL file(s) ('messages' or 'query'/'response' rows); FILE#N uses N examples"),
    "strict": ("data.strict", "true: stop at the first bad row; false (default): skip bad rows with a warning"),
    "max_length": ("data.max_length", "the most tokens of an example; a longer row is dropped with a warning "
                                      "(--truncation_strategy delete, swift's default) or cut (right / left)"),
    "truncation_strategy": ("data.truncation_strategy", "a row longer than --max_length: delete (swift's default: "
                                                        "skip it, with a warning) | right (cut its end) | left "
                                                        "(cut its start)"),
    "packing": ("data.packing", "pack examples into rows of up to max_length tokens, each example attending "
                                "only to itself (true/false)"),
    "padding_free": ("data.padding_free", "concatenate each micro-batch's examples instead of padding them, each "
                                          "attending only to itself (true/false)"),
    "tuner_type": ("tuner.type", "lora | full"),
    "train_type": ("tuner.type", "alias of --tuner_type"),
    "lora_rank": ("tuner.lora_rank", "LoRA rank r"),
    "lora_alpha": ("tuner.lora_alpha", "LoRA alpha"),
    "use_dora": ("tuner.use_dora", "DoRA (weight-decomposed LoRA); not on fused expert weights (true/false)"),
    "lora_dropout": ("tuner.lora_dropout", "LoRA dropout; 0 with --target_parameters (PEFT cannot drop out on fused "
                                           "expert weights)"),
    "target_modules": ("tuner.target_modules", "LoRA target modules (e.g. all-linear, or q_proj v_proj)"),
    "target_parameters": ("tuner.target_parameters", "LoRA on parameters, e.g. mlp.experts.gate_up_proj"),
    "max_restarts": ("launch.max_restarts", "torchrun restarts after a failure; the run resumes from its newest "
                                            "complete checkpoint"),
    "nnodes": ("launch.nnodes", "nodes of the run (swift: NNODES)"),
    "nproc_per_node": ("launch.nproc_per_node", "processes (devices) per node (swift: NPROC_PER_NODE)"),
    "device_memory": ("launch.device_memory", "memory per device for the plan checked before launch (e.g. 80GiB); "
                                              "default: the device's own (none on CPU: then no check)"),
    "host_memory": ("launch.host_memory", "host RAM per node for twinkle-sft plan's init verdict (e.g. 1TB)"),
    "routing_skew": ("launch.routing_skew", "twinkle-sft plan: the busiest EP rank receives this many times its "
                                            "balanced share of tokens (1 = balanced)"),
    "skip_plan": ("launch.skip_plan", "launch without checking that the memory plan fits the device (true/false)"),
}
# Every strategy option is a flag, named as swift names it where swift has one.
SWIFT_NAMES_OF_STRATEGY_OPTIONS = {"ep_size": "expert_parallel_size", "ep_fsdp_size": "expert_fsdp_size",
                                   "timeout_s": "ddp_timeout", "backend": "ddp_backend"}
for _name in config.option_names():
    _flag = SWIFT_NAMES_OF_STRATEGY_OPTIONS.get(_name, _name)
    SWIFT_FLAGS[_flag] = (f"strategy.{_name}", config.option_help(_name))
for _field in dataclasses.fields(TrainingArguments):
    SWIFT_FLAGS.setdefault(_field.name, (f"train.{_field.name}", _field.metadata["help"]))

LIST_KEYS = {"data.dataset", "tuner.target_modules", "tuner.target_parameters"}


def build_parser(*, recipe: Recipe | None = None, recipe_path: str | None = None) -> argparse.ArgumentParser:
    """The parser behind ``--help``; :func:`split_argv` reads the command line itself (see there).

    Each flag's help ends with its value: ``recipe``'s (the recipe at ``recipe_path`` with the command's flags
    and ``key=value`` applied) when given, else the built-in default.
    """
    parser = argparse.ArgumentParser(
        prog="twinkle-sft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False)
    parser.add_argument("recipe", nargs="?", help="YAML recipe (see yaml/); flags and key=value override it")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. train.max_steps=20")
    parser.add_argument("--swift-plugin-path", action="store_true",
                        help="print the path of the ms-swift --external_plugins module and exit")
    parser.add_argument("--version", action="store_true",
                        help="print this package's version, the installed torch/transformers/peft and the "
                             "declared ranges and tested versions, and exit")
    source = os.path.basename(recipe_path) if recipe is not None and recipe_path else "default"
    group = parser.add_argument_group("swift sft compatible flags (--max-steps = --max_steps; --flag=value works)"
                                      + (f"; values: {recipe_path} with this command's settings" if source != "default"
                                         else ""))
    defaults = {key: default for key, (_, default) in _schema_types().items()}
    for flag, (key, text) in SWIFT_FLAGS.items():
        value = _recipe_value(recipe, key) if recipe is not None else defaults.get(key)
        group.add_argument(f"--{flag}", dest=flag, nargs="+" if key in LIST_KEYS else None, default=None,
                           metavar="V", help=f"{text} ({source}: {_shown(value)}) [{key}]")
    return parser


def _recipe_value(recipe: Recipe, key: str) -> object:
    section, name = key.split(".", 1)
    return getattr(getattr(recipe, section), name)


def _shown(value: object) -> str:
    """A value as the user would write it (YAML spelling), escaped for argparse's %-formatting."""
    if value is None or value == "???":
        return "null" if value is None else "required"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, list | tuple):
        value = "[" + ", ".join(str(v) for v in value) + "]"
    return str(value).replace("%", "%%")


# A recipe override: a dotted key, '=', a value (tells a flag's list values from the overrides after them).
_OVERRIDE = re.compile(r"^[A-Za-z_]\w*(\.\w+)+=")
RECIPE_SUFFIXES = (".yaml", ".yml")  # a positional with one is the recipe, never a list flag's value


def _ends_list(token: str) -> bool:
    """Whether ``token`` ends a list flag's values: the next flag, a ``key=value`` or the YAML recipe."""
    return token.startswith("--") or bool(_OVERRIDE.match(token)) or token.lower().endswith(RECIPE_SUFFIXES)


def split_argv(argv: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """``argv`` as (positionals, [(flag, values)]), flags and positionals in any order.

    Like swift: ``--max-steps`` is ``--max_steps``, ``--flag=value`` is ``--flag value``; unlike argparse,
    no prefix of a flag is taken for it (``--max_step``), and a list flag (``--dataset a b``) stops at the
    next flag, ``key=value`` or ``*.yaml``/``*.yml`` (the recipe: ``--dataset d.jsonl yaml/demo.yaml``).
    An unknown flag is a :class:`RecipeError` with the reason (a swift flag not taken) or the nearest flag.
    """
    positionals: list[str] = []
    flags: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--":
            positionals.extend(argv[i:])
            break
        if token in ("-h", "--help"):
            positionals.append(token)
            continue
        if not token.startswith("-") or _is_number(token):
            positionals.append(token)
            continue
        name, eq, inline = token.lstrip("-").partition("=")
        name = name.replace("-", "_")
        if name not in SWIFT_FLAGS or not token.startswith("--"):
            raise RecipeError(_unknown_flag(token.partition("=")[0]))
        if eq:
            values = [inline]
        elif SWIFT_FLAGS[name][0] in LIST_KEYS:
            values = []
            while i < len(argv) and not _ends_list(argv[i]):
                values.append(argv[i])
                i += 1
        else:
            values = argv[i:i + 1] if i < len(argv) and not argv[i].startswith("--") else []
            i += len(values)
        if not values:
            key = SWIFT_FLAGS[name][0]
            after = f" before {argv[i]} (a YAML file is the recipe)" if i < len(argv) and \
                argv[i].lower().endswith(RECIPE_SUFFIXES) else ""
            reason = f"--{name} needs a value{after}, e.g. --{name} {_example_value(key)}"
            raise RecipeError(reason, key=key, reason=reason)
        flags.append((name, values))
    return positionals, flags


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _unknown_flag(flag: str) -> str:
    name = flag.lstrip("-").replace("-", "_")
    if name in SWIFT_FLAGS_NOT_TAKEN:
        return f"swift's --{name} is not a twinkle-sft flag: {SWIFT_FLAGS_NOT_TAKEN[name]}"
    hint = (did_you_mean(name, SWIFT_FLAGS, prefix="--")
            or "twinkle-sft --help lists them, and key=value sets any recipe key")
    return f"unknown flag {flag}; {hint}"


def parse(argv: list[str]) -> Recipe:
    positionals, flag_values = split_argv(argv)
    wants_help = "-h" in positionals or "--help" in positionals
    positionals = [p for p in positionals if p not in ("-h", "--help")]
    overrides = [p for p in positionals if "=" in p]
    recipes = [p for p in positionals if "=" not in p]  # the YAML recipe, wherever it stands
    if len(recipes) > 1:
        raise RecipeError(f"{recipes[1]!r} is a second recipe after {recipes[0]!r}; pass one YAML recipe, and "
                          "override its keys as key=value (e.g. train.max_steps=10)")
    recipe_path = recipes[0] if recipes else None
    flags = []
    for flag, values in flag_values:
        key = SWIFT_FLAGS[flag][0]
        if key in LIST_KEYS:
            flags.append(f"{key}=[{','.join(_quoted(v) for v in values)}]")
        else:
            check_value(key, values[0], f"--{flag}")
            flags.append(f"{key}={values[0]}")
    if wants_help:
        _print_help(recipe_path, flags + overrides)
    for override in overrides:
        key, eq, value = override.partition("=")
        if eq and key not in LIST_KEYS:
            check_value(key, value, None)
    return load_recipe(recipe_path, flags + overrides)


def _print_help(recipe_path: str | None, settings: list[str]) -> typing.NoReturn:
    """``--help``, with the values of the recipe and this command's settings (the recipe's alone if they do not
    load, the defaults without a recipe); exits 0."""
    recipe = None
    for attempt in ([settings, []] if recipe_path else []):
        try:
            recipe = load_recipe(recipe_path, attempt)
            break
        except (RecipeError, TwinkleError):
            continue
    build_parser(recipe=recipe, recipe_path=recipe_path).print_help()
    raise SystemExit(0)


def _schema_types() -> dict[str, tuple[object, object]]:
    """Every recipe key: (its type, its default)."""
    types = {}
    for section in dataclasses.fields(Recipe):
        cls = typing.get_type_hints(Recipe)[section.name]
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            default = field.default if field.default is not dataclasses.MISSING else None
            types[f"{section.name}.{field.name}"] = (hints[field.name], default)
    return types


def _example_value(key: str) -> str:
    """A value of ``key``'s type that works: its default, else a plain one."""
    hint, default = _schema_types().get(key, (str, None))
    if isinstance(default, bool):
        return str(default).lower()
    if default is not None and default != "???":
        return str(default)
    base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
    return {int: "1", float: "0.1", bool: "true"}.get(base, "VALUE")


def check_value(key: str, value: str, flag: str | None) -> None:
    """Raise a :class:`RecipeError` blaming ``flag`` (or ``key=value``) when ``value`` is not of ``key``'s type."""
    types = _schema_types()
    if key not in types:
        if flag is None:
            hint = did_you_mean(key, types) or "the recipe keys are the fields of yaml/demo.yaml"
            raise RecipeError(f"unknown recipe key {key!r} in {key}={value}; {hint}")
        return
    hint, _ = types[key]
    base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
    if value.lower() in ("null", "none", "~") and type(None) in typing.get_args(hint):
        return
    try:
        if base is bool:
            ok = value.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0")
        elif base in (int, float):
            base(value)
            ok = True
        else:
            ok = True
    except ValueError:
        ok = False
    if ok:
        return
    names = {int: "an integer", float: "a number", bool: "true or false"}
    fix = f"{flag} {_example_value(key)}" if flag else f"{key}={_example_value(key)}"
    reason = f"{value!r} is not {names[base]}; e.g. {fix}"
    raise RecipeError(reason, key=key, reason=reason)


def _quoted(value: str) -> str:
    """``value`` as one item of a ``key=[...]`` override (YAML single quotes: paths may hold ',', ' ' or '#')."""
    return "'" + value.replace("'", "''") + "'"


def flag_for(key: str) -> str | None:
    """The ``swift sft`` flag that sets recipe ``key``, if there is one."""
    return next((f"--{flag}" for flag, (k, _) in SWIFT_FLAGS.items() if k == key), None)
