"""Whether a change leaves training's numbers as they were: short fixed-seed runs whose metrics.jsonl must
match, line for line and key for key, those of a reference commit (all but timings).

    python benchmarks/same_metrics.py record --commit main --out DIR [--runs demo guess ...]
    python benchmarks/same_metrics.py compare --ref DIR [--commit REF] [--runs demo guess ...]

`record` exports the commit's tree (`git archive`, the working tree is untouched), runs each of the runs
below with that tree's code (`python -m orchestrator.cli run`, a fresh process each, PYTHONPATH its tree)
and keeps each metrics.jsonl as DIR/NAME.jsonl. `compare` runs the same with the current tree and compares
them with DIR's (`--commit`: that commit's tree instead, exported as `record` does, so the working
tree may change meanwhile; two records of one commit check that the runs are deterministic): every
step's line must hold the same keys with the same values, bar keys under `time/`
(and any `--ignore PREFIX`). It prints one line per run and exits 1 if any differs, naming the first
differing step and keys.

The runs (3 steps each, seed 0):

- `demo`: examples/demo/config.yaml, with Ray (each agent a trainer actor).
- `demo_local`: the same with `ray.enabled=false` (the trainers in the coordinator's process) and
  `schedule.period=1`, so that both agents update (alice, bob, alice).
- `demo_ema`: `demo_local` with `algorithm.baseline=ema`.
- `demo_async`: `demo_local` with `train.max_staleness=1` (rollouts a step ahead, truncated importance weights on).
- `demo_critic`: `demo_local` with `algorithm.baseline=critic` (a critic with its default settings).
- `guess`: examples/guess/config.yaml with both agents on `builtin:tiny` instead of SmolLM2-135M-Instruct,
  whose 3 steps take minutes on a 2-core CPU; the environment, prompts, schedule and algorithm are the
  example's.
- `guess_smollm2`: examples/guess/config.yaml on SmolLM2 as it is, but for an evaluation of 4 held-out
  samples and no partner seatings (the full one alone takes many minutes on a CPU); not in the default set.

Metrics are compared exactly (floats as JSON writes them): the runs are deterministic on one machine with a
fixed thread count, so any change of value is a change of behaviour, or of float order in a reduction.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["train.steps=3", "train.seed=0", "train.progress=false", "train.checkpoint_every=50"]
TINY = ["agents.alice.model=builtin:tiny", "agents.bob.model=builtin:tiny"]
RUNS = {
    "demo": ("examples/demo/config.yaml", COMMON),
    "demo_local": ("examples/demo/config.yaml", [*COMMON, "ray.enabled=false", "schedule.period=1"]),
    "demo_ema": ("examples/demo/config.yaml", [*COMMON, "ray.enabled=false", "schedule.period=1",
                                               "algorithm.baseline=ema"]),
    "demo_async": ("examples/demo/config.yaml", [*COMMON, "ray.enabled=false", "schedule.period=1",
                                                 "train.max_staleness=1"]),
    "demo_critic": ("examples/demo/config.yaml", [*COMMON, "ray.enabled=false", "schedule.period=1",
                                                  "algorithm.baseline=critic"]),
    "guess": ("examples/guess/config.yaml", [*COMMON, *TINY]),
    "guess_smollm2": ("examples/guess/config.yaml", [*COMMON, "eval.data.kwargs.n=4", "eval.partners={}"]),
}
DEFAULT_RUNS = ["demo", "demo_local", "demo_ema", "demo_async", "demo_critic", "guess"]


def run_metrics(tree: Path, name: str, work: Path) -> list[dict]:
    """The metrics.jsonl lines of run `name` made with the code of `tree`."""
    config, overrides = RUNS[name]
    run_dir = work / name
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "orchestrator.cli", "run", str(tree / config), *overrides,
               f"train.run_dir={run_dir}"]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"same_metrics: run {name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def exported(commit: str, into: Path) -> Path:
    """The tree of `commit` of this repository, written under `into`."""
    archive = into / "tree.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "-C", str(ROOT), "archive", commit], stdout=out, check=True)
    tree = into / "tree"
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    return tree


def kept(line: dict, ignore: list[str]) -> dict:
    return {k: v for k, v in line.items() if not any(k.startswith(p) for p in ignore)}


def difference(ref: list[dict], now: list[dict], ignore: list[str]) -> str | None:
    """Where `now` first departs from `ref`, or None."""
    if len(ref) != len(now):
        return f"{len(now)} lines where the reference has {len(ref)}"
    for i, (a, b) in enumerate(zip(ref, now)):
        a, b = kept(a, ignore), kept(b, ignore)
        if a != b:
            keys = sorted(k for k in a.keys() | b.keys() if a.get(k, "<absent>") != b.get(k, "<absent>"))
            shown = ", ".join(f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in keys[:6])
            return f"line {i + 1} (step {a.get('step')}): {len(keys)} keys differ: {shown}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    record = sub.add_parser("record", help="run the reference commit's code and keep its metrics")
    record.add_argument("--commit", default="HEAD", help="the commit whose code makes the reference")
    record.add_argument("--out", required=True, type=Path)
    compare = sub.add_parser("compare", help="run the current tree and compare with recorded metrics")
    compare.add_argument("--ref", required=True, type=Path)
    compare.add_argument("--commit", help="compare this commit's tree instead of the working tree")
    compare.add_argument("--ignore", action="append", default=[], help="a key prefix left out of the comparison")
    for p in (record, compare):
        p.add_argument("--runs", nargs="+", choices=list(RUNS), default=DEFAULT_RUNS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="same-metrics-") as tmp:
        work = Path(tmp)
        commit = tree = None
        if args.commit:
            commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.commit], capture_output=True,
                                    text=True, check=True).stdout.strip()
            tree = exported(commit, work)
        if args.command == "record":
            args.out.mkdir(parents=True, exist_ok=True)
            for name in args.runs:
                lines = run_metrics(tree, name, work)
                (args.out / f"{name}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
                print(f"{name}: {len(lines)} lines recorded at {commit[:12]}")
            (args.out / "commit").write_text(commit + "\n")
            return 0
        failed = 0
        ignore = ["time/", "memory/", *args.ignore]  # measured, not computed (orchestrator.steplog.MEASURED)
        for name in args.runs:
            ref_file = args.ref / f"{name}.jsonl"
            if not ref_file.is_file():
                print(f"{name}: no reference ({ref_file}); record it first")
                failed += 1
                continue
            ref = [json.loads(line) for line in ref_file.read_text().splitlines() if line.strip()]
            now = run_metrics(tree or ROOT, name, work)
            problem = difference(ref, now, ignore)
            print(f"{name}: " + (f"DIFFERS: {problem}" if problem else
                                 f"same ({len(now)} lines, {sum(len(kept(line, ignore)) for line in now)} values compared, all but {', '.join(ignore)})"))
            failed += problem is not None
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
