"""Device, backend, launch environment and the process group.

Everything that depends on *where* the job runs lives here: which accelerator
(CUDA, Ascend NPU or plain CPU), which collective backend goes with it, and
what torchrun told this process about its place in the job (which ranks share
a node: :mod:`twinkle_strategy.distributed.node`). The rest of the package asks
this module instead of reading environment variables or probing devices itself.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import resource
import time

import torch
import torch.distributed as dist

from twinkle_strategy import log
from twinkle_strategy.compat.torch_internals import gloo_worker_states
from twinkle_strategy.distributed import fatal_errors, teardown
from twinkle_strategy.errors import StrategyConfigError, TopologyError

# Backend that goes with each device type. Ascend's HCCL only exists when
# torch_npu is installed; it registers the "npu" device type on import.
_BACKEND_FOR_DEVICE = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401  (import registers torch.npu)
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None)) and torch.npu.is_available()


def detect_device_type(requested: str | None = None) -> str:
    """Return 'cuda', 'npu' or 'cpu'.

    ``requested`` (or the ``TWINKLE_DEVICE`` environment variable) overrides the
    detection, e.g. to force CPU on a GPU machine for a test.
    """
    requested = requested or os.environ.get("TWINKLE_DEVICE")
    if requested:
        if requested not in _BACKEND_FOR_DEVICE:
            raise StrategyConfigError(
                "device_type", f"device {requested!r} is not supported; use one of {sorted(_BACKEND_FOR_DEVICE)}"
            )
        return requested
    if torch.cuda.is_available():
        return "cuda"
    if _npu_available():
        return "npu"
    return "cpu"


def backend_for(device_type: str, requested: str | None = None) -> str:
    """The collective backend for ``device_type`` unless ``requested`` (or ``TWINKLE_BACKEND``) names one."""
    requested = requested or os.environ.get("TWINKLE_BACKEND")
    if requested:
        return requested
    return _BACKEND_FOR_DEVICE[device_type]


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """What torchrun (or any launcher following its conventions) told this process."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int  # torchrun's GROUP_RANK: index of this process's agent (= node)

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> LaunchEnv:
        env = os.environ if environ is None else environ
        if "RANK" not in env or "WORLD_SIZE" not in env:
            # Not launched by torchrun: a single process job.
            return cls(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0)
        missing = [k for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE") if k not in env]
        if missing:
            raise TopologyError(
                f"rank {env['RANK']}: environment variable(s) {', '.join(missing)} missing; "
                "launch with torchrun (it sets RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK) "
                "or export them like torchrun does"
            )
        local_world_size = int(env["LOCAL_WORLD_SIZE"])
        rank = int(env["RANK"])
        # GROUP_RANK is torchrun's node index. Other launchers set NODE_RANK.
        node = env.get("GROUP_RANK", env.get("NODE_RANK"))
        node_rank = int(node) if node is not None else rank // max(local_world_size, 1)
        return cls(
            rank=rank,
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env["LOCAL_RANK"]),
            local_world_size=local_world_size,
            node_rank=node_rank,
        )


# Ascend HCCL's own defaults time out long before a large checkpoint is read and distributed.
# Set only when the user has not: their values always win.
HCCL_ENV_DEFAULTS = {
    "HCCL_CONNECT_TIMEOUT": "1200",  # seconds to establish links when a communicator is created
    "HCCL_EXEC_TIMEOUT": "1800",  # seconds a collective may wait for its peers
}


def apply_backend_env_defaults(backend: str) -> dict[str, str]:
    """Set documented environment defaults for ``backend`` where unset; return what was set."""
    applied = {}
    if backend == "hccl":
        for key, value in HCCL_ENV_DEFAULTS.items():
            if key not in os.environ:
                os.environ[key] = value
                applied[key] = value
    return applied


def init_distributed(
    device_type: str | None = None, backend: str | None = None, timeout_s: float | None = None
) -> tuple[str, LaunchEnv]:
    """Initialise the default process group once, bind this process to its device, return (device_type, env).

    ``timeout_s`` bounds every collective: a rank whose peer died or hangs
    raises after at most this long instead of waiting forever.
    """
    log.apply_level_from_environment()  # this process's TWINKLE_LOG_LEVEL, read as its work starts
    device_type = detect_device_type(device_type)
    tell_accelerate_the_device(device_type)
    env = LaunchEnv.from_environ()
    if device_type == "cuda":
        torch.cuda.set_device(env.local_rank)
    elif device_type == "npu":
        torch.npu.set_device(env.local_rank)
    if not dist.is_initialized():
        kwargs = {}
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        backend = backend_for(device_type, backend)
        apply_backend_env_defaults(backend)
        if env.world_size == 1:
            # One process without torchrun (as `swift sft` runs on one device): a group of one, its store in
            # this process, so that device meshes and FSDP2 work as in a launched job.
            kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
        dist.init_process_group(backend=backend, **kwargs)
        # Destroyed while Python still runs, whether or not the script calls strategy.shutdown() (.teardown).
        teardown.on_exit(destroy_process_group, what="the process group")
    # After the group exists (whoever made it): torch wraps sys.excepthook then, and ours must see errors first.
    install_error_report(env)
    return device_type, env


# What ``accelerate launch --cpu`` exports. transformers' TrainingArguments (and so TRL's configs) read it when they
# first ask accelerate for the world: without it (or ``use_cpu=True``), on a machine without a GPU accelerate counts
# 1 process although the process group holds more, and TRL's GRPOConfig then refuses ``generation_batch_size``.
ACCELERATE_CPU_VARIABLE = "ACCELERATE_USE_CPU"


def tell_accelerate_the_device(device_type: str) -> None:
    """On a CPU run, tell accelerate (and every ``TrainingArguments`` made after this) that the job runs on the CPU,
    as ``accelerate launch --cpu`` would, so that a trainer sees every rank without ``use_cpu=True``. A value the
    user set wins (a trainer then checks the world it sees: ``integrations.transformers``)."""
    if device_type == "cpu":
        os.environ.setdefault(ACCELERATE_CPU_VARIABLE, "true")


def install_error_report(env: LaunchEnv | None = None) -> None:
    """For a process of a torchrun job: an exception ends it with its root cause said once per node, one line for
    this package's errors (:mod:`.fatal_errors`)."""
    try:
        env = LaunchEnv.from_environ() if env is None else env
    except TopologyError:
        return  # init_distributed says what is missing
    fatal_errors.install(fatal_errors.RankPlace(rank=env.rank, world_size=env.world_size, node_rank=env.node_rank))


def destroy_process_group() -> None:
    """Destroy the process group and every group made beside it, the newest first (torch's order), if it exists;
    then wait until gloo's worker threads have let go of their last collective (:func:`settle_gloo_workers`)."""
    if dist.is_initialized():
        dist.destroy_process_group()
        settle_gloo_workers()


GLOO_SETTLE_S = 2.0  # the longest the exit waits for gloo's workers (they need a moment of CPU, not seconds)
GLOO_SETTLE_POLL_S = 0.005


def settle_gloo_workers(*, timeout_s: float = GLOO_SETTLE_S) -> bool:
    """Wait (the GIL released) until every gloo worker thread of this process is waiting for work, seen so twice
    in a row; whether they were, within ``timeout_s``.

    Why: a gloo worker releases a collective's tensors after the rank's ``wait()`` has returned, and their Python
    objects need the GIL. A worker the scheduler delays past the script's end does so while the interpreter
    finalises: Python ends that thread with ``pthread_exit``, whose forced unwind cannot cross the work's
    destructor, and the process aborts (``terminate called without an active exception``). destroy_process_group
    does not stop the workers (gloo's shutdown does nothing; only the group's destructor joins them, and FSDP's
    meshes keep the group alive until the interpreter's end)."""
    deadline = time.monotonic() + timeout_s
    idle_polls = 0
    while idle_polls < 2:
        states = gloo_worker_states()
        if states is None:  # threads cannot be read: give them a moment
            time.sleep(min(0.1, timeout_s))
            return False
        idle_polls = idle_polls + 1 if all(state != "R" for state in states) else 0
        if time.monotonic() > deadline:
            return False
        time.sleep(GLOO_SETTLE_POLL_S)
    return True


def global_rank() -> int:
    """This process's rank in the default process group; 0 in a job without one."""
    return dist.get_rank() if dist.is_initialized() else 0


def current_device(device_type: str) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.accelerator.current_device_index())


def peak_rss_bytes() -> int:
    """Peak resident host memory of this process so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Start measuring this process's peak resident memory afresh (Linux: ``/proc/self/clear_refs``).

    Lets a phase (a checkpoint save) report its own peak, not the process's lifetime one. False
    where the kernel does not support it; :func:`peak_rss_since_reset` then gives the lifetime peak.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_since_reset() -> int:
    """Peak resident memory since :func:`reset_peak_rss` (``VmHWM``), else since the process started."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return peak_rss_bytes()


def rss_bytes() -> int:
    """Resident memory now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return peak_rss_bytes()
