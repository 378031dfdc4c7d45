"""What twinkle_strategy takes from torch's internals.

Each wrapper is declared with an :class:`~twinkle_strategy.compat.Internal` (what it is used for,
the versions checked, the public replacement) and tested in ``tests/unit/test_internals.py``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from twinkle_strategy.compat.registry import Internal

_CHECKED = "2.13 (tests run), 2.14.1 (source read)"

# ------------------------------------------------------------------ a module's own tensors
PARAMETER_SLOTS = Internal(
    "nn.Module._parameters", "torch",
    used_for="replace a module's parameters in place (placeholders, meta tensors in another dtype), tied ones "
             "staying one tensor",
    checked=_CHECKED,
    replacement="none to replace in place: register_parameter and setattr check the value's type and run "
                "registration hooks (named_parameters(recurse=False) reads them)")


@PARAMETER_SLOTS.wrapper
def parameter_slots(module: nn.Module) -> dict:
    """``module``'s own parameters by name (None for a declared, unset one): the live dict, so that assigning
    into it replaces a parameter."""
    return PARAMETER_SLOTS.attribute(module, "_parameters")


BUFFER_SLOTS = Internal(
    "nn.Module._buffers", "torch",
    used_for="replace a module's buffers in place (placeholders, computed RoPE buffers), shared ones staying one "
             "tensor",
    checked=_CHECKED,
    replacement="none to replace in place under the same persistence (named_buffers(recurse=False) reads them)")


@BUFFER_SLOTS.wrapper
def buffer_slots(module: nn.Module) -> dict:
    """``module``'s own buffers by name, persistent or not: the live dict, so that assigning into it replaces one."""
    return BUFFER_SLOTS.attribute(module, "_buffers")


NON_PERSISTENT_BUFFERS = Internal(
    "nn.Module._non_persistent_buffers_set", "torch",
    used_for="tell buffers a checkpoint has (persistent) from those computed at init (RoPE inv_freq)",
    checked=_CHECKED,
    replacement="none: only state_dict's omission of them shows which they are")


@NON_PERSISTENT_BUFFERS.wrapper
def non_persistent_buffer_names(module: nn.Module) -> set[str]:
    """The names of ``module``'s own buffers that are not in its state dict (the live set: do not change it)."""
    return NON_PERSISTENT_BUFFERS.attribute(module, "_non_persistent_buffers_set")


# ------------------------------------------------------------------ tensors without storage
WRAPPER_SUBCLASS = Internal(
    "Tensor._make_wrapper_subclass", "torch",
    used_for="make checkpoint placeholders: tensors with a shape, dtype and device that hold no storage, every "
             "operation on which reaches our __torch_dispatch__",
    checked=_CHECKED,
    replacement="none: torch's own subclasses (DTensor, FakeTensor) use it; it is private by name only")


@WRAPPER_SUBCLASS.wrapper
def make_wrapper_subclass(cls: type, shape, *, dtype: torch.dtype, device, requires_grad: bool = False):
    """A new tensor of subclass ``cls`` with ``shape``, ``dtype`` and ``device`` and no storage."""
    make = WRAPPER_SUBCLASS.attribute(torch.Tensor, "_make_wrapper_subclass")
    return make(cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)


DISABLED_TORCH_FUNCTION = Internal(
    "torch._C._disabled_torch_function_impl", "torch",
    used_for="let every operation on a placeholder go straight to its __torch_dispatch__, its results not "
             "re-wrapped by __torch_function__",
    checked=_CHECKED,
    replacement="none: torch's subclass documentation and its own wrapper subclasses use it")


@DISABLED_TORCH_FUNCTION.wrapper
def disabled_torch_function():
    """The ``__torch_function__`` that turns torch-function handling off for a tensor subclass."""
    return DISABLED_TORCH_FUNCTION.attribute(torch._C, "_disabled_torch_function_impl")


# ------------------------------------------------------------------ the process group's store
DEFAULT_STORE = Internal(
    "distributed_c10d._get_default_store", "torch",
    used_for="keep each rank's status in the default process group's store, so that every rank fails together "
             "and names the ranks that failed or hang",
    checked=_CHECKED,
    replacement="none: init_process_group does not return its store")


@DEFAULT_STORE.wrapper
def default_store():
    """The key-value store of the default process group (torch raises if there is none)."""
    return DEFAULT_STORE.attribute(dist.distributed_c10d, "_get_default_store")()


# ------------------------------------------------------------------ gloo's worker threads, at exit
GLOO_WORKER_THREADS = Internal(
    "ProcessGroupGloo.runLoop", "torch",  # its worker threads, which torch names pt_gloo_runloop
    used_for="wait, before the interpreter finalises, until every gloo worker thread has let go of its last "
             "collective: it releases that collective's tensors, whose Python objects need the GIL, and a thread "
             "taking the GIL after finalisation began is ended by a forced unwind that aborts the process",
    checked=_CHECKED,
    replacement="none: ProcessGroupGloo does not override shutdown() (destroy_process_group leaves its threads "
                "running); only its destructor joins them, once every reference to the group is gone")

GLOO_WORKER_THREAD_NAME = "pt_gloo_runloop"  # what torch names them (ProcessGroupGloo::runLoop)


@GLOO_WORKER_THREADS.wrapper
def gloo_worker_states() -> list[str] | None:
    """The scheduler state of each gloo worker thread of this process (``"S"`` waiting, ``"R"`` running or
    runnable: Linux's ``/proc/self/task/*/stat``), or None where threads cannot be read (not Linux)."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return None
    states = []
    for task in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, task, "stat")) as f:
                stat = f.read()
        except OSError:  # (the thread ended meanwhile)
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
        if name == GLOO_WORKER_THREAD_NAME:
            states.append(rest.split(" ", 1)[0])
    return states


# ------------------------------------------------------------------ a sharded parameter's local tensor
DTENSOR_LOCAL_TENSOR = Internal(
    "DTensor._local_tensor", "torch",
    used_for="hold a frozen weight of a quantized release as stored (quantized bytes and scales) in place of its "
             "FSDP2 shard, keeping the parameter object FSDP2 manages (quantized_base=keep); FSDP2 re-reads it at "
             "its lazy init and calls its fsdp_pre_all_gather before each all-gather",
    checked=_CHECKED,
    replacement="none to swap in place: DTensor.from_local makes a new parameter, which FSDP2 would not manage; "
                "torchao's NF4/float8 weights are subclasses before fully_shard, which the meta init cannot be")


@DTENSOR_LOCAL_TENSOR.wrapper
def replace_local_tensor(param, local: torch.Tensor) -> torch.Tensor:
    """Make ``local`` the local tensor of DTensor ``param`` (same shape and dtype); returns the one it replaced."""
    old = DTENSOR_LOCAL_TENSOR.attribute(param, "_local_tensor")
    if old.shape != local.shape or old.dtype != local.dtype:
        raise AssertionError(f"replacing a {old.dtype} {tuple(old.shape)} local tensor with a {local.dtype} "
                             f"{tuple(local.shape)} one")
    param._local_tensor = local
    return old


# ------------------------------------------------------------------ planning memory without memory
FAKE_TENSOR_MODE = Internal(
    "torch._subclasses.fake_tensor.FakeTensorMode", "torch",
    used_for="run the model's real forward and backward on tensors that have shapes, dtypes and devices but no "
             "storage, so a memory plan measures a layer of a 671B model on a laptop",
    checked=_CHECKED,
    replacement="none public: torch.compile and torch.distributed._tools use it; the meta device alone picks "
                "other kernels than the device does")


@FAKE_TENSOR_MODE.wrapper
def fake_tensor_mode():
    """A new FakeTensorMode: tensors made inside it are fake (no storage) on the device named."""
    mode_class = FAKE_TENSOR_MODE.import_name("torch._subclasses.fake_tensor", "FakeTensorMode")
    return mode_class()


DISPATCH_MODE = Internal(
    "torch.utils._python_dispatch.TorchDispatchMode", "torch",
    used_for="see every tensor an operation makes (fake ones included) and count the bytes of the storages "
             "alive at once, so a plan measures the peak of a traced forward and backward",
    checked=_CHECKED,
    replacement="none public: torch.distributed._tools.mem_tracker.MemTracker builds on it too (and, in 2.13, "
                "cannot trace a model with frozen parameters: it hooks every parameter's gradient)")


@DISPATCH_MODE.wrapper
def peak_tracked_bytes(run) -> int:
    """Run ``run()`` and return the peak bytes of the tensor storages it made that were alive at once
    (storages made before, such as the parameters, are not counted)."""
    import weakref

    mode_class = DISPATCH_MODE.import_name("torch.utils._python_dispatch", "TorchDispatchMode")
    from torch.utils._pytree import tree_flatten
    from torch.utils.weak import WeakIdKeyDictionary

    before = WeakIdKeyDictionary()
    counted = WeakIdKeyDictionary()
    state = {"live": 0, "peak": 0}

    def freed(nbytes: int) -> None:
        state["live"] -= nbytes

    def storages(tree):
        for t in tree_flatten(tree)[0]:
            if isinstance(t, torch.Tensor):
                try:
                    yield t.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue

    class Counting(mode_class):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            for storage in storages((args, kwargs)):
                if storage not in counted:
                    before[storage] = True
            out = func(*args, **(kwargs or {}))
            for storage in storages(out):
                if storage in counted or storage in before:
                    continue
                nbytes = storage.nbytes()
                counted[storage] = nbytes
                state["live"] += nbytes
                state["peak"] = max(state["peak"], state["live"])
                weakref.finalize(storage, freed, nbytes)
            return out

    with Counting():
        run()
    return state["peak"]


# ------------------------------------------------------------------ one kernel per group of gradients
FOREACH_NORM = Internal(
    "torch._foreach_norm", "torch",
    used_for="take the norms of all the gradients of one device and dtype in one kernel when clipping (as "
             "torch.nn.utils.clip_grad_norm_ does), not one norm and one launch per parameter",
    checked=_CHECKED,
    replacement="none for a list of tensors: torch.nn.utils.get_total_norm uses it, but cannot combine DTensors "
                "of several meshes; torch.linalg.vector_norm of each tensor is the per-parameter loop it replaces")


@FOREACH_NORM.wrapper
def foreach_norm(tensors: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """The ``norm_type`` norm of each of ``tensors`` (one device, no empty tensor), computed and returned in fp32."""
    return FOREACH_NORM.attribute(torch, "_foreach_norm")(tensors, norm_type, dtype=torch.float32)


FOREACH_MUL = Internal(
    "torch._foreach_mul_", "torch",
    used_for="scale all the gradients of one device and dtype by the clipping coefficient in one kernel (as "
             "torch.nn.utils.clip_grad_norm_ does), not one launch per parameter",
    checked=_CHECKED,
    replacement="none for a list of tensors: torch.nn.utils.clip_grads_with_norm_ uses it, but cannot combine "
                "DTensors of several meshes; Tensor.mul_ on each tensor is the per-parameter loop it replaces")


@FOREACH_MUL.wrapper
def foreach_mul_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply each of ``tensors`` (one device and dtype) in place by the 0-dim tensor ``factor`` (same device
    and dtype: no host sync)."""
    FOREACH_MUL.attribute(torch, "_foreach_mul_")(tensors, factor)
