"""Bench cases for a shared GPU host: head-of-line blocking, a mixed workload by class, users racing for a card.

Called from bench/run.py (``make bench``); each case compares, in the same run, the default
(classes, backfill) with settings that turn it off, and with Prefect's global concurrency
limit where the issue asks. No GPU: a declared capacity, or fake NVML readings that drop
only when a worker "loads".
"""

from __future__ import annotations

import json
import os
import pwd
import random
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from threads import Background, together

ROOT = Path(__file__).resolve().parents[1]


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def restart_pool() -> None:
    from resident_pool.client import shutdown_pool

    shutdown_pool()


def _providers(env: Any, budgets: dict[str, float], declare: bool = True, max_replicas: int = 1,
               admission_timeout_s: float = 600, preload: bool = False) -> None:
    """Echo providers (a sleep_s payload sets the service time), with their GPU budgets declared or not;
    ``preload``: forked from a zygote (docs/faster-starts.md), as a provider that is evicted often should be."""
    for slug, budget in budgets.items():
        folder = env.manifests / slug
        folder.mkdir(exist_ok=True)
        shutil.copy(env.manifests / "echo" / "worker.py", folder / "worker.py")
        gpu = f'[gpu]\npolicy = "required"\nvram_budget_gb = {budget}\n' if declare else ""
        (folder / "manifest.toml").write_text(
            f'slug = "{slug}"\nworker = "worker.py"\n{gpu}[lifecycle]\nidle_timeout_s = 0\n'
            f"max_replicas = {max_replicas}\nstart_timeout_s = 60\nadmission_timeout_s = {admission_timeout_s}\n"
            + ('preload = ["json"]\n' if preload else ""))


def _predict(slug: str, payload: dict, priority: str = "normal") -> Any:
    from resident_pool import Pool

    with Pool() as pool:
        return pool.predict(slug, payload, priority=priority)


def _settings(**values: str | None) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(f"RESIDENT_POOL_{name}", None)
        else:
            os.environ[f"RESIDENT_POOL_{name}"] = value


# -- head-of-line blocking: the case -----------------------------------------------------------------
def case_head_of_line(table, env, quick: bool) -> None:
    """A declared 10 GB card, 0.5 GB headroom: ``big`` (8 GB) held in a lease, ``big2`` (8 GB) waiting for it,
    ``small`` (1 GB, 1.5 GB free) asks 3 s later. Backfill on (the default), then strict order."""
    from resident_pool import Pool
    from resident_pool.errors import AdmissionTimeout

    case = "head of line (10 GB)"
    _settings(GPU_CAPACITY_GB="10", GPU_HEADROOM_GB="0.5")
    _providers(env, {"big": 8, "small": 1})
    _providers(env, {"big2": 8}, admission_timeout_s=20)
    served = {}
    for label, backfill in (("backfill (default)", "1"), ("strict order (RESIDENT_POOL_BACKFILL=0)", "0")):
        _settings(BACKFILL=backfill)
        restart_pool()
        with Pool() as pool, pool.session("big") as held:
            held.predict({})
            outcome: dict[str, Any] = {}

            def want_big2(outcome=outcome):
                try:
                    outcome["big2"] = _predict("big2", {})
                except AdmissionTimeout as exc:
                    outcome["big2"] = exc

            waiter = Background(want_big2)
            deadline = time.monotonic() + 30
            while not [w for w in pool.waiting() if w["slug"] == "big2"] and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(3.0)  # "small asks 3 s later"
            asked = time.perf_counter()
            _predict("small", {})
            served[label] = time.perf_counter() - asked
        waiter.join(60)
    on, off = served["backfill (default)"], served["strict order (RESIDENT_POOL_BACKFILL=0)"]
    table.add(case, "small served after asking, backfill", on, "s", "<= 1", on <= 1.0,
              note="big holds 8 GB, big2 (8 GB) waits; small fits in the 1.5 GB free (includes its worker's start)")
    table.add(case, "small served after asking, strict order", off, "s", "beside it", None,
              note="it waits behind big2 until big2's admission_timeout_s (20 s here; an hour by default)")
    table.add(case, "backfill / strict order", on / off, "x", "beside it", None)
    _settings(GPU_CAPACITY_GB=None, GPU_HEADROOM_GB=None, BACKFILL=None)
    restart_pool()


# -- a mixed workload on one card ----------------------------------------------------------------------------
CARD_GB = 10
CAMP_GB, INTER_GB = 4, 3  # two campaign workers fill the card (8 of 10 GB); an interactive one needs room


def _mixed_run(service_s: float, per_stream: int, streams: int, arrivals: list[float], camp_class: str,
               inter_class: str, governed: Callable[[str, float], Any] | None = None) -> dict[str, Any]:
    """A campaign of ``streams`` chunk streams (each request a lease, ``service_s`` long) and interactive requests
    at ``arrivals`` (seconds from the start); ``governed(slug, gb)`` wraps each call (Prefect's limit)."""
    from resident_pool import Pool

    waits: list[float] = []
    lock = threading.Lock()
    ends: list[float] = []
    started = time.perf_counter()

    def call(slug: str, gb: float, payload: dict, cls: str) -> float:
        """Seconds from asking to holding a worker."""
        asked = time.perf_counter()
        with Pool() as pool:
            if governed is None:
                with pool.session(slug, priority=cls) as session:
                    held = time.perf_counter()
                    session.predict(payload)
            else:
                with governed(slug, gb), pool.session(slug, priority=cls) as session:
                    held = time.perf_counter()
                    session.predict(payload)
        return held - asked

    def stream() -> None:
        for _ in range(per_stream):
            call("camp", CAMP_GB, {"sleep_s": service_s}, camp_class)
        with lock:
            ends.append(time.perf_counter() - started)

    def interactive(at: float) -> None:
        time.sleep(max(0.0, at - (time.perf_counter() - started)))
        waited = call("inter", INTER_GB, {"sleep_s": 0.05}, inter_class)
        with lock:
            waits.append(waited)

    together([stream] * streams + [lambda at=at: interactive(at) for at in arrivals])
    return {"makespan": max(ends), "waits": waits}


def case_mixed(table, env, quick: bool) -> None:
    """A batch campaign keeping a declared 10 GB card full (three streams on two 4 GB workers: a request always
    waits), interactive 3 GB requests at random: classes and backfill (the default), then every request in one
    class with backfill off, then Prefect's global concurrency limit; the campaign alone first."""
    case = "mixed workload (10 GB)"
    service_s, per_stream, streams = 2.0, (6 if quick else 10), 3
    alone_s = per_stream * streams * service_s / 2
    rng = random.Random(25)
    arrivals = sorted(rng.uniform(0.1 * alone_s, 0.85 * alone_s) for _ in range(3 if quick else 6))
    _settings(GPU_CAPACITY_GB=str(CARD_GB), GPU_HEADROOM_GB="0", BACKFILL=None)
    # Each interactive request evicts a campaign worker, which starts again after it: both fork from a zygote.
    _providers(env, {"camp": CAMP_GB}, max_replicas=3, preload=True)
    _providers(env, {"inter": INTER_GB}, preload=True)
    restart_pool()
    _predict("camp", {})  # the campaign's first worker is warm, as in a running campaign
    alone = _mixed_run(service_s, per_stream, streams, [], "batch", "interactive")
    runs = {"classes and backfill (default)": ("batch", "interactive", None),
            "one class, backfill off": ("normal", "normal", "0")}
    results = {}
    for label, (camp, inter, backfill) in runs.items():
        _settings(BACKFILL=backfill)
        restart_pool()
        _predict("camp", {})
        results[label] = _mixed_run(service_s, per_stream, streams, arrivals, camp, inter)
    _settings(BACKFILL=None)
    results["Prefect global concurrency limit"] = _mixed_by_prefect(env, service_s, per_stream, streams, arrivals)
    table.add(case, "campaign alone: makespan", alone["makespan"], "s", "",
              note=f"{streams} streams x {per_stream} requests of {service_s:g} s on 2 workers of 4 GB")
    for label, run in results.items():
        p95 = percentile(run["waits"], 95)
        growth = run["makespan"] / alone["makespan"] - 1
        ours = label.startswith("classes")
        table.add(case, f"{label}: interactive wait p95", p95, "s", f"<= {service_s:g} (one request)" if ours else
                  "beside it", p95 <= service_s if ours else None,
                  note=f"{len(run['waits'])} interactive requests; median {statistics.median(run['waits']):.2f} s, "
                       f"max {max(run['waits']):.2f} s (asking to holding a worker, its cold start included)")
        table.add(case, f"{label}: campaign makespan growth", 100 * growth, "%", "<= 5" if ours else "beside it",
                  growth <= 0.05 if ours else None,
                  note=f"makespan {run['makespan']:.2f} s against {alone['makespan']:.2f} s alone")
    _settings(GPU_CAPACITY_GB=None, GPU_HEADROOM_GB=None)
    restart_pool()


def _mixed_by_prefect(env: Any, service_s: float, per_stream: int, streams: int,
                      arrivals: list[float]) -> dict[str, Any]:
    """The same workload governed by what Prefect offers for GPU work: a global concurrency limit of 10 slots
    (one per GB) taken around each call, no pool admission (budgets not declared)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency
    from prefect.testing.utilities import prefect_test_harness

    _providers(env, {"camp": CAMP_GB}, declare=False, max_replicas=3, preload=True)
    _providers(env, {"inter": INTER_GB}, declare=False, preload=True)
    restart_pool()
    with prefect_test_harness(server_startup_timeout=120):
        with get_client(sync_client=True) as client:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name="gpu-gb", limit=CARD_GB))
        _predict("camp", {})
        run = _mixed_run(service_s, per_stream, streams, arrivals, "normal", "normal",
                         governed=lambda slug, gb: concurrency("gpu-gb", occupy=int(gb), strict=True))
    restart_pool()
    return run


# -- users racing for one card -----------------------------------------------------------------------------
ADMITTER = textwrap.dedent("""
    # One user's pool admitting as the pool does (its Admission, its ledger or the host service), against fake
    # NVML whose free memory drops only when a worker has "loaded" (LOAD_S after admission).
    import fcntl, json, os, sys, threading, time
    from pathlib import Path
    from resident_pool.admission import Admission, Ledger, read_devices
    from resident_pool.admission.remote import connect_service
    from resident_pool.settings import settings

    state, count, threads, need, hold, load = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), \\
        float(sys.argv[5]), float(sys.argv[6])
    nvml = os.environ["RESIDENT_POOL_FAKE_NVML"]
    woken = threading.Condition()
    def wake():
        with woken:
            woken.notify_all()
    config = settings()
    service = connect_service(config, wake, lambda *a: None)
    gate = Admission(Ledger(Path(state, "ledger.json"), audit=Path(state, "audit.jsonl")),
                     devices=lambda: read_devices(config), headroom_gb=0.0, service=service)

    def loaded(delta):
        with open(nvml + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = json.load(open(nvml))
            data["devices"][0]["free_gb"] = round(data["devices"][0]["free_gb"] + delta, 6)
            data["low"] = min(data.get("low", data["devices"][0]["free_gb"]), data["devices"][0]["free_gb"])
            with open(nvml + ".tmp" + str(os.getpid()), "w") as out:
                json.dump(data, out)
            os.replace(nvml + ".tmp" + str(os.getpid()), nvml)
            return data["devices"][0]["free_gb"]

    class Worker:
        def __init__(self, n):
            self.slug, self.replica, self.vram_budget_gb, self.pid = "w", n, need, os.getpid()
    left = [count]
    lock = threading.Lock()
    over, failed = [0], []
    def run():
        try:
            admit()
        except BaseException as exc:
            failed.append(repr(exc))
    def admit():
        while True:
            with lock:
                if not left[0]:
                    return
                left[0] -= 1
                n = left[0]
            worker = Worker(n)
            while gate.place(worker, need).device is None:
                with woken:
                    woken.wait(0.05)  # a release here, or the host service's push, wakes it sooner
            time.sleep(load)              # the model loads: only now does NVML see the memory go
            if loaded(-need) < 0:
                over[0] += 1
            gate.loaded(worker)           # as the pool says once its worker answers
            time.sleep(hold)
            loaded(need)
            gate.release(worker)
            wake()
    pool = [threading.Thread(target=run) for _ in range(threads)]
    [t.start() for t in pool]
    [t.join() for t in pool]
    if failed:
        sys.exit(f"{len(failed)} admitting threads failed: {failed[0]}")
    print(json.dumps({"over": over[0]}), flush=True)
""")


FOREIGN_GB = 8  # the variant with memory held outside the one ledger


def case_host_race(table, env, quick: bool) -> None:
    """Three users' pools on one 80 GB card (fake NVML), 1,000 admissions of 6 GB at once, with the host
    admission service and without it (each user's own ledger, NVML's free memory the only thing they share)."""
    case = "three users, one card"
    total = 300 if quick else 1000
    users = _bench_users()
    try:
        _race(table, case, total, users)
    finally:
        cleanup()


def _race(table, case: str, total: int, users: list[dict[str, Any]]) -> None:
    folder = Path(tempfile.mkdtemp(prefix="rp-race-"))
    try:
        _race_in(table, case, total, users, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _race_in(table, case: str, total: int, users: list[dict[str, Any]], folder: Path) -> None:
    folder.chmod(0o755)
    (folder / "nvml").mkdir(mode=0o777)
    (folder / "nvml").chmod(0o777)  # every user's "worker" updates the fake NVML reading
    nvml = folder / "nvml" / "nvml.json"
    results = {}
    for mode, foreign in (("with the host admission service", 0), ("without it (per-user ledgers)", 0),
                          (f"with it, {FOREIGN_GB} GB held outside it", FOREIGN_GB)):
        nvml.write_text(json.dumps({"devices": [{"total_gb": 80, "free_gb": 80 - foreign}]}))
        (folder / "nvml" / "nvml.json.lock").touch()
        for path in (nvml, folder / "nvml" / "nvml.json.lock"):
            path.chmod(0o666)
        service = _race_service(folder, users) if mode.startswith("with ") else None
        if service is not None and (folder / "service-audit.jsonl").exists():
            (folder / "service-audit.jsonl").unlink()  # each run's states audited on their own
        try:
            started = time.perf_counter()
            outputs = _race_pools(folder, users, nvml, total, service)
            wall = time.perf_counter() - started
        finally:
            if service is not None:
                service.terminate()
                service.communicate(timeout=10)
        states = _race_states(folder, users, service is not None)
        worst = max((sum(e["budget_gb"] for e in state) for state in states), default=0.0)
        low = json.loads(nvml.read_text()).get("low", 80.0)
        results[mode] = {"over": sum(o["over"] for o in outputs), "worst_booked": worst, "low": low,
                         "states": len(states), "wall": wall}
    who = ", ".join(u["name"] for u in users) + ("" if os.getuid() == 0 else " (one real user: not root)")
    on, off = results["with the host admission service"], results["without it (per-user ledgers)"]
    beside = results[f"with it, {FOREIGN_GB} GB held outside it"]
    table.add(case, "with the host service: oversubscribed loads", on["over"], "", "0", on["over"] == 0,
              note=f"{total} admissions of 6 GB by 3 pools ({who}); {on['states']} ledger states audited, at most "
                   f"{on['worst_booked']:g} GB booked; NVML free never below {on['low']:g} GB; {on['wall']:.1f} s")
    table.add(case, "with the host service: most GB booked in any ledger state", on["worst_booked"], "GB", "<= 80",
              on["worst_booked"] <= 80, note=f"every one of the {on['states']} states of the one ledger")
    table.add(case, "without it: oversubscribed loads (the race)", off["over"], "", "> 0 (reproduced)",
              off["over"] > 0, note=f"each user's ledger is right on its own ({off['states']} states); together "
                                    f"NVML free fell to {off['low']:g} GB of 80")
    table.add(case, f"with it, {FOREIGN_GB} GB held outside its ledger: oversubscribed loads", beside["over"], "",
              "0", beside["over"] == 0,
              note=f"a notebook or an off-ledger pool holds {FOREIGN_GB} GB (NVML reads {80 - FOREIGN_GB} free): "
                   "budgets booked but not loaded yet come off NVML's free memory; NVML free never below "
                   f"{beside['low']:g} GB; at most {beside['worst_booked']:g} GB booked; {beside['wall']:.1f} s")


def _bench_users() -> list[dict[str, Any]]:
    """Three real users where root (root and two made for the run), else this user three times."""
    me = pwd.getpwuid(os.getuid()).pw_name
    if os.getuid() != 0 or not shutil.which("useradd") or not os.path.exists("/usr/bin/python3"):
        return [{"name": me, "made": False, "python": sys.executable}] * 3
    users = [{"name": me, "made": False, "python": sys.executable}]
    for n in range(2):
        name = f"rp-bench{n}-{os.getpid()}"
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
        users.append({"name": name, "made": True, "python": "/usr/bin/python3"})
    return users


def _race_service(folder: Path, users: list[dict[str, Any]]) -> subprocess.Popen:
    group = f"rp-bench-{os.getpid()}" if os.getuid() == 0 else None
    if group is not None:
        subprocess.run(["groupadd", group], capture_output=True, check=False)
        for user in users:
            subprocess.run(["usermod", "-a", "-G", group, user["name"]], check=True)
    else:
        import grp

        group = grp.getgrgid(os.getgid()).gr_name
    etc = folder / "etc"
    etc.mkdir(exist_ok=True)
    etc.chmod(0o755)
    (folder / "run").mkdir(exist_ok=True)
    (folder / "run").chmod(0o755)
    config = etc / "admission.toml"
    config.write_text(f'socket = "{folder / "run" / "admission.sock"}"\ngroup = "{group}"\n'
                      f'state_dir = "{folder / "service"}"\naudit = "{folder / "service-audit.jsonl"}"\n'
                      f'fake_nvml = "{folder / "nvml" / "nvml.json"}"\nheadroom_gb = 0\n')
    config.chmod(0o644)
    proc = subprocess.Popen([sys.executable, "-m", "resident_pool", "admission-service", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not (folder / "run" / "admission.sock").exists() and time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the admission service did not start: {proc.communicate()[0][-2000:]}")
        time.sleep(0.02)
    return proc


def _race_pools(folder: Path, users: list[dict[str, Any]], nvml: Path, total: int,
                service: subprocess.Popen | None) -> list[dict[str, Any]]:
    procs = []
    site = sysconfig.get_paths()["purelib"]
    for n, user in enumerate(users):
        state = folder / f"pool-{n}"
        if state.exists():
            shutil.rmtree(state)
        state.mkdir(mode=0o700)
        info = pwd.getpwnam(user["name"])
        os.chown(state, info.pw_uid, info.pw_gid)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(state), "PYTHONPATH": f"{ROOT}:{site}",
               "RESIDENT_POOL_FAKE_NVML": str(nvml), "RESIDENT_POOL_STATE_DIR": str(state),
               "RESIDENT_POOL_ADMISSION_SERVICE": str(folder / "run" / "admission.sock") if service else "off"}
        count = total // len(users) + (1 if n < total % len(users) else 0)
        argv = [user["python"], "-c", ADMITTER, str(state), str(count), "24", "6", "0.03", "0.01"]
        if user["name"] != pwd.getpwuid(os.getuid()).pw_name:
            argv = ["setpriv", f"--reuid={user['name']}", f"--regid={user['name']}", "--init-groups", *argv]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"an admitting pool failed: {err[-2000:]}")
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    return outputs


def _race_states(folder: Path, users: list[dict[str, Any]], service: bool) -> list[list[dict[str, Any]]]:
    """Every ledger state: the service's one trail, or each user's own (each is right alone)."""
    paths = [folder / "service-audit.jsonl"] if service else [folder / f"pool-{n}" / "audit.jsonl"
                                                               for n in range(len(users))]
    states = []
    for path in paths:
        if path.exists():
            states += [json.loads(line)["entries"] for line in path.read_text().splitlines()]
    return states


def cleanup() -> None:
    """Users and groups the race made (where root)."""
    if os.getuid() != 0:
        return
    for line in Path("/etc/passwd").read_text().splitlines():
        name = line.split(":", 1)[0]
        if name.startswith("rp-bench") and name.endswith(f"-{os.getpid()}"):
            subprocess.run(["userdel", name], capture_output=True, check=False)
    subprocess.run(["groupdel", f"rp-bench-{os.getpid()}"], capture_output=True, check=False)


__all__ = ["case_head_of_line", "case_host_race", "case_mixed", "cleanup"]
