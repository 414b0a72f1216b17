"""Terminal escaping and secret redaction: what run-controlled text goes through before a person sees it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpudeck.console.core.sanitize import (
    LINE_LIMIT,
    REDACTED,
    escape_controls,
    escape_tree,
    is_secret_name,
    one_line,
    redact_env,
    redact_run,
    terminal_text,
)


def test_escape_sequences_c0_c1_and_bidi_controls_become_visible_escapes() -> None:
    assert escape_controls("\x1b]0;pwned\x07title") == "\\x1b]0;pwned\\x07title"
    assert escape_controls("\x1b[2J\x1b[H") == "\\x1b[2J\\x1b[H"
    assert escape_controls("\x1b]52;c;ZXZpbA==\x07") == "\\x1b]52;c;ZXZpbA==\\x07"  # clipboard write
    assert escape_controls("a\x9bb\x85c") == "a\\x9bb\\x85c"  # C1 CSI and NEL
    assert escape_controls("x\u202eevil\u2066") == "x\\u202eevil\\u2066"
    assert escape_controls("line\r\nnext\x7f") == "line\\x0d\\x0anext\\x7f"
    assert terminal_text("a\tb\nc\rd\x1b") == "a\tb\nc\\x0dd\\x1b"
    assert escape_controls("ünïcødé ✓ [bold red]x[/]") == "ünïcødé ✓ [bold red]x[/]"  # printable text untouched


@given(st.text())
def test_no_control_character_survives_and_printable_text_is_unchanged(text: str) -> None:
    out = terminal_text(text)
    assert not any((ord(c) < 0x20 and c not in "\n\t") or 0x7F <= ord(c) <= 0x9F for c in out)
    if all(
        c.isprintable()
        and c not in "\u061c\u200e\u200f\u2028\u2029\ufeff"
        and not 0x202A <= ord(c) <= 0x202E
        and not 0x2066 <= ord(c) <= 0x2069
        for c in text
    ):
        assert out == text


def test_escape_tree_escapes_every_string_and_key() -> None:
    assert escape_tree({"n\x1b": ["a\x07", 1, None, {"k": "\x9b"}]}) == {"n\\x1b": ["a\\x07", 1, None, {"k": "\\x9b"}]}


def test_secret_looking_names() -> None:
    for name in (
        "HF_TOKEN",
        "AWS_SECRET_ACCESS_KEY",
        "OPENAI_API_KEY",
        "DB_PASSWORD",
        "MYPASSWORD",
        "WANDB_API_KEY",
        "GITHUB_TOKEN",
        "api_key",
        "SSH_PRIVATE_KEY_PATH",
        "SECRET",
    ):
        assert is_secret_name(name), name
    for name in ("PATH", "HF_HOME", "CUDA_VISIBLE_DEVICES", "MONKEY", "KEYBOARD", "TOKENIZERS_PARALLELISM", "NCCL_SOCKET_IFNAME"):
        assert not is_secret_name(name), name


def test_redact_run_covers_the_spec_the_nodes_and_the_events() -> None:
    spec = {"argv": ["python", "x.py"], "env": {"HF_TOKEN": "hf_abc", "HF_HOME": "/data"}}
    run = {"id": "r1", "spec": spec, "nodes": [{"spec": spec}], "events": [{"kind": "run_created", "data": {"spec": spec}}]}
    out = redact_run(run)
    assert out["spec"]["env"] == {"HF_TOKEN": REDACTED, "HF_HOME": "/data"}
    assert out["nodes"][0]["spec"]["env"]["HF_TOKEN"] == REDACTED
    assert out["events"][0]["data"]["spec"]["env"]["HF_TOKEN"] == REDACTED
    assert run["spec"]["env"]["HF_TOKEN"] == "hf_abc"  # the input is not changed
    assert redact_env({"DB_PASSWORD": ""}) == {"DB_PASSWORD": ""}  # nothing to hide


def test_a_quarantined_event_s_raw_json_has_its_spec_secrets_redacted() -> None:
    import json

    from gpudeck.console.core.sanitize import redact_raw_event

    raw = json.dumps({"seq": 1, "kind": "run_created", "data": {"spec": {"env": {"HF_TOKEN": "hf_abc", "A": "1"}}}}, ensure_ascii=True)
    out = json.loads(redact_raw_event(raw))
    assert out["data"]["spec"]["env"] == {"HF_TOKEN": REDACTED, "A": "1"}
    plain = json.dumps({"seq": 2, "ts": 1.0, "data": {"record": {"step": 2**64}}})
    assert redact_raw_event(plain) is plain  # nothing to hide: byte for byte as stored
    assert redact_raw_event("{not json") == "{not json"


def test_one_line_escapes_line_breaks_too_and_cuts_at_the_limit_with_an_ellipsis() -> None:
    assert one_line("a\nb\tc\x1b[31m") == "a\\x0ab\\x09c\\x1b[31m"
    long = one_line("Stop " + "x" * 500 + "\nmore")
    assert len(long) == LINE_LIMIT and long.endswith("…") and "\n" not in long
    assert one_line("x" * 10, 10) == "x" * 10 and one_line("x" * 11, 10) == "x" * 9 + "…"
