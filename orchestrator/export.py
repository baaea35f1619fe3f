"""`marsi export`: an agent's weights at a checkpoint, written as a plain Hugging Face model."""

from __future__ import annotations

from pathlib import Path

from orchestrator.checkpoint_files import checkpoint_path
from protocols.config import load_config
from protocols.errors import describe


def cmd_export(args) -> int:
    """Write an agent's weights at a checkpoint as a plain HF model: an adapter agent's adapter merged into its
    base (float32), a full-model agent's weights as saved, a frozen agent's source."""
    from orchestrator import runstore

    with runstore.run_view(args.run_dir) as run_dir:
        return _export_run(args, run_dir)


def _export_run(args, run_dir: Path) -> int:
    import shutil
    import tempfile

    from orchestrator.checkpoint_files import checkpoint_problem
    from orchestrator.runlog import RunLog
    from protocols.config import ConfigError

    out = Path(args.out)
    config = load_config(run_dir / "config.yaml", check_imports=False)
    if args.agent not in config.agents:
        raise ConfigError(f"--agent {args.agent}: no such agent in {run_dir}; agents: {', '.join(config.agents)}")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out}: not empty; give a new or empty directory")
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot create or write this directory ({exc.strerror or describe(exc)}); "
                          "give one where you can write, e.g. --out ./exported") from None
    try:
        checkpoint = checkpoint_path(args.checkpoint, RunLog(run_dir))
        problem = checkpoint_problem(checkpoint)
        if problem:
            raise FileNotFoundError(f"checkpoint {checkpoint} is damaged ({problem}); export another with "
                                    "--checkpoint step-N")
        _export(config.agents[args.agent], checkpoint, args.agent, out)
    except BaseException:
        if made:
            shutil.rmtree(out, ignore_errors=True)  # made for this export, which did not finish
        raise
    print(f"marsi: wrote agent {args.agent!r} at {checkpoint.name} to {out} "
          f"({'adapter merged into ' + config.agents[args.agent].model if config.agents[args.agent].adapter else 'full model'})")
    return 0


def _export(agent, checkpoint, name: str, out: Path) -> None:
    """Write agent `name`'s model of `checkpoint` to `out`: its files are fetched from the store into a
    temporary directory, each checked against the checkpoint's manifest."""
    import tempfile

    from agent_trainer import storage
    from orchestrator.checkpoint_files import agent_files

    with tempfile.TemporaryDirectory(prefix="marsi-export-") as tmp:
        problem = storage.download(checkpoint / "agents" / name, agent_files(checkpoint, name), Path(tmp))
        if problem:
            raise FileNotFoundError(f"checkpoint {checkpoint}: agents/{name}/{problem}")
        model, tokenizer = _exported_model(agent, Path(tmp))
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)


def _exported_model(agent, source: Path):
    """(model, tokenizer) of a checkpoint's agent directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_trainer.adapters import ADAPTER_DIR, merged_model
    from agent_trainer.models import load_model

    if agent.adapter is not None:
        saved = source / ADAPTER_DIR if (source / ADAPTER_DIR).is_dir() else agent.adapter.path  # frozen: its source
        if saved is None:
            return load_model(agent.model, tokenizer=agent.tokenizer)  # a frozen, fresh adapter is the base
        return merged_model(agent, Path(saved))
    if (source / "model").is_dir():  # the trainer saved its tokenizer beside the weights
        return AutoModelForCausalLM.from_pretrained(source / "model"), AutoTokenizer.from_pretrained(source / "model")
    return load_model(agent.model, tokenizer=agent.tokenizer)  # no update yet (source.json): the model's own weights
