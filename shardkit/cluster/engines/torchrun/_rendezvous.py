"""A torchrun node's first rendezvous, bounded by ``fault_tolerance.startup_timeout``: a node other than
0 waits for node 0's store in Python (no C++ connect retries, a Ctrl-C taken at once), torch's join gets
the time that is left, and a node whose peers never came says so in one line."""

from __future__ import annotations

import math
import socket
import threading
import time
from datetime import timedelta
from typing import Any

from shardkit.cluster.engines.torchrun import TorchrunOptions
from shardkit.job import protocol as p
from shardkit.job.config import JobConfig

__all__ = ["Formation"]

_PROBE_S = 0.5  # between two tries to connect to node 0's store
_JOIN_DEFAULT_S = 600  # torch's rdzv_conf.join_timeout default: later rounds wait this long


class Formation:
    """The first rendezvous of this node: until its first attempt starts (`formed`), it must form by
    ``deadline`` (``startup_timeout`` seconds after ``started``, a ``time.monotonic`` time).

    Phases (`phase`): ``store`` (not node 0: waiting for node 0's store to accept a connection),
    ``join`` (connecting to the store and joining torch's rendezvous), ``formed``. `message` says, in one
    line, what this node waited for when the deadline passed.
    """

    def __init__(self, config: JobConfig, opts: TorchrunOptions, *, started: float) -> None:
        self.config, self.opts = config, opts
        self.timeout = config.fault_tolerance.startup_timeout
        self.deadline = started + self.timeout
        self.limit = self.timeout, "fault_tolerance.startup_timeout"  # what bounds the wait: seconds, key
        self.phase = "store" if opts.node_rank != 0 else "join"
        self.store_why: str | None = None  # why node 0's store did not answer, when it did not
        self.handler: Any = None  # torch's rendezvous handler, once made
        self._lock = threading.Lock()

    @property
    def formed(self) -> bool:
        return self.phase == "formed"

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def wait_for_store(self) -> bool:
        """Not node 0: wait until node 0's store accepts a TCP connection (True) or the deadline passes
        (False). In Python, so that a signal ends the wait at once and torch's C++ client, which retries
        for ``rdzv_conf.read_timeout`` and logs each try, connects at its first try."""
        host, port = p.parse_addr(self.opts.rdzv_endpoint)
        while True:
            left = self.remaining()
            try:
                with socket.create_connection((host, port), timeout=max(0.1, min(2.0, left))):
                    self.phase = "join"
                    return True
            except TimeoutError:
                self.store_why = "no answer"
            except OSError as e:
                self.store_why = e.strerror or str(e)
            left = self.remaining()
            if left <= 0:
                return False
            time.sleep(min(_PROBE_S, left))

    def join_timeout(self) -> int:
        """``rdzv_conf.join_timeout`` for the first round: the time left, at most the configured one."""
        configured = int(self.opts.rdzv_conf.get("join_timeout", _JOIN_DEFAULT_S))
        left = math.ceil(self.remaining())
        if configured < left:  # the rendezvous's own bound comes first
            self.limit = float(configured), "engine.rdzv_conf.join_timeout"
        return max(1, min(configured, left))

    def set_formed(self) -> bool:
        """The first attempt starts: later rounds (restarts, a node lost or joining) wait for their
        nodes as long as ``rdzv_conf.join_timeout`` says again. Whether this was the first."""
        with self._lock:
            if self.formed:
                return False
            self.phase = "formed"
        timeout = getattr(getattr(self.handler, "_settings", None), "timeout", None)
        if timeout is not None and hasattr(timeout, "_join"):  # torch's RendezvousTimeout
            timeout._join = timedelta(seconds=int(self.opts.rdzv_conf.get("join_timeout", _JOIN_DEFAULT_S)))
        return True

    def late(self) -> bool:
        """Past the deadline and not formed; from then on `formed` stays False."""
        with self._lock:
            return not self.formed and self.remaining() <= 0

    def joined(self) -> int | None:
        """How many nodes had joined the round when this node last looked (itself included), if known."""
        handler = self.handler
        try:
            state = handler._state_holder.state
            me = handler._this_node
            others = {n for n in (*state.participants, *state.wait_list) if n != me}
        except (AttributeError, TypeError):
            return None
        return 1 + len(others)

    def message(self, *, stuck: bool = False) -> str:
        """One line: what this node waited for, for how long, and what to do (``job J, node K: `` goes
        before it in the error). ``stuck``: this node's last request to the store has not returned."""
        opts, node = self.opts, self.opts.node_rank
        nodes = opts.min_nodes
        where = (f"the rendezvous {opts.rdzv_id or self.config.name!r} "
                 f"at {opts.rdzv_endpoint} never formed: waited {self.limit[0]:g} s ({self.limit[1]}) for "
                 f"{nodes} node{'s' if nodes > 1 else ''}")
        every = (f"start every node of the job (shardkit train JOB.yaml --node-rank K, K from 0 to "
                 f"{opts.max_nodes - 1}) with the same engine.rdzv_endpoint, rdzv_id and nnodes, within "
                 f"{self.limit[0]:g} s of each other, and read the output of any that ended (refused, "
                 "crashed)")
        if self.phase == "store":
            return (f"{where}; node 0, which hosts it, never came: its store did not answer "
                    f"({self.store_why or 'no answer'}): node 0 was refused, crashed before joining or was "
                    f"never started, or this host cannot reach {opts.rdzv_endpoint}. Fix: {every}; check "
                    "engine.rdzv_endpoint (node 0's address and a port free there)")
        if self.handler is None or (stuck and node != 0):
            if self.handler is not None:
                return (f"{where}, {self._count()} as this node last saw it; then node 0's store at "
                        f"{opts.rdzv_endpoint} stopped answering this node's requests (a network "
                        "partition between this host and node 0, or node 0's agent hung or gone). Fix: "
                        f"check node 0's output and this host's network path to it; {every}")
            return (f"{where}: node 0's store at {opts.rdzv_endpoint} accepted a connection but did not "
                    "answer (node 0's agent hung, or the network path to it drops packets). Fix: check "
                    f"node 0's output and the network path to it; {every}")
        joined = self.joined()
        missing = "the others" if joined is None else str(max(1, nodes - joined))
        return (f"{where}, {self._count()}; {missing} never came (refused, crashed before joining, or never "
                f"started). Fix: {every}; or let the job run with fewer nodes (engine.nnodes \"MIN:MAX\")")

    def _count(self) -> str:
        joined = self.joined()
        if joined is None:
            return "not all of them joined"
        who = "this node" if self.opts.node_rank == 0 or joined < 2 else "this node and node 0"
        return f"{joined} joined ({who})"
