"""Notification targets with secrets in them, in the forms people write (the watcher's secret tests share them).

Every URL holds :data:`SECRET` (in a user name, a password, a path, a query argument, a header, a token field);
:func:`leaks` says whether a text shows it in any spelling a URL or an error could give it. ``LOOPBACK`` targets point
at a closed port on 127.0.0.1 (a delivery attempt fails at once, so the watcher logs them); ``REMOTE`` ones name the
services' own hosts and are never sent to by the tests.
"""

from __future__ import annotations

from urllib.parse import quote

SECRET = "Zq8sEcReT4x7"
S = SECRET
CLOSED = "127.0.0.1:9"  # the discard port: nothing listens on it on a test machine

LOOPBACK = [
    f"ntfy://{S}@{CLOSED}/alerts",  # ntfy reads a lone user as a user name: a token in it is printed by apprise
    f"ntfy://tk_{S}abcdefghijklmnopq@{CLOSED}/alerts",
    f"ntfy://user:{S}@{CLOSED}/alerts",
    f"ntfy://{CLOSED}/alerts?token={S}",
    f"ntfy://{CLOSED}/{S}",  # a topic that is its own secret (ntfy.sh)
    f"json://{CLOSED}/hook?+Authorization=Bearer%20{S}",
    f"json://{CLOSED}/hooks/{S}/incoming",
    f"json://user:{S}@{CLOSED}/hook",
    f"json://{CLOSED}/hook?:token={S}&-title=1",
    f"xml://{CLOSED}/hook?+X-Api-Key={S}",
    f"form://{CLOSED}/hook?+Authorization=Basic%20{S}",
    f"form://{S}@{CLOSED}/hook",
    f"gotify://{CLOSED}/{S}abcdefg",
    f"matrix://user:{S}@{CLOSED}/!room:example.org",
    f"matrix://{S}@{CLOSED}/#room",
    f"mailto://user:{S}@{CLOSED}?to=ops@example.org",
    f"apprise://{CLOSED}/{S}",
]
REMOTE = [
    f"ntfys://{S}@ntfy.sh/alerts",
    f"pover://userkey1234567890abcdefghi@{S}abcdefghijklmnopq",
    f"tgram://123456789:{S}AAAAAAAAAAAAAAAAAAAAAAAAAA/12345",
    f"discord://1234567890/{S}abcdefghij",
    f"https://discord.com/api/webhooks/1234567890/{S}abcdefghij",
    f"slack://T1JJ3T3L2/A1BRTD4JD/{S}TIiajkdnlazkcOXrIdevi",
    f"mailtos://user:{S}@smtp.example.org?to=ops@example.org",
    f"pbul://o.{S}abcdefghijklmnopqrstuvw",
    f"notaservice://user:{S}@example.org/x",  # apprise cannot read it: scheme only
]
URLS = LOOPBACK + REMOTE


def leaks(text: str) -> bool:
    """Whether ``text`` shows the secret: as written, URL-quoted, or in part (apprise's masks keep one or four characters)."""
    return any(form in text for form in (SECRET, quote(SECRET), SECRET[:6], SECRET[-6:], SECRET.lower()[:6]))
