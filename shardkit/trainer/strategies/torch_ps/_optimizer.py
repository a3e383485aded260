"""The check of a parameter server's optimizer spec on a worker, with torch: the spec's names first
(`shardkit.job.config.optimizer`, which the job config's validation runs where there may be no torch),
then torch checks the option values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardkit.job.config.optimizer import OPTIMIZERS, optimizer_problem

__all__ = ["validate_optimizer"]


def validate_optimizer(spec: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Check an optimizer spec such as ``{"name": "adam", "lr": 0.01}``; returns a plain copy.

    ``where`` names its origin (``params.optimizer`` or ``connect(optimizer=...)``) for the message.
    `optimizer_problem` checks the spec, then torch the option values.
    """
    import torch

    from shardkit.errors import ConfigError

    problem = optimizer_problem(spec)
    if problem is not None:
        path, value, what, fix = problem
        raise ConfigError(f"{'.'.join((where, *path))}={value!r}: {what}; {fix}")
    name = spec["name"].lower()
    options = {key: (tuple(value) if isinstance(value, list) else value)
               for key, value in spec.items() if key != "name"}
    try:  # let torch check the rest (betas, eps, ...) now, on the worker, not later on a ps
        getattr(torch.optim, OPTIMIZERS[name][0])([torch.zeros(1, requires_grad=True)], **options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}={dict(spec)!r} is not a valid {name} optimizer: {e}") from e
    return {"name": name, **options}
