"""A model loaded on every rank: ``NativeFSDPStrategy.from_pretrained``, ``resolved_model_path`` and
``node_local_object``.

Without memory_efficient_init every rank loads the whole model on the CPU. With it, only each node's source
opens the checkpoint and the other ranks build the model on meta from the config their source sends
(:func:`twinkle_strategy.loading.open_on_this_rank` says how the source opens it). Each step runs
``collectively``: an error on any rank is raised on every rank, naming the ranks, instead of leaving the others
waiting in the next collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn
from transformers import AutoConfig

from twinkle_strategy.config import QuantizedBase, StrategyConfig
from twinkle_strategy.distributed.fail_together import collectively
from twinkle_strategy.distributed.node import broadcast_from_source
from twinkle_strategy.errors import DistributedInitError
from twinkle_strategy.loading import (
    config_from_text,
    load_pretrained_strict,
    open_on_this_rank,
    read_config_text,
    share_weight_conversions,
)
from twinkle_strategy.placement.process import ProcessPlace
from twinkle_strategy.sequence import check_sequence_parallel
from twinkle_strategy.sources.model_ids import HubConvention, resolve_model_path

T = TypeVar("T")


class ModelPaths:
    """The local directory of each model id this rank resolved (downloading it if needed), kept so that
    ``resolved_model_path`` answers with the directory ``from_pretrained`` used."""

    def __init__(self) -> None:
        self._resolved: dict[str, str] = {}

    def resolve(self, path_or_id: str, hubs: HubConvention) -> str:
        path = self._resolved[path_or_id] = resolve_model_path(path_or_id, hubs=hubs)
        return path

    def resolved(self, path_or_id: str, hubs: HubConvention) -> str:
        """The directory ``from_pretrained`` used, or (on a rank that did not resolve ``path_or_id``) resolved now."""
        return self._resolved.get(path_or_id) or resolve_model_path(path_or_id, hubs=hubs)


def load_model(path_or_id: str, dtype: torch.dtype, *, place: ProcessPlace, config: StrategyConfig,
               paths: ModelPaths, hubs: HubConvention, kwargs: dict) -> nn.Module:
    """This rank's model of ``path_or_id`` (collective): see ``NativeFSDPStrategy.from_pretrained``."""
    what = f"loading {path_or_id}"
    if not config.memory_efficient_init:
        return collectively(what, lambda: _load_whole(paths.resolve(path_or_id, hubs), dtype, place, kwargs),
                            error_class=DistributedInitError)
    # The config first, as text: every rank builds it and its meta model while the source checks the checkpoint.
    found = collectively(what, lambda: _config_text(paths.resolve(path_or_id, hubs)), here=place.topology.is_source,
                         error_class=DistributedInitError)
    text, path = broadcast_from_source(found, place.topology.source_rank, place.node_group)
    model = collectively(what, lambda: _build(path, text, dtype, place, config, kwargs),
                         error_class=DistributedInitError)
    share_weight_conversions(model, place.topology, place.node_group)
    return model


def node_local(make: Callable[[], T], *, place: ProcessPlace, config: StrategyConfig) -> T:
    """``make()`` on each node's source, shared with its node (every rank calls ``make`` without
    memory_efficient_init)."""
    if not config.memory_efficient_init:
        return make()
    obj = collectively("preparing a node-local object", make, here=place.topology.is_source,
                       error_class=DistributedInitError)
    return broadcast_from_source(obj, place.topology.source_rank, place.node_group)


def _load_whole(path: str, dtype: torch.dtype, place: ProcessPlace, kwargs: dict) -> nn.Module:
    if place.dims.sp_enabled:  # refuse a model sequence parallelism cannot split before reading its weights
        check_sequence_parallel(AutoConfig.from_pretrained(path), place.dims.sp_size)
    return load_pretrained_strict(path, dtype=dtype, **kwargs)


def _config_text(path: str) -> tuple[str, str]:
    """(config.json's text, the local directory) of ``path``, on a node's source."""
    return read_config_text(path), path


def _build(path: str, text: str, dtype: torch.dtype, place: ProcessPlace, config: StrategyConfig,
           kwargs: dict) -> nn.Module:
    """The source opens the checkpoint; every other rank builds the model on meta from the config."""
    model_config = config_from_text(text, os.path.join(path, "config.json"))
    check_sequence_parallel(model_config, place.dims.sp_size)
    return open_on_this_rank(path, model_config, dtype, topology=place.topology, stream=config.stream_checkpoint,
                             full_load=lambda: load_pretrained_strict(path, dtype=dtype, **kwargs), kwargs=kwargs,
                             quantized_base=QuantizedBase(config.quantized_base))
