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
