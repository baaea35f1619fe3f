"""`train` (steps, batch, seed, checkpoints and where they go, timeouts, transcripts, staleness) and `logging`
(metric sinks); a `train.storage` URI that carries credentials is refused."""

from __future__ import annotations

from pydantic import Field, model_validator

from protocols.config.base import _Strict


STORAGE_SCHEMES = ("file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")
"""URI schemes train.storage takes: those pyarrow.fs opens."""


def storage_problem(value: str) -> str | None:
    """Why `value` is not a usable train.storage, or None."""
    if not value.strip():
        return "train.storage: empty; leave it out (checkpoints in the run directory) or give a URI"
    scheme, sep, rest = value.partition("://")
    if not sep:
        return None  # a path (on a shared filesystem), resolved against the config file
    problem = credentials_problem(value, "train.storage")
    if problem:
        return problem
    if scheme not in STORAGE_SCHEMES:
        return (f"train.storage: scheme {scheme!r} of {value!r} is not supported; give one of "
                f"{', '.join(s + '://' for s in STORAGE_SCHEMES)}, or a path on a shared filesystem")
    if scheme == "file" and not rest.startswith("/"):
        return f"train.storage: {value!r} is not an absolute file URI; write file:///absolute/path"
    if scheme != "file" and not rest.strip("/"):
        return f"train.storage: {value!r} names no bucket or host; write {scheme}://bucket/prefix"
    return None


_SECRET_WORDS = ("key", "secret", "token", "password", "sas", "credential")
"""A URI's query option whose name holds one of these carries a credential (pyarrow's access_key, secret_key,
session_token for S3; account_key, sas_token, client_secret for Azure)."""


def credentials_problem(uri: str, what: str) -> str | None:
    """Why the storage URI `uri` (given as `what`) must be refused: it carries credentials (a password before the
    host, S3's `KEY:SECRET@`, a secret query option), which would be written to config.yaml, store.json, the store
    and reports; None when it carries none. The message shows the URI with them hidden."""
    import re
    from urllib.parse import parse_qsl, urlsplit

    try:
        parts = urlsplit(uri)
    except ValueError:
        return None
    userinfo = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else ""
    secret_options = [k for k, _ in parse_qsl(parts.query, keep_blank_values=True)
                      if any(word in k.lower() for word in _SECRET_WORDS)]
    if not (":" in userinfo or (userinfo and parts.scheme == "s3") or secret_options):
        return None
    shown = uri.replace(f"{userinfo}@", "***@") if userinfo else uri
    for option in secret_options:
        shown = re.sub(rf"([?&]{re.escape(option)}=)[^&#]*", r"\1***", shown)
    return (f"{what}: {shown!r} holds credentials, which would be written to config.yaml, store.json, the store and "
            "reports; remove them and give them as the store's client takes them: environment variables such as "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (ray.forward_env passes them to every trainer), config files "
            "or instance roles")


class TrainConfig(_Strict):
    steps: int = Field(10, ge=1)
    """Training steps."""
    batch_size: int = Field(4, ge=1)
    """Samples per step; each plays `num_generations` episodes."""
    num_generations: int = Field(4, ge=1)
    """Episodes per sample: the group over which advantages are relative."""
    seed: int = 0
    """Seed of data order, sampling and every RNG."""
    checkpoint_every: int = Field(0, ge=0)
    """Checkpoint every this many steps (and at the end); 0: only at the end."""
    keep_checkpoints: int = Field(2, ge=1)
    """Newest checkpoints kept."""
    run_dir: str = "runs/{name}-{time}"
    """Run directory; `{name}` is the config file's stem, `{time}` the start time."""
    storage: str | None = None
    """Where checkpoints go. None: `RUN_DIR/checkpoints`, which every node hosting a trainer must then see (one
    machine, or a shared filesystem; checked at start). Else a URI every node reaches: `s3://bucket/prefix`,
    `gs://...`, `hdfs://...`, `file:///shared/path`, or a path on a shared filesystem (relative to the config
    file); checkpoints go to `STORAGE/RUN_NAME/checkpoints/`, and each trainer uploads and downloads its own
    files there through pyarrow.fs (object stores take their credentials as pyarrow does: environment, config
    files, instance roles). Each checkpoint there also carries the run directory's records (config, source,
    metrics, transcripts), so `marsi resume STORAGE/RUN_NAME` continues the run from the store alone."""
    storage_timeout_s: float | None = Field(120.0, gt=0.0)
    """Seconds any one call to checkpoint storage may take (a listing, opening a file, one 8 MiB chunk read or
    written, a move), on the coordinator and on every trainer; a call that takes longer stops with one line
    naming what was being done and where (an unreachable bucket, a hung NFS mount). None waits forever."""
    max_restarts: int = Field(3, ge=0)
    """Times a dead or hung trainer is restarted (all trainers restored from the last checkpoint) before the run stops."""
    call_timeout_s: float | None = Field(3600.0, gt=0.0)
    """A generate or update taking longer than this counts as a hung trainer (Ray trainers); None waits forever."""
    checkpoint_timeout_s: float | None = Field(3600.0, gt=0.0)
    """A trainer's save or load (or its storage probe at start) taking longer than this counts as a hung trainer (Ray
    trainers); None waits forever."""
    start_timeout_s: float | None = Field(1800.0, gt=0.0)
    """Trainers not up (model loaded) this long after placement fail the start (Ray trainers); None waits forever."""
    transcripts_per_step: int = Field(2, ge=0)
    """Episodes per step written whole to transcripts.jsonl, spread over the step's samples (the first episode of
    each sample's group, then the second of each, ...), each turn with its prompt, completion, reward, advantage
    and the acting agent's policy version; `marsi report` browses them. 0: none."""
    transcripts_max_mb: float | None = Field(200.0, gt=0.0)
    """Size bound of transcripts.jsonl and of eval_transcripts.jsonl, each, in MB. A step whose transcripts would
    take a file past it writes none, and neither does any later step (metrics go on; a line on stderr says so once);
    resuming with a higher bound writes them again from there. None: no bound."""
    progress: bool = True
    """Show a progress bar."""
    max_staleness: int = Field(0, ge=0)
    """K: how many policy versions an action may be behind its learner (and its partners' learners) when an update
    uses it. 0: synchronous, every step generates then updates. K > 0: the rollouts of the next steps are played
    while the current step's updates run, as far ahead as the schedule keeps every agent within K versions (under
    `simultaneous` K steps ahead, under `alternate` 2K); each action records the version that drew it, and the
    update's importance weights are taken against its behaviour log-probs (see docs/roles-and-schedules.md,
    "Asynchronous rollouts"). Overridable per agent with `agents.NAME.rollout.max_staleness`."""

    @model_validator(mode="after")
    def _storage(self) -> TrainConfig:
        problem = storage_problem(self.storage) if self.storage is not None else None
        if problem:
            raise ValueError(problem)
        return self


class LoggingConfig(_Strict):
    tensorboard: bool = False
    """Also write TensorBoard events to RUN_DIR/tensorboard (needs the `tensorboard` extra): every scalar of every
    metrics.jsonl row, evaluation rows included, at its step; a resume drops the replayed steps' events."""
    wandb_project: str | None = None
    """Also log to this Weights & Biases project (needs the `wandb` extra), the run named after its directory:
    every scalar of every metrics.jsonl row with `step` as the x-axis, and the saved episodes as tables
    `episodes` and `eval/episodes` (one row per action: step, episode, turn, agent, role, prompt, completion,
    reward, episode_reward, advantage, policy_version). `marsi resume` continues the same W&B run.
    `WANDB_MODE=offline` keeps it under RUN_DIR/wandb/ (`wandb sync` uploads it later)."""
