"""The decision core's GPU line: starts waiting for device memory, in order, and what is done to seat them.

It owns the line (each waiting start's need, class and age) and decides, from the room the
runtime last read (the ledger and NVML are I/O, read where a placement is tried), which
start may try placement now: the head of the line, or a later one that fits in free memory
now without taking what the head is about to get (backfilled: given back as soon as the
head could use it). When the head could be placed if workers gave memory back, idle ones
are evicted at once (backfilled ones first, then the least recently used, kept-warm ones
last, and only a set that lets the head fit: never for nothing), and a busy backfilled
one's lease is recalled after its current request. A busy worker that is not backfilled is
never touched. Like the rest of the core: no threads, sockets or clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import priority as order
from . import starting
from .actions import Action, Announce, Place, Policy, Withdraw
from .leases import Leasing
from .lifecycle import Lifecycle
from .replica import Provider, Replica, Ticket
from .states import ReplicaState
from .view import LineEntry

__all__ = ["Admitting", "Waiting"]

R = ReplicaState


@dataclass(eq=False)
class Waiting:
    """A start waiting for GPU memory."""

    rid: int
    key: str
    need_gb: float
    device: int | None  # only there (a restore)
    priority: str
    arrived: float  # its request's arrival: the line's order counts from here
    since: float  # when it began to wait for memory: admission_timeout_s counts from here
    deadline: float


@dataclass
class _Plan:
    """How the head gets its memory: on ``device``, from what it frees (evict now, recall after a request)."""

    device: int
    evict: list[Replica]
    recall: list[Replica]
    spare_gb: float  # what stays free on ``device`` for a backfill once the head has what it needs


class Admitting:
    """The line of starts waiting for GPU memory, and every decision that seats one."""

    def __init__(self, providers: dict[str, Provider], lifecycle: Lifecycle, leasing: Leasing,
                 policy: Policy) -> None:
        self.providers = providers
        self.lifecycle = lifecycle
        self.leasing = leasing
        self.policy = policy
        self.line: dict[int, Waiting] = {}
        self.placing: int | None = None  # the one placement in flight (its report carries a fresh room)
        self.rooms: dict[int, float] | None = None  # room per device at the last reading; None: read it again
        self.read_at = float("-inf")
        self.tried: set[int] = set()  # tried since that reading and not placed: not tried again until the next

    # -- the line ------------------------------------------------------------------------------------
    def in_order(self, now: float) -> list[Waiting]:
        return order.in_order(self.line.values(), now, self.policy.aging_s, lambda w: w.priority,
                              lambda w: w.arrived)

    def enter(self, now: float, replica: Replica, need_gb: float, device: int | None, wait: bool) -> list[Action]:
        """A start needs ``need_gb``: it waits in the line, or (a warm-up, ``wait`` False) it is placed only
        if nobody waits and it fits now."""
        provider = self.providers[replica.key]
        ticket = self.leasing.ticket(replica.for_ticket)
        priority = ticket.priority if ticket is not None else order.CLASSES[-1]
        arrived = ticket.arrived if ticket is not None else now
        entry = Waiting(replica.rid, replica.key, need_gb, device, priority, arrived, now,
                        now + provider.spec.admission_timeout_s)
        if not wait:
            if self.line or self.placing is not None:
                return [Withdraw(replica.rid, "no_room")]  # a warm-up never queues ahead of, or behind, anyone
            self.placing = replica.rid
            return [Place(replica.rid, need_gb, device, priority, 0.0, once=True)]
        self.line[replica.rid] = entry
        return self.decide(now)

    def leave(self, rid: int) -> None:
        """The start ended (placed, failed or called off): it no longer waits."""
        self.line.pop(rid, None)
        self.tried.discard(rid)
        if self.placing == rid:
            self.placing = None
        if not self.line:
            # Nobody waits for memory: nothing is taken ahead of anyone.
            starting.settle_backfill(self.lifecycle.replicas.values())

    # -- reports from the runtime -------------------------------------------------------------------------
    def placed(self, now: float, rid: int) -> None:
        if self.placing == rid:
            self.placing = None
        self.line.pop(rid, None)
        self._read_again()  # it took room
        if not self.line:
            starting.settle_backfill(self.lifecycle.replicas.values())

    def not_placed(self, now: float, rid: int, rooms: dict[int, float]) -> list[Action]:
        if self.placing == rid:
            self.placing = None
        self.rooms, self.read_at = dict(rooms), now
        self.tried.add(rid)
        return self.decide(now)

    def freed(self, now: float) -> list[Action]:
        """Memory was given back (a worker ended, or hibernated): read the room again."""
        self._read_again()
        return self.decide(now)

    def giving_back(self, replica: Replica | None) -> None:
        """``replica`` gives its budget back now (it ended, or hibernated): the last reading is out of date."""
        if replica is not None and replica.admitted:
            self._read_again()

    def _read_again(self) -> None:
        self.rooms = None
        self.tried.clear()

    # -- deciding ------------------------------------------------------------------------------------------
    def decide(self, now: float) -> list[Action]:
        """Which start tries placement now, and what is evicted or recalled so the head gets its memory."""
        actions = self._called_off()
        if self.placing is not None or not self.line:
            return actions
        line = self.in_order(now)
        head = line[0]
        if self.rooms is None:  # no reading since memory changed: try the head, its report reads the room
            return [*actions, self._place(now, head)]
        if head.rid not in self.tried and self._fits(head, self.rooms) is not None:
            return [*actions, self._place(now, head)]
        plan = self._plan(now, head)
        if plan is not None:
            actions += self._free_for(now, head, plan)
        if not self.policy.backfill:
            return actions
        for entry in line[1:]:
            device = self._fits(entry, self.rooms, plan)
            if device is not None and entry.rid not in self.tried:
                return [*actions, self._place(now, entry, backfill=True)]
        return actions

    def _place(self, now: float, entry: Waiting, backfill: bool = False) -> Place:
        self.placing = entry.rid
        return Place(entry.rid, entry.need_gb, entry.device, entry.priority, round(now - entry.since, 3),
                     backfill=backfill)

    def _called_off(self) -> list[Action]:
        """Starts called off while they waited (their client left, a stop): they end here, unplaced."""
        gone = [rid for rid in self.line if rid != self.placing and (
            (replica := self.lifecycle.replicas.get(rid)) is None or replica.abort is not None)]
        for rid in gone:
            self.leave(rid)
        return [Withdraw(rid, "start_cancelled") for rid in gone]

    def _fits(self, entry: Waiting, rooms: dict[int, float], plan: _Plan | None = None) -> int | None:
        """The device (most room first) where ``entry`` fits now; with the head's ``plan``, only where it
        leaves the head what that plan counts on."""
        fits = []
        for device, free in rooms.items():
            if entry.device is not None and device != entry.device:
                continue
            room = min(free, plan.spare_gb) if plan is not None and device == plan.device else free
            if room >= entry.need_gb:
                fits.append((room, -device))
        return -max(fits)[1] if fits else None

    def _plan(self, now: float, head: Waiting) -> _Plan | None:
        """How the head could get its memory from this pool's own workers: on the device (most room first)
        where memory already on its way back, then idle workers, then busy backfilled ones, add up to it."""
        assert self.rooms is not None
        devices = sorted(self.rooms.items(), key=lambda item: -item[1])
        for device, room in devices:
            if head.device is not None and device != head.device:
                continue
            have = room + self._coming(device)
            if have >= head.need_gb:
                return _Plan(device, [], [], spare_gb=have - head.need_gb)  # what comes back is enough: wait
            chosen: list[Replica] = []
            for replica in [*self._idle(now, device, head), *self._busy_backfilled(device)]:
                chosen.append(replica)
                have += replica.budget_gb or 0.0
                if have >= head.need_gb:
                    break
            if have < head.need_gb:
                continue
            # Never for nothing: one whose memory the rest of the set already covers stays.
            for replica in list(chosen):
                if have - (replica.budget_gb or 0.0) >= head.need_gb:
                    chosen.remove(replica)
                    have -= replica.budget_gb or 0.0
            # A backfill takes from the room now; the head still gets its need once the rest comes back.
            # Idle ones (a kept lease's too: evicting it recalls its lease first) go now; busy backfilled ones
            # are recalled after their request.
            return _Plan(device, [r for r in chosen if r.state is R.READY or r.kept],
                         [r for r in chosen if r.state is R.LEASED and not r.kept],
                         spare_gb=max(0.0, have - head.need_gb))
        return None

    def _on(self, replica: Replica, device: int) -> bool:
        return replica.admitted and replica.device == str(device) and bool(replica.budget_gb)

    def _coming(self, device: int) -> float:
        """Memory on its way back on ``device``: workers stopping or hibernating, and leases recalled for it."""
        total = 0.0
        for replica in self.lifecycle.replicas.values():
            if not self._on(replica, device):
                continue
            if replica.state in (R.STOPPING, R.HIBERNATING) or (replica.recalling and replica.eviction is not None):
                total += replica.budget_gb or 0.0
        return total

    def evictable(self) -> list[Replica]:
        """Idle workers holding GPU memory, in the order they are evicted: backfilled, then ready ones before kept
        leases, least recently used; kept-warm ones last of all. Idle: ready, or held by a kept lease between calls
        (Pool.predict's: its lease is recalled first, after at most the request in flight; a request may run on
        it now, which the core cannot see, so a ready worker goes before it)."""
        idle = [r for r in self.lifecycle.replicas.values() if r.admitted
                and (r.state is R.READY or (r.state is R.LEASED and r.kept and not r.recalling))]
        warm = self.lifecycle.kept_warm_rids() if idle else set()
        return sorted(idle, key=lambda r: (not r.backfilled, r.rid in warm, r.state is not R.READY, r.last_used, r.rid))

    def _idle(self, now: float, device: int, head: Waiting) -> list[Replica]:
        """``evictable`` workers on ``device`` that ``head`` may take (``_spared``)."""
        return [r for r in self.evictable() if self._on(r, device) and not self._spared(now, r, head)]

    def _spared(self, now: float, replica: Replica, head: Waiting) -> bool:
        """A replica held by kept leases not evicted for ``head``: one just granted (it serves its one request
        first), or one whose holders are still calling (evicting it costs them a restart), unless ``head`` ranks
        above their highest class (asked so, or aged into it) or has waited out its patience. A backfilled one went
        ahead of the head: it is never spared."""
        if self.leasing.in_first_use(now, replica):
            return True
        if replica.backfilled or not self.leasing.calling(now, replica):
            return False
        if now - head.arrived >= self._patience(head):
            return False  # no stream holds a card for ever, an interactive one (nothing ranks above) included
        return order.effective(head.priority, now - head.arrived, self.policy.aging_s) >= \
            self.leasing.held_rank(replica)

    def _patience(self, head: Waiting) -> float:
        """How long ``head`` waits behind a stream of its class or above: one ageing step, or half its own
        admission_timeout_s where that is shorter (it must not time out behind a stream)."""
        ageing = self.policy.aging_s if self.policy.aging_s > 0 else float("inf")
        return min(ageing, (head.deadline - head.since) / 2)

    def _busy_backfilled(self, device: int) -> list[Replica]:
        """Backfilled workers busy under a session's lease (a kept lease is idle between calls: ``_idle``), not
        recalled yet."""
        busy = [r for r in self.lifecycle.replicas.values()
                if r.backfilled and r.state is R.LEASED and not r.kept and not r.recalling and self._on(r, device)]
        return sorted(busy, key=lambda r: r.rid)

    def _free_for(self, now: float, head: Waiting, plan: _Plan) -> list[Action]:
        slug = self.providers[head.key].slug
        actions: list[Action] = []
        for replica in plan.evict:
            actions += self.lifecycle.evict(now, replica.rid, head.need_gb)
            if replica.backfilled:
                actions.append(Announce("admission.recalled", self.providers[replica.key].slug, (
                    ("replica", replica.index), ("idle", True), ("for", slug), ("priority", head.priority))))
        for replica in plan.recall:
            for lease in list(replica.holds):
                actions += self.leasing.recall(now, lease, (
                    f"backfilled: {slug} ({head.priority}, {head.need_gb:g} GB) waits for its memory"),
                    evict_for=head.need_gb)
        return actions

    def claims(self, now: float, replica: Replica, ticket: Ticket) -> bool:
        """Whether the head of the line, ranking before ``ticket``, waits for the memory the free ``replica`` holds
        (with the room and the other idle workers on its device it would fit): then ``ticket`` does not get it."""
        if not self.line or self.rooms is None or not replica.admitted or replica.device is None:
            return False
        head = self.in_order(now)[0]
        mine = order.sort_key(head.priority, head.arrived, now, self.policy.aging_s)
        theirs = order.sort_key(ticket.priority, ticket.arrived, now, self.policy.aging_s)
        if head.key == replica.key or mine >= theirs:
            return False  # its own provider's start, or a ticket that goes first: the ticket takes the worker
        device = int(replica.device)
        if head.device is not None and head.device != device:
            return False
        idle = self._idle(now, device, head)  # the free replica among them
        return self.rooms.get(device, 0.0) + self._coming(device) + sum(r.budget_gb or 0.0 for r in idle) \
            >= head.need_gb

    def recall(self, now: float, rid: int, why: str) -> list[Action]:
        """The host admission service wants a backfilled worker's memory for a request of another pool."""
        replica = self.lifecycle.replicas.get(rid)
        if replica is None or not replica.admitted:
            return []
        if replica.state is R.READY:
            return self.lifecycle.evict(now, rid, replica.budget_gb or 0.0, why=f"evicted (idle, backfilled): {why}")
        if replica.state is R.LEASED:
            return [action for lease in list(replica.holds)
                    for action in self.leasing.recall(now, lease, why, evict_for=replica.budget_gb or 0.0)]
        return []

    # -- time passes ------------------------------------------------------------------------------------
    def tick(self, now: float) -> list[Action]:
        """Waits past admission_timeout_s end; the room is read again every ``poll_s`` (memory freed outside)."""
        actions: list[Action] = []
        for entry in list(self.line.values()):
            if now >= entry.deadline and entry.rid != self.placing:
                self.leave(entry.rid)
                actions.append(Withdraw(entry.rid, "admission_timeout", round(now - entry.since, 3)))
        if self.line and self.placing is None and now - self.read_at >= self.policy.poll_s:
            self._read_again()
        return actions + self.decide(now)

    def line_view(self, now: float) -> list[LineEntry]:
        """The line in order, for status: class, age, need, and what it waits for."""
        entries = []
        for position, entry in enumerate(self.in_order(now)):
            replica = self.lifecycle.replicas.get(entry.rid)
            ranks = order.effective(entry.priority, now - entry.arrived, self.policy.aging_s)
            entries.append(LineEntry(
                position, entry.rid, entry.key, self.providers[entry.key].slug,
                replica.index if replica is not None else None, entry.priority, order.CLASSES[ranks],
                round(now - entry.arrived, 3), round(now - entry.since, 3), entry.need_gb, entry.device,
                replica.for_ticket if replica is not None else None, entry.rid == self.placing))
        return entries
