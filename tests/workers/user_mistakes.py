"""A user's GRPO script under a plain torchrun, with one of issue 47's six usual mistakes in it.

No try/except anywhere, unlike the other workers: what the test (tests/multiproc/test_fatal_errors.py) checks is
what each rank prints when the mistake's exception leaves the script, as it does in a user's script. The mistake
is ``--mistake``, or, when empty, the one whose index is torchrun's restart count (``TORCHELASTIC_RESTART_COUNT``):
one torchrun launch with ``--max-restarts 5`` then makes all six, one per round, each round a fresh set of
processes as a user's next try would be.
"""

import argparse
import os
import warnings

import torch

MISTAKES = (
    "routing_replay_value",  # routing_replay="R3x": a package option with a value it does not have
    "misspelt_keyword",  # routing_reply="r3": a misspelt keyword of the package's API
    "ep_size_too_large",  # ep_size=4 on 2 ranks
    "reward_signature",  # a reward function that does not take TRL's keywords: TypeError in TRL's call
    "trl_refusal",  # num_generations that does not divide the generation batch: TRL's own ValueError
    "user_name_error",  # a NameError in the user's own code (the docs' weight-export snippet once had one)
)


def arithmetic_prompts() -> list[dict]:
    from twinkle_strategy.sources.demo import demo_conversations

    rows = {}
    for row in demo_conversations():
        question, answer = (m["content"] for m in row["messages"])
        if question.startswith("What is "):
            rows[question] = {"prompt": [{"role": "user", "content": question}], "answer": answer.split()[-1]}
    return list(rows.values())


def correct_answer(completions, answer, **_) -> list[float]:
    return [float(expected in str(completion)) for completion, expected in zip(completions, answer, strict=True)]


def reward_of_one_completion(completion) -> float:  # the mistake: TRL calls it with lists, by keyword
    return float("7" in str(completion))


def main() -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.integrations.transformers import with_strategy

    p = argparse.ArgumentParser()
    p.add_argument("--mistake", choices=MISTAKES, default=None)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    mistake = a.mistake or MISTAKES[int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))]
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()  # a quiet script: what each rank prints is the mistake's
    # TRL's configs default to gradient_checkpointing=True and TRL's generation turns it off and on by transformers'
    # old names, which transformers >= 5.2x warns of (tests/unit/test_future_warnings.py): TRL's, not the mistake's.
    warnings.filterwarnings("ignore", message="`(is_)?gradient_checkpointing(_enable|_disable)?` is deprecated",
                            category=FutureWarning)

    strategy = NativeFSDPStrategy(ep_size=4 if mistake == "ep_size_too_large" else 2, mixed_precision="no",
                                  device_type="cpu")
    model = strategy.from_pretrained("tiny://demo", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(strategy.resolved_model_path("tiny://demo"))
    config = GRPOConfig(output_dir=os.path.join(a.out, mistake), max_steps=1, per_device_train_batch_size=2,
                        num_generations=3 if mistake == "trl_refusal" else 4, max_completion_length=4,
                        logging_steps=1, save_strategy="no", report_to=[], bf16=False, use_cpu=True,
                        disable_tqdm=True, seed=0)
    if mistake == "user_name_error":
        print(f"training on {len(prompts)} prompts")  # noqa: F821 - the mistake: a name the script never defined
    options = {"routing_reply": "r3"} if mistake == "misspelt_keyword" else {
        "routing_replay": "R3x" if mistake == "routing_replay_value" else "r3"}
    trainer = with_strategy(GRPOTrainer)(
        model=model, args=config, processing_class=tokenizer, train_dataset=Dataset.from_list(arithmetic_prompts()),
        reward_funcs=reward_of_one_completion if mistake == "reward_signature" else correct_answer,
        strategy=strategy, **options)
    trainer.train()


if __name__ == "__main__":
    main()
