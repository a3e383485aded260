"""Small objects the in-process trainer tests share: a model of known weights, a JSON-stateful stand-in.

(The role scripts under ``scripts/`` and ``tests/cluster/scripts/`` run as files, outside the package,
and keep their own counter.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: test_context's tests of Counter need none
    from torch import nn


def linear(value: float) -> nn.Module:
    """An ``nn.Linear(3, 2)`` whose every parameter is ``value``."""
    import torch

    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def weight_of(model: nn.Module) -> float:
    """The first weight of ``model`` (all equal in a `linear`)."""
    return float(next(model.parameters()).detach().flatten()[0])


class Counter:
    """A `Stateful` reader stand-in: a JSON state of one number."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]
