"""The critic (`algorithm.baseline: critic`): GAE against hand-computed values, what each kind of critic sees,
the value loss on a fixed batch, its config checks, and kill / resume with a critic."""

from __future__ import annotations

import math

import pytest

from orchestrator.advantages import decision_rewards, gae, normalised_per_agent
from orchestrator.credit import CriticCredit, critic_state
from orchestrator.rollout import Action, Episode, RecordedRoles, Turn
from protocols.config import ConfigError, CriticConfig, validate_config
from protocols.messages import Completion
from protocols.plan import plan_of
from tests.envs import LetterEnv, config

GAMMA, LAM = 0.9, 0.8


# ------------------------------------------------------------------------------------------- GAE
@pytest.mark.fast
def test_gae_matches_hand_computed_values_when_the_episode_terminates():
    rewards, values = [0.0, 0.0, 1.0], [0.5, 0.6, 0.7]
    # deltas: r_k + 0.9 * V_{k+1} - V_k, with V_3 = 0 (terminated)
    d2 = 1.0 + 0.0 - 0.7                      # 0.3
    d1 = 0.0 + 0.9 * 0.7 - 0.6                # 0.03
    d0 = 0.0 + 0.9 * 0.6 - 0.5                # 0.04
    a2 = d2                                   # 0.3
    a1 = d1 + 0.9 * 0.8 * a2                  # 0.246
    a0 = d0 + 0.9 * 0.8 * a1                  # 0.21712
    adv, returns = gae(rewards, values, [1, 1, 1], GAMMA, LAM, last_value=0.0)
    assert adv == pytest.approx([0.21712, 0.246, 0.3])
    assert [a0, a1, a2] == pytest.approx([0.21712, 0.246, 0.3])
    assert returns == pytest.approx([0.71712, 0.846, 1.0])


@pytest.mark.fast
def test_a_truncated_episode_is_bootstrapped_from_the_value_after_its_last_turn():
    rewards, values = [0.0, 0.0, 1.0], [0.5, 0.6, 0.7]
    terminated, _ = gae(rewards, values, [1, 1, 1], GAMMA, LAM, last_value=0.0)
    truncated, _ = gae(rewards, values, [1, 1, 1], GAMMA, LAM, last_value=2.0)
    # only the last delta changes, by 0.9 * 2.0; earlier advantages see it through (0.9 * 0.8)^k
    assert truncated[2] - terminated[2] == pytest.approx(1.8)
    assert truncated[1] - terminated[1] == pytest.approx(1.8 * 0.72)
    assert truncated[0] - terminated[0] == pytest.approx(1.8 * 0.72 ** 2)


@pytest.mark.fast
def test_gae_with_lambda_one_and_zero_values_is_the_discounted_return():
    rewards = [1.0, 0.0, 2.0, 0.5]
    adv, returns = gae(rewards, [0.0] * 4, [1] * 4, GAMMA, 1.0, last_value=0.0)
    expected = [1 + 0.9 * 0 + 0.81 * 2 + 0.729 * 0.5, 0 + 0.9 * 2 + 0.81 * 0.5, 2 + 0.9 * 0.5, 0.5]
    assert adv == pytest.approx(expected)
    assert returns == pytest.approx(expected)


@pytest.mark.fast
def test_lambda_zero_gives_the_one_step_td_error():
    adv, _ = gae([0.0, 1.0], [0.2, 0.4], [1, 1], GAMMA, 0.0, last_value=0.0)
    assert adv == pytest.approx([0.9 * 0.4 - 0.2, 1.0 - 0.4])


@pytest.mark.fast
def test_decisions_turns_apart_sum_their_turn_rewards_and_discount_by_the_gap():
    # a role acting at turns 0 and 3 of a 5-turn episode: rewards of turns 0-2, then 3-4
    rewards, gaps = decision_rewards([1.0, 2.0, 3.0, 4.0, 5.0], [0, 3], GAMMA)
    assert rewards == pytest.approx([1 + 0.9 * 2 + 0.81 * 3, 4 + 0.9 * 5])
    assert gaps == [3, 2]
    adv, _ = gae(rewards, [1.0, 2.0], gaps, GAMMA, LAM, last_value=0.0)
    a1 = rewards[1] + 0.0 - 2.0
    a0 = rewards[0] + 0.9 ** 3 * 2.0 - 1.0 + 0.9 ** 3 * LAM * a1
    assert adv == pytest.approx([a0, a1])


@pytest.mark.fast
def test_advantages_are_normalised_per_agent():
    out = normalised_per_agent([1.0, 3.0, 10.0, 10.0, -4.0], ["a", "a", "b", "b", "b"])
    assert out[:2] == pytest.approx([-1.0, 1.0], abs=1e-3)
    b = out[2:]
    assert sum(b) == pytest.approx(0.0, abs=1e-9)
    assert math.sqrt(sum(x * x for x in b) / 3) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.fast
def test_an_agent_without_reward_signal_gets_no_advantage():
    # agent a's returns are all 0: its advantages differ only by the critic's noise, so they are 0;
    # agent b's returns vary, so its advantages are scaled to unit std as before
    adv = [-0.0061, -0.0059, -0.0060, 0.7, -0.1, -0.1]
    out = normalised_per_agent(adv, ["a", "a", "a", "b", "b", "b"], returns=[0.0, 0.0, 0.0, 0.75, 0.0, 0.0])
    assert out[:3] == [0.0, 0.0, 0.0]
    b = out[3:]
    assert math.sqrt(sum(x * x for x in b) / 3) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.fast
@pytest.mark.parametrize("scale", [0.01, 0.1, 1.0, 3.0, 10.0, 100.0])
def test_a_batch_without_reward_signal_never_gets_a_larger_step_than_one_with_signal(scale):
    """One-turn episodes scored by a critic whose values err by up to a tenth of the reward's scale (in the reward's
    units, as a critic's do): a batch whose rewards are all equal (all won, all lost) carries no signal and must not
    move the policy more than a batch whose rewards differ, at any scale of the reward."""
    import random

    raw = config(agents=("alice",), roles={"x": "alice"}, algorithm={"baseline": "critic"},
                 critic={"kind": "per_agent", "gae_lambda": 1.0})
    checked = validate_config(raw)
    credit = CriticCredit(checked, plan_of(checked))
    rng = random.Random(0)

    def values_of(states):
        return {c: [scale * (0.5 + rng.uniform(-0.1, 0.1)) for _ in s] for c, s in states.items()}

    def advantages(rewards):
        episodes = []
        for i, reward in enumerate(rewards):
            episode = Episode(index=i, sample_index=i // 4, env=RecordedRoles(["x"]), terminated=True)
            episode.turns = [Turn([_action("x", "alice", f"x-prompt-{i}", "said")], reward, {})]
            episodes.append(episode)
        experiences, _ = credit.score(episodes, values_of)
        return [e.advantage for e in experiences["alice"]]

    rms = lambda xs: math.sqrt(sum(x * x for x in xs) / len(xs))  # noqa: E731  the step's size, per token
    signal = advantages([scale * r for r in (1, 0, 1, 0, 0, 1, 0, 0)])
    assert rms(signal) == pytest.approx(1.0, abs=0.05)  # normalised per agent, whatever the scale
    for flat in ([scale] * 8, [0.0] * 8, [-scale] * 8):
        assert max(abs(a) for a in advantages(flat)) <= rms(signal), (scale, flat)


# ----------------------------------------------------------------------------- what critics see
def _action(role: str, agent: str, prompt: str, text: str) -> Action:
    return Action(role, agent, prompt, Completion(text=text, prompt_ids=[1], completion_ids=[2], per_token_logps=[0.0],
                                                  finish_reason="stop"))


def _episode(truncated: bool = False) -> Episode:
    episode = Episode(index=0, sample_index=0, env=LetterEnv(roles=("x", "y"), turns=3))
    episode.turns = [
        Turn([_action("x", "alice", "x-prompt-1", "alice-said-1"), _action("y", "bob", "y-prompt-1", "bob-said-1")],
             0.0, {}),
        Turn([_action("x", "alice", "x-prompt-2", "alice-said-2"), _action("y", "bob", "y-prompt-2", "bob-said-2")],
             1.0, {}),
    ]
    episode.truncated, episode.terminated = truncated, not truncated
    episode.next_prompts = {"x": "x-prompt-3", "y": "y-prompt-3"} if truncated else {}
    return episode


@pytest.mark.fast
def test_the_central_critic_sees_every_agents_turns_and_a_per_agent_critic_only_its_own():
    episode = _episode()
    central = critic_state(episode, 1, "x", "alice", central=True)
    for seen in ("x-prompt-1", "alice-said-1", "y-prompt-1", "bob-said-1", "x-prompt-2", "y-prompt-2"):
        assert seen in central
    own = critic_state(episode, 1, "x", "alice", central=False)
    for seen in ("x-prompt-1", "alice-said-1", "x-prompt-2"):
        assert seen in own
    for hidden in ("bob", "y-prompt"):
        assert hidden not in own
    assert "alice-said-2" not in central + own  # nothing of the turn being valued but its prompts
    assert own.endswith("[x] x-prompt-2") and central.endswith("[x] x-prompt-2")  # the role valued comes last
    first = critic_state(episode, 0, "x", "alice", central=False)
    assert own.startswith(first + "\n")  # a chain's states begin each other: one forward reads them all
    assert critic_state(episode, 2, "x", "alice", central=False).endswith("value of [x]")  # no prompt after the end


@pytest.mark.fast
def test_critic_credit_scores_each_chain_with_its_critic_and_bootstraps_a_truncated_episode():
    raw = config(agents=("alice", "bob"), roles={"x": "alice", "y": "bob"}, turns=3,
                 algorithm={"baseline": "critic", "discount": GAMMA}, critic={"kind": "per_agent", "gae_lambda": LAM})
    checked = validate_config(raw)
    credit = CriticCredit(checked, plan_of(checked))
    asked = {}

    def values_of(states):
        asked.update(states)
        return {critic: [0.5] * len(s) for critic, s in states.items()}

    experiences, targets = credit.score([_episode(truncated=True)], values_of)
    assert set(asked) == {"critic-alice", "critic-bob"}
    assert len(asked["critic-alice"]) == 3  # two turns and the state after them
    assert all("bob" not in s for s in asked["critic-alice"])
    adv, returns = gae([0.0, 1.0], [0.5, 0.5], [1, 1], GAMMA, LAM, last_value=0.5)
    assert [t.target for t in targets["critic-alice"]] == pytest.approx(returns)
    assert [t.old_value for t in targets["critic-alice"]] == [0.5, 0.5]
    assert len(experiences["alice"]) == len(experiences["bob"]) == 2
    assert sum(e.advantage for e in experiences["alice"]) == pytest.approx(0.0, abs=1e-9)


# ------------------------------------------------------------------------------------------ config
@pytest.mark.fast
def test_critic_config_places_each_critic_and_refuses_what_does_not_fit():
    base = config(algorithm={"baseline": "critic"})
    cfg = validate_config(base)
    assert cfg.critic is None and plan_of(cfg).critic == CriticConfig()  # the defaults, derived, not written in
    assert plan_of(cfg).critic.kind == "central" and plan_of(cfg).critic_members == {"critic": ["a", "b"]}
    assert plan_of(cfg).member_layout == {"a": ["a"], "b": ["b"], "critic": ["critic"]}
    per = validate_config({**base, "critic": {"kind": "per_agent", "placement": "agent", "model": "agent"}})
    assert plan_of(per).member_layout == {"a": ["a", "critic-a"], "b": ["b", "critic-b"]}
    bad = [
        ({"critic": {"kind": "central"}, "algorithm": {"baseline": "group"}}, "critic: given, but algorithm.baseline"),
        ({"critic": {"model": "agent"}}, "critic.model: agent puts a value head"),
        ({"critic": {"placement": "agent", "resources": {"num_cpus": 1}}}, "critic.resources: a critic with placement"),
        ({"critic": {"agent": "a"}}, "critic.agent: names the host"),
        ({"critic": {"placement": "agent", "agent": "zed"}}, "critic.agent: agent 'zed' is not defined"),
    ]
    for change, message in bad:
        with pytest.raises(ConfigError, match=message):
            validate_config({**base, **change}, source="run.yaml")


# ------------------------------------------------------------------------------------ value model
def test_the_value_loss_falls_on_a_fixed_batch():
    from agent_trainer.critic_trainer import CriticTrainer
    from protocols.config import CriticConfig, OptimizerConfig
    from protocols.messages import ValueTarget

    settings = CriticConfig(num_iterations=2, value_clip=None, optimizer=OptimizerConfig(lr=1e-3))
    critic = CriticTrainer("critic", settings, seed=0, total_updates=20)
    states = ["[x] Say a\nvalue of [x]", "[x] Say b\nvalue of [x]", "[x] Say c\n[x] > c\nvalue of [x]", "value of [y]"]
    targets = [1.0, -1.0, 0.5, 0.0]
    losses = []
    for _ in range(12):
        old = critic.values(states)
        batch = [ValueTarget(state=s, old_value=v, target=t) for s, v, t in zip(states, old, targets)]
        losses.append(critic.update(batch).value_loss)
    assert losses[-1] < 0.25 * losses[0], losses
    assert critic.values(states) == pytest.approx(targets, abs=0.3)


def test_states_that_begin_each_other_share_a_forward_and_keep_their_own_values():
    import torch

    from agent_trainer.critic_trainer import CriticTrainer
    from protocols.config import CriticConfig

    critic = CriticTrainer("critic", CriticConfig(micro_batch_size=2), seed=0, total_updates=1)
    with torch.no_grad():
        critic.head.weight.normal_()  # a zero head would value everything 0
    chain = ["[x] ..a", "[x] ..a\n[x] > a\n[x] .a..", "[x] ..a\n[x] > a\n[x] .a..\n[x] > b\n[x] a"]
    states = [chain[1], "[y] other", chain[0], chain[2], "value of [y]"]
    rows = []
    forward = critic._hidden
    critic._hidden = lambda ids, mask: rows.append(len(ids)) or forward(ids, mask)
    together = critic.values(states)
    assert sum(rows) == 3  # the chain in one row, the two others in their own
    alone = [critic.values([s])[0] for s in states]
    assert together == pytest.approx(alone, abs=1e-5)
    assert len(set(round(v, 4) for v in together)) == len(states)


def _shared_rows_by_scanning(rows):
    """The grouping `CriticTrainer._batches` made before `shared_rows`: every row against every carrier."""
    carriers, reads = [], []
    for i in sorted(range(len(rows)), key=lambda i: -len(rows[i])):
        r = rows[i]
        home = next((c for c, long in enumerate(carriers) if long[:len(r)] == r), None)
        if home is None:
            carriers.append(r)
            reads.append([])
            home = len(carriers) - 1
        reads[home].append((i, len(r) - 1))
    return carriers, reads


class _Counted(list):
    """A row that counts the comparisons made with it."""

    seen = 0

    def __eq__(self, other):
        _Counted.seen += 1
        return list.__eq__(self, other)

    def __ne__(self, other):
        _Counted.seen += 1
        return list.__ne__(self, other)

    def __lt__(self, other):
        _Counted.seen += 1
        return list.__lt__(self, other)

    __hash__ = None


@pytest.mark.fast
def test_states_that_begin_each_other_are_grouped_as_before_with_n_log_n_comparisons():
    import random

    from agent_trainer.critic_trainer import shared_rows

    rng = random.Random(0)
    for trial in range(200):  # chains of turns, repeated states, states of equal length, strangers
        rows = []
        for _ in range(rng.randint(1, 12)):
            chain = [rng.randint(0, 3) for _ in range(rng.randint(1, 9))]
            rows += [chain[:rng.randint(1, len(chain))] for _ in range(rng.randint(1, 4))]
        rng.shuffle(rows)
        assert shared_rows(rows) == _shared_rows_by_scanning(rows), rows
    n = 4000  # states that begin no other: the scan compared each with every carrier before it, n**2 / 2
    rows = [_Counted([i, i % 7]) for i in range(n)]
    rng.shuffle(rows)
    _Counted.seen = 0
    carriers, reads = shared_rows(rows)
    assert len(carriers) == n and sorted(i for read in reads for i, _ in read) == list(range(n))
    assert _Counted.seen <= 3 * n * math.ceil(math.log2(n)), _Counted.seen  # a sort's count, not n**2 / 2 = 8e6


@pytest.mark.fast
def test_value_clipping_keeps_the_larger_error():
    import torch

    from agent_trainer.losses import value_loss

    values, old, returns = torch.tensor([1.0, 0.1]), torch.tensor([0.0, 0.0]), torch.tensor([2.0, 0.2])
    loss, clipped = value_loss(values, old, returns, clip=0.2)
    # first: clipped prediction 0.2 is further from 2.0 than 1.0 is: 0.5 * 1.8^2; second: within the clip
    assert loss.tolist() == pytest.approx([0.5 * 1.8 ** 2, 0.5 * 0.1 ** 2])
    assert clipped.tolist() == [True, False]
    plain, _ = value_loss(values, old, returns, clip=None)
    assert plain.tolist() == pytest.approx([0.5, 0.5 * 0.1 ** 2])


# ------------------------------------------------------------------------------- kill and resume
STEPS = 3


def critic_config(agents=("a", "b"), **critic) -> dict:
    return config(agents, turns=3, algorithm={"baseline": "critic", "discount": GAMMA},
                  critic={"kind": "central", "gae_lambda": LAM, **critic},
                  train={"steps": STEPS, "checkpoint_every": 1, "keep_checkpoints": 5})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    from tests.runs import uninterrupted_rows

    return uninterrupted_rows(validate_config(critic_config()), tmp_path_factory.mktemp("whole"))


def test_a_run_with_a_critic_stopped_and_resumed_ends_as_if_uninterrupted(tmp_path, uninterrupted):
    from orchestrator.coordinator import Coordinator
    from tests.runs import rows, without_times

    assert any("critic/value_loss/critic" in m for m in uninterrupted)
    with Coordinator(validate_config(critic_config()), tmp_path) as coord:
        coord.run(until=2)
    with Coordinator.resume(tmp_path) as coord:
        coord.run()
    assert without_times(rows(tmp_path)) == uninterrupted


@pytest.fixture(scope="module")
def uninterrupted_one_agent(tmp_path_factory):
    from tests.runs import uninterrupted_rows

    return uninterrupted_rows(validate_config(critic_config(agents=("a",))), tmp_path_factory.mktemp("whole-one"))


def test_a_killed_critic_host_is_restarted_and_the_run_ends_as_if_uninterrupted(ray_cluster, tmp_path,
                                                                                 uninterrupted_one_agent):
    """One agent and the critic (two processes to start, and to restart): the agent's trainer, which lives, rolls
    back with the restarted critic."""
    from orchestrator.coordinator import Coordinator
    from tests.runs import rows, run_killing, without_times

    raw = critic_config(agents=("a",))
    raw["ray"]["enabled"] = True
    with Coordinator(validate_config(raw), tmp_path) as coord:
        victim = coord.pool.info()["critic"]["pid"]
        assert victim != coord.pool.info()["a"]["pid"]  # a host of its own
        run_killing(coord, victim, at_step=1)
        assert coord.restarts == 1
    metrics = without_times(rows(tmp_path))
    assert metrics == uninterrupted_one_agent and all("critic/value_loss/critic" in m for m in metrics)
