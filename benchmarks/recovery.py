"""Recovery time of the default demo after a trainer is killed: from SIGKILL to the next step done.

    python benchmarks/recovery.py [--kill-at 15] [--steps 30] [--checkpoint-every 10]

Prints the time to detect the death, the time from the kill to the next completed step, and the
number of steps replayed from the last checkpoint; checks the final metrics against an
uninterrupted run of the same seed.
"""

import argparse
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import bench_common as bc  # noqa: E402  (this script's folder is first on sys.path)
from orchestrator.coordinator import Coordinator  # noqa: E402
from orchestrator.steplog import computed  # noqa: E402
from protocols.config import load_config  # noqa: E402

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo" / "config.yaml"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill-at", type=int, default=15)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    args = parser.parse_args()
    overrides = [f"train.steps={args.steps}", f"train.checkpoint_every={args.checkpoint_every}", "train.progress=false"]
    config = load_config(DEMO, overrides)
    print(bc.machine_line())

    with Coordinator(config, tempfile.mkdtemp(prefix="marsi-recovery-")) as coord:
        victim, killed = coord.pool.info()["alice"]["pid"], {}

        def kill():
            while coord.state.step < args.kill_at:
                time.sleep(0.005)
            killed["at"] = time.time()
            os.kill(victim, signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()
        interrupted = coord.run()
    after = [m for m in interrupted if m["time/end"] > killed["at"]]
    first = after[0]
    print(f"killed alice (pid {victim}) after step {args.kill_at}; restarted from the checkpoint of step "
          f"{first['step'] - 1}, replaying {args.kill_at - first['step'] + 1} step(s)")
    print(f"kill -> next step done: {first['time/end'] - killed['at']:.1f} s "
          f"(restart and restore {first['time/recovery'] - first['time/step']:.1f} s, then the step {first['time/step']:.1f} s)")

    with Coordinator(config) as coord:
        whole = coord.run()
    same = [computed(m) for m in interrupted[-len(whole):]] == [computed(m) for m in whole]
    print(f"final metrics equal to an uninterrupted run: {same}")


if __name__ == "__main__":
    main()
