"""The Q-networks: a plain MLP head or a dueling one, built from a shape the export file states.

Dueling (Wang et al. 2016): a shared trunk feeds a value stream V(s) and an advantage stream
A(s, a); Q(s, a) = V(s) + A(s, a) - mean_a A(s, a), the mean taken per sample over actions.
"""
from __future__ import annotations

import numpy as np
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


class NumpyQNetwork:
    """``q_network``'s forward pass in numpy float32, on a copy of its weights.

    A decision is one observation through a network of a few thousand weights: torch spends
    ~70 us per call dispatching its ops (and its worst calls reach milliseconds on a loaded
    machine), numpy a few microseconds for the same matrix products. The Q-values equal torch's
    to float32 rounding (tests/test_export.py compares them, and the greedy actions, on many
    observations). Only the modules ``q_network`` builds are understood; anything else is refused.
    """

    def __init__(self, network: nn.Sequential) -> None:
        trunk, head = network
        self.trunk = self._layers(trunk)
        if isinstance(head, DuelingHead):
            self.value, self.advantage = self._layers(head.value), self._layers(head.advantage)
        elif isinstance(head, nn.Linear):
            self.value, self.advantage = None, self._layers(nn.Sequential(head))
        else:
            raise TypeError(f"NumpyQNetwork: unexpected head {type(head).__name__}")

    @staticmethod
    def _layers(seq: nn.Sequential) -> list[tuple[np.ndarray, np.ndarray, bool]]:
        """(W transposed, b, ReLU after) per Linear: x @ W.T + b, as nn.Linear computes it."""
        mods, layers = list(seq), []
        for i, m in enumerate(mods):
            if isinstance(m, nn.Linear):
                w = m.weight.detach().to("cpu", torch.float32).numpy()
                b = m.bias.detach().to("cpu", torch.float32).numpy()
                relu = i + 1 < len(mods) and isinstance(mods[i + 1], nn.ReLU)
                layers.append((np.ascontiguousarray(w.T), b.copy(), relu))
            elif not isinstance(m, nn.ReLU):
                raise TypeError(f"NumpyQNetwork: unexpected layer {type(m).__name__}")
        return layers

    @staticmethod
    def _run(x: np.ndarray, layers) -> np.ndarray:
        for wt, b, relu in layers:
            x = x @ wt + b
            if relu:
                np.maximum(x, 0.0, out=x)
        return x

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Q-values of a float32 batch (n, obs_dim) -> (n, n_actions)."""
        h = self._run(x, self.trunk)
        a = self._run(h, self.advantage)
        if self.value is None:
            return a
        return self._run(h, self.value) + a - a.mean(axis=1, keepdims=True)
