"""Alternating RSI: a proposer writes an arithmetic problem with its answer, a solver solves it, and
optionally a verifier judges the proposer's answer. Agents swap roles from episode to episode.

Turn 1: the proposer is asked for a problem that uses the sample's number, in the format

    Problem: 7 * 3 - 2
    Answer: 19

(`Problem: 7 * 3 - 2 = 19` on one line is accepted too). The problem is checked by a tiny parser of
whole numbers, + - * and parentheses, never by eval. Turn 2: the solver gets the problem and answers;
with `verifier=True` the verifier, in the same turn, sees the problem and the proposed answer and says
whether it is correct (yes / no).

The problem is valid when it parses, its stated answer is right, it uses the sample's number, and it
is not trivial (at least two numbers > 1). The shared team reward is split evenly between the acting
roles: with two roles, 0.5 on turn 1 for a valid problem and 0.5 on turn 2 when the problem is valid
and the solver's answer (the last integer of its reply) is right; with the verifier, thirds, the
verifier's third paid when its verdict matches the truth. A problem that does not parse ends the
episode after turn 1 with reward 0 (infos say why).

episode_info: `valid_problem`, `solver_correct` (against the true value; 0 when there was nothing to
solve), `parsed` (the problem was an expression), and with the verifier `verifier_correct`.
"""

from __future__ import annotations

import hashlib
import random
import re

import datasets

from protocols.env import Environment, StepResult

_INT = re.compile(r"-?[0-9]+")
_TOKEN = re.compile(r"\s*(?:([0-9]+)|(.))")
MAX_NUMBERS, MAX_DIGITS, MAX_CHARS = 8, 6, 120


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


def parse_proposal(text: str) -> tuple[str, int | None]:
    """(expression, stated answer or None) from the proposer's reply; ParseError when there is no problem."""
    match = re.search(r"problem\s*:\s*(.*)", text, re.IGNORECASE)
    if not match:
        raise ParseError("no 'Problem:' line")
    line = match.group(1).strip()
    expression, equals, rest = line.partition("=")
    expression = re.sub(r"^(what is|compute|calculate)\s+", "", expression.strip(), flags=re.IGNORECASE)
    expression = re.sub(r"(?<=[0-9)])\s*[xX×]\s*(?=[0-9(])", " * ", expression.rstrip(" ?."))
    stated = re.search(r"answer\s*:\s*(-?[0-9]{1,12})\b", text, re.IGNORECASE)
    if stated is None and equals:
        stated = re.match(r"\s*(-?[0-9]{1,12})\b", rest)
    evaluate(expression)  # raises ParseError
    return expression, int(stated.group(1)) if stated else None


class RSIEnv(Environment):
    max_turns = 2

    def __init__(self, verifier: bool = False):
        self.verifier = verifier
        self.possible_agents = ["proposer", "solver"] + (["verifier"] if verifier else [])
        self.share = 1.0 / len(self.possible_agents)

    def reset(self, sample, seed=None):
        self.number, self.a, self.b = int(sample["number"]), int(sample["a"]), int(sample["b"])
        self.turn, self.value, self.stated = 0, None, None
        self.parsed = self.valid = self.solved = self.judged = False
        n = self.number
        return {"proposer": (f"Write a short arithmetic problem that uses the number {n}, for example "
                             f"{n} + {self.a} or {self.b} * {n} - 1, with only whole numbers and + - *. "
                             f"Give it with its answer, in this format:\nProblem: ...\nAnswer: ...")}

    def step(self, actions):
        self.turn += 1
        if self.turn == 1:
            return self._proposal(actions.get("proposer", ""))
        infos, reward = {}, 0.0
        solution = _INT.findall(actions.get("solver", ""))
        if not solution:
            infos["solver"] = {"invalid": True, "reason": "no integer in the answer"}
        self.solved = bool(solution) and len(solution[-1]) <= 12 and int(solution[-1]) == self.value
        reward += self.share * (self.valid and self.solved)
        if "verifier" in actions:
            verdict = re.search(r"\b(yes|no)\b", actions["verifier"], re.IGNORECASE)
            if verdict is None:
                infos["verifier"] = {"invalid": True, "reason": "no yes/no verdict"}
            else:
                self.judged = (verdict.group(1).lower() == "yes") == (self.stated == self.value)
                reward += self.share * self.judged
        return StepResult(prompts={}, reward=reward, terminated=True, infos=infos)

    def episode_info(self):
        info = {"parsed": float(self.parsed), "valid_problem": float(self.valid), "solver_correct": float(self.solved)}
        if self.verifier:
            info["verifier_correct"] = float(self.judged)
        return info

    def _proposal(self, text: str) -> StepResult:
        try:
            expression, self.stated = parse_proposal(text)
            self.value, numbers = evaluate(expression)
        except ParseError as exc:
            return StepResult(prompts={}, reward=0.0, terminated=True,
                              infos={"proposer": {"invalid": True, "reason": f"problem does not parse: {exc}"}})
        self.parsed = True
        reasons = []
        if self.stated is None:
            reasons.append("no 'Answer: <integer>'")
        elif self.stated != self.value:
            reasons.append(f"stated answer {self.stated} but the value is {self.value}")
        if self.number not in numbers:
            reasons.append(f"does not use the number {self.number}")
        if sum(abs(x) > 1 for x in numbers) < 2:
            reasons.append("trivial: fewer than two numbers > 1")
        self.valid = not reasons
        infos = {"proposer": {"valid": self.valid, "reasons": reasons}}
        prompts = {"solver": f"Solve: {expression}\nReply with just the number."}
        if self.verifier and self.stated is not None:
            prompts["verifier"] = (f"A student was given this problem and a proposed answer.\nProblem: {expression}\n"
                                   f"Proposed answer: {self.stated}\nIs the proposed answer correct? Reply yes or no.")
        return StepResult(prompts=prompts, reward=self.share * self.valid, infos=infos)


def make_dataset(n: int = 128, seed: int = 0, low: int = 2, high: int = 20, split: str = "train") -> datasets.Dataset:
    """`n` samples: the number the problem must use, and two small numbers for the prompt's examples. `split`: "train" or "eval", a fixed partition of the
    possible samples (about one in five is held out for evaluation), so no evaluation sample is a training one."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        row = {"number": rng.randint(low, high), "a": rng.randint(2, 9), "b": rng.randint(2, 5)}
        if in_split(f"{row['number']}/{row['a']}/{row['b']}", split):
            rows.append(row)
    return datasets.Dataset.from_list(rows)


def in_split(key: str, split: str) -> bool:
    """Whether a sample keyed `key` belongs to `split`: a fixed hash partition, one in five held out for "eval"."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    return (int(hashlib.sha256(key.encode()).hexdigest(), 16) % 5 == 0) == (split == "eval")


def sample_action(role: str, prompt, rng: random.Random) -> str:
    """Well-formed random actions: a problem using the prompt's number (answer right 3 times in 4), a
    number for the solver, yes / no for the verifier."""
    if role == "proposer":
        match = re.search(r"uses the number (-?[0-9]+)", prompt)
        n, k = int(match.group(1)) if match else 7, rng.randint(2, 9)
        op = rng.choice("+-*")
        value = {"+": n + k, "-": n - k, "*": n * k}[op] + (rng.random() < 0.25)
        return rng.choice([f"Problem: {n} {op} {k}\nAnswer: {value}", f"Problem: {n} {op} {k} = {value}"])
    if role == "verifier":
        return rng.choice(["yes", "no", "Yes, it is correct.", "No."])
    return str(rng.randint(0, 100))
