"""The ``torchrun`` engine: one node of a torch DDP job through torch's elastic agent and c10d rendezvous."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import dataclasses
import difflib
import importlib.util
import ipaddress
import os
import runpy
import signal
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from shardkit.cluster import _addresses as addresses
from shardkit.errors import ConfigError, JobError, MissingDependencyError, ShardkitError, require
from shardkit.job import protocol as p
from shardkit.job.config import MAX_PROCESSES
from shardkit.job.config.messages import located

if TYPE_CHECKING:
    from shardkit.cluster._spec import ClusterSpec
    from shardkit.cluster.monitor.report import JobResult
    from shardkit.job.config import JobConfig
    from shardkit.trainer.rerun import Rerun

__all__ = ["RDZV_CONF", "TorchrunEngine", "TorchrunOptions", "check_job", "check_node", "main",
           "node_address", "parse_options", "run_node", "worker_log"]

DEFAULT_ENDPOINT = "127.0.0.1:29400"
#: c10d rendezvous settings ``engine.rdzv_conf`` may hold (torch's names; seconds unless said).
RDZV_CONF: dict[str, str] = {
    "join_timeout": "how long a node waits for the rendezvous to complete (torch default 600)",
    "last_call_timeout": "how long to wait for more nodes once `min` have joined (default 30)",
    "close_timeout": "how long closing the rendezvous may take (default 30)",
    "heartbeat_timeout": "how long one keep-alive write may take (default 5)",
    "keep_alive_interval": "seconds between a node's keep-alives (default 5)",
    "keep_alive_max_attempt": "missed keep-alives before a node counts as dead (default 3, a count)",
    "read_timeout": "the rendezvous store's read timeout (default 60)",
    "use_libuv": "the store's libuv backend (true/false, default true)",
}
_OPTIONS = ("nnodes", "nproc_per_node", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "node_rank", "local_addr",
            "max_restarts", "monitor_interval", "grace")
_PURPOSE = "engine: torchrun (torch's elastic agent)"
# Private to the agent and its workers: where this node's worker logs go, and the agent's pid.
ENV_LOG_DIR = "SHARDKIT_TORCHRUN_LOG_DIR"
ENV_AGENT_PID = "SHARDKIT_TORCHRUN_AGENT_PID"


@dataclass(frozen=True)
class TorchrunOptions:
    """The validated ``engine:`` options of a torchrun job (see `TorchrunEngine`); None: from the job."""

    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int | None = None
    rdzv_endpoint: str = DEFAULT_ENDPOINT
    rdzv_id: str | None = None
    rdzv_conf: dict[str, int | bool] = field(default_factory=dict)
    node_rank: int = 0
    local_addr: str | None = None
    max_restarts: int | None = None
    monitor_interval: float = 0.1
    grace: float = 5.0

    @property
    def endpoint_is_loopback(self) -> bool:
        host = p.parse_addr(self.rdzv_endpoint)[0]
        try:
            return host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False


def _int(value: Any, low: int) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    return value if ok else None


def _nodes(value: Any) -> tuple[int, int] | None:
    """``2`` / ``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4); None when malformed."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        return None
    low, sep, high = str(value).strip().partition(":")
    if not low.isdigit() or (sep and not high.isdigit()):
        return None
    nodes = int(low), int(high or low)
    return nodes if 1 <= nodes[0] <= nodes[1] else None


_Checked = tuple[dict[str, Any]] | tuple[dict[str, Any], str, str]
_EXAMPLES = {"rdzv_endpoint": "10.0.0.1:29400", "local_addr": "node-a.example.com", "rdzv_id": "digits-7"}


def _check(key: str, value: Any) -> _Checked:
    """One option -> ``({field: value},)``, or ``({}, problem, fix)``."""
    if key == "nnodes":
        nodes = _nodes(value)
        if isinstance(value, int) and value >= 60:  # YAML 1.1 reads an unquoted 1:2 as 62 (base 60)
            return {}, "an unquoted number of 60 or more, as YAML reads MIN:MAX without quotes (1:2 is 62)", \
                'quote it: "1:2" for 1 to 2 nodes, or "64" for 64 nodes'
        if nodes is None:
            return {}, "not a node count", 'write N or "MIN:MAX" with 1 <= MIN <= MAX, e.g. "1:2"'
        return ({"min_nodes": nodes[0], "max_nodes": nodes[1]},)
    if key in ("nproc_per_node", "node_rank", "max_restarts"):
        low = 1 if key == "nproc_per_node" else 0
        if _int(value, low) is None:
            return {}, f"not a whole number >= {low}", f"write e.g. {low + 1} (without quotes)"
        if key == "nproc_per_node" and value > MAX_PROCESSES:
            return {}, f"more than {MAX_PROCESSES:,} processes on one node (shardkit's limit)", \
                f"set it to {MAX_PROCESSES} or less"
    elif key in _EXAMPLES:
        if not isinstance(value, str) or not value.strip():
            return {}, "not a string", f"quote it, e.g. {_EXAMPLES[key]!r}"
        if key == "rdzv_endpoint":
            try:
                p.parse_addr(value)
            except ValueError:
                return {}, "not HOST:PORT", f"write node 0's address and a free port, e.g. {_EXAMPLES[key]}"
    elif key in ("monitor_interval", "grace"):
        positive = key == "monitor_interval"
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not (value > 0 if positive else value >= 0):
            return {}, f"not a number of seconds {'> 0' if positive else '>= 0'}", \
                f"write e.g. {0.1 if positive else 5}"
        value = float(value)
    elif key == "rdzv_conf":
        return _check_rdzv_conf(value)
    return ({key: value},)


def _check_rdzv_conf(value: Any) -> _Checked:
    if not isinstance(value, Mapping):
        return {}, "not a mapping", "write e.g. {last_call_timeout: 5, keep_alive_interval: 2}"
    for name, setting in value.items():
        if name == "is_host":
            return {}, "is_host is set by shardkit: node 0 hosts the rendezvous store", \
                "remove it and start the store's node with --node-rank 0"
        if name not in RDZV_CONF:
            return {}, f"{name!r} is not a c10d rendezvous setting", _did_you_mean(str(name), list(RDZV_CONF))
        flag = name == "use_libuv"
        if flag != isinstance(setting, bool) or (not flag and _int(setting, 1) is None):
            kind = "true or false" if flag else "a whole number >= 1"
            return {}, f"rdzv_conf.{name} = {setting!r} is not {kind}", f"{name}: {RDZV_CONF[name]}"
    return ({"rdzv_conf": dict(value)},)


def _did_you_mean(key: str, allowed: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    return (f"did you mean {close[0]!r}? " if close else "") + f"use one of: {', '.join(sorted(allowed))}"


def parse_options(options: Mapping[str, Any] | None, *, source: Path | None = None) -> TorchrunOptions:
    """Validate the ``engine:`` options of a torchrun job (every problem at once, each as ``engine.<key>``).

    Example:
        >>> parse_options({"nnodes": "1:2", "rdzv_endpoint": "10.0.0.1:29400"}).max_nodes
        2

    Raises:
        ConfigError: an unknown option (with a did-you-mean), a wrong type or value, or a node rank
            that the node range cannot hold.
    """
    from shardkit.job.config.messages import config_error

    values: dict[str, Any] = {}
    items: list[tuple[tuple[str | int, ...], Any, str, str]] = []
    for key, value in dict(options or {}).items():
        if key not in _OPTIONS:
            items.append((("engine", key), value, "not an option of the torchrun engine",
                          _did_you_mean(str(key), _OPTIONS)))
            continue
        checked = _check(key, value)
        if len(checked) == 1:
            values.update(checked[0])
        else:
            items.append((("engine", key), value, checked[1], checked[2]))
    opts = TorchrunOptions(**values)
    if not items and opts.node_rank >= opts.max_nodes:
        items.append((("engine", "node_rank"), opts.node_rank, f"the job has at most {opts.max_nodes} "
                      "node(s)", f"use a node rank below {opts.max_nodes}, or raise engine.nnodes"))
    if items:
        raise config_error(source, items)
    return opts


def check_job(config: JobConfig) -> None:
    """Refuse jobs the elastic agent cannot run: it starts torch workers of one allreduce group only."""
    if (config.framework, config.strategy) != ("torch", "allreduce") or set(config.roles) != {"worker"}:
        raise ConfigError(
            f"invalid job config {config.source or '(built in Python)'}: engine.name = 'torchrun' runs torch "
            f"allreduce jobs with workers only; this job is {config.framework} {config.strategy} with roles "
            f"{', '.join(sorted(config.roles))}. Fix: use engine: local for it")


def check_node(config: JobConfig, *, node_rank: int | None = None) -> TorchrunOptions:
    """What `run_node` checks before it starts anything (``shardkit validate`` runs it too, through
    `shardkit.cluster.engines.check_engine`): the engine options, with ``node_rank`` in place of
    ``engine.node_rank`` when given, a job the elastic agent can run (`check_job`), torch installed.

    Example:
        >>> check_node(load_config("job.yaml"), node_rank=1).max_nodes
        2

    Raises:
        ConfigError: a bad engine option or node rank (`parse_options`), or a job that is not torch
            allreduce with workers only.
        MissingDependencyError: torch is not installed.
    """
    options = dict(config.engine.options)
    if node_rank is not None:
        options["node_rank"] = node_rank
    with located(config, **({"node_rank": "from --node-rank"} if node_rank is not None else {})):
        opts = parse_options(options, source=config.source)
    check_job(config)
    if importlib.util.find_spec("torch") is None:  # cheap: run_node imports the agent when it starts
        raise MissingDependencyError("torch", "torch", _PURPOSE)
    return opts


class TorchrunEngine:
    """``engine: torchrun``: each node runs `run_node` (``shardkit train job.yaml --node-rank K``).

    Example (two machines; the checkpoint dir and data must be storage both see, e.g. ``s3://``)::

        engine: {name: torchrun, nnodes: "1:2", rdzv_endpoint: "10.0.0.1:29400", rdzv_id: digits-7}
        node-a$ shardkit train job.yaml --node-rank 0      # hosts the rendezvous store
        node-b$ shardkit train job.yaml --node-rank 1

    Options: ``nnodes`` (``N`` or ``"MIN:MAX"``, default 1), ``nproc_per_node`` (default
    ``roles.worker.count``), ``rdzv_endpoint`` (``host:port`` of node 0, default 127.0.0.1:29400),
    ``rdzv_id`` (default the job's name; use a new one per run), ``rdzv_conf`` (c10d settings, see
    `RDZV_CONF`), ``node_rank`` (the ``--node-rank`` default), ``local_addr`` (the address other nodes
    reach this one at, and its workers' collectives bind to; default 127.0.0.1 when the endpoint is
    loopback, else the address of the interface that routes to the endpoint), ``max_restarts`` (per
    node, default ``fault_tolerance.max_restarts``), ``monitor_interval`` (seconds, 0.1), ``grace``
    (seconds between SIGTERM and SIGKILL when workers stop, 5).

    Choices: torch's own agent (``LocalElasticAgent``) starts, restarts and re-ranks the workers; the
    c10d rendezvous decides the group ranks, so ``node_rank`` only says which node hosts the
    rendezvous store (node 0: losing it ends the job, as with torchrun) and writes ``summary.json``
    and TensorBoard. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: restarted gloo workers hung with the
    shared store (ENGINES.md). There is no `start` per attempt: restarts belong to torch's agent.

    Across machines: a node never advertises its host name's resolution (often 127.0.x.1): it uses
    ``local_addr`` (see above) for the rendezvous and ``MASTER_ADDR``, and its workers' gloo and NCCL
    bind to that address's interface (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``, unless the
    environment or ``env:`` sets them). A node other than 0 whose rendezvous store stops answering
    for ``fault_tolerance.lost_job_timeout`` seconds once the job has started (a partition, node 0
    gone) stops its workers and exits with code 1 (`LostJobError`), its summary saying so; a node 0
    that lost every other node waits for them as the rendezvous does (``rdzv_conf.join_timeout``).

    Starting: a node other than 0 waits for node 0's store to accept a connection before it joins, so
    nodes may start in any order. The first rendezvous must form within
    ``fault_tolerance.startup_timeout`` seconds of the moment the node begins to join (the first
    round's ``join_timeout`` is what is left of them): a node whose peers never come (node 0 refused
    or crashed before joining, a node never started) exits with code 1 and one line saying what it
    waited for (`JobError`, no summary printed; ``summary.json`` is written). Later rounds wait
    ``rdzv_conf.join_timeout``.

    Signals: SIGINT, SIGTERM and SIGHUP end a node within seconds at any point: its workers get SIGTERM
    (as the supervisor sends, whatever signal stopped the node), and a node whose main thread is stuck
    in one of torch's store calls (a store that stopped answering) is ended by a thread that reads
    the signal from the wakeup fd (`shardkit.cluster.engines.torchrun._backstop`). torch's C++ log
    lines (c10d's, each with a C++ stack trace) are off in the node (``TORCH_CPP_LOG_LEVEL=FATAL``
    while torch first imports, unless set; a program that imported torch before keeps its level) and
    errors only in its workers (``ERROR``, unless the environment or ``env:`` sets it).
    """

    name = "torchrun"

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        if importlib.util.find_spec("torch") is None:  # cheap: the agent imports torch when it runs
            raise MissingDependencyError("torch", "torch", _PURPOSE)
        self.options = parse_options(options)

    def start(self, spec: ClusterSpec, *, log_dir: Path) -> NoReturn:
        raise ConfigError("engine torchrun: torch's elastic agent starts and restarts the workers, so it is "
                          "run per node, not per attempt. Fix: shardkit train job.yaml --node-rank K on each "
                          "node (Python: shardkit.cluster.run_job(config, node_rank=K))")

    def run(self, config: JobConfig, *, node_rank: int | None = None, echo: bool = True,
            console: TextIO | None = None, rerun: Rerun = "refuse") -> JobResult:
        """Run this node's agent for ``config`` (see `run_node`)."""
        return run_node(config, node_rank=node_rank, echo=echo, console=console, rerun=rerun)


def run_node(config: JobConfig, *, node_rank: int | None = None, echo: bool = True,
             console: TextIO | None = None, rerun: Rerun = "refuse") -> JobResult:
    """Run one node of a torchrun job until the job ends: the elastic agent, its workers, their logs.

    Example:
        >>> result = run_node(load_config("job.yaml"), node_rank=1)   # on the second machine

    Each worker runs the job's entrypoint with the ``SHARDKIT_*`` environment: data shard = ``RANK`` of
    ``WORLD_SIZE`` of the current rendezvous round (so after a resize the reader re-shards the rest of
    the epoch from the checkpoint), attempt = a number all nodes agree on per round. This node's
    workers heartbeat to it: a worker silent past ``heartbeat_timeout`` is killed, so the group
    restarts. Logs: ``<logdir>/logs/node-<K>/attempt-<a>/worker-<rank>.log``; a summary is printed and
    written (``<logdir>/summary.json`` by node 0, ``logs/node-<K>/summary.json`` by the others).

    ``rerun`` (see `shardkit.cluster.run_job`): node 0 decides, before it joins the rendezvous, what the
    job does with a completed run in its checkpoint folder (refuse, resume, or move it aside); the
    other nodes ignore it, and their workers, which start only once node 0 has joined, resume what
    node 0 left.

    Raises:
        CompletedRunError: node 0, a completed run and ``rerun="refuse"``.
        ConfigError: bad engine options, a job the torchrun engine cannot run, an address problem
            (`node_address`), a local ``data.url`` with no dataset, or a logdir this node rank already
            uses (or cannot write).
        JobError: the workers failed more than ``max_restarts`` times on this node, or the rendezvous
            failed (closed by another node, timed out), or the first one did not form within
            ``fault_tolerance.startup_timeout`` (the message says what this node waited for; where
            torch's client is stuck in a store call, the process exits with code 1 instead, once the
            summary is written).
        LostJobError: this node lost the job (its rendezvous store silent past
            ``fault_tolerance.lost_job_timeout``); where torch's agent is stuck in a store call, the
            process exits with code 1 instead once the summary is written.
        KeyboardInterrupt: SIGINT, SIGTERM or SIGHUP, at any point (in the rendezvous too): the workers
            were stopped (``signum`` attribute), the summary says ``interrupted``.
    """
    opts = check_node(config, node_rank=node_rank)
    opts = dataclasses.replace(opts, local_addr=node_address(opts))
    with _quiet_cpp_logs():
        require("torch.distributed.elastic", extra="torch", purpose=_PURPOSE)
        from shardkit.cluster.engines.torchrun._agent import launch

    return launch(config, opts, echo=echo, console=console if console is not None else sys.stdout,
                  rerun=rerun)


@contextlib.contextmanager
def _quiet_cpp_logs() -> Iterator[None]:
    """``TORCH_CPP_LOG_LEVEL=FATAL`` while torch is first imported here (c10 reads it once, as its library
    loads), unless set: c10d logs each failed store connection and rendezvous error with a C++ stack
    trace on stderr, where this node says in its own words what failed (`_agent`). Its workers get
    their own level (``ERROR`` unless set)."""
    quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ and "torch" not in sys.modules
    if quiet:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        yield
    finally:
        if quiet:
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)


def node_address(opts: TorchrunOptions) -> str:
    """The address this node binds to and advertises (`shardkit.cluster._addresses.node_address`):
    ``engine.local_addr`` checked, or the one that routes to ``engine.rdzv_endpoint``.

    Raises:
        ConfigError: the endpoint does not resolve or no interface routes to it; ``local_addr`` is not
            an address of this host, or cannot reach the endpoint.
    """
    host = p.parse_addr(opts.rdzv_endpoint)[0]
    return addresses.node_address(
        "127.0.0.1" if opts.endpoint_is_loopback else host, opts.local_addr,
        endpoint_key=f"engine.rdzv_endpoint = {opts.rdzv_endpoint!r}", local_key="engine.local_addr",
        fix="set engine.local_addr: ADDR in the job's engine options (on this node only: "
            "`--set engine.local_addr=ADDR`)")


def worker_log(node_dir: Path, attempt: int, rank: int) -> Path:
    """Where worker ``rank`` of ``attempt`` writes its stdout and stderr on this node."""
    return node_dir / f"attempt-{attempt}" / f"worker-{rank}.log"


# -- the worker side: run by the agent as `python -u -m shardkit.cluster.engines.torchrun --worker ...` ----

def _die_with_agent() -> None:
    """Linux: SIGKILL this worker when its agent dies, even by SIGKILL (torch starts it in a new session)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
    agent = os.environ.get(ENV_AGENT_PID)
    if agent and os.getppid() != int(agent):  # the agent died before prctl took effect
        os._exit(1)


def _worker(argv: list[str]) -> NoReturn:
    env = os.environ
    rank, world = env[p.RANK], env[p.WORLD_SIZE]
    attempt = env.get(p.ENV_ATTEMPT) or env.get("TORCHELASTIC_RESTART_COUNT") or "0"
    env.update({p.ENV_ROLE: "worker", p.ENV_ROLE_INDEX: rank, p.ENV_ATTEMPT: attempt,
                p.ENV_DATA_SHARD: rank, p.ENV_DATA_NUM_SHARDS: world})
    _die_with_agent()
    log = worker_log(Path(env[ENV_LOG_DIR]), int(attempt), int(rank))
    log.parent.mkdir(parents=True, exist_ok=True)
    from shardkit.job.masking import job_masker, redirect_output

    redirect_output(log, job_masker(env))  # the job's secrets masked as *** on the way to the log
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py` sets it
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    # Done: skip the interpreter's teardown, where gloo sometimes aborts after restarts (ENGINES.md) and
    # would make the agent restart a finished group; the exit handlers still run.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shardkit.cluster.engines.torchrun job.yaml --node-rank K [--set key=value ...]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--worker"]:
        _worker(args[1:])
    parser = argparse.ArgumentParser(prog="python -m shardkit.cluster.engines.torchrun",
                                     description="run one node of a job with engine: torchrun")
    parser.add_argument("config", help="the job's YAML file")
    parser.add_argument("--node-rank", type=int, default=None, metavar="K",
                        help="this node (0 hosts the rendezvous store); default engine.node_rank or 0")
    parser.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE")
    parser.add_argument("--quiet", action="store_true", help="progress lines only, not the workers' output")
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--resume", action="store_const", const="resume", dest="rerun", default="refuse",
                        help="node 0: continue a completed run from its last checkpoint")
    choice.add_argument("--fresh", action="store_const", const="fresh", dest="rerun",
                        help="node 0: start a new run; the earlier one is moved to <logdir>/previous/<time>/")
    ns = parser.parse_args(args)
    from shardkit.job.config import load_config

    try:
        run_node(load_config(ns.config, ns.set), node_rank=ns.node_rank, echo=not ns.quiet, rerun=ns.rerun)
    except ShardkitError as e:  # the exit codes of `shardkit train`: 1 the job failed, 2 it could not start
        print(f"shardkit train: {e}", file=sys.stderr)
        return 1 if isinstance(e, JobError) else 2
    except KeyboardInterrupt as e:
        return 128 + int(getattr(e, "signum", signal.SIGINT))
    return 0


