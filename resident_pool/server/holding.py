"""The decision core's bookkeeping of the leases a replica is held by: taking one, the room left for callers, letting
one go, and marking which are being taken back.

Functions of the records, none of which ends a replica or decides when a lease is taken back: ``lifecycle.Lifecycle``
does, and ``leases.Leasing`` owns the leases themselves.
"""

from __future__ import annotations

from .actions import Action, Note
from .replica import Eviction, Hold, Recall, Replica
from .states import ReplicaState

__all__ = ["letting_go", "recall_failed", "room", "take", "taking_back", "touch"]

R = ReplicaState


def take(replica: Replica, lease: int, kept: bool) -> bool:
    """``replica`` is held by ``lease`` too; whether this is its first lease since a start (a cold one)."""
    if replica.state is not R.LEASED:
        replica.transition(R.LEASED, "leased")
    replica.holds[lease], replica.deadline = Hold(lease, kept), None
    cold, replica.fresh = replica.fresh, False
    return cold


def room(replica: Replica, max_callers: int, serving: bool) -> int:
    """How many more callers it takes now: a ``serving`` replica, ready or leased below ``max_callers``, that nothing
    is taking back for its memory."""
    if not serving or replica.eviction is not None or replica.state not in (R.READY, R.LEASED):
        return 0
    return max(0, max_callers - len(replica.holds))


def touch(now: float, replica: Replica, served: int) -> None:
    """A kept lease of it served ``served`` more requests (its client says so now and then): idle from now."""
    replica.last_used, replica.served = now, replica.served + served


def taking_back(replica: Replica, lease: int | None, backfilled: bool, idle_check: bool,
                evict_for: float | None) -> list[Hold]:
    """Mark the holds to take back (``lease``: that one; else every one) that may be: kept ones, or ``backfilled``
    ones. ``evict_for``: the GB admission needs once they are back."""
    if lease is not None:
        holds = [replica.holds[lease]] if lease in replica.holds else []
    else:
        holds = list(replica.holds.values())
    taken = [hold for hold in holds if hold.recall is None and (hold.kept or backfilled)]
    for hold in taken:
        hold.recall = Recall(idle_check)
    if taken and evict_for is not None:
        replica.eviction = Eviction(evict_for)
    return taken


def letting_go(now: float, replica: Replica, lease: int, served: int) -> None:
    """Lease ``lease`` ended, after ``served`` requests; once none holds it, idle time counts from now."""
    replica.holds.pop(lease, None)
    replica.served += served
    if not replica.holds:
        replica.last_used, replica.check, replica.eviction = now, None, None


def recall_failed(replica: Replica, lease: int, failure: str) -> list[Action]:
    """The pool could not send a recall (its own failure, EMFILE): the lease stays, the next look tries again."""
    hold = replica.holds.get(lease)
    if hold is not None:
        hold.recall = None
    if not replica.recalling:
        replica.deadline, replica.eviction, replica.idle_seen_s = None, None, None
    return [Note(replica.rid, f"the pool could not recall its lease ({failure}); not its fault")]
