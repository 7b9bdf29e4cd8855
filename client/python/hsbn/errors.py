"""Exceptions raised by hsbn.

Every failure of the C library surfaces as an HsbnError (or a subclass chosen by its status
code) whose message is the library's: it says what went wrong and what to do. Problems found in
Python before anything is sent (a bad environment, bad arguments) raise ConfigurationError.
"""

# gRPC / absl status code numbers, as in hsbn.h.
OK = 0
CANCELLED = 1
UNKNOWN = 2
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
ALREADY_EXISTS = 6
PERMISSION_DENIED = 7
RESOURCE_EXHAUSTED = 8
FAILED_PRECONDITION = 9
ABORTED = 10
OUT_OF_RANGE = 11
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14
DATA_LOSS = 15
UNAUTHENTICATED = 16

CODE_NAMES = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
    13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}


class HsbnError(RuntimeError):
    """A failed hsbn call. `code` is the status code number, `code_name` its name, `reason` why,
    as a name ("MEMBER_ABORTED", "TIMED_OUT", ...: hsbn.h's hsbn_reason without its prefix;
    "UNSPECIFIED" when not said). Branch on these, never on the message's text."""

    def __init__(self, message, code=UNKNOWN, reason="UNSPECIFIED"):
        super().__init__(message)
        self.code = code
        self.code_name = CODE_NAMES.get(code, str(code))
        self.reason = reason


class ConfigurationError(HsbnError, ValueError):
    """The environment or the arguments are inconsistent; nothing was sent."""

    def __init__(self, message):
        super().__init__(message, INVALID_ARGUMENT)


class UnavailableError(HsbnError, ConnectionError):
    """The sidecar cannot be reached, or the connection to it broke."""


class DeadlineExceededError(HsbnError, TimeoutError):
    """A round did not complete in time (some member did not contribute)."""


class RoundFailedError(HsbnError):
    """A round failed because a member left or broke (ABORTED, CANCELLED)."""


class InvalidArgumentError(HsbnError, ValueError):
    """The aggregator rejected a contribution or a join as malformed or inconsistent."""


class FailedPreconditionError(HsbnError):
    """The deployment cannot serve the call as set up (FAILED_PRECONDITION): e.g. a global round
    at a sidecar without a root (--upstream), a Status that needs tokens. The message names
    what to change; retrying the same call does not help."""


class ResourceExhaustedError(HsbnError):
    """An aggregator limit (channels, open rounds, jobs, message size) was reached."""


_BY_CODE = {
    UNAVAILABLE: UnavailableError,
    DEADLINE_EXCEEDED: DeadlineExceededError,
    ABORTED: RoundFailedError,
    CANCELLED: RoundFailedError,
    INVALID_ARGUMENT: InvalidArgumentError,
    FAILED_PRECONDITION: FailedPreconditionError,
    OUT_OF_RANGE: InvalidArgumentError,
    RESOURCE_EXHAUSTED: ResourceExhaustedError,
}


def error_for(code, message, reason=None):
    """The exception for a C ABI result code and message; `reason` None: the reason of the
    library's last failed call on this thread (call this right after that call)."""
    if reason is None:
        from . import _lib
        try:
            reason = _lib.last_error_reason()
        except Exception:  # the library is not loaded: nothing failed in it
            reason = "UNSPECIFIED"
    cls = _BY_CODE.get(code, HsbnError)
    err = cls("%s: %s" % (CODE_NAMES.get(code, str(code)), message), code)
    err.reason = reason
    return err
