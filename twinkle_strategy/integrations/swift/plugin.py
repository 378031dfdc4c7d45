"""ms-swift integration: ``swift sft --external_plugins <this file>`` trains with NativeFSDPStrategy.

    twinkle-sft --swift-plugin-path          # prints this file's path
    TWINKLE_EP_SIZE=2 NPROC_PER_NODE=2 swift sft --external_plugins $(twinkle-sft --swift-plugin-path) \\
        --model Qwen/Qwen3-30B-A3B --dataset sft.jsonl --tuner_type lora --lora_dropout 0 \\
        --target_modules q_proj k_proj v_proj o_proj \\
        --target_parameters mlp.experts.gate_up_proj mlp.experts.down_proj

swift imports this module while it parses its arguments (``BaseArguments._import_external_plugins``),
in every training process and before anything else happens. Importing it hooks four places of
ms-swift 4.x (:mod:`twinkle_strategy.integrations.swift.parts`, one module each); everything else
(data, template, loss, logging, output layout) stays swift's own:

1. **Arguments** (``SftArguments._init_deepspeed`` and ``_init_fsdp``): refuses ``--deepspeed``
   first, then reads the strategy options (``TWINKLE_*`` environment variables, or a ``"twinkle"``
   object in the ``--fsdp`` JSON) and checks them, the LoRA options and accelerate's launch
   settings before any model is loaded. ``--fsdp`` is then cleared: transformers and
   accelerate must not shard, wrap or save the model themselves. ``--sequence_parallel_size`` becomes the
   strategy's, swift's own set back to 1; ``--packing``/``--padding_free`` keep swift's packed rows, on any
   attention implementation (:mod:`~twinkle_strategy.integrations.swift.parts.sequence`).
2. **Model loading** (``ModelLoader.load``): with ``memory_efficient_init`` every rank builds the
   model from its config without weights; each node's local rank 0 checks the checkpoint's headers
   and, in ``wrap_model``, reads only the rows its node keeps (``stream_checkpoint``, the default;
   checkpoints that cannot be streamed are loaded whole on that rank). Without it every rank loads
   on CPU. Missing, unexpected or wrong-shaped tensors fail on every rank, named by checkpoint key.
3. **Tuner** (``TunerMixin.prepare_model``): swift applies its tuner (``--tuner_type lora`` with
   ``--target_parameters`` for expert LoRA, or ``full``) to the whole, un-split model, so a LoRA
   adapter is the full ``[r*E]`` one; then ``strategy.wrap_model`` applies EP and FSDP2 and, with
   ``memory_efficient_init``, sends every rank exactly its shards from its node's source.
4. **Trainer** (``TrainerFactory.get_trainer_cls``): swift's trainer class, with EP-aware gradient
   clipping; saves as any trainer of the shared layer (the same kinds of save, sync or async): full
   parameters written by every rank in parallel into the checkpoint's safetensors files (no gather,
   the source checkpoint's key layout), adapters gathered (small) and written by process zero in
   PEFT's format; swift's ``_save`` adds the rest of its layout; plus ``trainer_state/`` (optimizer state and
   trainable weights by full tensor, the library's layout-independent files), so that
   ``--resume_from_checkpoint`` continues exactly, on any number of nodes, ranks and ep_size. The trainer
   mixin is the shared one of :mod:`twinkle_strategy.integrations.transformers` plus swift's own layout.

Options (the ``--fsdp`` JSON's ``"twinkle"`` object wins over the environment)::

    TWINKLE_EP_SIZE=8                    "ep_size": 8                  ranks that split each MoE layer's experts
    TWINKLE_EP_FSDP_SIZE=2               "ep_fsdp_size": 2             default world_size / ep_size
    TWINKLE_MEMORY_EFFICIENT_INIT=1      "memory_efficient_init": true default true
    TWINKLE_STREAM_CHECKPOINT=1          "stream_checkpoint": true     read only each node's rows from the files
    TWINKLE_INIT_BUCKET_MB=256           "init_bucket_mb": 256
    TWINKLE_INIT_TRANSPORT=p2p           "init_transport": "p2p"       or "scatter"
    TWINKLE_VERIFY_INIT=0                "verify_init": false
    TWINKLE_MIXED_PRECISION=bf16         "mixed_precision": "bf16"     default: swift's --bf16/--fp16, else no
    TWINKLE_TIMEOUT_S=1800               "timeout_s": 1800
    TWINKLE_RESHARD_AFTER_FORWARD=1      "reshard_after_forward": true
"""

from __future__ import annotations

import os
import sys

from twinkle_strategy.integrations.swift.errors import SwiftPluginError  # noqa: F401  (raised by the plugin, importable from here)
from twinkle_strategy.integrations.swift.parts.arguments import check_arguments  # noqa: F401
from twinkle_strategy.integrations.swift.parts.hooks import install
from twinkle_strategy.integrations.swift.parts.options import (  # noqa: F401
    DEFAULTS,
    ENV_PREFIX,
    SWIFT_OWNED,
    env_var,
    option_names,
    resolve_options,
)
from twinkle_strategy.integrations.swift.parts.state import STATE, PluginState, get_strategy  # noqa: F401
from twinkle_strategy.integrations.swift.parts.trainer import TwinkleTrainerMixin  # noqa: F401

_CANONICAL_NAME = "twinkle_strategy.integrations.swift.plugin"
# swift imports this file by path, as `_swift_external_<hash>`, after putting its directory first on
# sys.path. That folder holds this plugin and the `parts` package only, so nothing in it shadows another module.


def plugin_path() -> str:
    """The path to pass to ``swift sft --external_plugins``."""
    return os.path.abspath(__file__)


if __name__ != _CANONICAL_NAME and _CANONICAL_NAME not in sys.modules:
    # One module per process, whichever name imported it first.
    sys.modules[_CANONICAL_NAME] = sys.modules[__name__]
try:
    import swift  # noqa: F401
except ImportError:  # imported outside ms-swift (e.g. for plugin_path): nothing to hook
    pass
else:
    install()
