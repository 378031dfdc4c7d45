"""The plugin's options: every StrategyConfig field, as ``TWINKLE_<NAME>`` or the ``--fsdp`` JSON's ``"twinkle"`` object.

Built from :mod:`twinkle_strategy.config` generically: an option added to StrategyConfig is an option here.
Plus the trainer's own options (:data:`TRAINER_OPTIONS`: ``TWINKLE_ASYNC_SAVE``) and the fit check's
(:data:`PLAN_OPTIONS`: ``TWINKLE_DEVICE_MEMORY``, ``TWINKLE_SKIP_PLAN``, ``TWINKLE_ROUTING_SKEW``), read the same two ways.
"""

from __future__ import annotations

import os
from typing import Any

from twinkle_strategy import config
from twinkle_strategy.integrations.swift.errors import SwiftPluginError

ENV_PREFIX = "TWINKLE_"
# Every StrategyConfig field is an option: TWINKLE_<NAME> or the --fsdp JSON's "twinkle": {"<name>": ...}.
# The plugin's own defaults where they differ from the strategy's (mixed_precision follows swift's --bf16).
DEFAULTS = {"memory_efficient_init": True}
SWIFT_OWNED = {"backend": "--ddp_backend"}  # options swift already has a flag for
# Options of the trainer, not of the strategy (twinkle-sft's train.* of the same name): name -> default.
TRAINER_OPTIONS = {"async_save": False}
# Options of the fit check before the model loads (parts/fit.py), neither the strategy's nor the trainer's.
PLAN_OPTIONS = {"device_memory": None, "skip_plan": False, "routing_skew": 1.0}


def option_names() -> list[str]:
    return [name for name in config.option_names() if name not in SWIFT_OWNED]


def env_var(name: str) -> str:
    return f"{ENV_PREFIX}{name.upper()}"


def resolve_options(fsdp_options: dict | None = None, environ=None) -> dict[str, Any]:
    """Strategy options from ``TWINKLE_*`` variables, overridden by the ``--fsdp`` JSON's ``"twinkle"`` object."""
    environ = os.environ if environ is None else environ
    trainer_options(fsdp_options, environ)  # their errors now too, before any model is loaded
    fsdp_options = {k: v for k, v in (fsdp_options or {}).items() if k not in TRAINER_OPTIONS and k not in PLAN_OPTIONS}
    names = option_names()
    options: dict[str, Any] = dict(DEFAULTS)
    sources = [(f"environment variable {env_var(k)}", k, environ[env_var(k)]) for k in names if env_var(k) in environ]
    unknown = sorted(set(fsdp_options or {}) - set(names))
    if unknown:
        raise SwiftPluginError(f'--fsdp: unknown key(s) {unknown} in "twinkle"; supported: {sorted(names)}')
    sources += [(f'--fsdp "twinkle": {{"{k}": ...}}', k, v) for k, v in (fsdp_options or {}).items()]
    for where, key, raw in sources:
        try:
            options[key] = config.parse_option(key, raw)
        except (TypeError, ValueError) as exc:
            raise SwiftPluginError(f"{where}={raw!r}: {exc}") from exc
    return options


def trainer_options(fsdp_options: dict | None = None, environ=None) -> dict[str, Any]:
    """The trainer's options (:data:`TRAINER_OPTIONS`) from ``TWINKLE_*`` variables and the ``--fsdp`` JSON's
    ``"twinkle"`` object (which wins)."""
    environ = os.environ if environ is None else environ
    options = dict(TRAINER_OPTIONS)
    for name in TRAINER_OPTIONS:
        for where, raw in ((f"environment variable {env_var(name)}", environ.get(env_var(name))),
                           (f'--fsdp "twinkle": {{"{name}": ...}}', (fsdp_options or {}).get(name))):
            if raw is None:
                continue
            try:
                options[name] = config.parse_bool(raw)
            except ValueError as exc:
                raise SwiftPluginError(f"{where}={raw!r}: {exc}") from exc
    return options

