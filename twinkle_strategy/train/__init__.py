"""The fine-tuning application built on the strategy library: recipes, the trainer, the CLI.

The library (``twinkle_strategy`` outside this package) never imports from here; a test checks it.

recipe.py       the typed YAML recipe (omegaconf structured config) and its overrides
cli.py          ``twinkle-sft``: recipes or swift-style flags, checks before launch, the torchrun re-launch
launcher.py     torchrun commands, free ports, per-node logging of the launched processes
preflight.py    dataset, model and output checks run on the launching machine
run.py          one rank's job: recipe -> model, data, strategy, Trainer
trainer.py      the training loop, logging.jsonl, checkpoints, resume
data.py         JSONL chat/query-response datasets, tokenisation, distributed sampling
rank_logs.py    per-rank log files and the failure summary
demo_model.py   the embedded demo model (``tiny://demo``): a tiny Qwen3-MoE and a tokenizer trained on the data
"""
