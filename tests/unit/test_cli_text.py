"""What the CLI's help and tables say matches what the code does: the secret-name rule (one, in console/core/sanitize.py),
the verify table's columns, diff --all, and the host-name rule."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gpudeck.agents.wire.protocol import ClaimRow
from gpudeck.console.cli.parser import SHOW_SECRETS_HELP, build_parser
from gpudeck.console.core import config as cfg
from gpudeck.console.core.sanitize import SECRET_ANYWHERE, SECRET_RULE, SECRET_WORDS, is_secret_name
from gpudeck.console.present.formats import format_claims

ROOT = Path(__file__).resolve().parents[2]
# every command that prints a spec or an environment
PRINTS_ENV = ("launch", "relaunch", "rollback", "status", "runs", "history", "show", "diff")


def _flat(text: str) -> str:
    return " ".join(text.split())


def _subparsers(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_the_rule_in_words_is_the_rule_the_code_matches() -> None:
    for w in SECRET_WORDS:
        assert w in SECRET_RULE
        for name in (w, f"X_{w}", f"{w}_FILE", f"A_{w}_B", w.lower()):
            assert is_secret_name(name), name
        if not any(a in w for a in SECRET_ANYWHERE):
            assert not is_secret_name(f"X{w}Y"), w  # inside a word: not a match
    for w in SECRET_ANYWHERE:
        assert w in SECRET_RULE and is_secret_name(f"my{w.lower()}x")
    for name in ("PATH", "HF_HOME", "MONKEY", "KEYBOARD", "TOKENIZERS_PARALLELISM", "NCCL_SOCKET_IFNAME"):
        assert not is_secret_name(name), name
    assert is_secret_name("KEY_FILE") and is_secret_name("DB_CREDENTIAL") and is_secret_name("MY_SECRETS")


def test_every_command_that_prints_an_env_has_show_secrets_and_its_help_quotes_the_rule() -> None:
    subs = _subparsers(build_parser())
    for cmd in PRINTS_ENV:
        opts = {o: a for a in subs[cmd]._actions for o in a.option_strings}
        assert "--show-secrets" in opts, cmd
        assert opts["--show-secrets"].help == SHOW_SECRETS_HELP and SECRET_RULE in SHOW_SECRETS_HELP
        assert SECRET_RULE in _flat(subs[cmd].format_help()), cmd  # as `gpudeck CMD --help` prints it


def test_the_docs_quote_the_rule_exactly() -> None:
    for doc in ("docs/cli.md", "README.md"):
        assert SECRET_RULE in _flat((ROOT / doc).read_text()), doc


def test_the_verify_table_has_a_header_over_every_column() -> None:
    text = format_claims("r-1", [ClaimRow("GPUs", 2, 1, False, "--gpus 0,1"), ClaimRow("params", 4, 4, True, "claims")], [])
    header, *rows = text.splitlines()[1:]
    assert header.split() == ["WHAT", "CLAIMED", "OBSERVED", "VERDICT", "CLAIM", "FROM", "DETAIL"]
    assert header.index("VERDICT") == rows[0].index("MISMATCH") == rows[1].index("OK")


def test_diff_all_help_says_what_it_shows() -> None:
    help_text = _flat(_subparsers(build_parser())["diff"].format_help())
    assert "equal (the outcome rows are always all shown)" in help_text


def test_the_host_name_message_says_what_the_check_accepts() -> None:
    for ok in ("gpu1", "user@gpu-1.example", "[fe80::1]", "host_2:22"):
        assert cfg.check_host_name(ok) == ok
    for bad in ("bad host", "-oProxyCommand=x", "a/b", "", "x" * 254):
        with pytest.raises(cfg.ConfigError) as e:
            cfg.check_host_name(bad)
        assert cfg.HOST_NAME_RULE in str(e.value)
    for c in ". _ - @ : [ ]".split():
        assert c in cfg.HOST_NAME_RULE and cfg.check_host_name(f"a{c}b")
