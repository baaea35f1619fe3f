"""The transcripts `marsi report` inlines: which records fit its bound, and each record in the episode browser's
shape, or skipped and counted when it is not one.

A run's transcripts.jsonl can grow to `train.transcripts_max_mb` (200 MB by default) and a page that inlines it
whole takes a browser about a minute to open. So the report inlines at most `max_mb` of records over all its runs:
each transcript file (training, evaluation, per run) gets an equal share, a file smaller than its share leaves the
rest to the others, and within a file half its share goes to the most recent records and half to a spread over
the older ones (every k-th). The others are counted on the page. Files are read twice, line by line: once to
measure and check every record, once to load the chosen ones, so a large file is never held whole.

A record the browser cannot show (not JSON, no integer `step`, turns or actions that are not lists, an action
without text fields, a reward that is not a number, or a list of them for a role's attempts) is skipped and
counted, with its file and line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.checkpoint_files import EVAL_TRANSCRIPTS, TRANSCRIPTS
from orchestrator.runfiles import open_inside

MAX_MB = 20.0
"""Default bound of the episodes a report inlines, in MB of JSON over all its runs."""


@dataclass
class Inlined:
    """What a report inlines of its runs' transcripts, and what it left out."""

    episodes: list[dict[str, Any]] = field(default_factory=list)
    """The chosen records in the episode browser's shape, in file order."""
    total: int = 0
    """Well-formed records in the files."""
    skipped: list[str] = field(default_factory=list)
    """`FILE:LINE` of each malformed record."""


@dataclass
class _Line:
    offset: int
    size: int
    step: int


def inlined(runs: dict[str, Path], max_mb: float = MAX_MB) -> Inlined:
    """The episodes of `runs` (name -> run directory) to inline, within `max_mb`. Only regular files inside a run
    directory are read (`runfiles.open_inside`): a transcript file that is a link is passed over."""
    out = Inlined()
    files = [(run, kind, run_dir, name) for run, run_dir in runs.items()
             for kind, name in (("train", TRANSCRIPTS), ("eval", EVAL_TRANSCRIPTS))]
    lines = {(d, n): found for _, _, d, n in files if (found := _measure(d, n, out)) is not None}
    files = [f for f in files if (f[2], f[3]) in lines]
    out.total = sum(len(found) for found in lines.values())
    budget, left = max_mb * 1e6, len(files)
    chosen: dict[tuple[Path, str], set[int]] = {}
    for _, _, d, n in sorted(files, key=lambda f: sum(line.size for line in lines[f[2], f[3]])):  # smallest first
        share = budget / left
        chosen[d, n] = _choose(lines[d, n], share)
        budget -= sum(lines[d, n][i].size for i in chosen[d, n])
        left -= 1
    for run, kind, d, n in files:
        with open_inside(d, n) as f:
            for i in sorted(chosen[d, n]) if f is not None else ():  # None: replaced by a link since it was measured
                f.seek(lines[d, n][i].offset)
                out.episodes.append(browsable(run, kind, json.loads(f.read(lines[d, n][i].size))))
    return out


def _measure(run_dir: Path, name: str, out: Inlined) -> list[_Line] | None:
    """Each well-formed record's place, size and step; a malformed one is counted in `out.skipped`. None where the
    file is not a regular file inside `run_dir`."""
    found, offset = [], 0
    with open_inside(run_dir, name) as f:
        if f is None:
            return None
        path = run_dir / name
        for number, raw in enumerate(f, 1):
            size, start = len(raw), offset
            offset += size
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                record = None
            if not raw.endswith(b"\n") or browsable("", "", record) is None:
                out.skipped.append(f"{path}:{number}")
                continue
            found.append(_Line(start, size, record["step"]))
    return found


def _choose(lines: list[_Line], share: float) -> set[int]:
    """Indices of `lines` within `share` bytes: all if they fit, else the most recent with half of it and every
    k-th of the older ones with the rest."""
    if sum(line.size for line in lines) <= share:
        return set(range(len(lines)))
    chosen, used = set(), 0
    for i in reversed(range(len(lines))):  # the most recent, newest first
        if used + lines[i].size > share / 2:
            break
        chosen.add(i)
        used += lines[i].size
    older = [i for i in range(len(lines)) if i not in chosen]
    stride = max(1, math.ceil(sum(lines[i].size for i in older) / max(1.0, share - used)))
    for i in older[::stride]:
        if used + lines[i].size <= share:
            chosen.add(i)
            used += lines[i].size
    return chosen


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _reward(value: Any) -> bool:
    """Shared, per role, or per attempt of an attempts role (a list)."""
    each = lambda v: _number(v) or (isinstance(v, list) and bool(v) and all(_number(x) for x in v))  # noqa: E731
    return _number(value) or (isinstance(value, dict) and all(each(v) for v in value.values()))


def _mean(value: Any) -> float:
    return sum(value) / len(value) if isinstance(value, list) else float(value)


def _prompt(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value))


def _turn(turn: Any) -> bool:
    if not isinstance(turn, dict) or not isinstance(turn.get("actions"), list) or not _reward(turn.get("reward", 0.0)):
        return False
    if not isinstance(turn.get("infos", {}), dict) or not all(isinstance(i, dict) for i in turn.get("infos", {}).values()):
        return False
    return all(isinstance(a, dict) and isinstance(a.get("role"), str) and isinstance(a.get("agent"), str)
               and isinstance(a.get("completion"), str) and _prompt(a.get("prompt"))
               and (a.get("advantage") is None or _number(a["advantage"]))
               and (a.get("policy_version") is None or isinstance(a["policy_version"], int))
               and (a.get("attempt") is None or (isinstance(a["attempt"], int) and a["attempt"] >= 0))
               for a in turn["actions"])


def browsable(run: str, kind: str, record: Any) -> dict[str, Any] | None:
    """`record` (a transcripts.jsonl line) as the episode browser reads it, or None if it cannot be one."""
    if not isinstance(record, dict) or not isinstance(record.get("step"), int) or not _reward(record.get("reward")):
        return None
    turns, info = record.get("turns", []), record.get("info", {})
    if not isinstance(turns, list) or not all(_turn(t) for t in turns):
        return None
    if not isinstance(info, dict) or not all(_number(v) or isinstance(v, (str, bool)) for v in info.values()):
        return None
    reward = record["reward"]
    shared = sum(map(_mean, reward.values())) / max(1, len(reward)) if isinstance(reward, dict) else float(reward)
    return {"run": run, "kind": kind, "step": record["step"], "episode": record.get("episode"),
            "sample": record.get("sample"), "setting": str(record.get("setting", "")), "reward": shared,
            "rewards": reward, "info": info,
            "turns": [{"reward": t.get("reward", 0.0), "infos": t.get("infos", {}), "actions": t["actions"]}
                      for t in turns],
            "ended": "terminated" if record.get("terminated") else "truncated"}
