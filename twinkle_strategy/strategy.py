"""NativeFSDPStrategy: FSDP2 + expert parallelism for transformers MoE models.

The strategy holds a run's options and state (the process's place, the expert-parallel plan, the routing hooks)
and each of its methods calls the package that does the work: :mod:`twinkle_strategy.placement` (setup,
loading, wrapping: :mod:`~twinkle_strategy.moe` for expert parallelism, :mod:`~twinkle_strategy.fsdp` for
sharding, :mod:`~twinkle_strategy.init` for the memory-efficient init), :mod:`twinkle_strategy.sequence`,
:mod:`twinkle_strategy.distributed.grad_clip`, :mod:`twinkle_strategy.shards.gather`,
:mod:`twinkle_strategy.checkpoint`, and, on the first call of a method that needs them,
:mod:`twinkle_strategy.planning` and :mod:`twinkle_strategy.rl` (importing the class loads neither).

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

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from twinkle_strategy.checkpoint.merged_export import MergedFormat, save_merged
from twinkle_strategy.checkpoint.training import save_pretrained
from twinkle_strategy.compat.transformers_internals import file_size_bytes
from twinkle_strategy.config import StrategyConfig, refuse_unknown_options
from twinkle_strategy.distributed import teardown
from twinkle_strategy.distributed.grad_clip import clip_grad_norm_
from twinkle_strategy.distributed.launch_conflicts import refuse_accelerate_sharding
from twinkle_strategy.distributed.runtime import destroy_process_group, install_error_report
from twinkle_strategy.fsdp import mixed_precision_policy
from twinkle_strategy.placement.load import ModelPaths, load_model, node_local
from twinkle_strategy.placement.process import ProcessPlace, place_process
from twinkle_strategy.placement.wrap import wrap_for_training
from twinkle_strategy.sequence import split_batch
from twinkle_strategy.shards.gather import gather_full_state_dict
from twinkle_strategy.sources.model_ids import PYTHON_HUBS, HubConvention
from twinkle_strategy.step import collectives

if TYPE_CHECKING:  # rl/ and planning/ load on the first call of a method that needs them, not with the class
    from twinkle_strategy.init.engine import InitReport
    from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan
    from twinkle_strategy.planning import MemoryPlan
    from twinkle_strategy.rl.export_plan import EngineExperts, OneReceiver
    from twinkle_strategy.rl.replay import RoutingHooks
    from twinkle_strategy.rl.weight_export import WeightExport


class NativeFSDPStrategy:
    """FSDP2 with expert parallelism.

    Takes a :class:`~twinkle_strategy.config.StrategyConfig` (every option, its default and its doc),
    or the same options as keyword arguments::

        NativeFSDPStrategy(StrategyConfig(ep_size=8, memory_efficient_init=True))
        NativeFSDPStrategy(ep_size=8, memory_efficient_init=True)          # the same
    """

    def __init__(self, config: StrategyConfig | None = None, /, **options: Any) -> None:
        install_error_report()  # a bad option below is one line per rank too, as every later refusal is
        refuse_unknown_options(options)
        if config is not None and options:
            config = config.replace(**options)
        self.config = config if config is not None else StrategyConfig(**options)
        self.init_report: InitReport | None = None
        mixed_precision_policy(self.config.mixed_precision, reduce_dtype=self.config.reduce_dtype)  # validate now
        self._ready = False
        self.place: ProcessPlace | None = None  # set by setup
        self._model_paths = ModelPaths()
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
        self.place = place_process(self.config)
        self._ready = True

    # What setup placed this process in (:class:`~twinkle_strategy.placement.process.ProcessPlace`), as attributes.
    device_type = property(lambda self: self.place.device_type)
    env = property(lambda self: self.place.env)
    device = property(lambda self: self.place.device)
    topology = property(lambda self: self.place.topology)
    dims = property(lambda self: self.place.dims)
    meshes = property(lambda self: self.place.meshes)
    node_group = property(lambda self: self.place.node_group)

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
    def plan(self, model_path: str, *, nnodes: int = 1, nproc_per_node: int = 1, **request: Any) -> MemoryPlan:
        """Will this strategy's run of ``model_path`` fit? A :class:`~twinkle_strategy.planning.MemoryPlan` of
        every rank's device memory and host RAM, made in this process from the model's config.json alone (no
        weight, no process group, no GPU; ``setup`` is not called). ``request``: the other fields of
        :class:`~twinkle_strategy.planning.PlanRequest` (``lora``, ``dtype``, ``micro_batch``, ``max_length``,
        ``gradient_checkpointing``, ``routing_skew``, ``device_memory``, ``host_memory``); ``table(plan)`` and
        ``to_json(plan)`` of :mod:`twinkle_strategy.planning` print it."""
        from twinkle_strategy.planning import plan_memory, strategy_request

        return plan_memory(strategy_request(self.config, model_path, nnodes=nnodes, nproc_per_node=nproc_per_node,
                                            **request))

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
        return load_model(path_or_id, dtype, place=self.place, config=self.config, paths=self._model_paths, hubs=hubs,
                          kwargs=kwargs)

    def resolved_model_path(self, path_or_id: str, *, hubs: HubConvention = PYTHON_HUBS) -> str:
        """The local directory ``from_pretrained`` used for ``path_or_id`` (downloading if this rank did not),
        e.g. for ``AutoTokenizer.from_pretrained``."""
        return self._model_paths.resolved(path_or_id, hubs)

    def node_local_object(self, make):
        """``make()`` on each node's source, shared with its node (every rank calls ``make`` without
        memory_efficient_init). For small things every rank needs, e.g. the tokenizer."""
        self.setup()
        return node_local(make, place=self.place, config=self.config)

    # --------------------------------------------------------------- wrapping
    def wrap_model(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        """Apply EP and FSDP2 to ``model`` in place; return ``(model, optimizer)``.

        A given optimizer is pointed at the sharded parameters (matched by name),
        keeping its class, hyper-parameters and parameter groups.
        """
        from twinkle_strategy.rl.replay import routing_hooks  # the routers wrapped once, for routing replay

        self.setup()
        wrapped = wrap_for_training(model, optimizer, place=self.place, config=self.config)
        if wrapped.ep_plan is not None:
            self.ep_plan = wrapped.ep_plan
        if wrapped.init_report is not None:
            self.init_report = wrapped.init_report
        self.routing = routing_hooks(model)
        return model, wrapped.optimizer

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
        rank's error raised on every rank: :func:`twinkle_strategy.checkpoint.training.save_pretrained`."""
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
                       release: str | None = None) -> WeightExport:
        """The trained weights for a rollout engine, as buckets of ``(checkpoint key, tensor)`` in the checkpoint's
        own layout, each tensor sent by the ranks that keep it (collective; nobody gathers the model). Iterate the
        result on every rank or call ``.send_to(receiver)``; options and receivers: docs/rl.md and
        :func:`twinkle_strategy.rl.export_options.export_weights`."""
        from twinkle_strategy.rl.export_options import export_weights

        self.setup()
        return export_weights(model, self.ep_plan, bucket_bytes=bucket_bytes, changed_only=changed_only, lora=lora,
                              dtype=dtype, receivers=receivers, merged_format=merged_format, release=release)

    # ------------------------------------------------ reinforcement learning
    # Routing replay (R2/R3), routing records and generation on every rank: rl/strategy_methods.py, with the
    # wrapped model's routing hooks (self.routing).
    def routing_replay(self, record: torch.Tensor, *, input_ids: torch.Tensor):
        """Context: forwards of ``input_ids`` inside dispatch the experts of ``record`` (``routed_experts``,
        ``[*input_ids.shape, MoE layers, top_k]``, -1 where the router may choose), weighted by the current router
        (R3 with a rollout engine's record, R2 with :meth:`routing_record`'s). Collective: a record that does not
        fit raises on every rank; a family that cannot replay raises on every rank (the same model everywhere)."""
        from twinkle_strategy.rl import strategy_methods

        return strategy_methods.routing_replay(self.routing, record, input_ids=input_ids)

    def routing_record(self):
        """Context yielding a :class:`~twinkle_strategy.rl.RoutingRecorder`: the forwards inside keep what their
        routers chose; ``recorder.routed_experts(like=input_ids)`` is the record to replay."""
        from twinkle_strategy.rl import strategy_methods

        return strategy_methods.routing_record(self.routing)

    def take_routing_agreement(self) -> list[float] | None:
        """Per MoE layer, the share of replayed tokens whose recorded experts are the ones the router would have
        chosen, since the last call, over every rank (collective); None when nothing was replayed, or (without a
        collective) when the model's routing cannot be replayed."""
        from twinkle_strategy.rl import strategy_methods

        return strategy_methods.take_routing_agreement(self.routing)

    def take_routing_agreement_counts(self) -> torch.Tensor | None:
        """:meth:`take_routing_agreement` without a host sync: the [layers, (agreeing, replayed)] token counts on
        the device (``twinkle_strategy.rl.replay.agreement_shares`` reads them), for a training step that reads them
        only at its log line; None as there."""
        from twinkle_strategy.rl import strategy_methods

        return strategy_methods.take_routing_agreement_counts(self.routing)

    def generate(self, model: nn.Module, *, input_ids: torch.Tensor, return_routing: bool = False, **kwargs):
        """``model.generate`` on every rank (collective), where some ranks may have no prompt (``input_ids`` of
        zero rows); with ``return_routing``, also the routing record of the sequences (R3 replays it)."""
        from twinkle_strategy.rl import strategy_methods

        return strategy_methods.generate_on_every_rank(self.routing, model, input_ids=input_ids,
                                                       return_routing=return_routing, **kwargs)

    def replay_of_batch(self, batch: dict):
        """The batch key front-ends pass a record under: ``(batch without routed_experts, context)``, the context
        replaying the record (:meth:`routing_replay`) or doing nothing when the batch has none."""
        from twinkle_strategy.rl import strategy_methods

        return strategy_methods.replay_of_batch(self.routing, batch)

    def _routing_hooks(self) -> RoutingHooks:
        """The wrapped model's routing hooks, or the error that says why routing cannot be replayed."""
        from twinkle_strategy.rl import strategy_methods

        return strategy_methods.served_hooks(self.routing)

    def shutdown(self) -> None:
        """Stop what the strategy started in this process, in order: background checkpoint writers, the gloo groups
        made beside the process group, then the process group (collective in spirit: call it on every rank, after
        the last collective). Idempotent. Optional: the same runs when the interpreter exits
        (:mod:`twinkle_strategy.distributed.teardown`); call it to free the group earlier, e.g. before the script
        goes on without the strategy."""
        teardown.stop_all()
        destroy_process_group()  # (a group the strategy joined but did not make: destroyed too, as always)
        self._ready = False
