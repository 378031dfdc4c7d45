"""NativeFSDPStrategy: FSDP2 + expert parallelism for transformers MoE models.

The strategy owns the process group, the node topology and the device meshes,
and calls the pieces that do the work: :mod:`twinkle_strategy.moe` for expert
parallelism, :mod:`twinkle_strategy.fsdp` for sharding,
:mod:`twinkle_strategy.shards.gather` and :mod:`twinkle_strategy.distributed.grad_clip` for what
training needs afterwards.

Typical use::

    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="bf16")
    model = strategy.from_pretrained("/path/to/Qwen3-30B-A3B")
    model = peft.get_peft_model(model, lora_config)        # optional, before wrapping
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = strategy.wrap_model(model, optimizer)
    ...
    strategy.clip_grad_norm_(model, 1.0)
    state = strategy.full_state_dict(model)                # plain transformers keys and shapes
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from twinkle_strategy.checkpoint.merged_export import MergedFormat, save_merged
from twinkle_strategy.checkpoint.save_plan import save_pretrained
from twinkle_strategy.compat.transformers_internals import file_size_bytes
from twinkle_strategy.config import QuantizedBase, StrategyConfig
from twinkle_strategy.distributed.fail_together import collectively
from twinkle_strategy.distributed.grad_clip import clip_grad_norm_
from twinkle_strategy.distributed.launch_conflicts import refuse_accelerate_sharding
from twinkle_strategy.distributed.node import NodeLink, NodeTopology, broadcast_from_source, discover_topology
from twinkle_strategy.distributed.runtime import current_device, init_distributed, install_error_report
from twinkle_strategy.errors import DistributedInitError
from twinkle_strategy.fsdp import apply_fsdp, mixed_precision_policy, rebind_optimizer
from twinkle_strategy.init.capture import buffer_alias_groups, capture_state, move_to_meta, restore_buffer_aliases
from twinkle_strategy.init.engine import InitReport, distribute
from twinkle_strategy.loading import (
    config_from_text,
    load_pretrained_strict,
    open_on_this_rank,
    read_config_text,
    share_weight_conversions,
)
from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan, apply_expert_parallel, plan_expert_parallel
from twinkle_strategy.parallel import Meshes, ParallelDims, build_meshes, build_node_groups
from twinkle_strategy.planning import PlanRequest, parse_size, plan_memory
from twinkle_strategy.rl import export_options, weight_export
from twinkle_strategy.rl.export_plan import EngineExperts, OneReceiver
from twinkle_strategy.rl.replay import RoutingHooks, routing_hooks
from twinkle_strategy.rl.strategy_methods import RoutingMethods
from twinkle_strategy.sequence import (
    apply_sequence_parallel,
    check_sequence_parallel,
    refuse_generation,
    split_batch,
)
from twinkle_strategy.shards.gather import gather_full_state_dict
from twinkle_strategy.sources.model_ids import PYTHON_HUBS, HubConvention, resolve_model_path
from twinkle_strategy.step import collectives

logger = logging.getLogger(__name__)


class NativeFSDPStrategy(RoutingMethods):
    """FSDP2 with expert parallelism.

    Takes a :class:`~twinkle_strategy.config.StrategyConfig` (every option, its default and its doc),
    or the same options as keyword arguments::

        NativeFSDPStrategy(StrategyConfig(ep_size=8, memory_efficient_init=True))
        NativeFSDPStrategy(ep_size=8, memory_efficient_init=True)          # the same
    """

    def __init__(self, config: StrategyConfig | None = None, /, **options: Any) -> None:
        if config is not None and options:
            config = config.replace(**options)
        self.config = config if config is not None else StrategyConfig(**options)
        self.init_report: InitReport | None = None
        mixed_precision_policy(self.config.mixed_precision)  # validate now, not after loading a model
        self._ready = False
        self._resolved_paths: dict[str, str] = {}
        self.ep_plan: ExpertParallelPlan | None = None
        self.routing: RoutingHooks | None = None  # the wrapped model's routers (routing replay), set by wrap_model

    # The options other code reads most, as attributes of the strategy.
    ep_size = property(lambda self: self.config.ep_size)
    memory_efficient_init = property(lambda self: self.config.memory_efficient_init)
    timeout_s = property(lambda self: self.config.timeout_s)
    init_bucket_bytes = property(lambda self: self.config.init_bucket_bytes)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Initialise the process group, agree on the topology, build the meshes. Idempotent."""
        if self._ready:
            return
        self.device_type, self.env = init_distributed(self.config.device_type, self.config.backend,
                                                      timeout_s=self.timeout_s)
        self.device = current_device(self.device_type)
        self.topology: NodeTopology = discover_topology(self.env)
        self.dims = ParallelDims(world_size=self.env.world_size, ep_size=self.ep_size,
                                 ep_fsdp_size=self.config.ep_fsdp_size,
                                 local_world_size=self.topology.local_world_size,
                                 sp_size=self.config.sequence_parallel_size)
        self.meshes: Meshes = build_meshes(self.dims, self.device_type)
        self.node_group = (build_node_groups(self.topology, self.device, self.timeout_s)
                           if self.memory_efficient_init else None)
        self._ready = True

    @property
    def rank(self) -> int:
        self.setup()
        return self.env.rank

    @property
    def world_size(self) -> int:
        self.setup()
        return self.env.world_size

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    # --------------------------------------------------------------- planning
    def plan(self, model_path: str, *, nnodes: int = 1, nproc_per_node: int = 1, **request: Any):
        """Will this strategy's run of ``model_path`` fit? A :class:`~twinkle_strategy.planning.MemoryPlan` of
        every rank's device memory and host RAM, made in this process from the model's config.json alone (no
        weight, no process group, no GPU; ``setup`` is not called). ``request``: the other fields of
        :class:`~twinkle_strategy.planning.PlanRequest` (``lora``, ``dtype``, ``micro_batch``, ``max_length``,
        ``gradient_checkpointing``, ``routing_skew``, ``device_memory``, ``host_memory``); ``table(plan)`` and
        ``to_json(plan)`` of :mod:`twinkle_strategy.planning` print it."""
        for budget in ("device_memory", "host_memory"):
            if isinstance(request.get(budget), str):
                request[budget] = parse_size(request[budget], what=budget)
        return plan_memory(PlanRequest(model_path=model_path, strategy=self.config, nnodes=nnodes,
                                       nproc_per_node=nproc_per_node, **request))

    # ---------------------------------------------------------------- loading
    def from_pretrained(self, path_or_id: str, dtype: torch.dtype = torch.float32, *,
                        hubs: HubConvention = PYTHON_HUBS, **kwargs) -> nn.Module:
        """Load a model from a local path, ``org/name`` or ``hf://org/name`` (the Hugging Face Hub, as
        transformers takes it), ``ms://org/name`` (ModelScope) or ``tiny://demo`` (the embedded demo) (collective).

        ``hubs``: the hub of a bare ``org/name`` and the words of a message naming the other hub
        (:mod:`twinkle_strategy.sources.model_ids`); command-line front-ends pass their own.

        The class is the checkpoint's own: a causal LM, or for a vision-language
        checkpoint its image-text-to-text class (``loading.model_class_for``).

        Without memory_efficient_init every rank loads the whole model on the CPU.
        With it, only each node's source opens the checkpoint and the other ranks
        build the model on meta from the config their source sends:

        * streaming (the default, for safetensors checkpoints): the source too builds
          the model without weights, from the config, and checks the checkpoint's
          headers against it; ``wrap_model`` reads from the files only the rows its
          node keeps. Whatever the user adds before ``wrap_model`` (LoRA, new heads)
          lives in the source's host memory and is sent from there.
        * in memory (``stream_checkpoint=False`` or a checkpoint that cannot be
          streamed): the source loads the whole model on the CPU, and ``wrap_model``
          sends from it by reference.

        A checkpoint with missing, unexpected or wrong-shaped tensors raises on every
        rank, naming them, before any weight is read. So does, first of all (before the
        process group and any file), an environment that asks accelerate to shard or
        broadcast the model too (its DeepSpeed or FSDP plugin, FSDP's cpu_ram_efficient_loading).
        """
        install_error_report()  # the refusal below comes before the process group: one line per rank too
        refuse_accelerate_sharding()  # the same variables on every rank: each raises on its own, none waits
        self.setup()
        what = f"loading {path_or_id}"
        if not self.memory_efficient_init:
            return collectively(what, lambda: self._load_whole(path_or_id, dtype, kwargs, hubs),
                                error_class=DistributedInitError)
        # The config first, as text: every rank builds it and its meta model while the source checks the checkpoint.
        found = collectively(what, lambda: self._config_text(path_or_id, hubs), here=self.topology.is_source,
                             error_class=DistributedInitError)
        text, path = broadcast_from_source(found, self.topology.source_rank, self.node_group)
        model = collectively(what, lambda: self._build(path, text, dtype, kwargs), error_class=DistributedInitError)
        share_weight_conversions(model, self.topology, self.node_group)
        return model

    def _load_whole(self, path_or_id: str, dtype: torch.dtype, kwargs: dict, hubs: HubConvention) -> nn.Module:
        path = self._resolve(path_or_id, hubs)
        if self.dims.sp_enabled:  # refuse a model sequence parallelism cannot split before reading its weights
            from transformers import AutoConfig

            check_sequence_parallel(AutoConfig.from_pretrained(path), self.dims.sp_size)
        return load_pretrained_strict(path, dtype=dtype, **kwargs)

    def _resolve(self, path_or_id: str, hubs: HubConvention) -> str:
        path = self._resolved_paths[path_or_id] = resolve_model_path(path_or_id, hubs=hubs)
        return path

    def _config_text(self, path_or_id: str, hubs: HubConvention) -> tuple[str, str]:
        """(config.json's text, the local directory) of ``path_or_id``, on a node's source."""
        path = self._resolve(path_or_id, hubs)
        return read_config_text(path), path

    def _build(self, path: str, text: str, dtype: torch.dtype, kwargs: dict) -> nn.Module:
        """The source opens the checkpoint; every other rank builds the model on meta from the config."""
        config = config_from_text(text, os.path.join(path, "config.json"))
        check_sequence_parallel(config, self.dims.sp_size)
        return open_on_this_rank(path, config, dtype, topology=self.topology, stream=self.config.stream_checkpoint,
                                 full_load=lambda: load_pretrained_strict(path, dtype=dtype, **kwargs), kwargs=kwargs,
                                 quantized_base=QuantizedBase(self.config.quantized_base))

    def resolved_model_path(self, path_or_id: str, *, hubs: HubConvention = PYTHON_HUBS) -> str:
        """The local directory ``from_pretrained`` used for ``path_or_id`` (downloading if this rank did not),
        e.g. for ``AutoTokenizer.from_pretrained``."""
        return self._resolved_paths.get(path_or_id) or resolve_model_path(path_or_id, hubs=hubs)

    def node_local_object(self, make):
        """``make()`` on each node's source, shared with its node (every rank calls ``make`` without
        memory_efficient_init). For small things every rank needs, e.g. the tokenizer."""
        self.setup()
        if not self.memory_efficient_init:
            return make()
        obj = collectively("preparing a node-local object", make, here=self.topology.is_source,
                           error_class=DistributedInitError)
        return broadcast_from_source(obj, self.topology.source_rank, self.node_group)

    # --------------------------------------------------------------- wrapping
    def wrap_model(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        """Apply EP and FSDP2 to ``model`` in place; return ``(model, optimizer)``.

        A given optimizer is pointed at the sharded parameters (matched by name),
        keeping its class, hyper-parameters and parameter groups.
        """
        self.setup()
        check_sequence_parallel(model.config, self.dims.sp_size)  # the same answer on every rank
        if self.dims.ep_enabled:
            # Refuse a model EP cannot serve before touching it: the same error on every rank,
            # raised before any collective (every rank holds the same model structure).
            plan_expert_parallel(model, self.dims, self.rank)
        names_by_param = {id(p): n for n, p in model.named_parameters()}
        capture = None
        if self.memory_efficient_init:
            # The source keeps references to its loaded tensors, then joins the
            # other ranks on meta: EP and FSDP run identically everywhere.
            capture = capture_state(model) if self.topology.is_source else None
            move_to_meta(model)
        elif any(p.is_meta for p in model.parameters()):
            raise ValueError("wrap_model got a model on the meta device; load it with strategy.from_pretrained "
                             "or set memory_efficient_init=True")
        experts_modules: list[nn.Module] = []
        if self.dims.ep_enabled:
            self.ep_plan = apply_expert_parallel(model, self.dims, self.rank, ep_group=self.meshes.ep_group)
            experts_modules = [model.get_submodule(name) for name in self.ep_plan.experts_modules]
        apply_fsdp(model, self.meshes, experts_modules, mixed_precision_policy(self.config.mixed_precision),
                   reshard_after_forward=self.config.reshard_after_forward)
        if self.memory_efficient_init:
            self._materialize(model, capture)
        if self.dims.sp_enabled:
            apply_sequence_parallel(model, self.meshes.sp_group)
            refuse_generation(model, self.dims.sp_size)
        self.routing = routing_hooks(model)
        if optimizer is not None:
            optimizer = rebind_optimizer(optimizer, names_by_param, model)
        return model, optimizer

    def _materialize(self, model: nn.Module, capture) -> None:
        aliases = buffer_alias_groups(model)
        model.to_empty(device=self.device)  # allocates this rank's shards only
        restore_buffer_aliases(aliases)
        try:
            self.init_report = distribute(
                model, capture, ep_plan=self.ep_plan, node=NodeLink(self.topology, self.node_group, self.device),
                bucket_bytes=self.init_bucket_bytes, transport_kind=self.config.init_transport,
                verify=self.config.verify_init, show_progress=self.is_main_process,
                quantized_base=self.config.quantized_base,
            )
        finally:
            if capture is not None:
                capture.release()
        if self.is_main_process:
            logger.info(self.init_report.log_line())

    # --------------------------------------------------------------- training
    @property
    def data_parallel_rank(self) -> int:
        """Which examples this rank trains on: the ranks of a sequence-parallel group share them."""
        self.setup()
        return self.dims.dp_rank(self.rank)

    @property
    def data_parallel_size(self) -> int:
        """How many different shares of each batch there are (world size / sequence_parallel_size)."""
        self.setup()
        return self.dims.dp_size

    def split_sequence(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's chunk of ``batch`` under sequence parallelism (``batch`` itself without it).

        Every rank of a sequence-parallel group passes the same batch; see :func:`sequence.split_batch`.
        The chunk's ``shift_labels`` are the labels its tokens' losses use: count them for the global
        number of tokens (``num_items_in_batch``).
        """
        self.setup()
        if not self.dims.sp_enabled:
            return batch
        return split_batch(batch, rank=self.dims.sp_rank(self.rank), size=self.dims.sp_size)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """EP-aware gradient clipping; returns the global gradient norm before clipping."""
        return clip_grad_norm_(model, max_norm, norm_type)

    def global_loss_tokens(self, *batches: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The tokens a causal LM's loss is taken over in ``batches`` (e.g. every accumulation micro-batch of a step,
        each a dict as the model takes it), summed over every rank. Collective.

        A batch's tokens are its ``labels`` that are not -100 after the first position (the model shifts them), or,
        in a chunk of :meth:`split_sequence`, its ``shift_labels`` that are not -100 (shifted on the whole row
        already). Pass the result as ``num_items_in_batch``: each rank's ``model(**batch, ...).loss`` is then its
        share of the global per-token mean (a rank without such a token contributes 0, not NaN), :meth:`reduce_sum`
        of the shares is the step's loss, and ``(loss * strategy.world_size).backward()`` gives the gradient of that
        mean (FSDP averages gradients over ranks).
        """
        return collectives.global_loss_tokens(*batches, strategy=self)

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum of a scalar over all ranks (for logging: the step's loss from each rank's share)."""
        return collectives.reduce_sum(value, strategy=self)

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean of a scalar over all ranks (for logging losses)."""
        return collectives.reduce_mean(value)

    # ------------------------------------------------------------ state dicts
    def full_state_dict(self, model: nn.Module, rank0_only: bool = False, keys: set[str] | None = None):
        """The unsharded state dict (plain transformers/PEFT keys and shapes, CPU tensors). Collective."""
        return gather_full_state_dict(model, self.ep_plan, rank0_only=rank0_only, keys=keys)

    def save_pretrained(self, model: nn.Module, directory: str, max_shard_size: int | str = "5GB",
                        tokenizer=None) -> None:
        """Save ``model`` as a Hugging Face checkpoint in ``directory`` (collective), without gathering it: every
        rank writes its rows into the final files, in the key layout of the checkpoint the model was loaded from
        (plain ``from_pretrained`` reads it); a PEFT model saves its whole adapter, as PEFT does. Crash-safe, any
        rank's error raised on every rank: :func:`twinkle_strategy.checkpoint.save_plan.save_pretrained`."""
        self.setup()
        save_pretrained(model, directory, ep_plan=self.ep_plan, max_file_bytes=file_size_bytes(max_shard_size),
                        chunk_bytes=self.init_bucket_bytes, tokenizer=tokenizer)

    def save_merged(self, model: nn.Module, directory: str, *, merged_format: MergedFormat | str = MergedFormat.BF16,
                    release: str | None = None, max_shard_size: int | str = "5GB") -> list[str]:
        """Merge a PEFT model's adapters into its base and save the result in ``directory`` (collective):
        ``merge_lora``. Consumes the model; works on a ``quantized_base: keep`` run. ``merged_format=bf16``: a plain
        checkpoint in the model's dtype; ``release`` (with ``release=`` the quantized release's local directory): its
        files byte for byte for every weight no adapter touched. Returns the merged modules (release, rank 0);
        :func:`twinkle_strategy.checkpoint.merged_export.save_merged`."""
        self.setup()
        modules, self.ep_plan = save_merged(  # the strategy now wraps the merged model, under its own names
            model, directory, ep_plan=self.ep_plan, merged_format=merged_format, release=release,
            max_file_bytes=file_size_bytes(max_shard_size), chunk_bytes=self.init_bucket_bytes)
        return modules

    def export_weights(self, model: nn.Module, *, bucket_bytes: int = 256 * 2**20, changed_only: bool = False,
                       lora: str = "merged", dtype: torch.dtype | None = None,
                       receivers: OneReceiver | EngineExperts | None = None, merged_format: str = "bf16",
                       release: str | None = None) -> weight_export.WeightExport:
        """The trained weights for a rollout engine, as buckets of ``(checkpoint key, tensor)`` in the checkpoint's
        own layout, each tensor sent by the ranks that keep it (collective; nobody gathers the model). Iterate the
        result on every rank or call ``.send_to(receiver)``; options and receivers: docs/rl.md and
        :func:`twinkle_strategy.rl.export_options.export_weights`."""
        self.setup()
        return export_options.export_weights(model, self.ep_plan, bucket_bytes=bucket_bytes,
                                             changed_only=changed_only, lora=lora, dtype=dtype, receivers=receivers,
                                             merged_format=merged_format, release=release)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self._ready = False
