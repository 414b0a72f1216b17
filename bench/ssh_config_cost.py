"""The console's ssh file work per connection at N hosts (issue 33).

For every host, what ``connect_ssh`` does before its handshake: the config files for the host
(``host_config_paths`` where it exists), gpudeck's own settings (``host_settings``), asyncssh's read of the
config, the known_hosts check and the cipher order; against a generated config with one ``Host`` block and
one known_hosts line per host (as bench/standin.py and bench/fleet_hosts.py write them). Runs on a checkout
without ``host_config_paths`` too (then every connection reads the whole files), for the before/after figure.

Usage: python bench/ssh_config_cost.py [N ...]   (default 256 1024 2048)
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import asyncssh

from gpudeck.console.fleet import transport


def main() -> None:
    host_config_paths = getattr(transport, "host_config_paths", lambda _name, paths: list(paths))
    release = getattr(transport, "release_host_config", lambda _paths: None)
    d = tempfile.mkdtemp()
    key = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    for n in [int(x) for x in (sys.argv[1:] or ["256", "1024", "2048"])]:
        cfg, kh = os.path.join(d, f"config{n}"), os.path.join(d, f"kh{n}")
        with open(cfg, "w") as f:
            for i in range(n):
                f.write(
                    f"Host s{i:04d}\n    HostName 127.0.0.1\n    Port {20000 + i}\n    User root\n    IdentityFile /tmp/x\n    IdentitiesOnly yes\n\n"
                )
        with open(kh, "w") as f:
            f.writelines(f"[127.0.0.1]:{20000 + i} {key}\n" for i in range(n))
        t = time.perf_counter()
        for i in range(n):
            name = f"s{i:04d}"
            paths = host_config_paths(name, [cfg])
            transport.host_settings(name, paths)
            c = asyncssh.config.SSHClientConfig.load(None, paths, False, False, False, "root", (), name, ())
            assert c.get("Port") == 20000 + i, (c.get("Port"), i)
            release(paths)  # as connect_ssh does once asyncssh has read them
            k = transport._KnownHosts([kh])
            k("127.0.0.1", "127.0.0.1", 20000 + i)
            assert k.recorded_keys == 1
            transport.encryption_preference([cfg])
        el = time.perf_counter() - t
        print(
            f"ssh_config_cost N={n}: every host's config + settings + known_hosts check + cipher order: {el:.2f} s CPU per console start "
            f"({el / n * 1000:.2f} ms per connect); load average {os.getloadavg()[0]:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
