"""Provides how a notification target (an apprise URL, secrets in it) is shown: never with its secrets.

:func:`privacy_form` is the one form a target takes wherever a person or another program sees it (``--check``,
``--status``, ``--status --json``, the watcher's log, errors, the console's Fleet header): apprise's own privacy
form (``url(privacy=True)`` of the plugin apprise builds from the URL), with what apprise leaves in clear that can
be a secret hidden as well. Apprise hides what each plugin declares private (passwords, tokens, API keys), but it
prints the rest as written: a user name given alone (``ntfys://TOKEN@host`` reads as a user), the path
(``json://host/TOKEN/hook``, ntfy topics, matrix rooms) and the query (``?+Authorization=Bearer%20TOKEN`` headers,
``?:key=`` payload fields). So only the scheme, the host and port, a user name that comes with a password, and
the pieces apprise wrote itself (its masks ``****``, ``a...z``, its default paths) are kept; every other piece
is ``…``, and the query is left out. A URL apprise cannot read is shown as its scheme and ``…``, never raw.

:func:`scrub` hides a target's secret pieces in free text (an error apprise or the network library wrote), and
:func:`label` gives the short id the metrics endpoint uses as the ``target`` label (a keyed hash: stable while the
outbox lives, and it says nothing about the URL to whoever scrapes it).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from urllib.parse import quote, unquote, urlsplit

HIDDEN = "…"
SHOWN_MAX = 200  # characters of a shown target (apprise's form of a long URL is cut, with …)
MIN_SECRET = 4  # pieces of a URL shorter than this are not searched for in free text (they would hide common words)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]{0,31}(?=://)")


def _scheme_only(url: str) -> str:
    """``scheme://…``: all that is shown of a URL apprise cannot read (``…`` alone when it has no scheme)."""
    m = _SCHEME.match(url)
    return f"{m.group(0).lower()}://{HIDDEN}" if m else HIDDEN


def _apprise_form(url: str) -> str | None:
    import apprise

    try:
        plugin = apprise.Apprise.instantiate(url)
        return str(plugin.url(privacy=True)) if plugin else None
    except Exception:  # apprise's plugins raise their own errors for URLs they cannot read
        return None


def _written(piece: str, url: str) -> bool:
    """Whether ``piece`` of apprise's form was copied from the URL as written (else apprise made it: a mask, a default)."""
    return bool(piece) and any(p in url for p in {piece, unquote(piece), quote(unquote(piece), safe="")})


def privacy_form(url: str) -> str:
    """The target as it may be shown anywhere: apprise's privacy form with its clear pieces hidden (see the module)."""
    private = _apprise_form(url)
    if private is None:
        return _scheme_only(url)
    try:
        parts = urlsplit(private)
        port = parts.port
    except ValueError:
        return _scheme_only(url)
    userinfo, at, _ = parts.netloc.rpartition("@")
    user, colon, password = userinfo.partition(":")
    if at:
        if colon and not _written(password, url):
            userinfo = f"{user}:{password}"  # apprise hid the password: the user name it goes with is a name
        else:
            userinfo = HIDDEN if _written(userinfo, url) else userinfo
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    segments = [HIDDEN if _written(s, url) else s for s in parts.path.split("/")]
    path = "/".join(s for i, s in enumerate(segments) if not (s == HIDDEN and i and segments[i - 1] == HIDDEN))
    text = f"{parts.scheme}://{userinfo + '@' if at else ''}{host}{f':{port}' if port else ''}{path}"
    return text if len(text) <= SHOWN_MAX else text[: SHOWN_MAX - 1] + HIDDEN


def _secret_pieces(url: str) -> list[str]:
    """The pieces of ``url`` that :func:`privacy_form` does not show (user info, a token in the host's place, path, query), longest first."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return [url.partition("://")[2]] if "://" in url else [url]
    visible = privacy_form(url)
    # every piece of the netloc (a token may sit where a user, a password, a host or even a port goes: tgram://BOT:TOKEN/),
    # of the path and of the query; those the privacy form shows (the host, mostly) are not secret
    pieces = {parts.netloc, *re.split(r"[@:]", parts.netloc), *parts.path.split("/"), parts.query}
    for arg in parts.query.split("&"):
        pieces.update(arg.split("=", 1))
    out = set()
    for p in pieces:
        for form in (p, unquote(p)):
            if len(form) >= MIN_SECRET and form not in visible:
                out.add(form)
    return sorted(out, key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """``text`` (an error about the target) with every secret piece of ``url`` replaced by ``…``."""
    for piece in _secret_pieces(url):
        text = text.replace(piece, HIDDEN)
    return text


def label(url: str, key: bytes) -> str:
    """The target's id for metrics labels and ``--status``: ``t-`` and 8 hex digits of an HMAC of the URL under ``key``."""
    return "t-" + hmac.new(key, url.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:8]
