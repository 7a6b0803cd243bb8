"""Double + Dueling DQN with prioritized replay and n-step returns, on stable-baselines3.

stable-baselines3's DQN has none of the three; each is added at one of its extension points and
each is a switch, so that an ablation is one flag:

- dueling: ``DQNPolicy.make_q_net`` builds ``agents/networks.py``'s dueling head (``dueling``);
- Double DQN (van Hasselt et al. 2016): ``train`` is overridden so that the online network picks
  the next action and the target network values it (``double``);
- prioritized replay with n-step returns: ``replay_buffer_class`` is
  ``agents/replay_buffer.py``'s buffer; ``train`` weights each sample's loss by its importance
  weight, feeds |TD error| back as its priority and anneals beta to 1 (``prioritized``,
  ``n_steps``).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch as th
from stable_baselines3 import DQN
from stable_baselines3.dqn.policies import DQNPolicy, QNetwork
from torch.nn import functional as F

from agents.networks import q_network
from agents.replay_buffer import PrioritizedNStepReplayBuffer


class OvercommitQNetwork(QNetwork):
    def __init__(self, *args, dueling: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dueling = dueling
        self.q_net = q_network(self.features_dim, int(self.action_space.n), self.net_arch, dueling)

    def _get_constructor_parameters(self) -> dict[str, Any]:
        return {**super()._get_constructor_parameters(), "dueling": self.dueling}


class OvercommitQPolicy(DQNPolicy):
    """``DQNPolicy`` whose Q-networks may be dueling."""

    def __init__(self, *args, dueling: bool = True, **kwargs) -> None:
        self.dueling = dueling
        super().__init__(*args, **kwargs)

    def make_q_net(self) -> OvercommitQNetwork:
        net_args = self._update_features_extractor(self.net_args, features_extractor=None)
        return OvercommitQNetwork(**net_args, dueling=self.dueling).to(self.device)

    def _get_constructor_parameters(self) -> dict[str, Any]:
        return {**super()._get_constructor_parameters(), "dueling": self.dueling}


def td_targets(q_online, q_target, next_obs: th.Tensor, rewards: th.Tensor, dones: th.Tensor,
               discounts: th.Tensor | float, double: bool) -> th.Tensor:
    """r + (1 - done) * discount * Q_target(s', a'), a' = argmax of the online network (Double)
    or of the target network itself (vanilla)."""
    with th.no_grad():
        target_q = q_target(next_obs)
        if double:
            best = q_online(next_obs).argmax(dim=1, keepdim=True)
        else:
            best = target_q.argmax(dim=1, keepdim=True)
        return rewards + (1 - dones) * discounts * target_q.gather(1, best)


class OvercommitDQN(DQN):
    """SB3's DQN with the three switches; everything else (exploration, target updates, vector
    environments, logging, checkpoints) is stable-baselines3's."""

    def __init__(self, policy=OvercommitQPolicy, env=None, *, double: bool = True, dueling: bool = True, prioritized: bool = True,
                 n_steps: int = 3, per_alpha: float = 0.6, per_beta0: float = 0.4, net_arch: tuple[int, ...] = (128, 128),
                 gamma: float = 0.99, policy_kwargs: dict | None = None, **kwargs) -> None:
        # n_steps goes to the replay buffer alone: SB3's own ``n_steps`` attribute (1 here) is for its n-step
        # buffer, which a custom buffer class replaces; the buffer's kwargs keep ours (a checkpoint's too)
        self.double, self.dueling, self.prioritized = double, dueling, prioritized
        self.per_beta0 = per_beta0
        super().__init__(
            policy, env, gamma=gamma,
            policy_kwargs={"net_arch": list(net_arch), "dueling": dueling, **(policy_kwargs or {})},
            replay_buffer_class=PrioritizedNStepReplayBuffer,
            replay_buffer_kwargs={"n_steps": n_steps, "gamma": gamma, "prioritized": prioritized,
                                  "alpha": per_alpha, "beta": per_beta0},
            **kwargs)

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        self.policy.set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        buffer: PrioritizedNStepReplayBuffer = self.replay_buffer  # type: ignore[assignment]
        done = min(max(1.0 - self._current_progress_remaining, 0.0), 1.0)  # SB3 may overshoot the total
        buffer.beta = self.per_beta0 + (1.0 - self.per_beta0) * done
        losses, q_means, td_abs = [], [], []
        for _ in range(gradient_steps):
            data = buffer.sample(batch_size, env=self._vec_normalize_env)
            weights, indices = buffer.last_weights, buffer.last_indices
            target = td_targets(self.q_net, self.q_net_target, data.next_observations, data.rewards, data.dones,
                                data.discounts, self.double)
            q_all = self.q_net(data.observations)
            current = th.gather(q_all, dim=1, index=data.actions.long())
            loss = (weights * F.smooth_l1_loss(current, target, reduction="none")).mean()
            self.policy.optimizer.zero_grad()
            loss.backward()
            th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
            self.policy.optimizer.step()
            td = (current - target).detach().abs().cpu().numpy().reshape(-1)
            buffer.update_priorities(indices, td)
            losses.append(loss.item())
            q_means.append(q_all.detach().mean().item())
            td_abs.append(float(td.mean()))
        self._n_updates += gradient_steps
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/loss", float(np.mean(losses)))
        self.logger.record("train/q_mean", float(np.mean(q_means)))
        self.logger.record("train/td_abs_mean", float(np.mean(td_abs)))
        self.logger.record("train/per_beta", buffer.beta)
        if self.prioritized:
            size = (buffer.buffer_size if buffer.full else buffer.pos) * buffer.n_envs
            self.logger.record("train/priority_mean", buffer.tree.total / max(size, 1))
