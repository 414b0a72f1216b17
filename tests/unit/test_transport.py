"""The console's SSH cipher preference: AES-GCM first unless the user's ssh config says otherwise."""

from __future__ import annotations

from pathlib import Path

import asyncssh

from console.transport import PREFERRED_CIPHERS, encryption_preference


def test_aes_gcm_first_and_every_default_still_allowed(tmp_path: Path) -> None:
    cfg = tmp_path / "config"
    cfg.write_text("Host gpu1\n    HostName 10.0.0.1\n    User me\n")
    algs = encryption_preference([str(cfg)])
    assert algs is not None and tuple(algs[:2]) == PREFERRED_CIPHERS
    assert sorted(algs) == sorted(a.decode() for a in asyncssh.encryption.get_default_encryption_algs())


def test_a_ciphers_line_or_an_include_leaves_the_choice_to_the_config(tmp_path: Path) -> None:
    for text in ("Host *\n  Ciphers chacha20-poly1305@openssh.com\n", "include ~/.ssh/more.conf\n"):
        cfg = tmp_path / "config"
        cfg.write_text(text)
        assert encryption_preference([str(cfg)]) is None
    assert encryption_preference([str(tmp_path / "missing")]) is not None
