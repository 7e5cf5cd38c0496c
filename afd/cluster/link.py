"""A link that behaves like a network, for benchmarks: the FFN nodes in a network namespace of their own,
joined to this one by a veth pair whose both ends are shaped by `tc` (netem: rate and delay; where the
kernel has no netem, tbf: rate only).

On loopback the exchange costs almost nothing, so what hides it (the ScMoE window, ping-pong) cannot
be measured; between hosts it costs what the link charges. Needs root and iproute2.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


class LinkError(RuntimeError):
    """The link cannot be emulated here (no root, no iproute2, a qdisc the kernel lacks)."""


@dataclass(frozen=True)
class LinkSpec:
    rate: str | None
    """tc's rate, e.g. 25gbit."""
    delay: str | None
    """tc's one-way delay per direction, e.g. 20us."""

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        """`RATE[,DELAY]` or `,DELAY`: 25gbit,20us / 10gbit / ,50us."""
        rate_text, _, delay_text = text.partition(",")
        rate, delay = rate_text.strip() or None, delay_text.strip() or None
        if rate is not None and not re.fullmatch(r"\d+(\.\d+)?(bit|kbit|mbit|gbit)", rate):
            raise ValueError(f"--link {text!r}: rate {rate!r} is not like 25gbit or 800mbit")
        if delay is not None and not re.fullmatch(r"\d+(\.\d+)?(us|ms)", delay):
            raise ValueError(f"--link {text!r}: delay {delay!r} is not like 20us or 1ms")
        if rate is None and delay is None:
            raise ValueError(f"--link {text!r}: give a rate, a delay or both (25gbit,20us)")
        return cls(rate, delay)

    def bytes_per_second(self) -> float:
        m = re.fullmatch(r"(\d+(?:\.\d+)?)(\w+)", self.rate or "")
        assert m is not None, "a link without a rate has no bytes per second"
        n, unit = m.groups()
        return float(n) * _RATE_UNITS[unit] / 8


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


def _check(r: subprocess.CompletedProcess, what: str) -> None:
    if r.returncode != 0:
        raise LinkError(f"{what}: {r.stderr.strip() or r.stdout.strip()}")


class EmulatedLink:
    """`with EmulatedLink(spec) as link:` gives link.netns (run the FFN nodes there, e.g. through
    `link.wrap(cmd)`), link.near_ip (this side: attention nodes) and link.far_ip (the FFN side)."""

    near_ip, far_ip = "10.79.0.1", "10.79.0.2"

    def __init__(self, spec: LinkSpec):
        self.spec = spec
        tag = str(os.getpid() % 100000)
        self.netns, self._near, self._far = f"afd-link-{tag}", f"afdla{tag}", f"afdlb{tag}"
        self.qdisc = ""

    def wrap(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *cmd]

    @property
    def hosts(self) -> dict[str, str]:
        """A local job's hosts across the link (afd.cluster.local_config.local_job's keywords)."""
        return {"host": self.near_ip, "ffn_host": self.far_ip}

    @property
    def prefix(self) -> tuple[str, ...]:
        """How an FFN node starts behind the link (LocalCluster's ffn_command_prefix)."""
        return tuple(self.wrap([]))

    def __enter__(self) -> EmulatedLink:
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
            raise LinkError("emulating a link needs root, ip and tc (iproute2)")
        _check(_run("ip", "netns", "add", self.netns), "ip netns add")
        try:
            self._setup()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _setup(self) -> None:
        ns = ("ip", "netns", "exec", self.netns)
        _check(_run("ip", "link", "add", self._near, "type", "veth", "peer", "name", self._far), "ip link add")
        _check(_run("ip", "link", "set", self._far, "netns", self.netns), "ip link set netns")
        _check(_run("ip", "addr", "add", f"{self.near_ip}/24", "dev", self._near), "ip addr add")
        _check(_run("ip", "link", "set", self._near, "up"), "ip link set up")
        _check(_run(*ns, "ip", "addr", "add", f"{self.far_ip}/24", "dev", self._far), "ip addr add (netns)")
        _check(_run(*ns, "ip", "link", "set", self._far, "up"), "ip link set up (netns)")
        _check(_run(*ns, "ip", "link", "set", "lo", "up"), "ip link set lo up (netns)")
        qdisc = self._qdisc()
        for prefix, dev in (((), self._near), (ns, self._far)):  # both directions
            _check(_run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", *qdisc), f"tc qdisc {' '.join(qdisc)}")
        self.qdisc = " ".join(qdisc)

    def _qdisc(self) -> list[str]:
        s = self.spec
        probe = _run("tc", "qdisc", "add", "dev", self._near, "root", "netem", "delay", "0us")
        if probe.returncode == 0:
            _run("tc", "qdisc", "del", "dev", self._near, "root")
            return ["netem", *(["rate", s.rate] if s.rate else []), *(["delay", s.delay] if s.delay else [])]
        if s.delay:
            raise LinkError(
                f"this kernel has no netem qdisc (sch_netem), so a delay ({s.delay}) cannot be "
                f"emulated here; give a rate only (tbf shapes that): {probe.stderr.strip()}"
            )
        assert s.rate is not None  # LinkSpec.parse refuses a link with neither
        # tbf needs a bucket of at least one timer tick's worth of bytes (HZ may be 100)
        burst = max(64 << 10, int(s.bytes_per_second() / 100))
        return ["tbf", "rate", s.rate, "burst", str(burst), "latency", "50ms"]

    def __exit__(self, *exc) -> None:
        _run("ip", "link", "del", self._near)
        _run("ip", "netns", "del", self.netns)
