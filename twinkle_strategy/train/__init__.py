"""The fine-tuning application built on the strategy library: recipes, the trainer, the CLI.

The library (``twinkle_strategy`` outside this package) never imports from here; a test checks it.

recipe.py       the typed YAML recipe (omegaconf structured config) and its overrides
cli.py          ``twinkle-sft``: checks before launch, the torchrun re-launch, one rank's entry point
flags.py        twinkle-sft's command line: swift-style flags and key=value overrides read into a Recipe
launcher.py     the launched torchrun agents: simulated nodes, per-node logging of the launched processes
torchrun.py     one node's torchrun command line, and the program each rank of twinkle-sft runs
ports.py        master ports: picked free, picked again when another process takes one first (EADDRINUSE)
errors.py       the application's own errors: recipe, dataset, preflight, a stopped run
preflight.py    dataset, model and output checks run on the launching machine
fit_check.py    the memory plan before launch (twinkle-sft plan, launch.device_memory / --skip_plan)
run.py          one rank's job: recipe -> model, data, strategy, Trainer
trainer.py      the training loop: set-up, steps (through the library's step core, twinkle_strategy.step), saves
                (through checkpoint.manager), resume
log_lines.py    the log line after each logging window (logging.jsonl and the console, swift's field names)
start_time.py   the start line: twinkle-sft to the first step, with its parts (plan, launch, imports, init, data...)
arguments.py    TrainingArguments
state.py        TrainState: where the run stands (integer steps, log history), saved in every checkpoint
run_dir.py      the run directory: v{N}-{time}, the one a torchrun restart continues, args.json, logging.jsonl
preemption.py   SIGTERM: a checkpoint at the next step boundary, then exit
data.py         JSONL chat/query-response datasets, tokenisation, the rows of each step (StepSampler)
rank_logs.py    per-rank log files and the failure summary
demo_model.py   twinkle-sft's ``tiny://NAME``: the tiny Qwen3-MoE (sources/tiny.py), its tokenizer trained on the data
versions.py     the installed torch/transformers/peft against the declared ranges and the tested versions
packing.py      packed and padding-free batches: packs, their collator, the refusal in the recipe's words
metrics.py      logging.jsonl's MoE and throughput fields
plots.py        images/: the loss curve and the expert-load heatmap
swift_flags.py  every flag of swift sft 4.6: taken with swift's meaning, or refused with the reason
"""
