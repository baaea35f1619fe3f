"""What a run keeps of its episodes: training transcripts with each action's advantage and policy version,
evaluation transcripts bounded by eval.transcripts, and the size bound train.transcripts_max_mb."""

from __future__ import annotations

import json

from orchestrator.coordinator import Coordinator
from protocols.config import validate_config
from tests.envs import HERE, config

HELD_OUT = {"factory": f"{HERE / 'envs.py'}:held_out"}


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_training_transcripts_carry_advantages_and_the_policy_version_that_acted(tmp_path):
    raw = config(train={"steps": 3, "batch_size": 2, "num_generations": 2, "transcripts_per_step": 4, "progress": False},
                 schedule={"kind": "pattern", "pattern": [["a"], ["b"]]})
    with Coordinator(validate_config(raw), tmp_path) as coord:
        coord.run()
    episodes = lines(tmp_path / "transcripts.jsonl")
    assert [e["step"] for e in episodes] == [1] * 4 + [2] * 4 + [3] * 4
    versions = {}
    for e in episodes:
        for turn in e["turns"]:
            for action in turn["actions"]:
                assert isinstance(action["advantage"], float)
                versions.setdefault((e["step"], action["agent"]), set()).add(action["policy_version"])
    # a trains at steps 1 and 3, b at step 2: each action is drawn by the weights of the updates before it
    assert versions == {(1, "a"): {0}, (1, "b"): {0}, (2, "a"): {1}, (2, "b"): {0}, (3, "a"): {1}, (3, "b"): {1}}
    # the advantages are group-relative: they sum to zero over each (sample, agent) group of one step
    for step in (1, 2, 3):
        for agent in ("a", "b"):
            total = sum(a["advantage"] for e in episodes if e["step"] == step and e["sample"] == 0
                        for t in e["turns"] for a in t["actions"] if a["agent"] == agent)
            assert abs(total) < 1e-6


def test_a_steps_transcripts_are_spread_over_its_samples(tmp_path):
    """3 samples x 4 episodes a step, 4 kept: one of each sample's group, then a second of the first sample's (the
    first 4 played were all of the first sample)."""
    raw = config(train={"steps": 2, "batch_size": 3, "num_generations": 4, "transcripts_per_step": 4, "progress": False})
    with Coordinator(validate_config(raw), tmp_path) as coord:
        coord.run()
    episodes = lines(tmp_path / "transcripts.jsonl")
    assert [(e["step"], e["sample"], e["episode"]) for e in episodes] == [
        (1, 0, 0), (1, 0, 1), (1, 1, 4), (1, 2, 8), (2, 0, 12), (2, 0, 13), (2, 1, 16), (2, 2, 20)]


def test_evaluation_transcripts_are_saved_up_to_eval_transcripts(tmp_path):
    raw = config(train={"steps": 2, "progress": False})
    raw["eval"] = {"data": dict(HELD_OUT), "episodes_per_sample": 2, "transcripts": 3}
    with Coordinator(validate_config(raw), tmp_path) as coord:
        coord.run()
    episodes = lines(tmp_path / "eval_transcripts.jsonl")
    assert [e["step"] for e in episodes] == [0] * 3 + [2] * 3  # before the first step and after the last
    first = episodes[0]
    assert first["setting"] == "" and first["episode"] == 0
    action = first["turns"][0]["actions"][0]
    assert action["prompt"].startswith("Say ") and action["advantage"] is None and action["policy_version"] == 0
    assert {a["policy_version"] for e in episodes[3:] for t in e["turns"] for a in t["actions"]} == {2}


def test_transcripts_stop_at_their_size_bound_and_say_so(tmp_path, capsys):
    raw = config(train={"steps": 3, "transcripts_per_step": 2, "progress": False})
    with Coordinator(validate_config(raw), tmp_path / "unbounded") as coord:
        coord.run()
    whole = (tmp_path / "unbounded" / "transcripts.jsonl").read_text().splitlines(keepends=True)
    first_step = sum(len(line.encode()) for line in whole[:2])
    raw["train"]["transcripts_max_mb"] = 1.5 * first_step / 1e6  # room for step 1's episodes, not step 2's
    capsys.readouterr()
    with Coordinator(validate_config(raw), tmp_path / "bounded") as coord:
        coord.run()
    assert (tmp_path / "bounded" / "transcripts.jsonl").read_text() == "".join(whole[:2])  # step 1 only
    err = capsys.readouterr().err
    assert err.count("train.transcripts_max_mb") == 1 and "from step 2 on no more episodes" in err
    assert len(lines(tmp_path / "bounded" / "metrics.jsonl")) == 3  # metrics go on
