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
    machine), numpy a few microseconds for the same matrix products. A dueling head becomes two
    plain layers: its streams' first layers side by side (one product instead of two), and its
    output layers stacked with the aggregation folded in, since V + A - mean(A) is linear in
    (V, A). The Q-values equal torch's to float32 rounding (tests/test_export.py compares them,
    and the greedy actions, on many observations). Only the modules ``q_network`` builds are
    understood; anything else is refused.
    """

    def __init__(self, network: nn.Sequential) -> None:
        trunk, head = network
        layers = _linears(trunk, trailing_relu=True)
        if isinstance(head, DuelingHead):
            (v1, bv1), (v2, bv2) = _linears(head.value, trailing_relu=False, count=2)
            (a1, ba1), (a2, ba2) = _linears(head.advantage, trailing_relu=False, count=2)
            n = a2.shape[0]
            # (V, A) -> Q: Q_j = V + A_j - mean(A), one matrix (1 + n, n)
            aggregate = np.vstack([np.ones((1, n)), np.eye(n) - 1.0 / n])
            out = np.zeros((1 + n, v2.shape[1] + a2.shape[1]))  # V from the value half, A from the advantage half
            out[:1, :v2.shape[1]], out[1:, v2.shape[1]:] = v2, a2
            layers += [(np.vstack([v1, a1]), np.concatenate([bv1, ba1])),
                       (aggregate.T @ out, aggregate.T @ np.concatenate([bv2, ba2]))]
        elif isinstance(head, nn.Linear):
            layers += _linears(nn.Sequential(head), trailing_relu=False)
        else:
            raise TypeError(f"NumpyQNetwork: unexpected head {type(head).__name__}")
        # x @ W.T + b as nn.Linear computes it, W.T stored contiguous; a ReLU after every layer but the last
        self.layers = [(np.ascontiguousarray(w.T, dtype=np.float32), b.astype(np.float32)) for w, b in layers]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Q-values of a float32 batch (n, obs_dim) -> (n, n_actions)."""
        *hidden, (wt, b) = self.layers
        for hw, hb in hidden:
            x = x @ hw + hb
            np.maximum(x, 0.0, out=x)
        return x @ wt + b


def _linears(seq: nn.Sequential, trailing_relu: bool, count: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """(W, b) in float64 of each Linear of ``seq``: Linear and ReLU alternating, as ``mlp`` and the
    dueling streams build them, with or without a last ReLU (and ``count`` Linears, if given)."""
    mods = list(seq)
    for i, m in enumerate(mods):
        if not isinstance(m, nn.Linear if i % 2 == 0 else nn.ReLU):
            raise TypeError(f"NumpyQNetwork: unexpected layer {type(m).__name__}")
    linears = mods[::2]
    if len(mods) % 2 != (0 if trailing_relu else 1) or (count is not None and len(linears) != count):
        raise TypeError(f"NumpyQNetwork: unexpected layers {[type(m).__name__ for m in mods]}")
    return [(m.weight.detach().double().cpu().numpy(), m.bias.detach().double().cpu().numpy()) for m in linears]
