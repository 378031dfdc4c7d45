"""``TrainState``: where a training run stands, saved in every checkpoint's ``trainer_state.json``.

Steps are integers here; the ``"global_step/max_steps"`` string exists only in log entries.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class TrainState:
    max_steps: int
    steps_per_epoch: int
    global_batch: int  # samples per optimizer step: per-device batch x data-parallel ranks x accumulation steps
    start_step: int = 0  # the step this attempt started from: 0, or the step of the checkpoint it resumed
    global_step: int = 0  # optimizer steps done
    log_history: list[dict] = dataclasses.field(default_factory=list)  # logging.jsonl's entries
    logged_steps: list[int] = dataclasses.field(default_factory=list)  # the global step of each entry
    # (step, [layers][experts] global token counts) of each window this attempt logged: the expert-load plot
    expert_load_history: list[tuple[int, list]] = dataclasses.field(default_factory=list)

    @property
    def epoch(self) -> float:
        return self.global_step / self.steps_per_epoch

    def log(self, step: int, entry: dict) -> None:
        self.logged_steps.append(step)
        self.log_history.append(entry)

    def saved_at(self, step: int) -> dict:
        """What a checkpoint of step ``step`` records of this state."""
        return {"global_step": step, "max_steps": self.max_steps, "log_history": self.log_history,
                "log_steps": self.logged_steps}

    def resume(self, saved: dict) -> None:
        """Continue from a checkpoint's trainer state (the dict :meth:`saved_at` wrote)."""
        self.start_step = self.global_step = saved["global_step"]
        self.log_history = saved.get("log_history", [])
        # Checkpoints written before "log_steps" existed: the steps from their own log entries.
        self.logged_steps = saved.get("log_steps") or [int(e["global_step/max_steps"].split("/")[0])
                                                       for e in self.log_history]
