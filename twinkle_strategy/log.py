"""The package logger: INFO lines to stderr by default, like transformers' own logger.

Set ``TWINKLE_LOG_LEVEL`` (DEBUG, INFO, WARNING, ...) to change the level, or configure the ``twinkle_strategy``
logger yourself (a level you set is kept).

Importing the package installs the handler at INFO; the variable is read by :func:`apply_level_from_environment`, which
runs when a process starts its work (the process group's creation in
:func:`~twinkle_strategy.distributed.runtime.init_distributed`, ``twinkle-sft``'s ``main``), not at import: a process
forked after the import (as the test suite forks its ranks from an interpreter that imported the package) follows its
own environment, not the one it was forked from.
"""

import logging
import os

_ROOT = "twinkle_strategy"
LEVEL_ENV = "TWINKLE_LOG_LEVEL"
DEFAULT_LEVEL = logging.INFO
_set_by_package = [DEFAULT_LEVEL]  # the level this module last gave the logger: any other was set by the user


def _install_handler() -> None:
    root = logging.getLogger(_ROOT)
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s %(levelname)s twinkle] %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(DEFAULT_LEVEL)
    root.propagate = False


def apply_level_from_environment() -> None:
    """Give the package logger the level ``TWINKLE_LOG_LEVEL`` names now (INFO where unset), unless its level was set
    by someone else since the package last set it."""
    root = logging.getLogger(_ROOT)
    if root.level != _set_by_package[0]:
        return
    root.setLevel(os.environ.get(LEVEL_ENV, "INFO").upper())
    _set_by_package[0] = root.level


_install_handler()


def mib(num_bytes: float) -> str:
    """Bytes as every log line and progress bar of the package shows them, so that figures agree."""
    return f"{num_bytes / 2**20:.1f} MiB"
