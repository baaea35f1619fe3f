"""`dtype: auto` and the emulated-bf16 warning: every case from an injected capability report, so nothing here
depends on the test machine's CPU or GPU."""

from __future__ import annotations

import math

import pytest
import torch

from agent_trainer import precision
from agent_trainer.precision import MEASURED, Capabilities, cpu_report, decide, resolve
from agent_trainer.trainer import AgentTrainer
from orchestrator.coordinator import Coordinator
from protocols.config import AgentConfig, AlgorithmConfig, validate_config
from protocols.messages import Experience, GenerateRequest, UpdateRequest
from tests.envs import config
from tests.errors_doc import assert_quoted
from tests.test_rl_correctness import tiny_variant

MODEL = "/models/some-llm"  # any model but builtin:tiny

AVX512_BF16 = Capabilities(device="cpu", cpu_model="Intel Xeon 8480", cpu_flags=frozenset({"avx512_bf16", "amx_bf16"}))
ZEN4 = Capabilities(device="cpu", cpu_model="AMD EPYC 9654", cpu_flags=frozenset({"avx512_bf16"}))
AMX_ONLY = Capabilities(device="cpu", cpu_model="Some CPU", cpu_flags=frozenset({"amx_bf16"}))
AVX2 = Capabilities(device="cpu", cpu_model="AMD EPYC 7B12")
A100 = Capabilities(device="cuda", cpu_model="AMD EPYC", gpu="NVIDIA A100-SXM4-80GB", cuda_bf16=True)
T4 = Capabilities(device="cuda", cpu_model="Intel Xeon", cpu_flags=frozenset({"avx512_bf16"}), gpu="Tesla T4")


@pytest.mark.parametrize("caps, dtype, reason", [
    (AVX512_BF16, MEASURED, "auto: CPU has avx512_bf16 and amx_bf16"),
    (ZEN4, MEASURED, "auto: CPU has avx512_bf16"),
    (AMX_ONLY, MEASURED, "auto: CPU has amx_bf16"),
    (AVX2, "float32", "auto: CPU has neither avx512_bf16 nor amx_bf16"),
    (A100, MEASURED, "auto: GPU NVIDIA A100-SXM4-80GB computes bf16"),
    (T4, "float16", "auto: GPU Tesla T4 has no native bf16; float16 with loss scaling"),  # the CPU's flags don't count
])
def test_auto_follows_what_the_device_reports(caps, dtype, reason):
    assert resolve("auto", caps, model=MODEL) == (dtype, reason)


@pytest.mark.parametrize("caps", [AVX512_BF16, AVX2, A100, T4])
def test_an_explicit_dtype_and_the_tiny_builtin_are_left_as_they_are(caps):
    assert resolve("float32", caps, model=MODEL) == ("float32", "as configured")
    assert resolve("bfloat16", caps, model=MODEL) == ("bfloat16", "as configured")
    assert resolve("auto", caps, model="builtin:tiny") == ("float32", "auto: builtin:tiny stays float32")


@pytest.mark.parametrize("float32_s, bfloat16_s, dtype", [
    (2.3, 1.0, "bfloat16"),    # an AMD EPYC with avx512_bf16 (SmolLM2)
    (1.0, 1.1, "float32"),     # an Intel Xeon with the same flag
    (1.0, 0.97, "float32"),    # within the margin: float32, at most 5% slower than bf16
    (1.0, 0.95, "bfloat16"),
])
def test_where_bf16_is_native_auto_takes_the_dtype_measured_faster(float32_s, bfloat16_s, dtype):
    chosen, reason = decide(float32_s, bfloat16_s, "CPU has avx512_bf16")
    assert chosen == dtype
    assert reason == f"auto: CPU has avx512_bf16; bf16 measured {float32_s / bfloat16_s:.2f}x as fast as float32 on this " \
                     "model's shapes"


def test_the_measurement_is_real_cached_per_shape_and_survives_a_bad_cache_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("MARSI_CACHE", str(tmp_path / "cache"))
    source = tiny_variant(tmp_path, "not-the-builtin")
    calls = []
    real = precision._time_one_layer
    monkeypatch.setattr(precision, "_time_one_layer", lambda config, device: calls.append(config) or real(config, device))
    first = precision.measure(source, torch.device("cpu"), ZEN4)
    assert len(calls) == 1 and all(s > 0 for s in first)
    assert precision.measure(source, torch.device("cpu"), ZEN4) == first and len(calls) == 1  # a restart reads it
    assert precision.measure(source, torch.device("cpu"), AVX512_BF16) and len(calls) == 2  # another machine measures
    (entry,) = [f for f in (tmp_path / "cache" / "precision").iterdir() if json_of(f)["key"]["machine"].startswith(
        "CPU AMD")]
    entry.write_text("{not json")
    assert precision.measure(source, torch.device("cpu"), ZEN4) and len(calls) == 3  # measured again, not raised


def json_of(path):
    import json

    return json.loads(path.read_text())


def test_auto_is_the_default_and_validated():
    assert AgentConfig(model=MODEL).dtype == "auto"
    with pytest.raises(ValueError, match="dtype"):
        AgentConfig(model=MODEL, dtype="bf16")


def test_cpu_flags_are_read_from_cpuinfo_on_x86_and_arm():
    x86 = "processor\t: 0\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
    assert cpu_report(x86) == ("AMD EPYC 9654", frozenset({"avx512_bf16"}))
    sapphire = "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: avx512_bf16 amx_bf16 amx_tile amx_int8\n"
    assert cpu_report(sapphire)[1] == {"avx512_bf16", "amx_bf16"}
    avx2 = "model name\t: AMD EPYC 7B12\nflags\t\t: fpu avx avx2 fma\n"
    assert cpu_report(avx2) == ("AMD EPYC 7B12", frozenset())
    graviton = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU implementer\t: 0x41\n"
    assert cpu_report(graviton) == ("unknown CPU", frozenset())  # ARM bf16: not what auto counts as native


def test_the_trainer_resolves_auto_on_its_own_device_and_its_model_follows(tmp_path, monkeypatch):
    source = tiny_variant(tmp_path, "not-the-builtin")
    monkeypatch.setattr(precision, "measure", lambda model, device, caps: (2.0, 1.0))  # bf16 measured 2x as fast
    for caps, dtype in ((ZEN4, torch.bfloat16), (AVX2, torch.float32)):
        monkeypatch.setattr(precision, "capabilities", lambda device, caps=caps: caps)
        frozen = AgentTrainer("judge", AgentConfig(model=source), AlgorithmConfig(), trainable=False)
        assert frozen.agent.dtype == str(dtype).removeprefix("torch.")
        assert {p.dtype for p in frozen.model.parameters()} == {dtype}
        trainable = AgentTrainer("a", AgentConfig(model=source), AlgorithmConfig())
        assert trainable.compute_dtype == dtype and {p.dtype for p in trainable.model.parameters()} == {torch.float32}
        assert trainable.precision.slowdown is None  # auto never runs the probe


def test_the_vllm_engine_gets_the_resolved_dtype_unless_it_names_its_own(monkeypatch):
    from agent_trainer import engine_kinds, engine_vllm

    made = []
    monkeypatch.setattr(engine_vllm, "VLLMEngine", lambda **kwargs: made.append(kwargs["dtype"]))
    for vllm in ({}, {"dtype": "float32"}):
        agent = AgentConfig(model=MODEL, rollout={"engine": "vllm", "vllm": vllm})
        resolved = agent.model_copy(update={"dtype": decide(2.0, 1.0, "")[0]})  # as the trainer where bf16 measured faster
        engine_kinds.make_engine(resolved, None, model_path=MODEL, tokenizer_path=MODEL, stop_ids=[], pad_id=0,
                            device=torch.device("cpu"), seed=0, autocast=None)
    assert made == ["bfloat16", "float32"]


def _start(raw, capsys):
    with Coordinator(validate_config(raw)) as coord:
        seen = capsys.readouterr()
        return coord.precision, seen.out, seen.err


def test_a_forced_bfloat16_on_a_device_without_it_warns_once_with_the_measured_slowdown(monkeypatch, capsys):
    monkeypatch.setattr(precision, "capabilities", lambda device: AVX2)  # the report; the probe's maths is real
    raw = config()
    for agent in raw["agents"].values():
        agent["dtype"] = "bfloat16"
    chosen, out, err = _start(raw, capsys)
    warnings = [line for line in err.splitlines() if "bfloat16 is emulated" in line]
    assert len(warnings) == 1, err
    assert warnings[0].startswith("marsi: WARNING: agents.a.dtype, agents.b.dtype: bfloat16 is emulated on CPU AMD EPYC "
                                  "7B12 (avx512_bf16 no, amx_bf16 no): a bf16 matmul probe took ")
    assert warnings[0].endswith("x the time of float32 there; set them to auto (float32 on this device) or float32")
    assert_quoted(warnings[0])
    assert all(p["dtype"] == "bfloat16" and math.isfinite(p["slowdown"]) and p["slowdown"] > 0 for p in chosen.values())
    assert "marsi: precision: a bfloat16 (as configured; emulated here); b bfloat16 (as configured; emulated here)" in out


def test_no_warning_where_bfloat16_is_native_or_not_asked_for(monkeypatch, capsys):
    monkeypatch.setattr(precision, "capabilities", lambda device: ZEN4)
    raw = config()
    raw["agents"]["a"]["dtype"] = "bfloat16"
    chosen, out, err = _start(raw, capsys)
    assert "WARNING" not in err and {a: p["slowdown"] for a, p in chosen.items()} == {"a": None, "b": None}
    assert "marsi: precision: a bfloat16 (as configured); b float32 (auto: builtin:tiny stays float32)" in out


def test_a_float16_step_whose_scaled_gradient_overflows_is_skipped_and_the_scale_lowered():
    agent = AgentConfig(model="builtin:tiny", dtype="float16", optimizer={"lr": 1e-3},
                        generation={"max_completion_length": 4})
    trainer = AgentTrainer("a", agent, AlgorithmConfig(), seed=0)
    result = trainer.generate(GenerateRequest(prompts=["Say a", "Say b"] * 4, seed=1))
    experiences = [Experience.from_completion(c, a) for c, a in zip(result.completions, [1.0, -1.0] * 4)]
    trainer.scaler.load_state_dict({**trainer.scaler.state_dict(), "scale": 2.0 ** 60})  # the backward overflows
    before = trainer.parameters_digest()
    overflowed = trainer.update(UpdateRequest(experiences=experiences))
    assert overflowed.skipped_steps == 1 and trainer.parameters_digest() == before
    assert trainer.scaler.get_scale() == 2.0 ** 59  # halved, as GradScaler does
    trainer.scaler.load_state_dict({**trainer.scaler.state_dict(), "scale": 2.0 ** 8})
    trained = trainer.update(UpdateRequest(experiences=experiences))
    assert trained.skipped_steps == 0 and trainer.parameters_digest() != before
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
