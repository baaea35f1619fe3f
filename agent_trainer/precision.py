"""The dtype an agent computes in: `dtype: auto` resolved from what its device reports, and a probe that
measures what an explicit bfloat16 costs where the device only emulates it.

`resolve` is a pure function of a `Capabilities` report, so every case is tested on any machine. `capabilities`
reads the report of one device of this process: a trainer reads its own device's where it runs; `marsi validate`
reads the driver's, which describes the trainers only where they run on the same kind of machine.

The rule of `auto`: bfloat16 where the device computes it natively (a CUDA device of compute capability 8.0
or later; a CPU with AVX-512 BF16 or AMX, flags `avx512_bf16` / `amx_bf16` in /proc/cpuinfo or torch's own
CPU report), float16 with loss scaling on a CUDA device without it (V100, T4), float32 otherwise (CPUs
without those flags; ARM CPUs too, whose `bf16` feature is not counted: not measured here). `builtin:tiny`
stays float32: a d=128 model gains nothing from bf16 (a generate + update took the same time in both on an
AVX-512 BF16 CPU), and its recorded figures (the demo's) are float32.
A trainable agent keeps float32 master weights whatever its compute dtype (`agent_trainer.trainer`).
"""

from __future__ import annotations

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
    """(dtype, reason) of an agent of `model` that asks for `requested` on the reported device."""
    if requested != "auto":
        return requested, "as configured"
    if model in STAYS_FLOAT32:
        return "float32", f"auto: {model} stays float32"
    native = native_bf16(caps)
    if native:
        return "bfloat16", f"auto: {native}"
    if caps.device == "cuda":
        return "float16", f"auto: GPU {caps.gpu} has no native bf16; float16 with loss scaling"
    return "float32", f"auto: CPU has neither {' nor '.join(NATIVE_CPU_FLAGS)}"


def choose(requested: str, device: torch.device, *, model: str) -> Precision:
    """`resolve` on `device`'s report; an explicit bfloat16 where it is emulated also gets the probe's slowdown."""
    caps = capabilities(device)
    dtype, reason = resolve(requested, caps, model=model)
    if requested == "bfloat16" and native_bf16(caps) is None:
        return Precision(dtype, "as configured; emulated here", describe(caps), bf16_slowdown(device))
    return Precision(dtype, reason, describe(caps))


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
