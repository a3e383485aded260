"""The optimizers a torch parameter server may apply (``params.optimizer`` of a torch
parameter-server job), and the check of their spec without torch: ``shardkit validate`` runs it before
any process starts, in a process that may have no torch. The worker checks the option values with torch
itself (`shardkit.trainer.strategies.torch_ps._optimizer.validate_optimizer`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

__all__ = ["OPTIMIZERS", "optimizer_problem"]

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
