"""Provides the typed errors of the operations layer: each names what was asked and what to do, and its exit code."""

from __future__ import annotations

from dataclasses import dataclass

from gpudeck.console.core.exitcodes import EXIT_ERROR, EXIT_USAGE


class OpsError(Exception):
    """An operation refused or failed; ``str()`` is the message a front-end shows, ``exit_code`` what the CLI returns."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class HistoryUnavailable(OpsError):
    """The history cannot be opened or read (its file, its owner, a closed handle): the message says which and why."""


class QueryRefused(OpsError):
    """A history filter the query language does not understand: the message names the word and the words it knows."""

    exit_code = EXIT_USAGE


class IntentError(OpsError):
    """A field of an intent is wrong: the message names the field and the fix (the CLI and the console show it as is)."""

    exit_code = EXIT_USAGE

    def __init__(self, field: str, problem: str, fix: str) -> None:
        super().__init__(f"{field}: {problem}; {fix}")
        self.field = field
        self.problem = problem
        self.fix = fix


@dataclass(frozen=True)
class Candidate:
    """One run a reference could mean: where it is, what it is called, its state and when it started."""

    host: str
    id: str
    name: str | None
    state: str
    started: float | None

    def line(self) -> str:
        """One line of the candidates list: host, id, name, state, started."""
        import time

        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)) if self.started else "-"
        return f"{self.host:<12} {self.id:<14} {self.name or '-':<16} {self.state:<16} {when}"


class AmbiguousRun(OpsError):
    """A run reference matches more than one run: never a silent pick; the candidates are listed."""

    exit_code = EXIT_USAGE

    def __init__(self, ref: str, candidates: list[Candidate], unanswered: list[str] | None = None, host_given: bool = False) -> None:
        # --host helps only when the candidates are on several hosts (and none was given)
        several_hosts = len({c.host for c in candidates}) > 1
        head = f"{ref!r} matches {len(candidates)} runs: give the full id (or more of it)" + (
            ", or --host" if several_hosts and not host_given else ""
        )
        lines = "\n".join(f"  {c.line()}" for c in candidates)
        more = f"\n{', '.join(unanswered)} did not answer and may hold more" if unanswered else ""
        super().__init__(f"{head}\n  {'HOST':<12} {'ID':<14} {'NAME':<16} {'STATE':<16} STARTED\n{lines}{more}")
        self.ref = ref
        self.candidates = candidates
        self.unanswered = unanswered or []


class NoSuchRun(OpsError):
    """No run matches a reference on the hosts that answered; the ones that did not are named."""

    def __init__(
        self, ref: str, where: str, unanswered: list[str] | None = None, listing: str = "gpudeck runs", host_given: bool = False
    ) -> None:
        msg = f"no run {ref!r} {where}"
        if unanswered:
            fix = "try again when it is back" if host_given else "give --host or the full id, or try again when it is back"
            msg += f"; {', '.join(unanswered)} did not answer: {fix}"
        super().__init__(msg + f" (`{listing}` lists them)")
        self.ref = ref
        self.unanswered = unanswered or []


class Unanswered(OpsError):
    """A destructive command by name while a host that may hold a live run of that name did not answer."""

    exit_code = EXIT_USAGE
