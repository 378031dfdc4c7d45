"""Master ports for the launches this package starts: pick one, and pick again when another process took it.

torchrun's agents must all be told the master port before node 0 listens on it, so a launch cannot bind port 0;
a port picked free may then be taken before torchrun binds it (the pick-then-bind race, lost to another job on a
busy machine). :func:`on_a_free_port` runs a launch again on a new port when node 0's agent reports EADDRINUSE.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar


def free_port() -> int:
    """A port the kernel says is free now. Another process may take it before torchrun binds it (the
    pick-then-bind race): launch through :func:`on_a_free_port`, which picks again when that happens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# torchrun's store names the errno when it cannot listen ("... code: -98, name: EADDRINUSE, ...").
MASTER_PORT_TAKEN_MARKER = "EADDRINUSE"
PORT_ATTEMPTS = 3  # picks of a free port per launch; losing the race three times in a row means a busier problem


class MasterPortTaken(Exception):
    """Node 0's torchrun could not listen on the master port that :func:`free_port` picked: taken since."""


def master_port_taken(log_path: Path | None) -> bool:
    """Whether the agent that logs to ``log_path`` failed to listen on its master port."""
    if log_path is None or not os.path.exists(log_path):
        return False
    with open(log_path, errors="replace") as f:
        return MASTER_PORT_TAKEN_MARKER in f.read()


Launched = TypeVar("Launched")


def on_a_free_port(launch: Callable[[int, bool], Launched], attempts: int = PORT_ATTEMPTS) -> Launched:
    """``launch(port, retry_if_taken)`` on a port :func:`free_port` picks, picked again (up to ``attempts``
    times) when another process took it before torchrun could bind it: binding port 0 is not possible for
    torchrun's agents, which must all be told the port before node 0 listens on it. The last attempt gets
    ``retry_if_taken=False`` and so reports the failure as any other."""
    for attempt in range(1, attempts + 1):
        try:
            return launch(free_port(), attempt < attempts)
        except MasterPortTaken:
            continue
    raise AssertionError("unreachable: the last attempt does not raise MasterPortTaken")


def port_in_use(port: int) -> bool:
    """Whether ``port`` cannot be listened on here (torchrun's store binds every address, reusing TIME_WAIT)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return True
        return False


def master_port_problem(port: int) -> str | None:
    """One line if the master ``port`` is taken on this machine (checked where this node is the master)."""
    if not port_in_use(port):
        return None
    return (f"master port {port} is in use on this machine (another run, or one not stopped?); "
            f"pick a free one with MASTER_PORT, e.g. MASTER_PORT={free_port()} twinkle-sft ...")
