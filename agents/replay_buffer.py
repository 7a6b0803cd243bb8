"""Prioritized replay with n-step returns, as a stable-baselines3 ``ReplayBuffer``.

- **Prioritized** (Schaul et al. 2016, proportional): transition i is drawn with probability
  P(i) = p_i^alpha / sum_j p_j^alpha, p_i = |TD error| + eps, new transitions at the largest
  priority seen. Importance weights w_i = (N P(i))^-beta, divided by the batch's largest, correct
  the bias; beta is annealed to 1 by the agent. Priorities live in a sum-tree (``SumTree``) that
  samples and updates a whole batch with numpy operations, one per tree level.
- **n-step returns**: a sample starting at step t carries R = sum_k gamma^k r_{t+k} over up to n
  steps of the same environment, the observation after the last of them, and the discount
  gamma^k for the bootstrap (the ``discounts`` field of ``ReplayBufferSamples``). The window stops
  early at an episode's end, and at the write head (never crossing into older or unwritten data).
  A time-limit truncation is not terminal: the target bootstraps from the observation after it.
- Several environments: transitions are stored per environment (``n_envs`` columns, as in
  stable-baselines3), and n-step windows never mix environments.
- ``prioritized=False`` samples uniformly with weights 1 (the no-PER ablation); ``n_steps=1`` is
  the one-step return.
"""
from __future__ import annotations

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from stable_baselines3.common.vec_env import VecNormalize


class SumTree:
    """Binary tree of sums over ``capacity`` leaves; batch updates and batch prefix-sum search."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.leaves = 1 << max(int(np.ceil(np.log2(max(capacity, 1)))), 0)
        self.tree = np.zeros(2 * self.leaves, dtype=np.float64)

    @property
    def total(self) -> float:
        return float(self.tree[1])

    def get(self, index: np.ndarray) -> np.ndarray:
        return self.tree[index + self.leaves]

    def update(self, index: np.ndarray, value: np.ndarray) -> None:
        node = np.asarray(index, dtype=np.int64) + self.leaves
        self.tree[node] = value  # a repeated index keeps its last value
        node = np.unique(node // 2)
        while node.size and node[0] >= 1:
            self.tree[node] = self.tree[2 * node] + self.tree[2 * node + 1]
            node = np.unique(node // 2)
            if node[0] == 0:
                break

    def find(self, mass: np.ndarray) -> np.ndarray:
        """For each prefix mass, the leaf whose cumulative range contains it."""
        node = np.ones(mass.shape, dtype=np.int64)
        mass = mass.astype(np.float64).copy()
        while node[0] < self.leaves:
            left = self.tree[2 * node]
            right = mass >= left
            mass = np.where(right, mass - left, mass)
            node = 2 * node + right
        return node - self.leaves


class PrioritizedNStepReplayBuffer(ReplayBuffer):
    def __init__(self, buffer_size: int, observation_space: spaces.Space, action_space: spaces.Space,
                 device: th.device | str = "auto", n_envs: int = 1, optimize_memory_usage: bool = False,
                 handle_timeout_termination: bool = True, n_steps: int = 3, gamma: float = 0.99,
                 prioritized: bool = True, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-6) -> None:
        if optimize_memory_usage:
            raise ValueError("PrioritizedNStepReplayBuffer keeps next observations: optimize_memory_usage must be False")
        if n_steps < 1:
            raise ValueError(f"n_steps must be >= 1, got {n_steps}")
        if not 0 < gamma <= 1 or alpha < 0 or not 0 <= beta <= 1 or eps <= 0:
            raise ValueError(f"bad replay settings: gamma={gamma} alpha={alpha} beta={beta} eps={eps}")
        super().__init__(buffer_size, observation_space, action_space, device, n_envs, False, handle_timeout_termination)
        self.n_steps, self.gamma = n_steps, gamma
        self.prioritized, self.alpha, self.beta, self.eps = prioritized, alpha, beta, eps
        self.tree = SumTree(self.buffer_size * self.n_envs)
        self.max_priority = 1.0
        self.last_indices: np.ndarray | None = None  # flat indices of the last sample, for update_priorities
        self.last_weights: th.Tensor | None = None

    def add(self, obs, next_obs, action, reward, done, infos) -> None:
        flat = self.pos * self.n_envs + np.arange(self.n_envs)
        super().add(obs, next_obs, action, reward, done, infos)
        self.tree.update(flat, np.full(self.n_envs, self.max_priority ** self.alpha))

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> ReplayBufferSamples:
        size = (self.buffer_size if self.full else self.pos) * self.n_envs
        if size == 0:
            raise ValueError("cannot sample an empty replay buffer")
        if self.prioritized:
            total = self.tree.total
            mass = (np.arange(batch_size) + np.random.uniform(size=batch_size)) * (total / batch_size)
            flat = np.minimum(self.tree.find(np.minimum(mass, np.nextafter(total, 0))), size - 1)
            probs = self.tree.get(flat) / total
            weights = (size * probs) ** (-self.beta)
            weights = weights / weights.max()
        else:
            flat = np.random.randint(0, size, size=batch_size)
            weights = np.ones(batch_size)
        self.last_indices = flat
        self.last_weights = th.as_tensor(weights, dtype=th.float32, device=self.device).reshape(-1, 1)
        return self._get_samples(flat // self.n_envs, env, env_indices=flat % self.n_envs)

    def _get_samples(self, batch_inds: np.ndarray, env: VecNormalize | None = None,
                     env_indices: np.ndarray | None = None) -> ReplayBufferSamples:
        if env_indices is None:
            env_indices = np.random.randint(0, high=self.n_envs, size=(len(batch_inds),))
        returns = np.zeros(len(batch_inds), dtype=np.float32)
        terminal = np.zeros(len(batch_inds), dtype=np.float32)
        last = batch_inds.copy()
        steps = np.zeros(len(batch_inds), dtype=np.int64)
        alive = np.ones(len(batch_inds), dtype=bool)
        for k in range(self.n_steps):
            idx = (batch_inds + k) % self.buffer_size
            if k:
                alive &= idx != self.pos  # the write head: beyond it lies older or unwritten data
            reward = self.rewards[idx, env_indices]
            returns += np.where(alive, (self.gamma ** k) * reward, 0.0).astype(np.float32)
            done = self.dones[idx, env_indices]
            timeout = self.timeouts[idx, env_indices]
            last = np.where(alive, idx, last)
            steps += alive
            terminal = np.where(alive, done * (1 - timeout), terminal)
            alive &= done == 0  # an episode's end (terminal or truncated) closes the window
        next_obs = self._normalize_obs(self.next_observations[last, env_indices, :], env)
        data = (
            self._normalize_obs(self.observations[batch_inds, env_indices, :], env),
            self.actions[batch_inds, env_indices, :],
            next_obs,
            terminal.reshape(-1, 1),
            self._normalize_reward(returns.reshape(-1, 1), env),
        )
        discounts = (self.gamma ** steps).astype(np.float32).reshape(-1, 1)
        return ReplayBufferSamples(*tuple(map(self.to_torch, data)), discounts=self.to_torch(discounts))

    def update_priorities(self, flat_indices: np.ndarray, td_errors: np.ndarray) -> None:
        """New priorities |TD error| + eps for the transitions of a sample."""
        if not self.prioritized:
            return
        p = np.abs(np.asarray(td_errors, dtype=np.float64)).reshape(-1) + self.eps
        self.max_priority = max(self.max_priority, float(p.max()))
        self.tree.update(np.asarray(flat_indices), p ** self.alpha)
