"""Self-play curriculum (Absolute Zero / R-Zero style): a proposer writes an arithmetic problem, the environment
computes its answer itself, a solver tries it k times; no labelled training data anywhere.

Turn 1: the proposer gets a prompt built from a seed sample (two example numbers and an operator: only a hint) and
answers with one line `Problem: <expression>`. The expression is checked by a tiny parser of whole numbers, + - *
and parentheses, never by eval. It is valid when it parses, has at least one operator, at most `max_operators` of
them and no number above `max_number` (the size cap: a longer or larger problem earns nothing, so complexity cannot
be farmed). Turn 2: the solver is asked to compute the expression and reply `Answer: <number>`; it answers
`attempts["solver"]` times (default 4, `roles.attempts` changes it). An attempt's answer is the integer of its
`Answer:` line, else its last integer; it is right when that is the value.

Rewards. Solver: 1 per right attempt, else 0. Proposer, at turn 2 from the solver's success rate p over its k
attempts: `reward="absolute_zero"` 1 - p when 0 < p < 1, else 0 (learnability); `"r_zero"` min(p, 1 - p);
`"cooperative"` 0.5 + 0.5 p (paid for a valid problem and for the solver's success). An invalid problem ends the
episode at turn 1 with -`invalid_penalty` for the proposer; a problem written more than once in the batch (the
same expression, spaces aside) has `duplicate_penalty` taken off each copy. The batch is what one call of the
rollout loop plays, and its environments share `self.batch` (`protocols.env.Environment.batch`): every episode's
turn 1 is stepped before any episode's turn 2, so the proposals of a batch are all counted there when the first
solver turn is scored. Outside a rollout (`batch` None) an episode is a batch of its own.

`proposer="fixed"`: no proposer role; the environment writes each problem itself with `random_problem` from the
episode's seed (the hand-written generator baseline).

Held-out samples (`make_dataset(split="eval")` / `"ood"`) carry their own problem and answer: the solver alone
answers, reward the share of right attempts (the proposer never acts), so `reward/mean` is held-out accuracy.
`split="eval"`: 210 problems from `random_problem` under the seed `HELD_OUT_SEED`, which training never uses, in
three levels of 70 (1: one operator, numbers up to 10; 2: one operator, up to 20; 3: two operators, up to 10).
`split="ood"`: 80 problems outside the training cap (40 of one operator with numbers 21-99, 40 of three operators
up to 10).

episode_info. Training: `valid_problem` (1 or 0), and for a valid problem `solver_success` (p), `problem_size`
(operators), `distinct` (1 / copies of the problem in the batch: its mean over episodes is distinct valid problems
per episode), `learnability`; for every episode with solver attempts `format_valid` (share of attempts with an
`Answer: N` line) and `strict_correct` (share right with that line). Held out: `accuracy`, `format_valid`,
`strict_correct`, and `accuracy_levelN` on the problems of level N (1-3; OOD: 4 larger
numbers, 5 three operators).
"""

from __future__ import annotations

import random
import re

import datasets

from protocols.env import Environment, StepResult

_INT = re.compile(r"-?[0-9]+")
_TOKEN = re.compile(r"\s*(?:([0-9]+)|(.))")
_ANSWER = re.compile(r"answer\s*:\s*(-?[0-9]{1,12})\b", re.IGNORECASE)
MAX_NUMBERS, MAX_DIGITS, MAX_CHARS = 8, 6, 120
HELD_OUT_SEED = 20261205
"""The seed of the held-out problems; training draws from per-episode seeds and never from this one."""
REWARDS = ("absolute_zero", "r_zero", "cooperative")


class ParseError(ValueError):
    pass


def evaluate(expression: str) -> tuple[int, list[int]]:
    """Value and numbers of an expression of whole numbers, + - * and parentheses. Never calls eval.

    Grammar: expr := term (('+' | '-') term)*; term := factor ('*' factor)*;
    factor := '-' factor | NUMBER | '(' expr ')'. Raises ParseError on anything else or when too large."""
    if len(expression) > MAX_CHARS:
        raise ParseError(f"longer than {MAX_CHARS} characters")
    tokens = []
    for number, symbol in _TOKEN.findall(expression):
        if number:
            if len(number) > MAX_DIGITS:
                raise ParseError(f"number {number[:12]} has more than {MAX_DIGITS} digits")
            tokens.append(int(number))
        elif symbol.strip():
            if symbol not in "+-*()":
                raise ParseError(f"unexpected character {symbol!r}")
            tokens.append(symbol)
    numbers = [t for t in tokens if isinstance(t, int)]
    if not numbers:
        raise ParseError("no number")
    if len(numbers) > MAX_NUMBERS:
        raise ParseError(f"more than {MAX_NUMBERS} numbers")
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def take():
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def expr(depth):
        value = term(depth)
        while peek() in ("+", "-"):
            value = value + term(depth) if take() == "+" else value - term(depth)
        return value

    def term(depth):
        value = factor(depth)
        while peek() == "*":
            take()
            value *= factor(depth)
        return value

    def factor(depth):
        if depth > 8:
            raise ParseError("nested too deeply")
        token = take() if peek() is not None else None
        if isinstance(token, int):
            return token
        if token == "-":
            return -factor(depth + 1)
        if token == "(":
            value = expr(depth + 1)
            if peek() != ")":
                raise ParseError("unbalanced parenthesis")
            take()
            return value
        raise ParseError("expected a number" if token is None else f"unexpected {token!r}")

    value = expr(0)
    if pos != len(tokens):
        raise ParseError(f"unexpected {tokens[pos]!r}")
    return value, numbers


def parse_problem(text: str) -> str:
    """The expression of the proposer's `Problem: ...` line (a trailing `= ...` or `?` dropped); ParseError when
    there is none or it does not parse."""
    match = re.search(r"problem\s*:\s*(.*)", text, re.IGNORECASE)
    if not match:
        raise ParseError("no 'Problem:' line")
    expression = match.group(1).strip().partition("=")[0]
    expression = re.sub(r"^(what is|compute|calculate)\s+", "", expression.strip(), flags=re.IGNORECASE)
    expression = re.sub(r"(?<=[0-9)])\s*[xX×]\s*(?=[0-9(])", " * ", expression.rstrip(" ?."))
    evaluate(expression)  # raises ParseError
    return expression


def operators(expression: str) -> int:
    """How many binary + - * an expression has (a leading or nested minus sign is not one)."""
    return len(re.findall(r"(?<=[0-9)])\s*[-+*]", expression))


def random_problem(rng: random.Random, n_operators: int, low: int, high: int) -> str:
    """A problem of `n_operators` operators (+ - * drawn evenly) on numbers drawn evenly from low..high."""
    parts = [str(rng.randint(low, high))]
    for _ in range(n_operators):
        parts += [rng.choice("+-*"), str(rng.randint(low, high))]
    return " ".join(parts)


def solver_prompt(expression: str) -> str:
    return f"Compute {expression}. Give the result as a single integer on one line, in the form Answer: <number>"


def grade(texts: list[str], value: int) -> tuple[list[float], list[float], list[float]]:
    """Per attempt: right (its answer is the value: the integer of its `Answer: N` line, else its last integer),
    format valid (it has an `Answer: N` line), strict (format valid and right)."""
    right, formatted, strict = [], [], []
    for text in texts:
        line, numbers = _ANSWER.search(text), _INT.findall(text)
        answer = line.group(1) if line else numbers[-1] if numbers else None
        right.append(float(answer is not None and len(answer) <= 12 and int(answer) == value))
        formatted.append(float(line is not None))
        strict.append(right[-1] * formatted[-1])
    return right, formatted, strict


class RSIEnv(Environment):
    max_turns = 2
    attempts = {"solver": 4}

    def __init__(self, reward: str = "absolute_zero", invalid_penalty: float = 0.5, duplicate_penalty: float = 0.5,
                 max_operators: int = 2, max_number: int = 20, proposer: str = "model"):
        if reward not in REWARDS:
            raise ValueError(f"environment.kwargs.reward: {reward!r}; give one of {', '.join(REWARDS)}")
        if proposer not in ("model", "fixed"):
            raise ValueError(f"environment.kwargs.proposer: {proposer!r}; give model or fixed")
        self.reward, self.invalid_penalty, self.duplicate_penalty = reward, invalid_penalty, duplicate_penalty
        self.max_operators, self.max_number, self.fixed = max_operators, max_number, proposer == "fixed"
        self.possible_agents = ["solver"] if self.fixed else ["proposer", "solver"]

    def reset(self, sample, seed=None):
        self.info: dict[str, float] = {}
        # the batch's valid problems (spaces removed) -> how many of its episodes proposed each
        self.proposals: dict[str, int] = (self.batch if self.batch is not None else {}).setdefault("proposals", {})
        self.held_out = "problem" in sample
        if self.held_out:
            self.expression, self.value, self.level = sample["problem"], int(sample["answer"]), int(sample["level"])
            return {"solver": solver_prompt(self.expression)}
        if self.fixed:
            rng = random.Random(seed)
            self.expression = random_problem(rng, rng.randint(1, self.max_operators), 1, self.max_number)
            return self._accept()
        a, b, op = int(sample["a"]), int(sample["b"]), sample["op"]
        return {"proposer": (f"Example:\nProblem: {a} {op} {b}\n\nWrite a different problem in the same format, with "
                             f"whole numbers up to {self.max_number} and at most {self.max_operators} of + - *. "
                             f"Reply with only the line Problem: ...")}

    def step(self, actions):
        if "proposer" in actions:
            return self._proposal(actions["proposer"])
        right, formatted, strict = grade(actions["solver"], self.value)
        p = sum(right) / len(right)
        self.info.update(format_valid=sum(formatted) / len(right), strict_correct=sum(strict) / len(right))
        infos = {"solver": {"attempts": [{"success": r} if a.strip() else {"invalid": True, "reason": "empty answer",
                                                                           "success": 0.0}
                                         for r, a in zip(right, actions["solver"])]}}
        if self.held_out:
            self.info.update(accuracy=p, **{f"accuracy_level{self.level}": p})
            return StepResult(prompts={}, reward=p, terminated=True, infos=infos)
        self.info["solver_success"] = p
        if self.fixed:
            return StepResult(prompts={}, reward={"solver": right}, terminated=True, infos=infos)
        copies = self.proposals.get(self.key, 1)
        self.info.update(distinct=1.0 / copies, learnability=1.0 - p if 0 < p < 1 else 0.0)
        paid = {"absolute_zero": self.info["learnability"], "r_zero": min(p, 1.0 - p), "cooperative": 0.5 + 0.5 * p}
        proposer = paid[self.reward] - self.duplicate_penalty * (copies > 1)
        return StepResult(prompts={}, reward={"proposer": proposer, "solver": right}, terminated=True, infos=infos)

    def episode_info(self):
        return dict(self.info)

    def _proposal(self, text: str) -> StepResult:
        self.info["valid_problem"] = 0.0
        try:
            self.expression = parse_problem(text)
            self.value, numbers = evaluate(self.expression)
        except ParseError as exc:
            return self._invalid(f"problem does not parse: {exc}")
        size = operators(self.expression)
        if size == 0:
            return self._invalid("no operator: a bare number is not a problem")
        if size > self.max_operators:
            return self._invalid(f"{size} operators; at most {self.max_operators}")
        if max(abs(n) for n in numbers) > self.max_number:
            return self._invalid(f"a number above {self.max_number}")
        self.info.update(valid_problem=1.0, problem_size=float(size))
        self.key = re.sub(r"\s+", "", self.expression)
        self.proposals[self.key] = self.proposals.get(self.key, 0) + 1
        return StepResult(prompts=self._accept(), reward={"proposer": 0.0}, infos={"proposer": {"valid": True}})

    def _accept(self) -> dict[str, str]:
        self.value = evaluate(self.expression)[0]
        return {"solver": solver_prompt(self.expression)}

    def _invalid(self, reason: str) -> StepResult:
        return StepResult(prompts={}, reward={"proposer": -self.invalid_penalty}, terminated=True,
                          infos={"proposer": {"invalid": True, "reason": reason}})


def make_dataset(n: int = 256, seed: int = 0, split: str = "train") -> datasets.Dataset:
    """`split="train"`: `n` prompt seeds (two example numbers and an operator for the proposer's prompt; no problem,
    no answer). `"eval"` and `"ood"`: the fixed labelled held-out sets (module docstring), whatever `n` and `seed`."""
    if split == "train":
        rng = random.Random(seed)
        return datasets.Dataset.from_list([{"a": rng.randint(1, 20), "b": rng.randint(1, 20), "op": rng.choice("+-*")}
                                           for _ in range(n)])
    levels = {"eval": [(1, 70, 1, 1, 10), (2, 70, 1, 1, 20), (3, 70, 2, 1, 10)],
              "ood": [(4, 40, 1, 21, 99), (5, 40, 3, 1, 10)]}
    if split not in levels:
        raise ValueError(f"split must be 'train', 'eval' or 'ood', got {split!r}")
    rng, rows = random.Random(HELD_OUT_SEED), []
    for level, count, n_operators, low, high in levels[split]:
        for _ in range(count):
            problem = random_problem(rng, n_operators, low, high)
            rows.append({"problem": problem, "answer": evaluate(problem)[0], "level": level})
    return datasets.Dataset.from_list(rows)


def sample_action(role: str, prompt, rng: random.Random) -> str:
    """Well-formed random actions: a problem within the cap for the proposer (now and then too big), an
    `Answer: N` line for the solver (right now and then)."""
    if role == "proposer":
        return "Problem: " + random_problem(rng, rng.choice([1, 1, 2, 3]), 1, 20)
    match = re.search(r"Compute (.*)\. Give", prompt)
    value = evaluate(match.group(1))[0] if match else 0
    return f"Answer: {value + rng.choice([0, 0, 1, -2])}"
