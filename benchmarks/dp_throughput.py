"""Update throughput (completion tokens per second) of one agent on 1 worker and on 2 data-parallel workers,
side by side in one run.

    python benchmarks/dp_throughput.py [--model builtin:smollm2-135m-instruct] [--batch 16] [--tokens 16]
                                       [--repeats 5]

Contenders, each its own Ray actors with the same weights, updated on the same batch (one generate by the
first contender, scored with alternating advantages):

  1 worker x 1 thread     the default agent on one core
  1 worker x 2 threads    the same agent given both cores as torch threads (num_cpus: 2)
  2 workers x 1 thread    num_workers: 2, one core each: each trains on half the batch, gradients summed
                          over gloo

They update in turn, the order rotating every round; each figure is the median over rounds of the
driver's wall time of one `update` call (so the 2-worker figure includes the gradient all-reduce and the
object-store copy of the request), and of the trainer's own `seconds`. Afterwards two worker processes
time one gradient all-reduce of the whole model between them alone, once per round: what data
parallelism adds to every pass of an update.
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ray  # noqa: E402
import torch  # noqa: E402

import bench_common as bc  # noqa: E402
from agent_trainer.actor import RayTrainers, quiet_ray_startup  # noqa: E402
from agent_trainer.agent import Agent  # noqa: E402
from protocols.config import validate_config  # noqa: E402
from protocols.messages import Experience, GenerateRequest, UpdateRequest  # noqa: E402
from protocols.plan import plan_of  # noqa: E402

CONTENDERS = {  # agent name -> (num_workers, num_cpus per worker)
    "1 worker x 1 thread": (1, 1.0),
    "1 worker x 2 threads": (1, 2.0),
    "2 workers x 1 thread": (2, 1.0),
}


def allreduce_seconds(model: str, repeats: int) -> list[float]:
    """Seconds of each of `repeats` all-reduces of a whole-model gradient (zeros) between two data-parallel
    workers (`agent_trainer.workers.DataParallel`, gloo), in two processes of their own after the Ray rounds."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    ports, results = context.Queue(), context.Queue()
    procs = [context.Process(target=_allreduce_worker, args=(rank, model, repeats, ports, results)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    seconds = results.get(timeout=600)
    for proc in procs:
        proc.join()
    return seconds


def _allreduce_worker(rank: int, model: str, repeats: int, ports, results) -> None:
    from agent_trainer import workers
    from agent_trainer.models import load_model

    torch.set_num_threads(1)
    weights, _ = load_model(model, dtype="float32")
    if rank == 0:
        ports.put(workers.open_store(address="127.0.0.1", world_size=2, timeout_s=300))
    port = ports.get(timeout=300) if rank == 1 else None
    trainer = type("Worker", (), {"device": torch.device("cpu"), "model": weights, "ref_model": None})()
    workers.join(trainer, address="127.0.0.1", port=port or 0, rank=rank, world_size=2, timeout_s=300)
    seconds = []
    for _ in range(repeats):
        for p in weights.parameters():
            p.grad = torch.zeros_like(p)
        start = time.perf_counter()
        trainer.parallel.reduce_gradients(weights.parameters(), True)
        seconds.append(time.perf_counter() - start)
    if rank == 0:
        results.put(seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=16, help="sequences per update")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per completion")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of one update per contender")
    args = parser.parse_args()
    print("$ python " + " ".join(sys.argv))
    print("before:", bc.load_line())
    print(bc.machine_line())
    names = {label: f"agent{i}" for i, label in enumerate(CONTENDERS)}
    agents = {names[label]: {"model": args.model, "dtype": "float32", "micro_batch_size": args.batch,
                             "generation": {"max_completion_length": args.tokens, "use_chat_template": False},
                             "optimizer": {"lr": 1e-6}, "resources": {"num_cpus": cpus, "num_workers": workers}}
              for label, (workers, cpus) in CONTENDERS.items()}
    config = validate_config({
        "agents": agents,
        "environment": {"name": "bench_common:TeamEnv", "kwargs": {"num_roles": len(agents)}},
        "roles": {"assignment": {f"role{i}": name for i, name in enumerate(agents)}},
        "data": {"factory": "bench_common:make_dataset"},
        "train": {"progress": False},
    }, source="<benchmark>")
    asked = sum(w * c for w, c in CONTENDERS.values())
    quiet_ray_startup()
    ray.init(num_cpus=asked, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    trainers = RayTrainers(config, plan_of(config), {name: args.repeats + 1 for name in agents})
    try:
        first = names["1 worker x 1 thread"]
        prompts = [f"Write a short sentence about the number {i}." for i in range(args.batch)]
        completions = trainers[first].generate(GenerateRequest(prompts=prompts, seed=0))
        batch = [Experience(prompt_ids=c.prompt_ids, completion_ids=c.completion_ids, advantage=(-1.0) ** i)
                 for i, c in enumerate(completions.completions)]
        tokens = sum(len(e.completion_ids) for e in batch)
        request = UpdateRequest(experiences=batch)
        trainers.each(Agent.update, {name: request for name in agents})  # warm-up: first-call allocations
        wall = {label: [] for label in CONTENDERS}
        inside = {label: [] for label in CONTENDERS}
        labels = list(CONTENDERS)
        for r in range(args.repeats):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:  # who goes first rotates
                start = time.perf_counter()
                result = trainers[names[label]].update(request)
                wall[label].append(time.perf_counter() - start)
                inside[label].append(result.seconds)
    finally:
        trainers.close()
        ray.shutdown()
    allreduce = allreduce_seconds(args.model, args.repeats)
    print(f"model {args.model}; {args.batch} sequences x up to {args.tokens} new tokens = {tokens} completion "
          f"tokens per update; median of {args.repeats} rounds")
    print(f"{'contender':22s} {'update s':>9s} {'tokens/s':>9s} {'trainer s':>10s} {'vs 1x1':>7s}")
    base = bc.median(wall["1 worker x 1 thread"])
    for label in CONTENDERS:
        seconds = bc.median(wall[label])
        print(f"{label:22s} {seconds:9.3f} {tokens / seconds:9.1f} {bc.median(inside[label]):10.3f} "
              f"{base / seconds:6.2f}x")
    print(f"gradient all-reduce between the 2 workers (whole model, float32): {bc.median(allreduce):.3f} s")
    print("after: ", bc.load_line())


if __name__ == "__main__":
    main()
