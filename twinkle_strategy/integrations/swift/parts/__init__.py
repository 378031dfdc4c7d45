"""The ms-swift plugin's parts (``plugin.py`` is the file swift imports; it installs :func:`.hooks.install`).

options.py    the options: every StrategyConfig field as TWINKLE_<NAME> or the --fsdp JSON's "twinkle" object
state.py      this process's PluginState (swift's arguments, the options, the strategy)
fit.py        the memory plan of the launched run against TWINKLE_DEVICE_MEMORY or the GPU, before any weight is read
arguments.py  swift's arguments checked and FSDP hidden from transformers/accelerate (SftArguments._init_deepspeed/_init_fsdp)
loading.py    the model loaded as the strategy loads it (ModelLoader.load): loading.open_on_this_rank / load_pretrained_strict
trainer.py    swift's trainer on the shared transformers layer (TrainerFactory.get_trainer_cls)
sequence.py   --packing/--padding_free (swift's rows, any attention) and --sequence_parallel_size (the strategy's)
hooks.py      swift's tuner then EP + FSDP2 (TunerMixin.prepare_model); installing the hooks

These live one folder below plugin.py: swift puts plugin.py's folder first on sys.path, where modules named
options or loading would shadow others; a folder named ``parts`` is nothing anyone imports by that name.
"""
