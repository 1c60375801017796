"""The host admission service's ledger and line, driven directly: quotas, class caps, backfill across users,
recall, reclaim, and nobody touching another's entries. Fake processes and devices; the real service over its
socket, with real users, is in test_admission_service.py."""

from __future__ import annotations

import os

import pytest

from resident_pool.admission.config import Limits, ServiceConfig
from resident_pool.admission.devices import Device
from resident_pool.admission.host import HostLedger, Peer, Procs, Refused

ALICE = Peer(pid=100, uid=1001, gid=1001, user="alice", groups=("alice", "lab"))
BOB = Peer(pid=200, uid=1002, gid=1002, user="bob", groups=("bob", "lab"))
CAROL = Peer(pid=300, uid=1003, gid=1003, user="carol", groups=("carol",))


class FakeProcs(Procs):
    def __init__(self) -> None:
        self.live: dict[int, int] = {100: 1, 200: 1, 300: 1}  # pid: uid-less start time
        self.owners: dict[int, int] = {}
        self.parents: dict[int, int] = {}

    def start_time(self, pid: int) -> int | None:
        return self.live.get(pid)

    def owner(self, pid: int) -> int | None:
        return self.owners.get(pid)

    def alive(self, pid: int, started: int | None) -> bool:
        return pid in self.live and (started is None or self.live[pid] == started)

    def parent(self, pid: int) -> int | None:
        return self.parents.get(pid) if pid in self.live else None


TEN_GB = (Device(0, 10.0),)


def ledger(tmp_path, devices=TEN_GB, clock=None, **config) -> tuple[HostLedger, FakeProcs]:
    procs = FakeProcs()
    made = HostLedger(ServiceConfig(state_dir=tmp_path, headroom_gb=0.5, **config), lambda: (list(devices), "test"),
                      procs, **({"clock": clock} if clock is not None else {}))
    return made, procs


def place(host: HostLedger, peer: Peer, key: str, need: float, priority: str = "normal", now: float = 0.0,
          **extra):
    slug = key.split("[", maxsplit=1)[0]
    reply, pushes = host.place(now, peer, peer.pid, {"key": key, "slug": slug, "replica": 0, "need_gb": need,
                                                     "priority": priority, **extra})
    return reply, pushes


def test_a_request_that_fits_now_is_backfilled_across_users_ahead_of_another_users_head(tmp_path):
    host, _ = ledger(tmp_path)
    assert place(host, ALICE, "big[0]", 8)[0]["placed"]
    reply, _ = place(host, BOB, "big2[0]", 8, now=1.0)
    assert not reply["placed"] and reply["rooms"] == {0: 1.5}
    reply, _ = place(host, CAROL, "small[0]", 1, now=4.0)
    assert reply["placed"] and reply["backfilled"]
    assert [(e["user"], e["backfilled"]) for e in host.status(5.0, ALICE)["entries"]] == [
        ("alice", False), ("carol", True)]


def test_the_head_recalls_a_backfilled_entry_of_another_users_pool_when_that_lets_it_fit(tmp_path):
    host, _ = ledger(tmp_path)
    place(host, ALICE, "big[0]", 7)
    place(host, BOB, "big2[0]", 8, now=1.0)
    assert place(host, CAROL, "small[0]", 2, now=2.0)[0]["backfilled"]
    assert host.release(ALICE, {"key": "big[0]"}) == [((1002, 200), {"push": "wake"})]  # bob waits: told to try
    reply, pushes = place(host, BOB, "big2[0]", 8, now=3.0)
    assert not reply["placed"]  # 7.5 free: 8 needs carol's 2 back
    assert pushes == [((1003, 300), {"push": "recall", "slug": "small", "replica": 0,
                                     "why": "backfilled: bob's big2 (normal, 8 GB) waits for its memory"})]
    assert place(host, BOB, "big2[0]", 8, now=3.5)[1] == []  # asked once (again only after RECALL_AGAIN_S)
    host.release(CAROL, {"key": "small[0]"})
    assert place(host, BOB, "big2[0]", 8, now=4.0)[0]["placed"]


def test_classes_a_user_may_not_claim_are_capped_and_the_line_orders_by_what_was_granted(tmp_path):
    host, _ = ledger(tmp_path, default=Limits(classes=("normal", "batch")),
                     users={"alice": Limits(classes=("interactive", "normal", "batch"))}, backfill=False)
    place(host, CAROL, "hog[0]", 9)
    place(host, BOB, "b[0]", 2, "interactive", now=1.0)  # bob may not claim interactive: normal
    place(host, ALICE, "a[0]", 2, "normal", now=2.0)
    place(host, CAROL, "c[0]", 2, "interactive", now=3.0)
    line = host.status(4.0, ALICE)["line"]
    assert [(w["user"], w["asked"], w["priority"]) for w in line] == [
        ("bob", "interactive", "normal"), ("alice", "normal", "normal"), ("carol", "interactive", "normal")]
    assert host.hello(BOB)["classes"] == ["normal", "batch"] and host.hello(ALICE)["classes"][0] == "interactive"


def test_a_group_grants_a_class_to_its_members(tmp_path):
    host, _ = ledger(tmp_path, default=Limits(classes=("batch",)), groups={"lab": Limits(classes=("interactive",))})
    assert host.classes(BOB) == ("interactive", "batch") and host.classes(CAROL) == ("batch",)


def test_quotas_per_user_and_per_group_hold_and_what_never_fits_them_is_refused_at_once(tmp_path):
    host, _ = ledger(tmp_path, devices=(Device(0, 80.0),), users={"alice": Limits(gpu_gb=10, replicas=2)},
                     groups={"lab": Limits(gpu_gb=16)})
    assert place(host, ALICE, "a[0]", 6)[0]["placed"]
    reply, _ = place(host, ALICE, "b[0]", 6)
    assert not reply["placed"] and "user alice holds 6 of its 10 GB quota" in reply["why"]
    assert place(host, BOB, "c[0]", 6)[0]["placed"]  # bob: no quota of his own; the lab's: 12 of 16
    reply, _ = place(host, BOB, "d[0]", 6)
    assert not reply["placed"] and "group lab holds 12 of its 16 GB quota" in reply["why"]
    assert place(host, CAROL, "e[0]", 30)[0]["placed"]  # not in the lab: bound by nothing here
    with pytest.raises(Refused, match="alice's quota is 10 GB"):
        place(host, ALICE, "f[0]", 12)
    host.release(ALICE, {"key": "a[0]"})
    assert place(host, ALICE, "b[0]", 6)[0]["placed"]


def test_a_pool_cannot_release_name_or_withdraw_another_pools_entries(tmp_path):
    host, procs = ledger(tmp_path)
    place(host, ALICE, "a[0]", 4)
    assert host.release(BOB, {"key": "a[0]"}) == []  # looked up under bob's own uid and pid: nothing there
    other_alice_pool = Peer(pid=101, uid=1001, gid=1001, user="alice", groups=())
    assert host.release(other_alice_pool, {"key": "a[0]"}) == []
    assert [e["slug"] for e in host.status(0.0, ALICE)["entries"]] == ["a"]
    procs.owners[999] = BOB.uid
    with pytest.raises(Refused, match="no entry a\\[0\\] of this pool"):
        host.started(BOB, {"key": "a[0]", "pid": 999})
    with pytest.raises(Refused, match="needs the worker's pid"):
        host.started(ALICE, {"key": "a[0]", "pid": 1})
    with pytest.raises(Refused, match="is not a process of user alice"):
        host.started(ALICE, {"key": "a[0]", "pid": 999})  # bob's process cannot hold alice's budget


def test_a_dead_pools_budget_is_reclaimed_once_its_workers_are_gone(tmp_path):
    host, procs = ledger(tmp_path)
    place(host, ALICE, "a[0]", 4)
    procs.live[555], procs.owners[555], procs.parents[555] = 7, ALICE.uid, ALICE.pid
    host.started(ALICE, {"key": "a[0]", "pid": 555})
    place(host, ALICE, "b[0]", 2)  # still loading: held by the pool's own pid
    del procs.live[100]  # the pool is killed mid-admission
    host.gone(ALICE, ALICE.pid)
    assert [e["slug"] for e in host.status(0.0, BOB)["entries"]] == ["a"]  # its worker outlives it a while
    procs.live[555] = 8  # the pid was reused by another process: not the worker any more
    assert host.reclaim() == [] and host.status(0.0, BOB)["entries"] == []


def test_a_booking_is_held_only_by_a_process_its_pool_started(tmp_path):
    """Issue 31 finding 5: the service took, in `started`, any pid of the caller's own user: a 1 GB booking named
    on a `sleep 100000` outlived its pool by more than 15 minutes."""
    host, procs = ledger(tmp_path)
    place(host, ALICE, "a[0]", 1)
    procs.live[777], procs.owners[777], procs.parents[777] = 1, ALICE.uid, 1  # alice's own `sleep`, not the pool's
    with pytest.raises(Refused, match="not a process this pool started") as info:
        host.started(ALICE, {"key": "a[0]", "pid": 777})
    assert info.value.reason == "not_yours"
    procs.live[600], procs.parents[600] = 1, ALICE.pid  # a zygote the pool started
    procs.live[601], procs.owners[601], procs.parents[601] = 1, ALICE.uid, 600  # a worker it forked
    host.started(ALICE, {"key": "a[0]", "pid": 601})
    assert [e["pid"] for e in host.status(0.0, ALICE)["entries"]] == [601]


def test_a_worker_outlives_its_dead_pools_booking_by_the_orphan_grace_at_most(tmp_path):
    """Issue 31 finding 5: a worker that never exits (a request in flight for hours, or a process that is no worker)
    holds its dead pool's booking for orphan_grace_s, then it is given back; a fake clock."""
    clock = [0.0]
    host, procs = ledger(tmp_path, clock=lambda: clock[0])
    grace = host.config.orphan_grace_s
    place(host, ALICE, "a[0]", 1)
    procs.live[555], procs.owners[555], procs.parents[555] = 1, ALICE.uid, ALICE.pid
    host.started(ALICE, {"key": "a[0]", "pid": 555})
    assert not place(host, BOB, "b[0]", 9.5)[0]["placed"]  # waits for alice's gigabyte
    del procs.live[ALICE.pid]  # the pool is killed; its worker runs on
    assert host.reclaim() == []
    clock[0] += grace - 1
    assert not place(host, BOB, "b[0]", 9.5, now=clock[0])[0]["placed"]
    assert host.status(clock[0], BOB)["entries"][0]["orphaned_s"] == grace - 1
    clock[0] += 2
    assert place(host, BOB, "b[0]", 9.5, now=clock[0])[0]["placed"]
    assert [e["user"] for e in host.status(clock[0], BOB)["entries"]] == ["bob"]
    assert host.config.orphan_grace_s == 150  # the workers' default 120 s grace and their 30 s heartbeat


def test_bad_input_is_refused_naming_the_field(tmp_path):
    host, _ = ledger(tmp_path)
    for fields, message in (({"key": "../etc"}, "not a worker's name"),
                            ({"key": "a[0]", "slug": "a", "replica": 0, "need_gb": -1}, "not a GPU budget"),
                            ({"key": "a[0]", "slug": "a", "replica": 0, "need_gb": 1, "priority": "root"},
                             "not a class"),
                            ({"key": "a[0]", "slug": "A/B", "replica": 0, "need_gb": 1}, "not a provider's name")):
        with pytest.raises(Refused, match=message):
            host.place(0.0, ALICE, 1, fields)


def test_the_ledger_survives_a_restart_of_the_service(tmp_path):
    host, procs = ledger(tmp_path)
    place(host, ALICE, "a[0]", 4)
    again = HostLedger(host.config, host.devices, procs)
    again.load()
    assert [e["slug"] for e in again.status(0.0, ALICE)["entries"]] == ["a"]


def test_a_request_its_pool_stopped_asking_for_leaves_the_line_so_it_cannot_hold_the_head_for_ever(tmp_path):
    host, _ = ledger(tmp_path, backfill=False)
    place(host, ALICE, "hog[0]", 8)
    place(host, BOB, "stuck[0]", 8, "interactive", now=1.0)  # its pool is then stopped (SIGSTOP): it never asks again
    assert not place(host, CAROL, "c[0]", 1, now=2.0)[0]["placed"]  # behind bob's head, backfill off
    assert [w["user"] for w in host.status(5.0, ALICE)["line"]] == ["bob", "carol"]
    assert place(host, CAROL, "c[0]", 1, now=11.5)[0]["placed"]  # bob's request unheard of for 10 s: dropped


def test_a_request_pinned_to_a_device_the_host_lacks_is_refused_at_once_not_queued_at_the_head(tmp_path):
    host, _ = ledger(tmp_path)
    with pytest.raises(Refused, match="asks for device 3, which this host does not have"):
        place(host, BOB, "b[0]", 1, device=3)
    assert host.status(0.0, BOB)["line"] == []


def test_a_configuration_that_lets_a_user_claim_no_class_is_refused():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="name at least one"):
        Limits(classes=())


def test_each_field_a_users_section_leaves_out_is_the_defaults_and_null_is_refused(tmp_path):
    """Review r25: a user's section replaced [default] whole, so the example's `[users.alice] classes = [...]` lifted
    alice's 40 GB and 4-replica quota; each field now falls back on its own."""
    from pydantic import ValidationError

    from resident_pool.admission.config import EXAMPLE, load_config

    folder = tmp_path / "etc"
    folder.mkdir(mode=0o755)
    path = folder / "admission.toml"
    path.write_text(EXAMPLE)
    path.chmod(0o644)
    alice = load_config(path).users["alice"]
    assert (alice.gpu_gb, alice.replicas, alice.classes) == (40, 4, ("interactive", "normal", "batch"))
    config = ServiceConfig(default=Limits(gpu_gb=40, replicas=4), users={"bob": Limits(replicas=1)})
    assert (config.users["bob"].gpu_gb, config.users["bob"].replicas) == (40, 1)  # built in code alike
    with pytest.raises(ValidationError, match=r"(?s)users\.bob\.gpu_gb.*null is not a value here"):
        ServiceConfig.model_validate({"default": {"gpu_gb": 40}, "users": {"bob": {"gpu_gb": None}}})


def test_the_example_configuration_loads_and_one_others_can_write_is_refused_naming_it(tmp_path):
    from resident_pool.admission.config import EXAMPLE, load_config
    from resident_pool.errors import ResidentPoolError

    folder = tmp_path / "etc"
    folder.mkdir(mode=0o755)
    path = folder / "admission.toml"
    path.write_text(EXAMPLE)
    path.chmod(0o644)
    config = load_config(path)
    assert config.default.classes == ("normal", "batch") and config.groups["lab"].gpu_gb == 70
    path.chmod(0o664)
    with pytest.raises(ResidentPoolError, match=f"{path} is writable by its group or others"):
        load_config(path)
    path.chmod(0o644)
    path.write_text(EXAMPLE + "\n[users.bob]\nclasses = [\"urgent\"]\n")
    with pytest.raises(ResidentPoolError, match=r"users\.bob\.classes: .*'urgent' is not a class"):
        load_config(path)


def test_a_worker_killed_but_not_yet_reaped_counts_as_gone():
    """Its pool dead, a killed worker stays a zombie until init reaps it: it holds no memory meanwhile."""
    import signal
    import subprocess
    import sys

    from helpers import wait_until

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    procs = Procs()
    started = procs.start_time(child.pid)
    assert procs.alive(child.pid, started) and not procs.alive(child.pid, (started or 0) + 1)  # a reused pid
    os.kill(child.pid, signal.SIGKILL)
    try:
        wait_until(lambda: not procs.alive(child.pid, started), timeout=10, message="the zombie to count as gone")
        assert procs.start_time(child.pid) is not None  # still in /proc, unreaped
    finally:
        child.wait()
