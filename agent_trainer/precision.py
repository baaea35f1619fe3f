"""The dtype an agent computes in: `dtype: auto` resolved from what its device reports and, where bfloat16 is
native, from a measurement of the agent's own shapes; and a probe that measures what an explicit bfloat16 costs
where the device only emulates it.

`resolve` is a pure function of a `Capabilities` report, and `decide` of two measured times, so every case is
tested on any machine. `capabilities` reads the report of one device of this process: a trainer reads its own
device's where it runs; `marsi validate` reads the driver's, which describes the trainers only where they run on
the same kind of machine.

The rule of `auto`: where the device computes bfloat16 natively (a CUDA device of compute capability 8.0 or
later; a CPU with AVX-512 BF16 or AMX, flags `avx512_bf16` / `amx_bf16` in /proc/cpuinfo or torch's own CPU
report) a flag does not say that bf16 is faster (SmolLM2-135M: 2.3x faster on an AMD EPYC with avx512_bf16,
1.1x slower on an Intel Xeon with it, 0.9x as fast on an H200), so `measure` times a forward and backward and a
few one-token forwards of a one-layer model of the agent's own shapes in float32 and under bfloat16 autocast,
and bfloat16 is taken only when it is at least `MARGIN` faster (so auto is never more than that slower than the
faster of the two). The times are cached per machine, torch version, thread count and model shape
(`MARSI_CACHE/precision/`), so a restart does not measure again. float16 with loss scaling on a CUDA device
without native bf16 (V100, T4); float32 otherwise (CPUs without those flags, whose emulated bf16 measured 8-25x
slower; ARM CPUs too, whose `bf16` feature is not counted: not measured here). `builtin:tiny` stays float32: a
d=128 model gains nothing from bf16, and its recorded figures (the demo's) are float32.
A trainable agent keeps float32 master weights whatever its compute dtype (`agent_trainer.trainer`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

NATIVE_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
"""CPU flags under which bfloat16 matmuls run natively (AVX-512 BF16 dot products, AMX tiles)."""
STAYS_FLOAT32 = ("builtin:tiny",)
"""Models that `auto` keeps in float32."""
MARGIN = 0.05
"""`auto` takes bfloat16 only where it measured at least this much faster than float32."""
MEASURED = "measure"
"""What `resolve` returns as the dtype where the device computes bf16 natively: `decide` between the two."""


@dataclass(frozen=True)
class Capabilities:
    """What a device reports about bfloat16: its kind, the CPU's model and flags, the GPU and its support."""

    device: str
    """`cpu` or `cuda`."""
    cpu_model: str = "unknown CPU"
    cpu_flags: frozenset[str] = frozenset()
    """Those of NATIVE_CPU_FLAGS the CPU has."""
    gpu: str | None = None
    """The CUDA device's name; None on CPU."""
    cuda_bf16: bool = False
    """The CUDA device computes bfloat16 natively (not emulated)."""


class Precision(NamedTuple):
    """The compute dtype an agent got, why, and on what (`describe` of its device); `slowdown`: for an explicit
    bfloat16 on a device that emulates it, the bf16 matmul probe's time over float32's there (None otherwise)."""

    dtype: str
    reason: str
    machine: str
    slowdown: float | None = None


def cpu_report(cpuinfo: str) -> tuple[str, frozenset[str]]:
    """The CPU model and its NATIVE_CPU_FLAGS from the text of /proc/cpuinfo (x86 `flags`, ARM `Features`)."""
    model, flags = "unknown CPU", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "Hardware") and model == "unknown CPU" and value.strip():
            model = value.strip()
        elif key in ("flags", "Features"):
            flags.update(value.split())
    return model, frozenset(flags & set(NATIVE_CPU_FLAGS))


def capabilities(device: torch.device | str = "cpu") -> Capabilities:
    """The report of `device` in this process: /proc/cpuinfo and torch's CPU report for the CPU, torch.cuda for
    a GPU (compute capability 8.0 or later computes bf16; earlier ones emulate it)."""
    import torch  # here, not at the top: the coordinator imports this module and never torch

    device = torch.device(device)
    try:
        model, flags = cpu_report(Path("/proc/cpuinfo").read_text())
    except OSError:
        model, flags = "unknown CPU", frozenset()
    reported = getattr(torch.cpu, "get_capabilities", lambda: {})()  # torch's cpuinfo: any OS
    flags |= {f for f in NATIVE_CPU_FLAGS if reported.get(f)}
    model = model if model != "unknown CPU" else reported.get("cpu_name") or model
    if device.type != "cuda":
        return Capabilities(device="cpu", cpu_model=model, cpu_flags=frozenset(flags))
    major, _ = torch.cuda.get_device_capability(device)
    return Capabilities(device="cuda", cpu_model=model, cpu_flags=frozenset(flags),
                        gpu=torch.cuda.get_device_name(device), cuda_bf16=major >= 8)


def describe(caps: Capabilities) -> str:
    """`CPU AMD EPYC (avx512_bf16 yes, amx_bf16 no)` or `GPU NVIDIA H100 (bf16 native)`: the parts that decide."""
    if caps.device == "cuda":
        return f"GPU {caps.gpu} (bf16 {'native' if caps.cuda_bf16 else 'emulated'})"
    flags = ", ".join(f"{f} {'yes' if f in caps.cpu_flags else 'no'}" for f in NATIVE_CPU_FLAGS)
    return f"CPU {caps.cpu_model} ({flags})"


def native_bf16(caps: Capabilities) -> str | None:
    """Why the reported device computes bfloat16 natively, or None where it emulates it."""
    if caps.device == "cuda":
        return f"GPU {caps.gpu} computes bf16" if caps.cuda_bf16 else None
    have = [f for f in NATIVE_CPU_FLAGS if f in caps.cpu_flags]
    return f"CPU has {' and '.join(have)}" if have else None


def resolve(requested: str, caps: Capabilities, *, model: str) -> tuple[str, str]:
    """(dtype, reason) of an agent of `model` that asks for `requested` on the reported device; the dtype is
    `MEASURED` where `auto` is to be decided by a measurement (bf16 native there)."""
    if requested != "auto":
        return requested, "as configured"
    if model in STAYS_FLOAT32:
        return "float32", f"auto: {model} stays float32"
    native = native_bf16(caps)
    if native:
        return MEASURED, f"auto: {native}"
    if caps.device == "cuda":
        return "float16", f"auto: GPU {caps.gpu} has no native bf16; float16 with loss scaling"
    return "float32", f"auto: CPU has neither {' nor '.join(NATIVE_CPU_FLAGS)}"


def decide(float32_s: float, bfloat16_s: float, native: str) -> tuple[str, str]:
    """(dtype, reason) from the measured seconds of the same work in float32 and under bfloat16 autocast."""
    speed = float32_s / bfloat16_s
    dtype = "bfloat16" if speed >= 1.0 + MARGIN else "float32"
    return dtype, f"auto: {native}; bf16 measured {speed:.2f}x as fast as float32 on this model's shapes"


def choose(requested: str, device: torch.device, *, model: str) -> Precision:
    """`resolve` on `device`'s report, `decide` on a measurement of `model` where bf16 is native; an explicit
    bfloat16 where it is emulated also gets the probe's slowdown."""
    caps = capabilities(device)
    dtype, reason = resolve(requested, caps, model=model)
    if dtype == MEASURED:
        float32_s, bfloat16_s = measure(model, device, caps)
        dtype, reason = decide(float32_s, bfloat16_s, reason.removeprefix("auto: "))
    if requested == "bfloat16" and native_bf16(caps) is None:
        return Precision(dtype, "as configured; emulated here", describe(caps), bf16_slowdown(device))
    return Precision(dtype, reason, describe(caps))


def measure(model: str, device: torch.device, caps: Capabilities) -> tuple[float, float]:
    """(float32 seconds, bfloat16 seconds) of the same work on `device`: a forward and backward of 8 x 64 tokens and
    16 forwards of 8 x 1 token through a one-layer model of `model`'s shapes (its config, random weights, float32
    master weights, bf16 under autocast), the fastest of 3 after a warm-up; about a second on a CPU for a
    135M-parameter model. Read from the cache when this machine measured the same shapes before."""
    import torch
    from transformers import AutoConfig

    from agent_trainer.models import cache_dir, resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path(model))
    shape = {k: getattr(config, k, None) for k in ("model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                                                   "num_key_value_heads", "vocab_size", "tie_word_embeddings")}
    key = json.dumps({"machine": describe(caps), "device": str(device), "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "shape": shape}, sort_keys=True)
    entry = cache_dir() / "precision" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
    try:
        cached = json.loads(entry.read_text())
        return float(cached["float32_s"]), float(cached["bfloat16_s"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    times = _time_one_layer(config, device)
    try:  # whole or not at all: another trainer of this node may write the same entry
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"float32_s": times[0], "bfloat16_s": times[1], "key": json.loads(key)}))
        tmp.replace(entry)
    except OSError:
        pass  # a read-only cache only costs a measurement next time
    return times


def _time_one_layer(config, device: torch.device) -> tuple[float, float]:
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    config.num_hidden_layers = 1
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        layer = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (8, 64), generator=generator).to(device)

    def work(dtype: torch.dtype) -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            layer(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
            with torch.no_grad():
                for t in range(16):
                    layer(input_ids=ids[:, t:t + 1])
        layer.zero_grad(set_to_none=True)

    def fastest(dtype: torch.dtype) -> float:
        times = []
        for _ in range(4):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            work(dtype)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return min(times[1:])

    return fastest(torch.float32), fastest(torch.bfloat16)


def bf16_slowdown(device: torch.device, size: int = 256, repeats: int = 5) -> float:
    """The time of a (size x size) @ (size x size) matmul in bfloat16 over its time in float32 on `device`, each the
    fastest of `repeats` after one warm-up: tens of milliseconds on a CPU that emulates bf16."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(device) for _ in range(2))

    def fastest(dtype: torch.dtype) -> float:
        x, y = a.to(dtype), b.to(dtype)
        times = []
        for _ in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            x @ y
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return min(times[1:])

    with torch.no_grad():
        return fastest(torch.bfloat16) / fastest(torch.float32)


def emulation_warning(keys: list[str], machine: str, slowdown: float) -> str:
    """The one start-up line for agents whose explicit bfloat16 (`keys`: their dotted dtype keys) is emulated."""
    auto = "float16 with loss scaling" if machine.startswith("GPU") else "float32"
    return (f"WARNING: {', '.join(keys)}: bfloat16 is emulated on {machine}: a bf16 matmul probe took "
            f"{slowdown:.1f}x the time of float32 there; set {'them' if len(keys) > 1 else 'it'} to auto "
            f"({auto} on this device) or float32")
