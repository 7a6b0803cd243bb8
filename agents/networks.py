"""The Q-networks: a plain MLP head or a dueling one, built from a shape the export file states.

Dueling (Wang et al. 2016): a shared trunk feeds a value stream V(s) and an advantage stream
A(s, a); Q(s, a) = V(s) + A(s, a) - mean_a A(s, a), the mean taken per sample over actions.
"""
from __future__ import annotations

import torch
from torch import nn


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers)


class DuelingHead(nn.Module):
    def __init__(self, features: int, n_actions: int, hidden: int) -> None:
        super().__init__()
        self.value = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.advantage = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.advantage(x)
        return self.value(x) + a - a.mean(dim=1, keepdim=True)


def q_network(obs_dim: int, n_actions: int, net_arch: list[int], dueling: bool) -> nn.Sequential:
    """obs -> Q-values: an MLP trunk ``net_arch`` then a linear head, or a dueling head whose
    streams have the trunk's last width."""
    if obs_dim <= 0 or n_actions <= 0 or not net_arch or min(net_arch) <= 0:
        raise ValueError(f"q_network: bad shape obs_dim={obs_dim} n_actions={n_actions} net_arch={net_arch}")
    trunk = mlp([obs_dim] + list(net_arch[:-1] if dueling else net_arch))
    last = (net_arch[-2] if len(net_arch) > 1 else obs_dim) if dueling else net_arch[-1]
    head = DuelingHead(last, n_actions, net_arch[-1]) if dueling else nn.Linear(last, n_actions)
    return nn.Sequential(trunk, head)
