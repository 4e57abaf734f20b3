"""Two hosts on one machine: network namespaces joined by a veth pair (root only).

Each namespace has its own loopback and one address on a private 10.x subnet, so a run
that spans both talks over a real link that can be cut (`link(False)`) or lose every
process at once (`kill(i)`, a node loss). Nothing here reaches a real network.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess

__all__ = ["Hosts", "Lan", "netns_unavailable"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    name = f"rsprobe{os.getpid()}"
    probe = subprocess.run(
        ["ip", "netns", "add", name], capture_output=True, text=True, check=False
    )
    if probe.returncode != 0:
        return f"`ip netns add` failed: {probe.stderr.strip() or probe.returncode}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
    return None


class Hosts:
    """Two network namespaces joined by a veth pair, on a private 10.x subnet of their own."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 10000}{random.randint(10, 99)}"
        self.ns = [f"rsa{tag}", f"rsb{tag}"]
        self.dev = [f"rva{tag}", f"rvb{tag}"]
        net = f"10.{random.randint(64, 127)}.{random.randint(0, 255)}"
        self.addr = [f"{net}.1", f"{net}.2"]

    def up(self) -> None:
        for ns in self.ns:
            _ip("netns", "add", ns)
        _ip("link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
        for ns, dev, addr in zip(self.ns, self.dev, self.addr, strict=True):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def exec_prefix(self, i: int) -> list[str]:
        """Run a command on host i, with gloo on that host's link."""
        return ["ip", "netns", "exec", self.ns[i], "env", f"GLOO_SOCKET_IFNAME={self.dev[i]}"]

    def link(self, up: bool, i: int = 1) -> None:
        _ip("-n", self.ns[i], "link", "set", self.dev[i], "up" if up else "down")

    def pids(self, i: int) -> list[int]:
        out = subprocess.run(
            ["ip", "netns", "pids", self.ns[i]], capture_output=True, text=True, check=False
        )
        return [int(p) for p in out.stdout.split()]

    def kill(self, i: int) -> None:
        """kill -9 every process of host i (the agent and its workers): a node loss."""
        for pid in self.pids(i):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)

    def down(self) -> None:
        for i in range(2):
            self.kill(i)
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)

    def __enter__(self) -> Hosts:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()


class Lan(Hosts):
    """`n` hosts on one switch: a bridge in a network namespace of its own, each host joined
    to it by a veth pair, all on one private 10.x/24. Host i has address `addr[i]`; the same
    calls as Hosts (exec_prefix, link, pids, kill, down)."""

    def __init__(self, n: int) -> None:
        tag = f"{os.getpid() % 10000}{random.randint(10, 99)}"
        self.n = n
        self.ns = [f"rl{i}{tag}" for i in range(n)]
        self.switch = f"rls{tag}"
        self.dev = [f"rlh{i}{tag}" for i in range(n)]
        self.peer = [f"rlp{i}{tag}" for i in range(n)]
        net = f"10.{random.randint(64, 127)}.{random.randint(0, 255)}"
        self.addr = [f"{net}.{i + 1}" for i in range(n)]

    def up(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for ns, dev, peer, addr in zip(self.ns, self.dev, self.peer, self.addr, strict=True):
            _ip("netns", "add", ns)
            _ip("link", "add", dev, "type", "veth", "peer", "name", peer)
            _ip("link", "set", dev, "netns", ns)
            _ip("link", "set", peer, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", peer, "master", "br0")
            _ip("-n", self.switch, "link", "set", peer, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def down(self) -> None:
        for i in range(self.n):
            self.kill(i)
        for ns in [*self.ns, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
