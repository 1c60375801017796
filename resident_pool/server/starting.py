"""The decision core's bookkeeping of a replica's start, from its admission to its first answer: where its memory was
placed, its process, a restore that became a fresh start, and which waiting request it starts for.

Functions of the records (a replica, its provider), none of which ends a replica: ``lifecycle.Lifecycle`` makes
replicas, and decides a start's end (started, failed, called off).
"""

from __future__ import annotations

from collections.abc import Iterable

from .replica import Provider, Replica
from .states import ReplicaState, StopCause

__all__ = ["admitted", "covering", "hand_over", "restore_failed", "settle_backfill", "spawned"]

R = ReplicaState


def admitted(replica: Replica | None, device: str | None, backfilled: bool = False) -> None:
    """Admission placed the replica's budget (on ``device``; None where it holds no GPU budget), ahead of a waiting
    request if ``backfilled``."""
    if replica is not None and replica.state is R.STARTING:
        replica.device, replica.admitted = device, replica.budget_gb is not None and device is not None
        replica.backfilled = backfilled and replica.admitted


def settle_backfill(replicas: Iterable[Replica]) -> None:
    """Nobody waits for memory any more: no worker holds memory ahead of anyone."""
    for replica in replicas:
        replica.backfilled = False


def spawned(replica: Replica | None, pid: int) -> None:
    if replica is not None and replica.state is R.STARTING:
        replica.pid = pid


def restore_failed(replica: Replica | None, provider: Provider | None, why: str) -> None:
    """A restore from hibernation failed (``why``) and the replica is being started afresh instead."""
    if replica is not None and provider is not None and replica.state is R.STARTING:
        provider.starts += 1
        replica.pid = None
        replica.last_error = provider.last_error = why


def hand_over(provider: Provider, gone_ticket: int, waiting: list[int]) -> None:
    """The request a start served went away: another waiting one takes it over; with none, a start still waiting for
    admission is called off (the card's memory is not taken for nobody), one already running finishes and serves
    whoever comes next."""
    for replica in provider.replicas.values():
        if replica.state is R.STARTING and replica.for_ticket == gone_ticket:
            replica.for_ticket = waiting.pop(0) if waiting else None
            if replica.for_ticket is None and replica.pid is None:
                replica.abort = replica.abort or (StopCause.STOPPED, "the client waiting for it went away")


def covering(provider: Provider) -> set[int]:
    """The tickets a start in progress serves."""
    return {r.for_ticket for r in provider.replicas.values() if r.state is R.STARTING and r.for_ticket}
