"""A whole run as a user sees it, marsi against CoMLRL (MAGRPO), each in a fresh process of its own.

    python benchmarks/whole_run.py [--model builtin:smollm2-135m-instruct] [--steps 4] [--batch 2] [--group 4]
        [--tokens 32] [--prompt-tokens 40] [--dtype float32] [--engine hf] [--repeats 2] [--lr 1e-5]

Both train two agents on the `bench_common` task (vs_comlrl.py's; `--prompt-tokens` puts a fixed
instruction of about that many tokens before each prompt) with the same model files, samples, group,
new tokens, learning rate and a budget of 2 CPU threads: marsi as `marsi run` would (Ray, one actor
per agent with 1 thread, a checkpoint at step 0 and at the last step), CoMLRL in one process with
`--comlrl-threads` threads (2). The contenders alternate, `--repeats` runs each, and each figure is the median over runs:

  wall          seconds from starting the process to its exit
  start-up      seconds from starting the process to the first step (imports, Ray, model loads, marsi's
                step-0 checkpoint); marsi's run lines add the seconds beyond its slowest model load and the
                coordinator's split (`Coordinator.startup`: Ray, the trainers with their imports)
  s/step        median seconds per training step (marsi's run lines add its generate / update split)
  RSS, PSS      peak over the run of the summed resident / proportional set size of the process and all its
                descendants (driver, Ray's processes, trainer actors), sampled every second; PSS splits pages
                shared between processes (libraries, Ray's object store), so it adds up to what the tree costs
  ckpt MB       disk of each marsi checkpoint (step 0, last step); CoMLRL writes none in its loop

`--dtype bfloat16` gives marsi's agents bf16 compute with fp32 master weights; CoMLRL stays fp32 (its
MAGRPO trainer has no mixed precision). `--engine vllm` samples marsi's agents with vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="samples per step")
    parser.add_argument("--group", type=int, default=4, help="completions per sample")
    parser.add_argument("--tokens", type=int, default=32, help="max new tokens")
    parser.add_argument("--prompt-tokens", type=int, default=40, help="instruction tokens before each prompt")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="marsi's compute dtype")
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm"), help="marsi's rollout engine")
    parser.add_argument("--comlrl-threads", type=int, default=2,
                        help="CoMLRL's torch threads (1 is faster on a busy machine: see benchmarks/README.md)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per contender, alternating")
    parser.add_argument("--only", choices=("marsi", "comlrl"), help="run one contender")
    parser.add_argument("--child", choices=("marsi", "comlrl"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        report = run_marsi(args) if args.child == "marsi" else run_comlrl(args)
        Path(args.out).write_text(json.dumps(report))
        return

    import bench_common as bc

    command = " ".join([Path(sys.executable).name, *sys.argv])
    print(f"$ {command}\nbefore: {bc.load_line()}", flush=True)
    print(bc.machine_line())
    contenders = [args.only] if args.only else ["marsi", "comlrl"]
    runs: dict[str, list[dict]] = {c: [] for c in contenders}
    for r in range(args.repeats):
        for name in contenders if r % 2 == 0 else contenders[::-1]:  # who goes first alternates
            report = measure(name, args)
            runs[name].append(report)
            print(f"  run {r + 1} {name:6s}: wall {report['wall_s']:.1f} s, start-up {report['ready_s']:.1f} s{_startup(report)}, "
                  f"s/step {statistics.median(report['step_s']):.2f}{_split(report)}, peak RSS {report['rss_mb']:.0f} MB, "
                  f"peak PSS {report['pss_mb']:.0f} MB", flush=True)
    print(f"after: {bc.load_line()}\n")
    table(runs, args)


def measure(name: str, args) -> dict:
    """Run one contender in a fresh process; its own report plus wall time and the tree's peak memory."""
    with tempfile.TemporaryDirectory(prefix="marsi-whole-run-") as tmp:
        out = Path(tmp) / "report.json"
        argv = [sys.executable, __file__, "--child", name, "--out", str(out), "--model", args.model,
                "--steps", str(args.steps), "--batch", str(args.batch), "--group", str(args.group),
                "--tokens", str(args.tokens), "--prompt-tokens", str(args.prompt_tokens), "--lr", str(args.lr),
                "--dtype", args.dtype, "--engine", args.engine, "--comlrl-threads", str(args.comlrl_threads)]
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=tmp, env={**os.environ, "MARSI_BENCH_START": str(time.time())})
        peak_rss = peak_pss = 0.0
        by_process: dict[str, list[float]] = {}
        while proc.poll() is None:
            processes = tree_memory_mb(proc.pid)
            rss, pss = sum(m[0] for m in processes.values()), sum(m[1] for m in processes.values())
            peak_rss = max(peak_rss, rss)
            if pss > peak_pss:
                peak_pss, by_process = pss, {}
                for (label, _), (r, p) in processes.items():
                    total = by_process.setdefault(label, [0, 0.0, 0.0])
                    total[0], total[1], total[2] = total[0] + 1, total[1] + r, total[2] + p
            time.sleep(SAMPLE_EVERY_S)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"{name} run failed with exit status {proc.returncode}")
        return {**json.loads(out.read_text()), "wall_s": wall, "rss_mb": peak_rss, "pss_mb": peak_pss,
                "by_process": by_process}


SAMPLE_EVERY_S = 1.0
"""Reading a large process's smaps_rollup walks its page tables: sampled more often, the sampler itself took
a noticeable share of the 2 cores from the contenders (marsi's SmolLM2 steps read 19 s at 0.2 s, 13 s at 1 s)."""


def tree_memory_mb(root: int) -> dict[tuple[str, int], tuple[float, float]]:
    """RSS and PSS (MB) of `root` and every descendant, by (what the process is, pid), from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):  # ended meanwhile, or not ours to read
            continue
        label = "driver" if pid == root else process_label(command)
        out[(label, pid)] = (int(fields["Rss"].split()[0]) / 1024, int(fields["Pss"].split()[0]) / 1024)
    return out


RAY_PROCESSES = (("_TrainerActor", "trainer actor"), ("ray::IDLE", "Ray idle worker"), ("gcs_server", "Ray GCS"),
                 ("raylet", "Ray raylet"), ("dashboard.py", "Ray dashboard head"), ("DashboardAgent", "Ray dashboard agent"),
                 ("RuntimeEnvAgent", "Ray runtime-env agent"), ("log_monitor.py", "Ray log monitor"),
                 ("monitor.py", "Ray autoscaler monitor"), ("reaper", "marsi reaper"))


def process_label(command: str) -> str:
    return next((label for key, label in RAY_PROCESSES if key in command), command.split(" ")[0].rsplit("/", 1)[-1])


def _since_start() -> float:
    return time.time() - float(os.environ["MARSI_BENCH_START"])


def run_marsi(args) -> dict:
    import bench_common as bc
    from orchestrator.coordinator import Coordinator

    config = bc.marsi_config(model=args.model, batch_size=args.batch, group=args.group, tokens=args.tokens,
                             lr=args.lr, steps=args.steps, prompt_tokens=args.prompt_tokens, dtype=args.dtype,
                             engine=args.engine, checkpoint_every=args.steps, num_cpus=1.0)
    with Coordinator(config, run_dir=Path.cwd() / "run") as coord:
        steps = coord.run()  # writes the step-0 checkpoint, then steps
        first_step_start = steps[0]["time/end"] - steps[0]["time/step"]
        checkpoints = {p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 2**20
                       for p in coord.log.checkpoints()}
    return {"ready_s": first_step_start - float(os.environ["MARSI_BENCH_START"]),
            "step_s": [m["time/step"] for m in steps], "checkpoint_mb": checkpoints,
            "generate_s": [m["time/generate"] for m in steps], "update_s": [m["time/update"] for m in steps],
            "startup": coord.startup,
            "reward": [m["reward/mean"] for m in steps]}


def _split(report: dict) -> str:
    """marsi's step as generate / update (medians over steps); CoMLRL's loop does not time them apart."""
    if "generate_s" not in report:
        return ""
    return f" (generate {statistics.median(report['generate_s']):.2f} / update {statistics.median(report['update_s']):.2f})"


def _startup(report: dict) -> str:
    """marsi's start-up beyond loading the models (the slowest trainer's model, tokenizer and engine), and the
    parts the coordinator times: Ray, the trainers (their imports included)."""
    if "startup" not in report:
        return ""
    up = report["startup"]
    return (f" ({report['ready_s'] - up['model_load_s']:.1f} s beyond the model loads of {up['model_load_s']:.1f} s; "
            f"Ray {up['ray_s']:.1f} s, trainers {up['trainers_s']:.1f} s)")


def run_comlrl(args) -> dict:
    import bench_common as bc
    from agent_trainer.models import resolve_model_path
    from vs_comlrl import ComlrlRunner

    runner = ComlrlRunner(resolve_model_path(args.model), batch=args.batch, group=args.group, tokens=args.tokens,
                          lr=args.lr, seed=0, prompt_tokens=args.prompt_tokens)
    ready = _since_start()
    rows = bc.task_rows(args.steps * args.batch, 0)
    steps, rewards = [], []
    for step in range(args.steps):
        start = time.perf_counter()
        rewards.extend(runner.train(rows[step * args.batch:(step + 1) * args.batch], threads=args.comlrl_threads))
        steps.append(time.perf_counter() - start)
    return {"ready_s": ready, "step_s": steps, "checkpoint_mb": {}, "reward": rewards}


def table(runs: dict[str, list[dict]], args) -> None:
    def med(name: str, key: str) -> float:
        values = [statistics.median(r[key]) if isinstance(r[key], list) else r[key] for r in runs[name]]
        return statistics.median(values)

    print(f"{args.model}, 2 agents, {args.steps} steps of {args.batch} samples x {args.group}, {args.tokens} new "
          f"tokens, prompts with a {args.prompt_tokens}-token instruction; marsi {args.dtype}, engine {args.engine}; "
          f"medians over {args.repeats} runs")
    keys = (("wall_s", "wall s"), ("ready_s", "start-up s"), ("step_s", "s/step"), ("rss_mb", "peak RSS MB"),
            ("pss_mb", "peak PSS MB"))
    print(f"{'contender':10s} " + " ".join(f"{label:>12s}" for _, label in keys))
    for name in runs:
        print(f"{name:10s} " + " ".join(f"{med(name, key):12.2f}" for key, _ in keys))
    if len(runs) == 2:
        print(f"{'marsi/CoMLRL':10s} " + " ".join(f"{med('marsi', key) / med('comlrl', key):12.3f}" for key, _ in keys))
    for name in runs:
        last = runs[name][-1]
        print(f"{name}, last run, at its peak PSS: " + "; ".join(
            f"{label} x{n}: RSS {r:.0f} MB, PSS {p:.0f} MB" for label, (n, r, p) in
            sorted(last["by_process"].items(), key=lambda kv: -kv[1][2])))
    if "marsi" in runs:
        sizes = runs["marsi"][-1]["checkpoint_mb"]
        print("marsi checkpoints: " + ", ".join(f"{name} {mb:.1f} MB" for name, mb in sizes.items()))


if __name__ == "__main__":
    main()
