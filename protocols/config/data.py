"""`data` (the task samples episodes start from) and `eval` (held-out evaluation)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field, model_validator

from protocols.config.base import _Strict, unknown_agent
from protocols.config.cluster import ResourcesConfig
from protocols.config.environment import attempts_value_problem

if TYPE_CHECKING:
    from protocols.config.run import RunConfig


class DataConfig(_Strict):
    path: str | None = None
    """A json/jsonl/csv/parquet file, or a directory written by `datasets`' `save_to_disk` (a `Dataset`, or a
    `DatasetDict` whose `split` is used), relative to the config file."""
    factory: str | None = None
    """`module:function` or `file.py:function` returning a `datasets.Dataset`."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments for `factory`."""
    hub: str | None = None
    """A dataset name for `datasets.load_dataset` (needs the hub, or its local cache)."""
    split: str = "train"
    """Split to use with `hub`, or of a saved `DatasetDict` under `path`."""
    shuffle: bool = True
    """Reshuffle the data each epoch with the run's seed."""

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        given = [k for k in ("path", "factory", "hub") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"data: set exactly one of path, factory, hub (got {given or 'none'})")
        if self.path is not None and self.kwargs:
            raise ValueError(f"data.kwargs: {sorted(self.kwargs)} would be ignored: kwargs go to data.factory or "
                             "data.hub, not data.path; remove them")
        return self


class EvalConfig(_Strict):
    data: DataConfig
    """Held-out samples (path, factory or hub, with split); none may also be a training sample."""
    every: int = Field(0, ge=0)
    """Evaluate every this many steps; always before the first step and after the last. 0: only those two."""
    episodes_per_sample: int = Field(1, ge=1)
    """Episodes played from each held-out sample (pass@k needs k of them)."""
    max_samples: int | None = Field(None, ge=1)
    """Evaluate on the first this many held-out samples; None: all."""
    temperature: float = Field(0.0, ge=0.0)
    """Sampling temperature of evaluation episodes; 0 decodes greedily."""
    environment_kwargs: dict[str, Any] = {}
    """Environment kwargs for evaluation, over `environment.kwargs` (e.g. {opponent: random})."""
    pass_k: list[int] = []
    """k values of pass@k (unbiased estimator) over each sample's episodes, where episodes report `success`, and
    over each prompt's attempts, where an attempts role's attempts report `success` (`eval/pass@k/ROLE`); each k
    at most episodes_per_sample or some role's attempts."""
    attempts: dict[str, int] = {}
    """Role -> k for evaluation episodes, over roles.attempts and the environment's own; {}: as in training."""
    partners: dict[str, dict[str, str]] = {}
    """Extra evaluations, label -> {agent: `initial` | `scripted` | a checkpoint or model directory}: that agent
    plays at its initial weights, as the environment's scripted player, or with those weights; the others as trained."""
    partner_resources: ResourcesConfig = ResourcesConfig(num_cpus=0.1)
    """Resources of each partner's trainer (a frozen copy of its agent's model that only generates); on GPUs
    give it a share, e.g. {num_gpus: 0.2}."""
    seed: int | None = None
    """Seed of evaluation episodes (the same at every evaluation, so curves compare like with like); None: train.seed."""
    transcripts: int = Field(8, ge=0)
    """Episodes of each evaluation (per setting: as trained and each partner label) written whole to
    RUN_DIR/eval_transcripts.jsonl, the first ones played; bounded in size by train.transcripts_max_mb. 0: none."""

    @model_validator(mode="after")
    def _checks(self) -> EvalConfig:
        for k in self.pass_k:
            if k < 1:
                raise ValueError(f"eval.pass_k: k={k} needs 1 <= k <= eval.episodes_per_sample "
                                 f"({self.episodes_per_sample}); raise episodes_per_sample or drop k")
        for label in self.partners:
            if not label or not all(c.isalnum() or c in "_-" for c in label):
                raise ValueError(f"eval.partners: label {label!r} must be letters, digits, '_' or '-' (it names metrics)")
        return self


def eval_problem(config: RunConfig) -> str | None:
    """Why the evaluation's partners or attempts do not fit the run's agents and roles, or a partner asks for
    several workers, or None."""
    if config.eval is None:
        return None
    for label, held in config.eval.partners.items():
        if problem := unknown_agent(f"eval.partners.{label}", list(held), config.agents):
            return problem
    for role, k in config.eval.attempts.items():
        if problem := attempts_value_problem(f"eval.attempts.{role}", role, k, config.roles.seatings()[0]):
            return problem
    if config.eval.partners and config.eval.partner_resources.num_workers > 1:
        return (f"eval.partner_resources.num_workers: {config.eval.partner_resources.num_workers}; a partner "
                "only generates for evaluations, on one worker; set eval.partner_resources.num_workers: 1")
    return None
