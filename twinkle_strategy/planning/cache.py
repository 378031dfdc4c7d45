"""Plans kept on disk: the same question asked again is answered without building and tracing the model.

A plan's figures depend on the model's config.json, the request (the world, the strategy, the recipe's shape of a
step), the package's code and the installed packages (torch, transformers and PEFT run the trace; an optional
kernel package changes which code a model runs). The key is a hash of all of these, so a change to any of them is
a new question, never a stale answer:

* the text of config.json (not its path: the same config elsewhere is the same model);
* every field of the request but the budgets (``device_memory``, ``host_memory``): the figures do not depend on
  them, the verdict and the fixes are worked out again from the live request (each fix is a plan of its own, cached
  under its own key);
* the source of every module of this package, and the name and version of every installed distribution;
* ``CACHE_FORMAT``, raised when what a record holds changes.

A record is JSON: the figures of :class:`~twinkle_strategy.planning.plan.MemoryPlan` and the
:class:`~twinkle_strategy.planning.plan.ModelFacts` its fixes read. The front-ends (``twinkle-sft plan`` and the
fit check before every launch) keep them under ``$XDG_CACHE_HOME/twinkle_strategy/plans`` (``~/.cache/...``);
deleting that directory costs only the next plans' time. The Python API plans afresh unless given a cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

from twinkle_strategy.config import LoraExperts
from twinkle_strategy.errors import TwinkleError
from twinkle_strategy.loading import read_config_text
from twinkle_strategy.planning.activations import ActivationPeak
from twinkle_strategy.planning.plan import CommBytes, InitMemory, MemoryPlan, ModelFacts, StepPeak, plan_once
from twinkle_strategy.planning.request import PlanRequest
from twinkle_strategy.planning.states import ModelStates, UnitBytes

CACHE_FORMAT = 2  # raise it when a record's fields change
PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # twinkle_strategy/


@dataclasses.dataclass(frozen=True)
class PlanCache:
    """Plans as JSON files in ``directory``, one per question (see the module docstring for the key)."""

    directory: Path

    @classmethod
    def default(cls) -> PlanCache:
        """``$XDG_CACHE_HOME/twinkle_strategy/plans``, or ``~/.cache/twinkle_strategy/plans``."""
        root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return cls(Path(root) / "twinkle_strategy" / "plans")

    def path(self, request: PlanRequest) -> Path | None:
        """The file of ``request``'s plan; None when its config.json cannot be read (planning says why)."""
        try:
            config_text = read_config_text(request.model_path)
        except TwinkleError:  # the plan itself names the missing or broken file, in its own words
            return None
        question = {"format": CACHE_FORMAT, "config": config_text, "request": _question(request),
                    "code": package_digest(), "installed": installed_digest()}
        key = hashlib.sha256(json.dumps(question, sort_keys=True, default=str).encode()).hexdigest()
        return self.directory / f"{key}.json"

    def load(self, request: PlanRequest) -> tuple[MemoryPlan, ModelFacts] | None:
        """The kept plan of ``request`` (with ``request`` itself, budgets included), or None."""
        path = self.path(request)
        if path is None:
            return None
        try:
            record = json.loads(path.read_text())
            return _from_record(record, request)
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or a file cut short: plan again
            return None

    def store(self, request: PlanRequest, plan: MemoryPlan, facts: ModelFacts) -> None:
        """Keep ``plan``; a directory that cannot be written only means no cache (the plan stands)."""
        path = self.path(request)
        if path is None:
            return
        record = {**_record(plan, facts), "request": _question(request)}  # (the request for people reading it)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        except OSError:
            return
        try:  # written aside and renamed: a plan running at the same time reads a whole file or none
            with os.fdopen(handle, "w") as f:
                json.dump(record, f, default=str)
            os.replace(temporary, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(temporary)


def measured_plan(request: PlanRequest, *, cache: PlanCache | None = None) -> tuple[MemoryPlan, ModelFacts]:
    """The plan of ``request`` without fixes and the facts its fixes read: kept in ``cache``, or measured."""
    if cache is not None and (kept := cache.load(request)) is not None:
        return kept
    plan, planned = plan_once(request)
    facts = ModelFacts.of(planned)
    if cache is not None:
        cache.store(request, plan, facts)
    return plan, facts


@functools.lru_cache(maxsize=1)
def package_digest() -> str:
    """A hash of every module's source in this package (a code change is a new question)."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def installed_digest() -> str:
    """A hash of the Python version and of the installed distributions' names and versions (their
    ``*.dist-info`` / ``*.egg-info`` entries on ``sys.path``: a listing, not a read of each one's metadata)."""
    entries = [sys.version]
    for folder in sys.path:
        with contextlib.suppress(OSError):
            entries += sorted(name for name in os.listdir(folder or ".") if name.endswith((".dist-info", ".egg-info")))
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()


def _question(request: PlanRequest) -> dict:
    """What the figures depend on in ``request``: everything but where config.json lies and the budgets."""
    return dataclasses.asdict(request.replace(model_path="", device_memory=None, host_memory=None))


def _record(plan: MemoryPlan, facts: ModelFacts) -> dict:
    return {"notes": list(plan.notes), "states": dataclasses.asdict(plan.states),
            "activations": dataclasses.asdict(plan.activations), "step": dataclasses.asdict(plan.step),
            "init": dataclasses.asdict(plan.init), "comm": dataclasses.asdict(plan.comm),
            "expert_lora": None if plan.expert_lora is None else plan.expert_lora.value,
            "facts": dataclasses.asdict(facts)}


def _from_record(record: dict, request: PlanRequest) -> tuple[MemoryPlan, ModelFacts]:
    states = dict(record["states"])
    states.update(root=UnitBytes(**states["root"]), layers=tuple(UnitBytes(**unit) for unit in states["layers"]))
    plan = MemoryPlan(request=request, notes=tuple(record["notes"]), states=ModelStates(**states),
                      activations=ActivationPeak(**record["activations"]), step=StepPeak(**record["step"]),
                      init=InitMemory(**record["init"]), comm=CommBytes(**record["comm"]),
                      expert_lora=None if record["expert_lora"] is None else LoraExperts(record["expert_lora"]))
    return plan, ModelFacts(**record["facts"])
