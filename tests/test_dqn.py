"""Each extension of stable-baselines3's DQN does what it claims, on small fixed inputs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium import spaces

from agents.dqn import td_targets
from agents.networks import DuelingHead, q_network
from agents.replay_buffer import PrioritizedNStepReplayBuffer, SumTree

OBS = spaces.Box(0.0, 1.0, (2,), dtype=np.float32)
ACT = spaces.Discrete(3)


class Fixed(torch.nn.Module):
    """A 'network' answering fixed Q-values per observation row (row index in obs[:, 0])."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.tensor(table, dtype=torch.float32)

    def forward(self, obs):
        return self.table[obs[:, 0].long()]


def test_double_target_differs_from_vanilla_exactly_where_the_networks_disagree():
    online = Fixed([[0.0, 5.0, 1.0], [9.0, 1.0, 0.0]])   # row 0 prefers action 1, row 1 action 0
    target = Fixed([[0.0, 2.0, 7.0], [4.0, 3.0, 1.0]])   # row 0 prefers action 2, row 1 action 0
    next_obs = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    r, d = torch.tensor([[1.0], [1.0]]), torch.zeros(2, 1)
    double = td_targets(online, target, next_obs, r, d, 0.5, double=True)
    vanilla = td_targets(online, target, next_obs, r, d, 0.5, double=False)
    assert double[0].item() == pytest.approx(1 + 0.5 * 2.0)   # target's value of the online choice
    assert vanilla[0].item() == pytest.approx(1 + 0.5 * 7.0)  # target's own max
    assert double[1].item() == vanilla[1].item() == pytest.approx(1 + 0.5 * 4.0)
    done = td_targets(online, target, next_obs, r, torch.ones(2, 1), 0.5, double=True)
    assert torch.equal(done, r)


def test_dueling_aggregation_is_value_plus_advantage_minus_its_mean_per_sample():
    torch.manual_seed(0)
    head = DuelingHead(4, 3, 8)
    x = torch.randn(5, 4)
    q = head(x)
    v, a = head.value(x), head.advantage(x)
    assert torch.allclose(q, v + a - a.mean(dim=1, keepdim=True), atol=1e-6)
    assert torch.allclose(q.mean(dim=1, keepdim=True), v, atol=1e-6)  # per sample, not over the batch
    assert not torch.allclose(a.mean(dim=1), a.mean(dim=1)[0].expand(5))
    plain = q_network(4, 3, [8, 8], dueling=False)
    duel = q_network(4, 3, [8, 8], dueling=True)
    assert isinstance(duel[1], DuelingHead) and isinstance(plain[1], torch.nn.Linear)
    assert duel(x).shape == plain(x).shape == (5, 3)


def test_sum_tree_finds_the_leaf_a_cumulative_search_finds():
    rng = np.random.default_rng(0)
    tree = SumTree(37)
    values = rng.uniform(0, 3, 37)
    tree.update(np.arange(37), values)
    assert tree.total == pytest.approx(values.sum())
    mass = rng.uniform(0, values.sum(), 1000)
    assert np.array_equal(tree.find(mass), np.searchsorted(np.cumsum(values), mass, side="right"))
    tree.update(np.array([3, 3, 5]), np.array([0.0, 10.0, 0.0]))
    values[3], values[5] = 10.0, 0.0
    assert tree.total == pytest.approx(values.sum())


def buffer(n_envs=1, size=16, **kw) -> PrioritizedNStepReplayBuffer:
    return PrioritizedNStepReplayBuffer(size, OBS, ACT, "cpu", n_envs=n_envs, **kw)


def fill(buf, rewards, dones=None, truncated=None, env_rewards=None):
    n = buf.n_envs
    for t, r in enumerate(rewards):
        done = np.array([bool(dones and dones[t])] * n)
        infos = [{"TimeLimit.truncated": bool(truncated and truncated[t])} for _ in range(n)]
        rew = np.array(env_rewards[t] if env_rewards else [r] * n, dtype=np.float32)
        obs = np.full((n, 2), t, dtype=np.float32)
        buf.add(obs, obs + 1, np.zeros((n, 1)), rew, done, infos)


def test_sampling_frequencies_follow_priorities_and_weights_correct_the_bias():
    np.random.seed(0)
    buf = buffer(size=4, alpha=1.0, beta=1.0)
    fill(buf, [0, 1, 2, 3])
    buf.update_priorities(np.arange(4), np.array([1.0, 2.0, 3.0, 4.0]))
    counts = np.zeros(4)
    values = np.array([10.0, 20.0, 30.0, 40.0])
    weighted, weights_sum, plain = 0.0, 0.0, []
    for _ in range(2000):
        buf.sample(16)
        idx, w = buf.last_indices, buf.last_weights.numpy().reshape(-1)
        np.add.at(counts, idx, 1)
        weighted += (w * values[idx]).sum()
        weights_sum += w.sum()
        plain.append(values[idx].mean())
    p = np.array([1.0, 2.0, 3.0, 4.0]) + buf.eps
    assert np.allclose(counts / counts.sum(), p / p.sum(), atol=0.01)
    assert np.mean(plain) > values.mean() + 3  # prioritised sampling alone is biased to the high ones
    assert weighted / weights_sum == pytest.approx(values.mean(), abs=0.3)  # weighted: the uniform mean
    uniform = buffer(size=4, prioritized=False)
    fill(uniform, [0, 1, 2, 3])
    uniform.sample(8)
    assert torch.equal(uniform.last_weights, torch.ones(8, 1))


def test_n_step_returns_stop_at_episode_ends_and_at_the_write_head():
    buf = buffer(size=8, n_steps=3, gamma=0.5)
    fill(buf, [1, 2, 4, 8, 16], dones=[0, 0, 0, 1, 0])
    s = buf._get_samples(np.array([0, 2, 3, 4]), env_indices=np.zeros(4, dtype=int))
    assert s.rewards.reshape(-1).tolist() == [1 + 0.5 * 2 + 0.25 * 4, 4 + 0.5 * 8, 8, 16]
    assert s.discounts.reshape(-1).tolist() == [0.125, 0.25, 0.5, 0.5]
    assert s.dones.reshape(-1).tolist() == [0, 1, 1, 0]  # the episode ended at step 3; step 4 is the newest
    assert s.next_observations[:, 0].tolist() == [3, 4, 4, 5]  # obs after the window's last step


def test_a_time_limit_truncation_is_not_terminal():
    buf = buffer(size=8, n_steps=2, gamma=0.9)
    fill(buf, [1, 1, 1], dones=[0, 1, 0], truncated=[0, 1, 0])
    s = buf._get_samples(np.array([0, 1]), env_indices=np.zeros(2, dtype=int))
    assert s.dones.reshape(-1).tolist() == [0, 0]            # bootstraps from the truncation's next obs
    assert s.discounts.reshape(-1).tolist() == pytest.approx([0.81, 0.9])
    assert s.rewards.reshape(-1).tolist() == pytest.approx([1.9, 1.0])
    assert s.next_observations[:, 0].tolist() == [2, 2]


def test_several_environments_never_mix_in_a_window():
    buf = buffer(n_envs=2, size=8, n_steps=3, gamma=1.0)
    fill(buf, [0, 0, 0, 0], env_rewards=[[1, 100], [1, 100], [1, 100], [1, 100]])
    s = buf._get_samples(np.array([0, 0]), env_indices=np.array([0, 1]))
    assert s.rewards.reshape(-1).tolist() == [3, 300]
    buf.sample(64)
    assert set(buf.last_indices % 2) == {0, 1}
