"""Provides the typed errors the agent raises; each carries a wire code and the fix."""

from __future__ import annotations


class AgentError(Exception):
    """An error a user can hit; ``code`` travels on the wire, ``message`` says what to do."""

    code = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(AgentError):
    """The request is well-formed JSON but asks for something impossible."""

    code = "bad_request"


class NotFound(AgentError):
    """A run (or other object) named in the request does not exist."""

    code = "not_found"


class LaunchFailed(AgentError):
    """The run could not be started; the run is recorded as failed with this cause."""

    code = "launch_failed"


class PermissionDenied(AgentError):
    """The peer is not allowed to talk to this agent."""

    code = "permission_denied"


class StorageError(AgentError):
    """The agent's state directory cannot be written (disk full, permissions)."""

    code = "storage"


class AgentUnavailable(AgentError):
    """No agent answers on the socket and none could be started."""

    code = "agent_unavailable"


class VersionMismatch(AgentError):
    """Console and agent speak different protocol versions."""

    code = "unsupported_version"


class ConnectionLimit(AgentError):
    """A run's processes hold as many connections to the agent as a run may; the message names the limit."""

    code = "connection_limit"


class RemoteError(AgentError):
    """An Error reply from an agent, with the agent's code and message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def from_wire(code: str, message: str) -> AgentError:
    """The typed error for an Error reply's code."""
    for cls in (BadRequest, NotFound, LaunchFailed, PermissionDenied, StorageError, AgentUnavailable, VersionMismatch, ConnectionLimit):
        if cls.code == code:
            return cls(message)
    return RemoteError(code, message)
