"""The optimizers a torch parameter server applies, and the check of their spec (``params.optimizer``).

Apart from `shardkit.trainer.strategies.torch_ps.server` because the job config's validation checks
``params.optimizer`` with `optimizer_problem` (``shardkit validate``, before any process starts) in a
process that may have no torch: nothing here imports torch but `validate_optimizer`, on a worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

__all__ = ["OPTIMIZERS", "optimizer_problem", "validate_optimizer"]

# name -> (torch.optim class name, options a config may set). Only these two: their per-parameter state
# is a flat dict of tensors, which is what lets the state be saved by parameter name (see `Shard.state`).
OPTIMIZERS: Final[dict[str, tuple[str, frozenset[str]]]] = {
    "sgd": ("SGD", frozenset({"lr", "momentum", "dampening", "weight_decay", "nesterov"})),
    "adam": ("Adam", frozenset({"lr", "betas", "eps", "weight_decay", "amsgrad"})),
}


def optimizer_problem(spec: Any) -> tuple[tuple[str, ...], Any, str, str] | None:
    """What is wrong with an optimizer spec without torch (name, option names, ``lr``), or None.

    Example:
        >>> optimizer_problem({"name": "adamw"})
        (('name',), 'adamw', 'not a parameter-server optimizer', "use one of ['adam', 'sgd']")

    Returns ``(key path under the spec, bad value, problem, fix)``, the shape of a job config problem.
    The option values torch itself checks (``betas``, ``eps``, ...) are left to `validate_optimizer`.
    """
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        return (), spec, "must be a mapping with a 'name'", "write e.g. {name: sgd, lr: 0.05}"
    name = spec["name"].lower()
    if name not in OPTIMIZERS:
        return ("name",), spec["name"], "not a parameter-server optimizer", f"use one of {sorted(OPTIMIZERS)}"
    allowed = OPTIMIZERS[name][1]
    unknown = sorted(set(spec) - allowed - {"name"})
    if unknown:
        return ((), dict(spec), f"option(s) {unknown} that {name} does not take",
                f"remove them; {name} takes {sorted(allowed)}")
    lr = spec.get("lr", 1)
    if isinstance(lr, bool) or not (isinstance(lr, int | float) and lr > 0):
        return ("lr",), lr, "must be a number > 0", "set e.g. lr: 0.01"
    return None


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
