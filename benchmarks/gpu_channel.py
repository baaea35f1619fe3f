"""GPU check of the weight channel over NCCL: a learner and its engine apart, each a process with a GPU of its own.

    python benchmarks/gpu_channel.py [--layers 30] [--repeats 5] [--cpu]

Part E of `gpu_check.py`, which runs it; alone it needs torch with CUDA and transformers only (no Ray, no vLLM, no
pydantic, no model files).
Two spawned processes, rank 0 (the learner, GPU 0) and rank 1 (the engine, GPU 1), form the channel
(`agent_trainer.weight_channel.WeightChannel`) over a TCP store as a run's two actors do, each holding a model of
SmolLM2-135M's shape (`--layers` of width 576, a tied embedding) with its own random weights, float32. Checked:

1. **Transfer.** After version 0 is sent, the engine's weights equal the learner's, bit for bit.
2. **Refusal.** A transfer of a version the learner does not hold raises `ChannelRefused` on both sides, and the
   engine's weights do not move.
3. **Memory.** The extra device memory each side allocates during a transfer (peak over what it held before): at
   most one bucket (`weight_channel._BUCKET_BYTES`, 16 MiB).
4. **Time.** A transfer: each side's median (`--repeats`, after one warm-up) from leaving a barrier to its call
   returning, the larger of the two; against one copy of the same bytes from GPU 0 to GPU 1 in one process (the
   floor between the two devices) and one copy within GPU 0. The target: at most 2x the copy between the devices.

Fewer than 2 GPUs: skipped (NCCL refuses two ranks on one device). `--cpu` runs the same steps with gloo on CPU
(the broadcast path; no memory figure) to smoke-test this script where there is no GPU. Exit status 1 when a
check fails.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import queue
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from agent_trainer.weight_channel import _BUCKET_BYTES, ChannelRefused, WeightChannel, unique  # noqa: E402

_STORE_TIMEOUT = datetime.timedelta(seconds=60)


SMOLLM2_SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                 "num_key_value_heads": 3, "tie_word_embeddings": True}
"""SmolLM2-135M's shape (its vocabulary aside), for models built with random weights here and in `gpu_check`."""


def model(layers: int, seed: int, device: torch.device) -> torch.nn.Module:
    """A model of SmolLM2-135M's shape, with SmolLM2's vocabulary size and `layers` layers, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**SMOLLM2_SHAPE, "num_hidden_layers": layers}, vocab_size=49152)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device)


def _side(rank: int, port: int, args: argparse.Namespace, out: mp.Queue) -> None:
    """One process of the pair: rank 0 sends, rank 1 receives; what it saw goes to `out`."""
    gpu = not args.cpu
    device = torch.device(f"cuda:{rank}") if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=_STORE_TIMEOUT)
    channel = WeightChannel(store, rank, device=device, timeout_s=120, agent="gpu-check")
    weights = model(args.layers, seed=1 + rank, device=device).state_dict()
    report: dict = {"rank": rank}

    def synchronize():
        if gpu:
            torch.cuda.synchronize(device)

    def transfer(version: int, holds: int):
        return channel.send(weights, version, holds) if rank == 0 else channel.receive(weights, version)

    def digest() -> str:  # SHA-256 of the names and bytes (not agent_trainer.trainer's: that imports pydantic)
        h = hashlib.sha256()
        for name, tensor in unique(weights):
            h.update(name.encode())
            h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    try:
        report["before"] = digest()
        try:  # 2. the learner holds version 0, the engine asks for 1: both refuse, nothing moves
            transfer(1, 0)
            report["refused"] = "not refused"
        except ChannelRefused as exc:
            report["refused"] = exc.reason
        report["after_refusal"] = digest()
        synchronize()
        if gpu:
            torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device) if gpu else 0
        transfer(0, 0)  # 1. and 3.
        synchronize()
        report["extra_bytes"] = torch.cuda.max_memory_allocated(device) - held if gpu else None
        report["after"] = digest()
        times = []
        for _ in range(args.repeats + 1):  # 4.
            channel.group.barrier().wait()
            start = time.perf_counter()
            transfer(0, 0)
            synchronize()
            times.append(time.perf_counter() - start)
        report["seconds"] = statistics.median(times[1:])
        if rank == 0:
            report["bytes"] = sum(t.numel() * t.element_size() for _, t in unique(weights))
            report["copy_peer"] = copy_seconds(weights, torch.device("cuda:1") if gpu else device, args.repeats)
            if gpu:
                report["copy_local"] = copy_seconds(weights, device, args.repeats)
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        report["error"] = f"{type(exc).__name__}: {exc}"
    out.put(report)


def copy_seconds(weights: dict[str, torch.Tensor], to: torch.device, repeats: int) -> float:
    """Median seconds of one `copy_` of every tensor (a tied one once) into a destination on `to` written before."""
    src = [t for _, t in unique(weights)]
    dst = [torch.empty_like(t, device=to) for t in src]
    times = []
    for _ in range(repeats + 1):
        for d in {t.device for t in src + dst if t.device.type == "cuda"}:
            torch.cuda.synchronize(d)
        start = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)
        for d in {t.device for t in src + dst if t.device.type == "cuda"}:
            torch.cuda.synchronize(d)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def check_weight_channel(args: argparse.Namespace) -> bool:
    """Parts 1-4 above; True when every check passed (or the check was skipped for want of a second GPU)."""
    backend = "gloo on CPU" if args.cpu else "NCCL"
    if not args.cpu and torch.cuda.device_count() < 2:
        print(f"[E: weight channel over NCCL] skipped ({torch.cuda.device_count()} GPU visible; it needs 2, one "
              "for the learner and one for its engine)")
        return True
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=_STORE_TIMEOUT)
    context = mp.get_context("spawn")
    out = context.Queue()
    sides = [context.Process(target=_side, args=(rank, store.port, args, out)) for rank in (0, 1)]
    for p in sides:
        p.start()
    reports, deadline = {}, time.monotonic() + 600
    try:
        while len(reports) < len(sides) and time.monotonic() < deadline:
            try:
                report = out.get(timeout=5)
            except queue.Empty:
                if not any(p.is_alive() for p in sides):
                    break
                continue
            reports[report["rank"]] = report
    finally:
        for p in sides:
            p.join(30)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}: {rep['error']}" for r, rep in reports.items() if "error" in rep]
    errors += [f"rank {r} ended without a report (exit code {p.exitcode})" for r, p in enumerate(sides)
               if r not in reports]
    if errors:
        print(f"[E: weight channel over {backend}] FAILED: {'; '.join(errors)}")
        return False
    learner, engine = reports[0], reports[1]
    ok = True

    def say(passed: bool, text: str) -> None:
        nonlocal ok
        ok &= passed
        print(f"[E] {'ok  ' if passed else 'FAIL'} {text}")

    print(f"[E: weight channel over {backend}] {learner['bytes'] / 1e6:.1f} MB float32 ({args.layers} layers)")
    say(learner["before"] != engine["before"] and engine["after"] == learner["before"],
        "the engine's weights equal the learner's after a transfer (they differed before)")
    say("not refused" not in (learner["refused"], engine["refused"])
        and engine["after_refusal"] == engine["before"],
        f"a version the learner does not hold is refused on both sides, nothing moved ({learner['refused']})")
    if not args.cpu:
        extra = max(learner["extra_bytes"], engine["extra_bytes"])
        say(extra <= _BUCKET_BYTES, f"extra device memory during a transfer: learner {learner['extra_bytes'] / 2**20:.1f} "
            f"MiB, engine {engine['extra_bytes'] / 2**20:.1f} MiB (bound: one bucket, {_BUCKET_BYTES / 2**20:.0f} MiB)")
    seconds = max(learner["seconds"], engine["seconds"])
    floor = learner["copy_peer"]
    copies = (f"one copy in memory {floor * 1e3:.2f} ms" if args.cpu else
              f"one copy GPU 0 -> GPU 1 {floor * 1e3:.2f} ms, within GPU 0 {learner['copy_local'] * 1e3:.2f} ms")
    print(f"[E] transfer {seconds * 1e3:.2f} ms; {copies}; transfer / copy {seconds / floor:.1f} (bound 2)")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30, help="decoder layers of the SmolLM2-shaped model")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu", action="store_true", help="smoke-test with gloo on CPU")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("gpu_channel: no CUDA device visible to torch; run it on a machine with 2 GPUs (or --cpu)")
    ok = check_weight_channel(args)
    print("gpu_channel: " + ("all checks passed" if ok else "a check FAILED (see above)"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
