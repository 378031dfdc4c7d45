"""A user's HF Trainer script under a plain torchrun, in which one rank's step raises a ModelStructureError.

No try/except around the training, unlike the other workers: what the test checks is what each rank prints
when the error leaves the script, as it does in a user's script. The error is raised by a callback at the start
of step 2 on ``--failing-rank``, so the other ranks are already inside that step's collectives when it ends.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

MESSAGE = "router_aux_loss_coef: injected on one rank by the test"


def main():
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.errors import ModelStructureError
    from twinkle_strategy.integrations.transformers import with_strategy

    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--failing-rank", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()  # a quiet script: what each rank prints is the failure's
    failing = int(os.environ["RANK"]) == a.failing_rank

    class FailAtStep2(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1 and failing:
                raise ModelStructureError(MESSAGE)

    # No EP across the simulated nodes, no init report: nothing printed before the failure either.
    strategy = NativeFSDPStrategy(mixed_precision="no", device_type="cpu")
    model = strategy.from_pretrained(a.model, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(1, model.config.vocab_size, (16, 8), generator=g)]
    args = TrainingArguments(output_dir=a.out, max_steps=4, per_device_train_batch_size=2, save_strategy="no",
                             use_cpu=True, report_to=[], disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = with_strategy(Trainer)(model=model, args=args, train_dataset=rows, strategy=strategy,
                                     callbacks=[FailAtStep2()])
    trainer.train()


if __name__ == "__main__":
    main()
