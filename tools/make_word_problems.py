"""Write a small arithmetic word-problem set as parquet train/test files (no download).

    python tools/make_word_problems.py --out data/word_problems --seed 0
    python -m moerl.launch +recipe=deepseek_moe task=dataset \\
        task.path=data/word_problems task.eval_split=test task.metadata_keys=[difficulty]

`tom has 3 apples and buys 4 more. how many now? ` -> `7`. Every character is in the tiny
models' built-in tokenizer (lowercase letters, digits, `+-*/=()., :?` and space), and every
prompt is at most MAX_PROMPT_CHARS long, so a prompt, its BOS and an 8-token answer fit the
tiny models' seq_length of 64: the set runs on the tiny recipes as well as on real
checkpoints. Columns:

    prompt      the problem text
    messages    the same as one chat user turn (for task.messages_key=messages)
    answer      the integer answer, as text
    difficulty  1 one step (+ or -), 2 one step (* or /), 3 two steps
    kind        the template's name

The files are a function of the seed and the sizes; no problem text is in both splits.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

NAMES = ["tom", "ann", "sam", "mia", "ben", "eva", "leo", "zoe", "max", "ivy"]
THINGS = ["apples", "pens", "cards", "books", "coins", "shells", "stamps", "marbles"]
BOXES = [("box", "boxes"), ("bag", "bags"), ("jar", "jars"), ("crate", "crates")]

MAX_PROMPT_CHARS = 55
Problem = tuple[str, int]
"""(problem text, answer)."""


def buy(rng: np.random.Generator) -> Problem:
    who, what = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.integers(1, 20, size=2)
    return f"{who} has {a} {what} and buys {b} more. how many now? ", a + b


def give(rng: np.random.Generator) -> Problem:
    who, what = rng.choice(NAMES), rng.choice(THINGS)
    a = rng.integers(2, 30)
    b = rng.integers(1, a)
    return f"{who} has {a} {what} and gives {b} away. how many left? ", a - b


def groups(rng: np.random.Generator) -> Problem:
    box, boxes = BOXES[rng.integers(len(BOXES))]
    what = rng.choice(THINGS)
    each, n = rng.integers(2, 10, size=2)
    return f"a {box} holds {each} {what}. how many in {n} {boxes}? ", each * n


def share(rng: np.random.Generator) -> Problem:
    what = rng.choice(THINGS)
    kids, each = rng.integers(2, 10, size=2)
    return f"{kids * each} {what} shared by {kids} kids. how many each? ", each


def buy_then_give(rng: np.random.Generator) -> Problem:
    who, what = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.integers(1, 20, size=2)
    c = rng.integers(1, a + b)
    return f"{who} has {a} {what}, buys {b}, gives {c}. how many now? ", a + b - c


def groups_plus(rng: np.random.Generator) -> Problem:
    _, boxes = BOXES[rng.integers(len(BOXES))]
    what = rng.choice(THINGS)
    n, each = rng.integers(2, 10, size=2)
    loose = rng.integers(1, 10)
    return f"{n} {boxes} of {each} {what} and {loose} more. how many {what}? ", n * each + loose


KINDS: dict[str, tuple[int, Callable[[np.random.Generator], Problem]]] = {
    "buy": (1, buy),
    "give": (1, give),
    "groups": (2, groups),
    "share": (2, share),
    "buy_then_give": (3, buy_then_give),
    "groups_plus": (3, groups_plus),
}


def make_problems(n: int, rng: np.random.Generator, seen: set[str]) -> list[dict[str, Any]]:
    """n problems with texts not in `seen` (which grows), kinds drawn uniformly."""
    kinds = list(KINDS)
    rows: list[dict[str, Any]] = []
    for _ in range(100 * n):
        if len(rows) == n:
            return rows
        kind = kinds[rng.integers(len(kinds))]
        difficulty, make = KINDS[kind]
        text, answer = make(rng)
        assert len(text) <= MAX_PROMPT_CHARS, text
        if text in seen:
            continue
        seen.add(text)
        rows.append(
            {
                "prompt": text,
                "messages": [{"role": "user", "content": text}],
                "answer": str(int(answer)),
                "difficulty": difficulty,
                "kind": kind,
            }
        )
    raise ValueError(f"could not draw {n} distinct problems; ask for fewer")


def write_word_problems(
    out: str | Path, num_train: int = 2000, num_test: int = 200, seed: int = 0
) -> dict[str, Path]:
    """Write OUT/train.parquet and OUT/test.parquet; split name -> file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    files = {}
    for split, n in (("train", num_train), ("test", num_test)):
        files[split] = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(make_problems(n, rng, seen)), files[split])
    return files


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--num-train", type=int, default=2000)
    parser.add_argument("--num-test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for split, path in write_word_problems(
        args.out, args.num_train, args.num_test, args.seed
    ).items():
        print(f"wrote {split} to {path}")


if __name__ == "__main__":
    main()
