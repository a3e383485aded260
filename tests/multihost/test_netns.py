"""The harness itself: hosts reach each other only by their own addresses, a cut is silence, and
everything made is removed, also when the test body fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.multihost.netns import Network, remove_stale

pytestmark = pytest.mark.timeout(60)

SERVE = ("import socket,sys;s=socket.socket();s.bind((sys.argv[1],9000));s.listen();"
         "c,_=s.accept();c.sendall(b'hi');c.recv(1)")
CONNECT = ("import socket,sys;s=socket.create_connection((sys.argv[1],9000),timeout=float(sys.argv[2]));"
           "print(s.recv(2).decode())")


def test_hosts_reach_each_other_by_address_and_the_host_name_is_loopback(net2: Network) -> None:
    a, b = net2.hosts
    b.popen([sys.executable, "-c", SERVE, b.addr])
    for _ in range(50):
        got = a.run([sys.executable, "-c", CONNECT, b.addr, "2"], timeout=10)
        if got.returncode == 0:
            break
    assert got.stdout.strip() == "hi"
    name = a.run([sys.executable, "-c", "import socket;print(socket.gethostbyname(socket.gethostname()))"],
                 timeout=10)
    assert name.stdout.strip().startswith("127.")
    # only this host's own link and loopback: no route out of the namespaces
    routes = a.run(["ip", "route"], timeout=10).stdout
    assert "default" not in routes
    assert a.ifname != b.ifname


def test_a_cut_host_is_silent_and_heals(net2: Network) -> None:
    a, b = net2.hosts
    b.popen([sys.executable, "-c", SERVE, b.addr])
    b.cut()
    got = a.run([sys.executable, "-c", CONNECT, b.addr, "1"], timeout=10)
    assert got.returncode != 0
    assert "timed out" in got.stderr  # no RST: silence, as a partition is
    b.heal()
    for _ in range(50):
        got = a.run([sys.executable, "-c", CONNECT, b.addr, "2"], timeout=10)
        if got.returncode == 0:
            break
    assert got.stdout.strip() == "hi"


def test_everything_is_removed_also_when_the_test_fails() -> None:
    pids: list[int] = []
    made: list[str] = []

    def fail_inside() -> None:
        with Network(2) as net:
            pids.extend(h.popen(["sleep", "600"]).pid for h in net.hosts)
            made.extend(Network.leftover())
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_inside()
    assert len(made) == 3  # two hosts and the switch
    assert Network.leftover() == []
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split()[2] == "Z"


def test_a_killed_runs_namespaces_are_removed_by_the_next() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os;print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    ns = f"skmh{dead.stdout.strip()}-1-h0"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        assert ns in remove_stale()
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=False, capture_output=True)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert ns not in listed.stdout
