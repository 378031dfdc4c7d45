"""The package logger: INFO lines to stderr by default, like transformers' own logger.

Set ``TWINKLE_LOG_LEVEL`` (DEBUG, INFO, WARNING, ...) to change the level, or
configure the ``twinkle_strategy`` logger yourself.
"""

import logging
import os

_ROOT = "twinkle_strategy"


def _configure() -> None:
    root = logging.getLogger(_ROOT)
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s %(levelname)s twinkle] %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(os.environ.get("TWINKLE_LOG_LEVEL", "INFO").upper())
    root.propagate = False


_configure()


def mib(num_bytes: float) -> str:
    """Bytes as every log line and progress bar of the package shows them, so that figures agree."""
    return f"{num_bytes / 2**20:.1f} MiB"
