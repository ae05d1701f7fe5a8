"""The router's architecture: the MLP of the paper (``h -> 2h -> h -> 1``) at any hidden widths, and the names of the
widths ``router.layers_grid`` trains.

Each hidden layer is Linear, BatchNorm, ReLU and dropout; the widths are multiples of the SLM's hidden size h in
params (``router.layers``: ``[2, 1]`` the paper's, ``[]`` a linear probe), so the same router can be priced on
another SLM's hidden size (:mod:`citer.evaluation.pricing`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from citer.config import RouterParams
from citer.routing.features import RouterError, param_bytes


def layer_widths(layers: Sequence[float], hidden_size: int) -> tuple[int, ...]:
    """Hidden-layer widths from ``router.layers`` (multiples of the SLM's hidden size), each rounded, at least 1."""
    return tuple(max(1, round(float(m) * hidden_size)) for m in layers)


def layers_tag(layers: Sequence[float]) -> str:
    """A width grid entry's name in method names and directories: ``linear`` for [], else ``w2-1``, ``w0.25``."""
    return "linear" if not layers else "w" + "-".join(f"{float(m):g}" for m in layers)


LAYERS_METHOD = "citer@"  # the sweep's name of the CITER router at one router.layers_grid width: citer@w0.25


def grid_widths(params: RouterParams) -> dict[str, list[float]]:
    """The ``router.layers_grid`` entries that need a router of their own, by tag: every one but ``router.layers``
    (the last iteration's router is that one)."""
    own = [float(m) for m in params.layers]
    return {layers_tag(g): [float(m) for m in g] for g in params.layers_grid if [float(m) for m in g] != own}


class MLPRouter(nn.Module):
    """``forward(x (B, D)) -> scores (B,)`` in [0, 1]; with D = H (the default) this is the engine's router interface
    (docs/contracts.md). A router on more features than the hidden state is a :class:`FeatureRouter` around one.

    ``widths``: the hidden layers (each Linear, BatchNorm, ReLU, dropout), default ``(2H, H)``; ``()`` is a linear
    probe."""

    def __init__(
        self,
        hidden_size: int,
        dropout: float = 0.1,
        input_dim: int | None = None,
        widths: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        h = hidden_size
        self.hidden_size = h
        self.input_dim = h if input_dim is None else int(input_dim)
        self.dropout = dropout
        self.widths = (2 * h, h) if widths is None else tuple(int(w) for w in widths)
        if any(w < 1 for w in self.widths):
            raise ValueError(f"hidden-layer widths must be >= 1, got {list(self.widths)}")
        layers: list[nn.Module] = []
        prev = self.input_dim
        for w in self.widths:
            layers += [nn.Linear(prev, w), nn.BatchNorm1d(w), nn.ReLU(), nn.Dropout(dropout)]
            prev = w
        self.net = nn.Sequential(*layers, nn.Linear(prev, 1))

    @property
    def weight_bytes(self) -> int:
        """Bytes read per call: parameters and BatchNorm running statistics (the engine charges them per SLM step)."""
        return param_bytes(self)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, D) any float dtype/device -> (B,) float32 logits on the module's device."""
        if hidden.dim() != 2 or hidden.shape[1] != self.input_dim:
            raise RouterError(
                f"router input: field hidden has shape {tuple(hidden.shape)}, expected (B, {self.input_dim})"
            )
        p = self.net[0].weight
        return self.net(hidden.to(device=p.device, dtype=p.dtype)).squeeze(-1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # No autograd graph at inference; scores come back on the caller's device to be compared with τ in place.
        with torch.set_grad_enabled(self.training and torch.is_grad_enabled()):
            return torch.sigmoid(self.logits(hidden)).to(hidden.device)
