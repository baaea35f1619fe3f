"""Data helpers the example environments share: a fixed held-out split, and the arithmetic questions two of them
ask. Plain Python (no `datasets`): each example's `make_dataset` turns the rows into its dataset."""

from __future__ import annotations

import hashlib
import random

SPLITS = ("train", "eval")


def in_split(key: str, split: str) -> bool:
    """Whether a sample keyed `key` belongs to `split`: a fixed hash partition, one in five held out for "eval"."""
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    return (int(hashlib.sha256(key.encode()).hexdigest(), 16) % 5 == 0) == (split == "eval")


def arithmetic_rows(n: int = 256, seed: int = 0, max_operand: int = 9, ops: str = "+*",
                    split: str = "train") -> list[dict]:
    """`n` questions "What is a <op> b?" with 1 <= a, b <= max_operand, drawn with a fixed seed, each with its
    `answer`. `split`: "train" or "eval", a fixed partition of the possible questions (`in_split`: about one in
    five is held out for evaluation), so no evaluation sample is a training one."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        a, b, op = rng.randint(1, max_operand), rng.randint(1, max_operand), rng.choice(ops)
        if in_split(f"{a}{op}{b}", split):
            answer = {"+": a + b, "-": a - b, "*": a * b}[op]
            rows.append({"question": f"What is {a} {op} {b}?", "answer": answer})
    return rows
