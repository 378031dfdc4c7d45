"""``twinkle-sft``: train from a YAML recipe and/or ``swift sft``-style flags.

    twinkle-sft yaml/demo.yaml train.max_steps=20
    twinkle-sft --model /models/Qwen3-30B-A3B --dataset data.jsonl --tuner_type lora \\
                --expert_parallel_size 8 --memory_efficient_init true --output_dir output
    NPROC_PER_NODE=8 NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 twinkle-sft ...

Flags keep the names of ``swift sft``; each maps to one recipe key (see
``--help``), and ``key=value`` overrides any recipe key (it wins over a flag).
The recipe, flags and ``key=value`` come in any order; ``--max-steps`` is
``--max_steps`` and ``--max_steps=3`` is ``--max_steps 3``; a flag is never
guessed from a prefix. A swift flag twinkle-sft does not take is refused with
the reason, any other unknown flag with the nearest one. Like swift, when
NPROC_PER_NODE (and NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT for several
nodes) are set, the command re-launches itself under torchrun.

Before any process or process group starts, the recipe is validated and its paths
are checked on this machine: the dataset files and their first rows, the model
directory (or an hf:// / ms:// id already in the local cache), the output directory.
A problem is one line naming the key and flag, exit status 2, nothing written.

A multi-process run writes every rank's output to <run dir>/logs/rank<R>.log and
shows the first rank here; if it fails, it ends with one summary: each distinct
error once with the ranks that raised it, and the first failing rank's traceback.

Data: JSONL rows with 'messages', or 'query' and 'response'. As with swift's default
--strict false, a row that cannot become an example (not JSON, no assistant turn,
longer than --max_length under swift's default --truncation_strategy delete) is
skipped, with one warning naming the lines; --strict true stops at the first.
--dataset a.jsonl b.jsonl#1000 is all of a.jsonl and 1000 examples of b.jsonl
(swift's #N: whole copies of the file while N exceeds it, then a random subset
seeded with --seed).

Models: a local directory, hf://org/name (huggingface_hub; HF_HUB_OFFLINE=1 uses
only the cache under HF_HOME) or ms://org/name (modelscope; a snapshot already under
MODELSCOPE_CACHE is used without network access). A bare org/name is taken as swift
takes it: a local path of that name if one exists, else from ModelScope, or from the
Hugging Face Hub with --use_hf true (or USE_HF=1 when --use_hf is not given). With
--memory_efficient_init true only each node's local rank 0 resolves and reads it.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import os
import re
import sys
import traceback
import typing
from collections.abc import Callable

from twinkle_strategy import config
from twinkle_strategy.checkpoint import latest_checkpoint
from twinkle_strategy.errors import TwinkleError
from twinkle_strategy.train.arguments import TrainingArguments
from twinkle_strategy.train.errors import RunStoppedError
from twinkle_strategy.train.fit_check import check_fit_before_launch, plan_command
from twinkle_strategy.train.launcher import (
    device_problem,
    run_logged,
    torchrun_command,
    waiting_line,
)
from twinkle_strategy.train.ports import master_port_problem, on_a_free_port
from twinkle_strategy.train.preflight import check_before_launch
from twinkle_strategy.train.rank_logs import RUN_DIR_ENV, capture_rank_output, logs_dir, record_error
from twinkle_strategy.train.recipe import Recipe, RecipeError, load_recipe
from twinkle_strategy.train.run import prepare_model_path, run_recipe
from twinkle_strategy.train.run_dir import make_run_dir
from twinkle_strategy.train.swift_flags import SWIFT_FLAGS_NOT_TAKEN
from twinkle_strategy.train.versions import startup_line, version_text

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
    close = difflib.get_close_matches(name, list(SWIFT_FLAGS), n=1, cutoff=0.6)
    hint = f"did you mean --{close[0]}?" if close else "twinkle-sft --help lists them, and key=value sets any recipe key"
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
            close = difflib.get_close_matches(key, list(types), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else "the recipe keys are the fields of yaml/demo.yaml"
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


def _launch_torchrun(argv: list[str], recipe: Recipe) -> int | None:
    """Re-launch under torchrun like swift (NPROC_PER_NODE, NNODES, ...); None to train in this process."""
    env = os.environ
    nproc = int(env.get("NPROC_PER_NODE", recipe.launch.nproc_per_node))
    nnodes = int(env.get("NNODES", recipe.launch.nnodes))
    if nproc * nnodes == 1:
        return None
    node_rank = int(env.get("NODE_RANK", "0"))
    ranks = list(range(node_rank * nproc, (node_rank + 1) * nproc))  # torchrun numbers ranks node by node
    if nnodes == 1 and "MASTER_PORT" not in env:  # one node, no port named: pick one, as torchrun --standalone
        return _run_logged(lambda port: [torchrun_command(["-m", "twinkle_strategy.train.cli", *argv], 1, 0, nproc,
                                                          port, max_restarts=recipe.launch.max_restarts)],
                           recipe, ranks, [0], f"torchrun, {nproc} ranks on this node")
    port, master_addr = int(env.get("MASTER_PORT", "29500")), env.get("MASTER_ADDR", "127.0.0.1")
    if node_rank == 0 and (problem := master_port_problem(port)):
        print(f"twinkle-sft: error: {problem}", file=sys.stderr)
        return 2
    cmd = torchrun_command(["-m", "twinkle_strategy.train.cli", *argv], nnodes, node_rank, nproc,
                           port, master_addr=master_addr, max_restarts=recipe.launch.max_restarts)
    waiting = waiting_line(nnodes, node_rank, nproc, master_addr, port) if nnodes > 1 else None
    return _run_logged([cmd], recipe, ranks, [node_rank], f"torchrun, {nproc} ranks on this node", waiting)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--version" in argv:
        print(version_text())
        return 0
    if "--swift-plugin-path" in argv:
        # A path, not an import: importing the plugin would patch ms-swift in this process.
        print(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integrations", "swift", "plugin.py"))
        return 0
    if "LOCAL_RANK" in os.environ:  # a torchrun worker
        return _worker_main(argv)
    if argv[:1] == ["plan"]:
        return plan_command(argv[1:], parse)
    try:
        return _parse_and_launch(argv)
    except RunStoppedError as exc:  # SIGTERM / SIGINT during a launched run: every process has ended
        print(f"twinkle-sft: {exc}", file=sys.stderr, flush=True)
        return 128 + exc.signum
    except KeyboardInterrupt:
        print("twinkle-sft: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return 130


def _parse_and_launch(argv: list[str]) -> int:
    try:
        recipe = parse(argv)
        check_before_launch(recipe)
    except (RecipeError, TwinkleError) as exc:
        print(f"twinkle-sft: error: {_describe(exc)}", file=sys.stderr)
        return 2
    if problem := device_problem(recipe.strategy.device_type, recipe.strategy.backend):
        print(f"twinkle-sft: error: {problem}", file=sys.stderr)
        return 2

    # Build the embedded model (tiny://) once here, before any worker starts; the workers find it built.
    recipe.model.path = prepare_model_path(recipe.model.path, recipe.data.dataset)
    try:
        refusal = check_fit_before_launch(recipe)
    except TwinkleError as exc:
        refusal = f"the memory plan failed: {exc}; --skip_plan true launches without it"
    if refusal:
        print(f"twinkle-sft: error: {refusal}", file=sys.stderr)
        return 2
    if recipe.launch.simulated_nodes and recipe.launch.nnodes > 1:
        return _launch_simulated_nodes(argv, recipe)
    code = _launch_torchrun(argv, recipe)
    if code is not None:
        return code
    print(startup_line(), file=sys.stderr, flush=True)
    run_recipe(recipe)  # one process: train here
    return 0


def _describe(exc: Exception) -> str:
    key = getattr(exc, "key", None)
    flag = flag_for(key) if key else None
    return f"{key} ({flag}): {exc.reason}" if flag else str(exc)


@dataclasses.dataclass(frozen=True)
class LaunchShape:
    nnodes: int
    nproc_per_node: int

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def simulated_launch_shape(recipe: Recipe) -> LaunchShape:
    """The simulated nodes to start: as for a real launch (and the world size the recipe was checked
    against, :func:`~twinkle_strategy.train.recipe.planned_world_size`), swift's NNODES/NPROC_PER_NODE win."""
    return LaunchShape(nnodes=int(os.environ.get("NNODES", recipe.launch.nnodes)),
                       nproc_per_node=int(os.environ.get("NPROC_PER_NODE", recipe.launch.nproc_per_node)))


def _launch_simulated_nodes(argv: list[str], recipe: Recipe) -> int:
    shape = simulated_launch_shape(recipe)
    nnodes, nproc = shape.nnodes, shape.nproc_per_node

    def commands(port: int) -> list[list[str]]:
        return [torchrun_command(["-m", "twinkle_strategy.train.cli", *argv], nnodes, node, nproc, port,
                                 max_restarts=recipe.launch.max_restarts) for node in range(nnodes)]

    return _run_logged(commands, recipe, list(range(nnodes * nproc)), list(range(nnodes)),
                       f"{nnodes} simulated nodes x {nproc} ranks on this machine")


def _run_logged(commands: list[list[str]] | Callable[[int], list[list[str]]], recipe: Recipe, ranks: list[int],
                node_ranks: list[int], what: str, waiting: str | None = None) -> int:
    """``commands``: the agents' commands, or a function of the master port for a launch that picks its own
    (:func:`~twinkle_strategy.train.launcher.on_a_free_port`: picked again if another process takes it first)."""
    # Chosen here, not by rank 0, so the logs have a home even if the run fails before training.
    run_dir = make_run_dir(recipe.train.output_dir, recipe.train.add_version)
    if 0 in ranks:  # the node of rank 0, once
        print(startup_line(), file=sys.stderr, flush=True)
    print(f"twinkle-sft: {what}; rank {ranks[0]}'s output follows, every rank's is in {logs_dir(run_dir)}",
          file=sys.stderr, flush=True)
    if callable(commands):
        ok = on_a_free_port(lambda port, retry: run_logged(commands(port), run_dir, ranks, node_ranks, waiting,
                                                           retry_if_port_taken=retry))
    else:
        ok = run_logged(commands, run_dir, ranks, node_ranks, waiting)
    if not ok:
        return 1
    if 0 in ranks:  # with several real nodes, rank 0's node holds the checkpoints; its trainer does not print them
        last = latest_checkpoint(run_dir)
        merged = f"\nmerged model: {last}-merged" if last and os.path.isdir(f"{last}-merged") else ""
        print(f"run directory: {run_dir}\nlast checkpoint: {last}{merged}", flush=True)
    return 0


def _worker_main(argv: list[str]) -> int:
    """One rank of a run ``twinkle-sft`` launched: log to the run directory, record a failure for the summary."""
    run_dir, rank = os.environ.get(RUN_DIR_ENV), int(os.environ.get("RANK", "0"))
    if run_dir:
        capture_rank_output(run_dir, rank)
    try:
        recipe = parse(argv)
        recipe.model.path = prepare_model_path(recipe.model.path, recipe.data.dataset)
        run_recipe(recipe, run_dir, print_summary=not run_dir)  # a launcher that named run_dir prints it at the end
    except BaseException as exc:
        if not run_dir:
            raise
        record_error(run_dir, rank, exc)
        if not isinstance(exc, Exception):  # Ctrl-C, SystemExit: as Python ends on them
            raise
        # The whole traceback in the rank's log, where the launcher's summary points (the one-line report of
        # distributed.fatal_errors is for a plain torchrun, whose terminal shows every rank's output).
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
