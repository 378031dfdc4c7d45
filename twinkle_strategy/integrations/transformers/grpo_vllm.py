"""TRL's ``GRPOTrainer(use_vllm=True)`` under ``with_strategy``: the rollout engine gets the trained weights
through ``strategy.export_weights``.

``vllm_mode="colocate"``: TRL starts a ``vllm.LLM`` on every rank (a group of ``vllm_tensor_parallel_size`` ranks
shares one) and, at each new step, loads the policy into it with a bare ``load_weights`` per parameter, after
gathering each (TRL's ``VLLMGeneration.sync_weights``). For an MoE engine that is wrong after the first sync
(vLLM's kernels keep weights in formats made after loading: SkyRL #1680), and under expert parallelism TRL's
gather does not know the experts' owners. :func:`sync_colocated_engines` replaces it: for each rank in turn, an
export (:meth:`NativeFSDPStrategy.export_weights`: checkpoint names and layout, LoRA merged on the fly, in the
engine's dtype, every tensor sent by the ranks that keep it) into that rank's engine through
:class:`~twinkle_strategy.rl.vllm_receiver.VLLMReceiver` (vLLM's layerwise reload). Every engine rank receives the
whole model: each colocated engine (or each tensor-parallel rank, which cuts its own share) serves all of it.

``vllm_mode="server"``: TRL's ``VLLMClient`` (on the main process, rank 0) gets the weights through
:func:`sync_server_engine` instead of TRL's per-parameter gather: one export to rank 0 into
:class:`~twinkle_strategy.rl.engines.trl_client.VLLMClientReceiver` (one weight update, a bucket per
``update_named_params``). The client moves the tensors over NCCL, so without a CUDA device the mode is refused
before TRL connects (docs/rl.md, "What waits for a GPU or vLLM").
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from twinkle_strategy.compat.trl_internals import (
    colocated_engine,
    replace_vllm_sync,
    server_client,
    wake_colocated_weights,
)
from twinkle_strategy.errors import ParallelConfigError
from twinkle_strategy.rl.engines.trl_client import VLLMClientReceiver
from twinkle_strategy.rl.export_plan import OneReceiver
from twinkle_strategy.rl.export_report import ExportReport
from twinkle_strategy.rl.vllm_receiver import VLLMReceiver

logger = logging.getLogger(__name__)


def refuse_vllm_server(args) -> None:
    """Before TRL connects to a server: ``vllm_mode="server"`` moves the weights over NCCL, so it needs CUDA."""
    if not (getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) == "server"):
        return
    if getattr(args, "use_cpu", False) or not torch.cuda.is_available():
        raise ParallelConfigError(
            "vllm_mode='server' needs a CUDA device: TRL's VLLMClient sends the weights to the server over NCCL "
            "(VLLMClient.init_communicator), which has no CPU transport; on CPU use vllm_mode='colocate', or "
            "use_vllm=False (generation through strategy.generate)")


def install_vllm_sync(trainer) -> None:
    """Replace TRL's weight sync of ``trainer``'s vLLM engines: :func:`sync_colocated_engines` (colocate) or
    :func:`sync_server_engine` (server)."""
    if not getattr(trainer, "use_vllm", False):
        return
    sync = {"colocate": sync_colocated_engines, "server": sync_server_engine}.get(getattr(trainer, "vllm_mode", None))
    if sync is None:
        return
    trainer.weight_sync_reports: list[ExportReport] = []
    replace_vllm_sync(trainer.vllm_generation, lambda: sync(trainer))


def sync_server_engine(trainer, *, bucket_bytes: int = 256 * 2**20) -> ExportReport:
    """The policy's weights (LoRA merged) into TRL's vLLM server (collective: every rank calls it, as TRL does
    before generating): one export to rank 0, whose ``VLLMClient`` sends each bucket in one weight update."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    export = trainer.strategy.export_weights(model, bucket_bytes=bucket_bytes, lora="merged",
                                             receivers=OneReceiver(0))
    receiver = VLLMClientReceiver(server_client(trainer.vllm_generation)) if dist.get_rank() == 0 else None
    report = export.send_to(receiver)
    trainer.weight_sync_reports.append(report)
    if dist.get_rank() == 0:
        logger.info("vLLM server sync at step %d: %s", trainer.state.global_step, report.log_line())
    return report


def sync_colocated_engines(trainer, *, bucket_bytes: int = 256 * 2**20) -> ExportReport:
    """The policy's weights (LoRA merged) into every rank's colocated vLLM engine (collective: every rank calls
    it, as TRL does before generating). One export per destination rank; returns the last one's report."""
    generation = trainer.vllm_generation
    wake_colocated_weights(generation)
    llm = colocated_engine(generation)
    model = trainer.accelerator.unwrap_model(trainer.model)
    receiver = VLLMReceiver(llm, model_type=model.config.model_type)
    dtype = llm.llm_engine.model_config.dtype  # the engine's own: it casts to it anyway, so send no more
    rank, world = dist.get_rank(), dist.get_world_size()
    report = None
    for dest in range(world):
        export = trainer.strategy.export_weights(model, bucket_bytes=bucket_bytes, lora="merged", dtype=dtype,
                                                 receivers=OneReceiver(dest))
        report = export.send_to(receiver if rank == dest else None)
    trainer.weight_sync_reports.append(report)
    if rank == 0:
        logger.info("vLLM colocate sync at step %d, each of %d engines: %s", trainer.state.global_step, world,
                    report.log_line())
    return report
