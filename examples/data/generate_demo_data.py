"""Regenerate demo_sft.jsonl: small chat-format SFT data a tiny model can learn in minutes.

    python examples/data/generate_demo_data.py

Each line is {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]};
a few use the alternative {"query": ..., "response": ...} form, which the
loader accepts too.
"""

import json
import os
import random

COLORS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "sun": "yellow", "blood": "red"}
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Egypt": "Cairo",
            "Peru": "Lima", "Kenya": "Nairobi", "Chile": "Santiago"}
WORDS = ["cat", "dog", "tree", "moon", "river", "stone", "bird", "fish"]


def examples(rng: random.Random):
    for _ in range(120):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        yield f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    for thing, color in COLORS.items():
        for _ in range(4):
            yield f"What color is the {thing}?", f"The {thing} is {color}."
    for country, city in CAPITALS.items():
        for _ in range(4):
            yield f"What is the capital of {country}?", f"The capital of {country} is {city}."
    for _ in range(60):
        word = rng.choice(WORDS)
        yield f"Spell the word {word}.", " ".join(word.upper()) + "."


def main():
    rng = random.Random(0)
    rows = list(examples(rng))
    rng.shuffle(rows)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_sft.jsonl")
    with open(out, "w") as f:
        for i, (q, a) in enumerate(rows):
            if i % 10 == 0:
                row = {"query": q, "response": a}
            else:
                row = {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} examples to {out}")


if __name__ == "__main__":
    main()
