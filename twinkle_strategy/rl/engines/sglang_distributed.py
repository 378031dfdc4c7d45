"""SGLang as a receiver of the export over a process group: ``update_weights_from_distributed``, one call per bucket.

SGLang 0.5's flow (an ``sglang.Engine`` or its HTTP server, the same methods): the trainer asks the engine to
``init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name, backend)``; each of
the engine's tensor-parallel ranks joins a new group as ``rank_offset + tp_rank``, the sending trainer rank being
rank 0. Then, per bucket, ``update_weights_from_distributed(names, dtypes, shapes, group_name, flush_cache)``: each
engine rank allocates the bucket's tensors and receives them by ``broadcast(src=0)`` in that order, while the trainer
broadcasts them. Both calls return only once the trainer has done its part, so the engine is called from a thread.

SGLang makes the group with its ``init_custom_process_group`` (OpenRLHF's: a ``tcp://`` rendezvous whose store rank
0 hosts, then torch's own group construction under the group's name). The trainer already has a default group (the
training job's), so it joins with torch's public classes instead, over the same store keys: ``TCPStore`` ->
``PrefixStore(group_name)`` (SGLang's) -> ``PrefixStore(group_name + "/")`` -> ``PrefixStore(device + "/")`` (torch's
per-backend prefix) -> ``ProcessGroupGloo`` / ``ProcessGroupNCCL``: one backend under the first device's prefix when
torch's ``BackendConfig`` maps every device to the same one (gloo: cpu and cuda), as torch does. tests/unit/test_sglang_distributed.py checks that layout against SGLang's function.
"""

from __future__ import annotations

import concurrent.futures
import datetime

import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

from twinkle_strategy.errors import ArgumentError, ArgumentTypeError
from twinkle_strategy.rl.engines.sglang import _check
from twinkle_strategy.rl.weight_export import Bucket, TensorMeta

_METHODS = ("init_weights_update_group", "update_weights_from_distributed", "flush_cache")


class SGLangDistributedReceiver:
    """Feeds :meth:`WeightExport.send_to`'s buckets to ``engine`` (``sglang.Engine``, or
    :class:`~twinkle_strategy.rl.engines.sglang_http.SGLangHTTPEngine` for a server) through a process group that
    this rank opens at ``master_address:master_port`` on its first ``prepare`` and keeps for later exports.
    ``engine_ranks``: the engine's tensor-parallel size (each rank joins); ``backend``: "nccl" (GPU tensors, the
    engine's GPUs) or "gloo"; ``timeout_s``: how long a rendezvous or a broadcast may wait for the engine."""

    def __init__(self, engine, *, master_address: str, master_port: int, engine_ranks: int = 1,
                 group_name: str = "weight_update_group", backend: str = "nccl", timeout_s: float = 600.0):
        if not all(callable(getattr(engine, m, None)) for m in _METHODS):
            raise ArgumentTypeError(f"SGLangDistributedReceiver needs an SGLang engine or server client ({', '.join(_METHODS)}),"
                            f" got {type(engine).__name__}: pip install sglang")
        if engine_ranks < 1:
            raise ArgumentError(f"engine_ranks must be at least 1 (the engine's tensor-parallel size), got {engine_ranks}")
        self.engine, self.group_name, self.backend = engine, group_name, dist.Backend(backend)
        self.master_address, self.master_port, self.world_size = master_address, master_port, 1 + engine_ranks
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = "cuda" if self.backend == dist.Backend.NCCL else "cpu"
        self.groups: dict[str, dist.ProcessGroup] = {}  # device -> this rank's backend, once joined
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-call")
        self.buckets = 0

    def prepare(self, manifest: list[TensorMeta]) -> None:
        if not manifest:
            raise ArgumentError("the export holds no tensor; nothing to send to the SGLang engine")
        self.buckets = 0
        if not self.groups:
            answer = self._thread.submit(self.engine.init_weights_update_group, master_address=self.master_address,
                                         master_port=self.master_port, rank_offset=1, world_size=self.world_size,
                                         group_name=self.group_name, backend=str(self.backend))
            where = f"the weight-update group {self.group_name!r} at {self.master_address}:{self.master_port}"
            try:
                groups = self._join()
            except Exception as exc:
                engine = answer.result() if answer.done() else "no answer yet"
                raise RuntimeError(f"opening {where} failed: {exc} (the SGLang engine: {engine})") from exc
            _check(answer.result(timeout=self.timeout.total_seconds()), f"joining {where}")
            self.groups = groups

    def _join(self) -> dict[str, dist.ProcessGroup]:
        """Rank 0 of the group, over the store keys SGLang's ``init_custom_process_group`` uses (module docstring)."""
        store = dist.TCPStore(self.master_address, self.master_port, self.world_size, is_master=True,
                              timeout=self.timeout)
        store = dist.PrefixStore(f"{self.group_name}/", dist.PrefixStore(self.group_name, store))
        devices = BackendConfig(self.backend).get_device_backend_map()
        if len(set(devices.values())) == 1:  # torch makes one backend, under the first device's prefix, for all
            device = next(iter(devices))
            return dict.fromkeys(devices, self._backend(devices[device], dist.PrefixStore(f"{device}/", store)))
        return {device: self._backend(backend, dist.PrefixStore(f"{device}/", store))
                for device, backend in devices.items()}

    def _backend(self, backend: str, store: dist.Store):
        if backend == dist.Backend.GLOO:
            return dist.ProcessGroupGloo(store, 0, self.world_size, timeout=self.timeout)
        return dist.ProcessGroupNCCL(store, 0, self.world_size, timeout=self.timeout)  # (torch's CUDA builds only)

    def __call__(self, bucket: Bucket) -> None:
        if not self.groups:
            raise RuntimeError("SGLangDistributedReceiver got a bucket before prepare (send it with "
                               "WeightExport.send_to)")
        names = [k for k, _ in bucket.tensors]
        answer = self._thread.submit(
            self.engine.update_weights_from_distributed, names=names,
            dtypes=[str(v.dtype).removeprefix("torch.") for _, v in bucket.tensors],
            shapes=[list(v.shape) for _, v in bucket.tensors], group_name=self.group_name, flush_cache=False)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        group = self.groups[self.device]
        try:
            for _, value in bucket.tensors:  # in the engine's receive order
                group.broadcast([value.to(self.device).contiguous()], options).wait()
        except Exception as exc:
            answer.cancel()
            raise RuntimeError(f"broadcasting bucket {bucket.index} (first tensor {names[0]}) to the SGLang engine "
                               f"failed: {exc}") from exc
        _check(answer.result(), f"bucket {bucket.index} (first tensor {names[0]})")
        self.buckets += 1

    def finish(self) -> None:
        _check(self.engine.flush_cache(), "flush_cache after the update")
