"""Regenerate demo_sft.jsonl: small chat-format SFT data a tiny model can learn in minutes.

    python examples/data/generate_demo_data.py

Each line is {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}: TRL's conversational format,
which datasets' load_dataset("json", ...), TRL's SFTTrainer, twinkle-sft and swift sft all take. The rows are
twinkle_strategy.sources.demo.demo_conversations(), the data the tiny://demo model's tokenizer is trained on.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from twinkle_strategy.sources.demo import demo_conversations, write_demo_dataset  # noqa: E402


def main():
    out = write_demo_dataset(os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_sft.jsonl"))
    print(f"wrote {len(demo_conversations())} examples to {out}")


if __name__ == "__main__":
    main()
