"""The errors resident-pool raises to its callers.

Each carries what an operator needs as attributes (slug, reason, exit code and
its hint, transcript path and last lines) and crosses process boundaries as
plain data: it pickles (Prefect pickles exceptions) and round-trips through
``to_dict``/``error_from_dict`` over the pool's socket.
"""

from __future__ import annotations

from typing import Any

from .exits import exit_hint

__all__ = [
    "AdmissionRefused",
    "AdmissionTimeout",
    "BreakerOpen",
    "CampaignFailed",
    "GoldenMismatch",
    "InputError",
    "KitUnavailable",
    "ManifestError",
    "PoolStopping",
    "RequestTimeout",
    "ResidentPoolError",
    "SocketPathTooLong",
    "StateDirError",
    "WeightsMismatch",
    "WorkerRequestError",
    "WorkerStartError",
    "error_from_dict",
]

_FIELDS = ("slug", "reason", "exit_code", "hint", "transcript", "transcript_tail", "details", "headline")


class ResidentPoolError(Exception):
    """Base of every error resident-pool raises on purpose."""

    default_reason = "error"

    def __init__(
        self,
        message: str,
        reason: str | None = None,
        *,
        slug: str | None = None,
        exit_code: int | None = None,
        hint: str | None = None,
        transcript: str | None = None,
        transcript_tail: list[str] | None = None,
        details: dict[str, Any] | None = None,
        headline: str | None = None,
    ) -> None:
        """``reason`` may come by position, as in the original design's ``WorkerRequestError(message, reason)``;
        ``headline`` is the message without the transcript lines it may quote."""
        super().__init__(message)
        self.message = message
        self.headline = headline or message.split("\n", 1)[0]
        self.slug = slug
        self.reason = reason or self.default_reason
        self.exit_code = exit_code
        self.hint = hint if hint is not None else exit_hint(exit_code)
        self.transcript = transcript
        self.transcript_tail = list(transcript_tail or [])
        self.details = dict(details or {})

    def __reduce__(self):
        return (_rebuild, (type(self).__name__, self.to_dict()))

    def to_dict(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in _FIELDS}
        data["type"] = type(self).__name__
        data["error"] = self.message
        return data


class WorkerStartError(ResidentPoolError, RuntimeError):
    """The worker exited or hung before it answered on its socket."""

    default_reason = "start_failed"


class BreakerOpen(WorkerStartError):
    """Not started: the provider's last starts failed and its breaker is open for a while.

    ``details["original"]`` is the error those starts ended with, ``details["breaker"]`` how many failed and
    when it closes (``closes_in_s``). Retrying it only repeats the refusal.
    """

    default_reason = "breaker_open"


class WorkerRequestError(ResidentPoolError, RuntimeError):
    """A request failed: the model raised, the worker exited, or it died."""

    default_reason = "request_failed"


class RequestTimeout(WorkerRequestError, TimeoutError):
    """A request outran its provider's ``request_timeout_s``; the worker that ran it is replaced."""

    default_reason = "request_timeout"


class PoolStopping(ResidentPoolError):
    """The pool is draining to stop (a SIGTERM, an upgrade); a client retries with the next pool."""

    default_reason = "pool_stopping"


class AdmissionTimeout(ResidentPoolError, TimeoutError):
    """A worker waited for GPU memory longer than its admission timeout."""

    default_reason = "admission_timeout"


class AdmissionRefused(ResidentPoolError):
    """A worker can never be admitted here (its budget exceeds every device)."""

    default_reason = "admission_refused"


class KitUnavailable(ResidentPoolError, RuntimeError):
    """The provider's optimization kit could not be probed or applied."""

    default_reason = "kit_unavailable"


class ManifestError(ResidentPoolError, ValueError):
    """A provider manifest that cannot be used; names the file and the field."""

    default_reason = "bad_manifest"


class WeightsMismatch(ResidentPoolError):
    """Pinned weights are missing, short or altered; the launch is stopped."""

    default_reason = "weights_mismatch"


class SocketPathTooLong(ResidentPoolError, ValueError):
    """A socket path longer than AF_UNIX allows (107 bytes): the state directory is too deep."""

    default_reason = "socket_path_too_long"


class GoldenMismatch(ResidentPoolError):
    """A smoke answer is off its expected answer, or a kit's answer off stock, beyond tolerance."""

    default_reason = "golden_mismatch"


class StateDirError(ResidentPoolError, PermissionError):
    """The state directory is not private to this user."""

    default_reason = "state_dir_unsafe"


class InputError(ResidentPoolError, ValueError):
    """A campaign's input file cannot be read as inputs (names the file and what was expected)."""

    default_reason = "bad_input_file"


class CampaignFailed(ResidentPoolError):
    """A campaign ended with failed inputs and was asked to fail for them; ``details["summary"]`` has its table."""

    default_reason = "input_errors"


_TYPES = {
    cls.__name__: cls
    for cls in (
        ResidentPoolError,
        WorkerStartError,
        BreakerOpen,
        WorkerRequestError,
        RequestTimeout,
        PoolStopping,
        AdmissionTimeout,
        AdmissionRefused,
        CampaignFailed,
        InputError,
        KitUnavailable,
        GoldenMismatch,
        ManifestError,
        StateDirError,
        SocketPathTooLong,
        WeightsMismatch,
    )
}


def _rebuild(type_name: str, data: dict[str, Any]) -> ResidentPoolError:
    return error_from_dict({**data, "type": type_name})


def error_from_dict(data: dict[str, Any]) -> ResidentPoolError:
    """Rebuild an error sent as data; an unknown type becomes the base class."""
    cls = _TYPES.get(str(data.get("type")), ResidentPoolError)
    kwargs = {name: data.get(name) for name in _FIELDS}
    return cls(str(data.get("error", "")), **kwargs)
