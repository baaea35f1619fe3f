"""AgentTrainer: one agent's model, tokenizer, optimizer and learning-rate schedule, usable without Ray.

Choices a reviewer should know (they follow trl, verl and SPIRAL unless said otherwise):

- Precision: `agent.dtype: auto` is resolved here, on the trainer's own device (`agent_trainer.precision`), and
  `self.agent` holds the result, so the model, a shared base and the rollout engine all get it; `self.precision`
  says which dtype and why. A trainable agent keeps float32 master weights and AdamW state and computes in
  that dtype under autocast (float16 adds dynamic loss scaling: a step whose scaled gradient overflows is
  skipped and the scale halved), so small updates are not rounded away; a frozen agent stores its weights
  in it, and so does the KL reference model.
- Dropout is off: the model stays in eval mode during updates too (trl disables dropout likewise), so
  the update trains the policy that sampled.
- Log-probs, behaviour and trained, are those of the distribution sampled from: temperature (the one
  each completion was drawn at), top-k and top-p applied and renormalised (`agent_trainer.sampling`).
- `num_iterations == 1`: the ratio is taken against the detached current log-probs (ratio 1, the
  REINFORCE gradient); the behaviour log-probs only feed the `logp_mismatch` diagnostic. More passes
  use the behaviour log-probs as the ratio's denominator (PPO).
- A pass whose loss or gradient is not finite does not step the optimizer (its state stays clean);
  it counts in `skipped_steps`. Non-finite weights are never checkpointed.
- The learning rate is a pure function of (update count, scheduled total): after `load`, it follows
  the schedule of the total this trainer was built with at the restored update count, so extending a
  run (a larger `train.steps`) continues on the curve for the new total from where the run stands.
- `grad_norm` is the mean of the passes' pre-clipping norms.
- A prompt that several completions of a micro-batch share (a group) runs through the model once, in the
  update and in generation's prefill (`agent_trainer.shared_prompts`): the same log-probs and gradient as
  one forward per row, up to rounding, for a fraction of the prompt's compute.
- Data parallelism (`resources.num_workers` > 1, `agent_trainer.workers`): every worker gets the whole
  request and takes its share of the rows; the loss keeps the whole batch's token and sequence counts, the
  gradients are summed over the workers before clipping and stepping, and the statistics are the whole
  batch's. `self.parallel` is that hook; with one worker it takes every row and reduces nothing.
- Generation is the rollout engine's (`agent_trainer.engines`: `hf`, the decode loop on this model; `vllm`,
  a colocated vLLM engine with its own copy of the weights). The engine sleeps during an update and is
  synced with the new weights right after it (`sync_seconds`), and after `load`.
- Host kinds: this class is a full-model agent. `agent_trainer.adapters.AdapterTrainer` is the adapter agent
  (a LoRA adapter on a frozen base the agents of one host share): it overrides where the policy comes from
  (`_load_policy`), the KL reference (`_reference_model`), what the optimizer trains (`_trainable_parameters`),
  save/load/digests, and `selected` (its adapter active and its RNG state in place during a call).
- Truncated importance sampling (`agent.rollout.tis_cap`, on by default with the vllm engine or stale
  actions): the engine's behaviour log-probs mu differ from the learner's pi_old for the same weights (kernels, precision). Each
  token's policy-gradient term is multiplied by w = min(exp(log pi_old - log mu), tis_cap), detached, where
  pi_old is this update's first-pass log-prob; the PPO ratio of later passes is then taken against pi_old,
  not mu. `logp_mismatch` / `logp_gap_max` are the mean / largest |log pi_old - log mu| over tokens.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

from agent_trainer import attention, losses, precision, rng, sampling, shared_prompts
from agent_trainer.guarded_step import GuardedSteps
from agent_trainer.optimizer_offload import OptimizerOffload
from agent_trainer.engine_kinds import make_engine
from agent_trainer.engines import RolloutEngine, left_pad, model_logps
from agent_trainer.models import (
    DTYPES, SOURCE_MARKER, context_problem, fingerprint_difference, load_model, resolve_model_path, source_fingerprint,
)
from agent_trainer.workers import SingleWorker
from protocols.config import AgentConfig, AlgorithmConfig, OptimizerConfig, tis_cap_of
from protocols.errors import UserError
from protocols.messages import (
    CheckpointInfo, Completion, Experience, GenerateRequest, GenerateResult, Prompt, UpdateRequest, UpdateResult,
    WeightDigests, check_experiences,
)

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

def pick_device(num_gpus: float) -> torch.device:
    return torch.device("cuda", 0) if num_gpus > 0 and torch.cuda.is_available() else torch.device("cpu")


class AgentTrainer:
    """Generates completions for prompts and, unless frozen, updates its policy from scored completions."""

    where = "this machine"
    """How messages name the node this trainer runs on (its host sets it: `node NAME (IP, id ...)` under Ray)."""

    def __init__(self, name: str, agent: AgentConfig, algorithm: AlgorithmConfig, *, seed: int = 0,
                 total_updates: int = 1000, device: str | torch.device | None = None, trainable: bool = True,
                 kv_cache_sequences: int | None = None, staleness_bound: int = 0):
        """`kv_cache_sequences`: a vLLM engine's CPU KV-cache size in whole sequences, as the run's plan sizes it
        (`protocols.plan.RunPlan.engine_cache_sizes`); None: the agent's own `rollout.vllm` settings.
        `staleness_bound`: how many policy versions its actions may be behind (`RunPlan.staleness_bounds`), which
        `rollout.tis_cap: auto` follows."""
        self.device = torch.device(device) if device is not None else pick_device(agent.resources.num_gpus)
        self.precision = precision.choose(agent.dtype, self.device, model=agent.model)  # `auto` resolved here
        agent = agent.model_copy(update={"dtype": self.precision.dtype})  # what the model, base and engine get
        self.name, self.agent, self.algorithm, self.trainable = name, agent, algorithm, trainable
        self.tis_cap = tis_cap_of(agent.rollout, staleness_bound)
        self.total_updates = max(1, total_updates)
        self.compute_dtype = DTYPES[agent.dtype]
        _seed_everything(seed)
        loading = time.perf_counter()
        self.model, self.tokenizer = self._load_policy()
        self.model.eval()  # dropout off for good: the update trains the policy that sampled
        gen = agent.generation
        problem = context_problem(self.model.config, gen.max_prompt_length, gen.max_completion_length)
        if problem:
            raise ValueError(problem)
        self.stop_ids = sampling.stop_token_ids(self.tokenizer, self.model)
        model_path = resolve_model_path(agent.model)
        self.engine = self._make_engine(
            agent, model_path=model_path,
            tokenizer_path=resolve_model_path(agent.tokenizer) if agent.tokenizer else model_path,
            stop_ids=self.stop_ids, pad_id=self.tokenizer.pad_token_id, device=self.device, seed=seed,
            autocast=self._autocast, kv_cache_sequences=kv_cache_sequences)
        self.load_seconds = time.perf_counter() - loading  # the model, its tokenizer and its rollout engine
        # a frozen agent builds no optimizer and runs no backward pass, so it holds no gradient either. Its parameters
        # keep requires_grad: without it torch's matmul splits its products otherwise, and a frozen copy (a rollout
        # engine of its own, `rollout.placement: separate`) would sample unlike its learner by rounding
        self.ref_model = self.optimizer = self.offload = None
        if trainable:
            if algorithm.beta > 0:
                self.ref_model = self._reference_model()
            self._make_optimizer()
        self.parallel = SingleWorker()  # agent_trainer.workers.join makes it one of several data-parallel workers
        self.policy_version = 0  # updates this agent's weights have had
        self.from_checkpoint = False  # weights came from a checkpoint, not from agent.model
        self.use_chat_template = (
            gen.use_chat_template if gen.use_chat_template is not None else bool(self.tokenizer.chat_template)
        )
        self._template_opening: str | None = None  # the chat template's first special token, found on first use
        self._said_pretemplated = False

    # ------------------------------------------------------------------------------------ generate
    def generate(self, request: GenerateRequest) -> GenerateResult:
        start = time.perf_counter()
        if request.policy_version is not None and request.policy_version != self.policy_version:
            raise ValueError(f"agent {self.name!r}: a generate planned for policy version {request.policy_version} "
                             f"reached weights at version {self.policy_version}")
        gen = self.agent.generation
        temperature = gen.temperature if request.temperature is None else request.temperature
        first, last = self.parallel.rows(len(request.prompts))  # this worker's share of the rows
        prompts = [self.encode_prompt(p) for p in request.prompts[first:last]]
        rollouts = self.engine.generate([ids for ids, _ in prompts], temperature=temperature, seed=request.seed,
                                        max_new_tokens=request.max_completion_length or gen.max_completion_length,
                                        first_row=first, total_rows=len(request.prompts)) if prompts else []
        completions = []
        for (ids, truncated), rollout in zip(prompts, rollouts):
            row, stopped = rollout.completion_ids, rollout.finish_reason == "stop"
            completions.append(Completion(
                text=self.tokenizer.decode(row[:-1] if stopped else row, skip_special_tokens=True),
                prompt_ids=ids, completion_ids=row, per_token_logps=rollout.per_token_logps,
                finish_reason=rollout.finish_reason, prompt_truncated=truncated, temperature=temperature,
                policy_version=self.policy_version,
            ))
        return GenerateResult(agent=self.name, completions=completions, seconds=time.perf_counter() - start)

    def encode_prompt(self, prompt: Prompt) -> tuple[list[int], bool]:
        """Token ids of a prompt (chat template applied when enabled), cut to max_prompt_length from the left.
        With `use_chat_template` unset, a text prompt that already opens with the template's first special
        token (it was templated by its author) is used as written, and that is said once."""
        if self.use_chat_template and self._pretemplated(prompt):
            ids = self.tokenizer(prompt, add_special_tokens=False).input_ids
        elif self.use_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
        else:
            text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
            ids = self.tokenizer(text).input_ids
        limit = self.agent.generation.max_prompt_length
        return (ids[-limit:], True) if len(ids) > limit else (ids, False)

    def _pretemplated(self, prompt: Prompt) -> bool:
        if self.agent.generation.use_chat_template is not None or not isinstance(prompt, str):
            return False
        if self._template_opening is None:
            rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
            first = self.tokenizer(rendered, add_special_tokens=False).input_ids[:1]
            special = first and first[0] in set(self.tokenizer.all_special_ids) | set(self.tokenizer.added_tokens_decoder)
            self._template_opening = self.tokenizer.decode(first) if special else ""
        if not self._template_opening or not prompt.startswith(self._template_opening):
            return False
        if not self._said_pretemplated:
            self._said_pretemplated = True
            print(f"marsi: agent {self.name!r}: a prompt already opens with the chat template's "
                  f"{self._template_opening!r}; it is used as written, not templated again (set "
                  "agents.NAME.generation.use_chat_template to decide)", file=sys.stderr, flush=True)
        return True

    # -------------------------------------------------------------------------------------- update
    def update(self, request: UpdateRequest) -> UpdateResult:
        """Train on scored completions, then put the new weights into the rollout engine."""
        start = time.perf_counter()
        if not self.trainable:
            raise ValueError(f"agent {self.name!r} is frozen (schedule.frozen): it has no optimizer and never updates")
        experiences = [e for e in request.experiences if e.completion_ids]
        if not experiences:
            raise ValueError(f"agent {self.name!r}: update needs at least one experience with completion tokens")
        check_experiences(self.name, experiences)
        if self.algorithm.num_iterations > 1 and any(e.old_per_token_logps is None for e in experiences):
            raise ValueError(f"agent {self.name!r}: num_iterations > 1 needs old_per_token_logps in every experience")
        self.engine.sleep()  # an engine sharing the GPU frees its memory for the update
        try:
            result = self._learn(experiences)
        finally:
            sync_start = time.perf_counter()
            self.engine.sync(self.model)  # the next generate samples from the new weights
            sync_seconds = time.perf_counter() - sync_start
        return result.model_copy(update={"seconds": time.perf_counter() - start, "sync_seconds": sync_seconds})

    def _learn(self, experiences: list[Experience]) -> UpdateResult:
        """The optimizer steps of one update: `num_iterations` passes over the experiences in micro-batches of
        similar lengths (`by_length`)."""
        alg, mb = self.algorithm, self.agent.micro_batch_size
        experiences = by_length(experiences)
        total_tokens = float(sum(len(e.completion_ids) for e in experiences))
        total_sequences = float(len(experiences))
        first, last = self.parallel.rows(len(experiences))
        experiences = experiences[first:last]  # this worker's share; the normalisers above stay the whole batch's
        lr = self.agent.optimizer.lr * self._lr_factor(self.policy_version)
        self.offload.resident()  # fetched in the background when the schedule's plan saw this update coming
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        tis_cap = self.tis_cap
        stats = dict.fromkeys(("loss", "kl", "entropy", "clipped", "mismatch", "mismatch_tokens", "gap_max",
                               "tis_weight", "tis_truncated", "tis_tokens"), 0.0)
        first_logps: dict[int, torch.Tensor] = {}  # TIS: the learner's log-probs before the update, per micro-batch
        steps = GuardedSteps()
        for iteration in range(alg.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            finite = True
            for i in range(0, len(experiences), mb):
                batch = _collate(experiences[i:i + mb], self.tokenizer.pad_token_id, self.agent.generation.temperature,
                                 self.device)
                completion_mask, behaviour = batch.completion_mask, batch.behaviour
                per_token_logps, candidate_logits = self._token_logps(self.model, batch)  # (B, T), (B, T, K)
                if iteration == 0 and behaviour is not None:
                    gap = (per_token_logps.detach() - behaviour).abs() * completion_mask  # (B, T)
                    stats["mismatch"] += float(gap.sum())
                    stats["mismatch_tokens"] += float(completion_mask.sum())
                    stats["gap_max"] = max(stats["gap_max"], float(gap.max()))
                weights = None
                if tis_cap is not None and behaviour is not None:
                    old = first_logps.setdefault(i, per_token_logps.detach())  # (B, T) pi_old, the PPO denominator
                    weights = losses.truncated_importance_weights(old, behaviour, tis_cap)  # (B, T)
                    if iteration == 0:
                        stats["tis_weight"] += float((weights * completion_mask).sum())
                        stats["tis_truncated"] += float(((weights >= tis_cap) * completion_mask).sum())
                        stats["tis_tokens"] += float(completion_mask.sum())
                elif alg.num_iterations == 1 or behaviour is None:
                    old = per_token_logps.detach()
                else:
                    old = behaviour
                per_token_loss, clipped = losses.clipped_policy_loss(per_token_logps, old, batch.advantages, alg.epsilon)
                if weights is not None:
                    per_token_loss = per_token_loss * weights
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref, _ = self._token_logps(self.ref_model, batch)
                    kl = losses.kl_k3(per_token_logps, ref)  # (B, T)
                    per_token_loss = per_token_loss + alg.beta * kl
                    stats["kl"] += float((kl.detach() * completion_mask).sum())
                loss = losses.aggregate_loss(per_token_loss, completion_mask, alg.loss_aggregation,
                                             total_tokens, total_sequences)
                loss_value = float(loss.detach())
                stats["loss"] += loss_value
                if not math.isfinite(loss_value):
                    finite = False
                    break
                self.scaler.scale(loss).backward()
                with torch.no_grad():
                    stats["entropy"] += float((losses.entropy_from_logits(candidate_logits.detach()) * completion_mask).sum())
                    stats["clipped"] += float((clipped.float() * completion_mask).sum())
            finite = self.parallel.reduce_gradients(self.model.parameters(), finite)  # the whole batch's gradient
            steps.step(self.optimizer, self.model.parameters(), max_grad_norm=self.agent.optimizer.max_grad_norm,
                       finite=finite, scaler=self.scaler)
        self.optimizer.zero_grad(set_to_none=True)
        self.offload.changed()
        self.policy_version += 1
        self.parallel.reduce_stats(stats, maxima=("gap_max",))  # the whole batch's sums
        n = alg.num_iterations
        tis_tokens = stats["tis_tokens"]
        return UpdateResult(
            agent=self.name, policy_version=self.policy_version, loss=stats["loss"] / n, grad_norm=steps.mean_grad_norm,
            kl=stats["kl"] / (n * total_tokens), entropy=stats["entropy"] / (n * total_tokens),
            clip_fraction=stats["clipped"] / (n * total_tokens), lr=lr, num_tokens=int(total_tokens),
            num_sequences=int(total_sequences), seconds=0.0, skipped_steps=steps.skipped,
            logp_mismatch=stats["mismatch"] / stats["mismatch_tokens"] if stats["mismatch_tokens"] else None,
            logp_gap_max=stats["gap_max"] if stats["mismatch_tokens"] else None,
            tis_weight=stats["tis_weight"] / tis_tokens if tis_tokens else None,
            tis_truncated=stats["tis_truncated"] / tis_tokens if tis_tokens else None,
        )

    def per_token_logps(self, experiences: list[Experience]) -> list[list[float]]:
        """Current log-probs of each experience's completion tokens under the sampling distribution (no gradient)."""
        batch = _collate(experiences, self.tokenizer.pad_token_id, self.agent.generation.temperature, self.device)
        with torch.no_grad():
            logps, _ = self._token_logps(self.model, batch)
        return [logps[i, :len(e.completion_ids)].tolist() for i, e in enumerate(experiences)]

    def score(self, experiences: list[Experience], *, engine: bool = False) -> list[list[float]]:
        """Log-probs of each experience's completion tokens under the full softmax at temperature 1, by the
        learner's model or (`engine=True`) by the rollout engine: equal up to numerics when the engine holds the
        learner's weights."""
        prompts, completions = [e.prompt_ids for e in experiences], [e.completion_ids for e in experiences]
        if engine:
            return self.engine.score(prompts, completions)
        with self._autocast():
            return model_logps(self.model, prompts, completions, self.device)

    def hold_optimizer(self, keep: bool) -> None:
        """The schedule's plan (`orchestrator.memory_plan`): `keep` False releases the optimizer state, True fetches
        a released one back in the background (`agent_trainer.optimizer_offload`); a frozen agent has none."""
        if self.offload is not None:
            self.offload.prefetch() if keep else self.offload.release()

    def close(self) -> None:
        """Release the rollout engine (a vLLM engine holds its own weights and KV cache) and the optimizer's
        scratch file."""
        self.engine.close()
        if self.offload is not None:
            self.offload.close()

    # ---------------------------------------------------------------------------------- save/load
    def save(self, path: str | Path) -> CheckpointInfo:
        """Weights (the fp32 master weights of a trainable agent) in HF format under `path/model`; optimizer,
        loss scale, update count and RNGs in `path/trainer_state.pt`. While the weights are still the
        agent's model's (no update yet), `path/source.json` names that model instead of a copy of its weights;
        a frozen agent writes nothing else."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self._weights_are_source():
            (path / SOURCE_MARKER).write_text(json.dumps(
                {"model": self.agent.model, "fingerprint": source_fingerprint(self.agent.model)}))
            if self.trainable:
                self.save_training_state(path)
            return self._checkpoint_info(path)
        refuse_nonfinite(self.name, "weight", dict(self.model.named_parameters()))
        self.model.save_pretrained(path / "model")
        self.tokenizer.save_pretrained(path / "model")
        self.save_training_state(path)
        return self._checkpoint_info(path)

    def _checkpoint_info(self, path: Path) -> CheckpointInfo:
        return CheckpointInfo(agent=self.name, path=str(path), policy_version=self.policy_version)

    def _weights_are_source(self) -> bool:
        """Whether the weights are still exactly those loaded from `agent.model`."""
        return self.policy_version == 0 and not self.from_checkpoint

    def save_training_state(self, path: Path) -> None:
        """Optimizer, loss scale, update count and RNGs: `path/trainer_state.pt` (every host kind writes it). A
        released optimizer state is fetched for it and released again (its copy is still current)."""
        with self.offload.held() if self.offload is not None else contextlib.nullcontext():
            torch.save({
                "optimizer": self.optimizer.state_dict() if self.optimizer else None,
                "scaler": self.scaler.state_dict() if self.optimizer else None, "policy_version": self.policy_version,
                "rng": rng.capture(),
            }, path / "trainer_state.pt")

    def load_training_state(self, path: Path) -> None:
        """What `save_training_state` wrote; a fresh optimizer where it was saved while frozen."""
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        self.policy_version = state["policy_version"] if "policy_version" in state else state["step"]
        if self.trainable:
            self._make_optimizer()
            if state.get("optimizer") is not None:  # None: saved while frozen; a fresh optimizer starts here
                self.optimizer.load_state_dict(state["optimizer"])
                self.scaler.load_state_dict(state["scaler"])
        rng.restore(state["rng"])

    def load(self, path: str | Path, *, checkpoint: str | None = None) -> CheckpointInfo:
        """Load what `save` wrote at `path`; `checkpoint` is how messages name it (the checkpoint in the store,
        where `path` is a copy staged on this node), `path` itself by default."""
        path = Path(path)
        marker = path / SOURCE_MARKER
        if marker.exists():  # the weights are agent.model's
            saved = json.loads(marker.read_text())
            check_same_source(self.name, saved, {"model": self.agent.model, "fingerprint": source_fingerprint(self.agent.model)},
                              checkpoint=checkpoint or str(path), where=self.where)
            if not self._weights_are_source():  # trained since it started: back to the model's weights
                self._set_weights(load_model(self.agent.model, tokenizer=self.agent.tokenizer, device=self.device,
                                             dtype=str(self.model.dtype).removeprefix("torch."))[0])
                self.from_checkpoint = False
            if not (path / "trainer_state.pt").exists():  # a frozen agent's: nothing else was saved
                self.policy_version = 0
                return self._checkpoint_info(path)
        else:
            self._set_weights(AutoModelForCausalLM.from_pretrained(path / "model", dtype=self.model.dtype))
            self.from_checkpoint = True
        self.load_training_state(path)
        return self._checkpoint_info(path)

    def published_weights(self) -> dict[str, torch.Tensor]:
        """The policy's weights, for a rollout engine in another process (`rollout.placement: separate`): the live
        tensors (`Agent.published_weights` packs them for the object store, which copies them)."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def take_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Sample with these weights, published by the agent's learner at policy `version`, from now on (an engine
        process: its weights never train)."""
        self.model.load_state_dict(weights)
        self.engine.sync(self.model)
        self.policy_version = version

    def receive_weights(self, channel, version: int) -> None:
        """Receive the weights of policy `version` over `channel` (`weight_channel.WeightChannel`) into the ones it
        samples with (`published_weights`: the full model's, or an adapter agent's adapter), in place. Until they
        are all in, the trainer holds no policy version: a transfer cut short leaves nothing a generate accepts."""
        from agent_trainer.weight_channel import ChannelRefused

        held, self.policy_version = self.policy_version, -1
        try:
            channel.receive(self.published_weights(), version, owner=self.model)
        except ChannelRefused:  # refused before anything moved: the weights are those of the version it held
            self.policy_version = held
            raise
        self.engine.sync(self.model)
        self.policy_version = version

    def _set_weights(self, model) -> None:
        """Make `model` the policy, on this trainer's device, and put its weights into the rollout engine."""
        attention.use(model)
        self.model = model.to(self.device).eval()
        self.engine.sync(self.model)

    def parameters_digest(self) -> str:
        """SHA-256 of the weights this agent computes with: equal digests mean equal weights."""
        return weights_digest(dict(self.model.named_parameters()))

    def weight_digests(self) -> WeightDigests:
        """The digest in the two parts an adapter agent has: the base and its own adapter (none here)."""
        return WeightDigests(base=self.parameters_digest(), adapter="")

    # ----------------------------------------------------------------------------- host kind hooks
    def _load_policy(self):
        """The policy model and tokenizer: the agent's own copy, float32 master weights when trainable."""
        agent = self.agent
        return load_model(agent.model, tokenizer=agent.tokenizer, device=self.device,
                          dtype="float32" if self.trainable else agent.dtype)

    def _make_engine(self, agent: AgentConfig, **kwargs) -> RolloutEngine:
        """The rollout engine `agent.rollout` names, over this trainer's model (`engine_kinds.make_engine`)."""
        return make_engine(agent, self.model, **kwargs)

    def _reference_model(self):
        """The KL reference: a frozen copy of the initial policy in the compute dtype."""
        return copy.deepcopy(self.model).to(self.compute_dtype).requires_grad_(False)

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def selected(self, *, updating: bool = False):
        """The context every call of this agent runs in (a host's agents take turns): nothing to switch for
        an agent that has its process's model to itself."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------------------------ internals
    def _make_optimizer(self) -> None:
        if self.offload is not None:  # a restored state replaces the released one
            self.offload.close()
        opt = self.agent.optimizer
        params = self._trainable_parameters()
        self.optimizer = torch.optim.AdamW(
            params, lr=opt.lr, betas=opt.betas,
            weight_decay=opt.weight_decay, fused=True,  # fused kernels on CPU and GPU: ~5x faster steps on CPU
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.compute_dtype == torch.float16)
        self.offload = OptimizerOffload(self.optimizer, device=self.device, label=self.name)

    def _lr_factor(self, step: int) -> float:
        """Multiplier of the base learning rate at update `step` (0-based) of `total_updates`."""
        return lr_factor(self.agent.optimizer, step, self.total_updates)

    def _autocast(self):
        """Compute in agent.dtype over float32 master weights (trainable agents); frozen ones hold agent.dtype."""
        if self.compute_dtype == torch.float32 or not self.trainable:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _token_logps(self, model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) log-probs of the completion tokens under the sampling distribution (each row at its own
        temperature, top-k / top-p applied, the token itself always kept), and the (B, T, K) candidate logits
        they are normalised over; each distinct prompt runs once."""
        with self._autocast():
            logits = shared_prompts.completion_logits(model, batch.prompt_ids, batch.prompt_mask, batch.prompt_index,
                                                      batch.completion_ids, batch.completion_mask)  # (B, T, V)
        gen = self.agent.generation
        return sampling.token_logps(logits, batch.completion_ids, batch.temperatures.view(-1, 1, 1), gen.top_k,
                                    gen.top_p)


def lr_factor(opt: OptimizerConfig, step: int, total: int) -> float:
    """Multiplier of `opt.lr` at update `step` (0-based) of `total`: warm-up, then the schedule's decay."""
    if step < opt.warmup_steps:
        return (step + 1) / (opt.warmup_steps + 1)
    progress = min(1.0, (step - opt.warmup_steps) / max(1, total - opt.warmup_steps))
    if opt.lr_schedule == "linear":
        return 1.0 - progress
    if opt.lr_schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


def weights_digest(named: dict[str, torch.Tensor]) -> str:
    """SHA-256 of named tensors' names and bytes: equal digests mean equal weights."""
    h = hashlib.sha256()
    for key, p in sorted(named.items()):
        h.update(key.encode())
        h.update(p.detach().cpu().float().numpy().tobytes())
    return h.hexdigest()


def refuse_nonfinite(agent: str, kind: str, named: dict[str, torch.Tensor]) -> None:
    """Raise rather than checkpoint weights with a non-finite value; the last good checkpoint stays the newest."""
    bad = [n for n, p in named.items() if not bool(torch.isfinite(p).all())]
    if bad:
        raise ValueError(f"agent {agent!r}: {len(bad)} {kind} tensors are not finite (first: {bad[0]}); "
                         "refusing to write a checkpoint from them; the last good checkpoint stays the newest")


def by_length(experiences: list[Experience]) -> list[Experience]:
    """Experiences ordered by prompt length, prompt, then completion length: micro-batches of neighbours pad
    little (prompts are left-padded, completions right-padded, each to the longest in its micro-batch) and
    keep a prompt's completions together, so that it runs once (`shared_prompts`). The loss is a sum over
    experiences normalised by whole-batch counts, so the order changes only rounding."""
    return sorted(experiences, key=lambda e: (len(e.prompt_ids), e.prompt_ids, len(e.completion_ids)))


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _right_pad(rows: list[list[float]], pad, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    values = torch.full((len(rows), width), pad, dtype=dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        values[i, :len(r)] = torch.tensor(r, dtype=dtype)
        mask[i, :len(r)] = 1
    return values.to(device), mask.to(device)


class Batch(NamedTuple):
    """A micro-batch on the device: the distinct left-padded prompts (U, P) and, per row, (B,) the index of its
    prompt, the right-padded completion ids and mask (B, T), advantage, old log-probs (B, T) or None, and
    sampling temperature."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    prompt_index: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    behaviour: torch.Tensor | None
    temperatures: torch.Tensor


def _collate(experiences: list[Experience], pad: int, temperature: float, device) -> Batch:
    """`experiences` as a `Batch`; an experience without a temperature was sampled at `temperature`."""
    prompt_ids, prompt_mask = left_pad([e.prompt_ids for e in experiences], pad, device)
    prompt_ids, prompt_mask, prompt_index = shared_prompts.distinct_rows(prompt_ids, prompt_mask)
    completion_ids, completion_mask = _right_pad([e.completion_ids for e in experiences], pad, torch.long, device)
    advantages = torch.tensor([e.advantage for e in experiences], dtype=torch.float32, device=device)
    temperatures = torch.tensor([e.temperature or temperature for e in experiences], dtype=torch.float32, device=device)
    old = None
    if all(e.old_per_token_logps is not None for e in experiences):
        old, _ = _right_pad([e.old_per_token_logps for e in experiences], 0.0, torch.float32, device)
    return Batch(prompt_ids, prompt_mask, prompt_index, completion_ids, completion_mask, advantages, old, temperatures)


class ModelChanged(UserError, ValueError):
    """A checkpoint names its agent's model instead of copying its weights, and that model is not the same here."""


def check_same_source(agent: str, saved: dict, now: dict, *, checkpoint: str, where: str) -> None:
    """Raise ModelChanged unless the model (and adapter) files a checkpoint's `source.json` records (`saved`) have
    the contents of those on this node (`now`); the message names the checkpoint, the node, the path and whether
    the contents or only the times differ."""
    for key, fingerprint in (("model", "fingerprint"), ("adapter", "adapter_fingerprint")):
        if saved.get(key) != now.get(key):
            raise ModelChanged(f"agent {agent!r}: checkpoint {checkpoint} refers to {key} {saved.get(key)!r}, but the "
                               f"config now gives {now.get(key)!r}; restore agents.{agent}.{'adapter.path' if key == 'adapter' else key} "
                               "or start a new run")
        difference = fingerprint_difference(saved.get(fingerprint, {}), now.get(fingerprint, {}))
        if difference:
            raise ModelChanged(f"agent {agent!r}: checkpoint {checkpoint} refers to {key} {saved[key]!r} as it was when "
                               f"saved; at {resolve_model_path(saved[key])} on {where} {difference}; put the same files "
                               "there on every node that may host the agent, or start a new run")
