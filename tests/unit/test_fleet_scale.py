"""A fleet of a thousand hosts fits in the console's file descriptors (issue 33: one per host, and a login's soft limit is
often 1,024)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import resource
from gpudeck.console.fleet.fleet import FDS_BESIDE_HOSTS, room_for_hosts
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
room_for_hosts(100)
small = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
room_for_hosts(2000)
print(small, resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard, FDS_BESIDE_HOSTS)
"""


def test_the_soft_fd_limit_is_raised_only_when_the_hosts_would_not_fit() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    small, big, hard, beside = (int(x) for x in out)
    assert small == min(1024, hard)  # 100 hosts fit: left alone
    assert big >= min(hard, 2000 + beside)  # 2,000 hosts: raised towards the hard limit


def test_a_big_fleet_is_spread_over_phases_of_the_interval_and_a_small_one_keeps_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Every agent sends on the wall clock's grid; past SNAPSHOT_GROUP hosts the console asks for ceil(N / group)
    phases, evenly over the interval, so no turn of its event loop reads the whole fleet (bench/RESULTS.md 35-phase)."""
    from collections import Counter

    from gpudeck.console.core import config as cfg
    from gpudeck.console.fleet.fleet import SNAPSHOT_GROUP, Fleet

    def fleet(n: int, interval: float = 1.0) -> Fleet:
        hosts = tuple(cfg.HostSettings(name=f"h{i:04d}") for i in range(n))
        return Fleet(config=cfg.Config(hosts=hosts, path=tmp_path / "hosts.toml"), interval_s=interval, watch=False)

    small = fleet(SNAPSHOT_GROUP)
    assert {link.phase_s for link in small.links.values()} == {0.0}
    big = fleet(1024)
    phases = Counter(link.phase_s for link in big.links.values())
    assert sorted(phases) == [i / 8 for i in range(8)] and set(phases.values()) == {128}
    # neighbours in the config (a rack, one switch) are dealt to different phases; the interval scales the phases
    names = list(big.links)
    assert big.links[names[0]].phase_s != big.links[names[1]].phase_s
    odd = fleet(SNAPSHOT_GROUP + 1, interval=2.0)
    assert sorted(Counter(link.phase_s for link in odd.links.values()).items()) == [(0.0, 65), (1.0, 64)]
