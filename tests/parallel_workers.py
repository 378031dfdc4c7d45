"""The suite on two pytest-xdist workers (``pytest -n 2``, as scripts/test.sh runs it): what goes where, what runs
once for both, and the launches of both in one table and one budget.

Most launches leave a core idle part of the time (an agent's rendezvous, a rank waiting on its peers, a test
polling a log), so two workers finish the suite sooner than one on this machine's two cores.

- **What goes where** (:class:`FileOrTierScheduling`): each test file stays on one worker (its module-scoped
  launches run once), and each tier that runs in another virtualenv (ms-swift's, vLLM's) stays on one worker whole,
  so only one worker starts that interpreter's fork servers (tests/preload.py). Those tiers are handed out
  first and the one-process tier last, so that the end of the run, when one worker may be idle already, is short.
- **What runs once** (:func:`once_per_run`): a session fixture several files assert on (tests/launches.py's shared
  launches, the demo model) is computed by the first worker that needs it, under a lock, and read by the other.
- **One table, one budget:** each worker sends its launches (tests/launch_log.py) to the controller when it ends,
  and tests/conftest.py's table and budget count them all.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from typing import TypeVar

import launch_log
import pytest

WHOLE_TIERS = ("swift_plugin", "vllm_engine")  # their interpreter's fork servers start in one worker only
TIER_ORDER = ("swift_plugin", "vllm_engine", "multiproc", "unit")
T = TypeVar("T")


def is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def is_controller(config) -> bool:
    """The process that hands out the tests and runs none: ``-n N`` with N > 0, not a worker."""
    return bool(getattr(config.option, "numprocesses", None)) and not is_worker(config)


def once_per_run(tmp_path_factory, name: str, compute: Callable[[], T]) -> T:
    """``compute()`` once per pytest run. Under pytest-xdist the first worker to ask computes it while it holds a
    lock, and leaves the value pickled in the run's folder that every worker's temporary folders live in; the other
    worker waits for it and reads it. Without workers: ``compute()``, as a session fixture would."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return compute()
    from filelock import FileLock  # a dependency of huggingface_hub, so of transformers

    shared = tmp_path_factory.getbasetemp().parent
    with FileLock(str(shared / f"{name}.lock")):
        done = shared / f"{name}.pickle"
        if done.exists():
            return pickle.loads(done.read_bytes())
        value = compute()
        done.write_bytes(pickle.dumps(value))
        return value


def _scope(nodeid: str) -> str:
    """The unit one worker runs whole: the tier, for a tier in another virtualenv; otherwise the test file."""
    file = nodeid.split("::", 1)[0]
    tier = file.split("/")[-2] if file.count("/") >= 2 else ""
    return f"tier {tier}" if tier in WHOLE_TIERS else file


def _tier_rank(item) -> int:
    tier = item.path.parent.name
    return TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # a pytest-xdist hook: only called where it is installed
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class FileOrTierScheduling(LoadScopeScheduling):
        """xdist's scope scheduling, with :func:`_scope` as the scope. (Its ``--dist loadgroup`` would group by
        marks, but pytest 9 keeps node ids where xdist 3.8 no longer writes the group into them.)"""

        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    # Hand the scopes out in the collection's order (TIER_ORDER), not xdist's default (--loadscope-reorder: most
    # tests first), which put the files of one or two long launches (the bf16 and memory_efficient_init matrices,
    # the clean-exit runs) last, where one worker ran them alone while the other had finished; the unit files at
    # the end are seconds each, so both workers end together.
    config.option.loadscopereorder = False
    return FileOrTierScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if is_worker(config):  # the controller hands the scopes out in this order
        items.sort(key=_tier_rank)  # stable: each file's tests keep their order


def pytest_sessionfinish(session):
    if is_worker(session.config):  # the controller tables and budgets every worker's launches
        session.config.workeroutput["launches"] = json.dumps(launch_log.to_records(launch_log.LAUNCHES))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook
def pytest_testnodedown(node, error):
    launch_log.LAUNCHES.extend(launch_log.from_records(json.loads(node.workeroutput.get("launches", "[]"))))
