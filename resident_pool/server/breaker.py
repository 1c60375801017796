"""The start-failure breaker: a provider whose starts keep failing is refused at once for a while."""

from __future__ import annotations

from typing import Any

__all__ = ["FAILURES_TO_OPEN", "Breaker"]

FAILURES_TO_OPEN = 3


class Breaker:
    """Opens after a refusal (exit 3 or 5) or ``failures_to_open`` failed starts in a row.

    While open, requests are refused at once with reason ``breaker_open``, carrying the
    original error (a campaign of thousands must not start a broken model thousands of
    times). It closes when its cooldown ends, when the manifest changes (its fingerprint),
    after a successful start, or on ``reset()``. Every method takes the time: no clock here.
    """

    def __init__(self, cooldown_s: float, failures_to_open: int = FAILURES_TO_OPEN) -> None:
        self.cooldown_s = cooldown_s
        self.failures_to_open = failures_to_open
        self.fingerprint = ""
        self.failures = 0
        self.error: dict[str, Any] | None = None
        self.open_until = 0.0
        self.refused = 0
        self.openings = 0

    def is_open(self, fingerprint: str, now: float) -> bool:
        """Whether a request for the manifest with ``fingerprint`` must be refused now (and count it)."""
        if self.open_until and fingerprint != self.fingerprint:
            self.reset()  # the manifest changed: worth another start
        if now < self.open_until:
            self.refused += 1
            return True
        return False

    def remaining_s(self, now: float) -> float:
        return max(0.0, self.open_until - now)

    def failed(self, fingerprint: str, error: dict[str, Any], refusal: bool, now: float) -> bool:
        """Record a failed start; True when this one opened the breaker."""
        if fingerprint != self.fingerprint:
            self.failures = 0
        self.fingerprint = fingerprint
        self.failures += 1
        self.error = error
        if (refusal or self.failures >= self.failures_to_open) and now >= self.open_until:
            self.open_until = now + self.cooldown_s
            self.openings += 1
            return True
        return False

    def succeeded(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.failures, self.error, self.open_until, self.refused = 0, None, 0.0, 0

    def snapshot(self, now: float) -> dict[str, Any] | None:
        """For status: None while it has nothing to say."""
        if not (self.failures or self.open_until):
            return None
        return {"failures": self.failures, "open": now < self.open_until,
                "closes_in_s": round(self.remaining_s(now), 1), "refused": self.refused,
                "error": (self.error or {}).get("headline") or (self.error or {}).get("error")}
