"""Every ``RESIDENT_POOL_*`` variable, with its type and default, and the XDG folders they fall back to.

``settings()`` is called at the edges only: the CLI, the daemon's start (``PoolServer``), ``Pool()``, a
standalone ``ResidentWorker``, the admission service's start and the flows (``resident_pool.prefect``). They hand
the ``Settings`` (and the folders, as one ``host.paths.Paths``) down; no other module calls it or reads
``os.environ`` for these names (``tests/test_settings.py`` reads the code to check both). ``worker_base.py`` keeps
its own reads of the worker-side names (it is standard library only); they are listed here too, so this file is
the one place that names them all.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import ResidentPoolError

__all__ = ["WORKER_SIDE", "Settings", "settings", "xdg_dir"]

# Read by the worker (worker_base.py) from its own environment; the pool sets them.
WORKER_SIDE = {
    "RESIDENT_POOL_PROTOCOL": "absolute path of protocol.py, set for every worker",
    "RESIDENT_POOL_WORKER_BASE": "absolute path of worker_base.py, set for every worker",
    "RESIDENT_POOL_HEARTBEAT": "the file whose mtime the pool refreshes while it lives, set for every worker",
    "RESIDENT_POOL_MAX_BATCH_SIZE": "a batching worker's most requests per model call ([batching] max_batch_size)",
    "RESIDENT_POOL_MAX_WAIT_MS": "how long a batching worker holds a model call open for more requests "
                                 "([batching] max_wait_ms)",
    "RESIDENT_POOL_MAX_BATCH_WORK": "a batching worker's most work per model call, as its size_of measures it "
                                    "([batching] max_batch_work)",
}


PREFIX = "RESIDENT_POOL_"


class Settings(BaseModel):
    """The pool's and the client's settings, from ``RESIDENT_POOL_<NAME>`` variables (``from_environment``).

    A plain model read by hand, not pydantic-settings' ``BaseSettings``: every field is a scalar, and importing
    pydantic-settings cost every pool, CLI and admission service at its start (``import resident_pool.settings``:
    0.17 s of CPU with it, 0.13 s without).
    """

    model_config = ConfigDict(extra="ignore", frozen=True, validate_default=True)

    manifests: Path | None = Field(None, description="the providers' folder (default ./manifests)")
    state_dir: Path | None = Field(
        None, description="sockets, ledger, locks; must be yours and 0700 "
        "(default $XDG_RUNTIME_DIR/resident-pool, else /tmp/resident-pool-<uid>)")
    log_dir: Path | None = Field(
        None, description="one transcript per worker start; outlives the pool "
        "(default $XDG_STATE_HOME/resident-pool/logs)")
    cache_dir: Path | None = Field(None, description="hash cache, GPU peaks, the kits' default JIT caches "
                                   "(default $XDG_CACHE_HOME/resident-pool)")
    gpu_capacity_gb: str | None = Field(
        None, description="declared capacity where NVML cannot read: `80`, or `0:80,1:80`")
    gpu_headroom_gb: float = Field(0.5, ge=0, description="kept free on every device")
    fake_nvml: Path | None = Field(None, description="read device memory from this JSON file (drills, tests)")
    ledger_audit: Path | None = Field(None, description="append every ledger state to this JSONL file")
    core_log: Path | None = Field(None, description="the pool's decision core's event log: every event it hears and "
                                  "what it decides, a JSON line each; an absolute path, 0600 in a folder only you "
                                  "can reach; a new file at each pool start, the last pool's kept as FILE.1 (up to "
                                  "FILE.3) (`resident-pool replay FILE` feeds it to a fresh core)")
    core_log_max_mb: float = Field(256.0, gt=0, description="the core event log stops at this size (said in pool.log "
                                   "and in its last line); the pool serves on")
    admission_service: str = Field("auto", description="the host-wide admission service's socket: `auto` (in force "
                                   "where its configuration file exists, at the socket it names; else "
                                   "/run/resident-pool/admission.sock where that exists), `off` (this user's own "
                                   "ledger), or a path; a service in force that does not answer is an error")
    admission_config: Path = Field(Path("/etc/resident-pool/admission.toml"), description="the host admission "
                                   "service's configuration: where it exists, `auto` takes the service as in force "
                                   "(a restart's missing socket is then an error, not a silent per-user ledger); "
                                   "`resident-pool admission-service` reads it by default")
    admission_service_user: str = Field("resident-pool", description="the user the host admission service may run "
                                        "as (besides root and yourself); a socket served by anyone else is refused")
    aging_s: float = Field(300.0, ge=0, description="a waiting request rises one priority class per this many "
                           "seconds waited, so `batch` is never starved (0: no ageing)")
    backfill: bool = Field(True, description="a request that fits in free GPU memory now may start ahead of one "
                           "that does not (its lease is recalled after its current request when that one could "
                           "start); off: strict order")
    quiet_exit_s: float = Field(600.0, ge=0, description="the pool exits after this long with no worker and "
                                "no client (0: never)")
    breaker_cooldown_s: float = Field(300.0, ge=0, description="how long a provider that refused at start "
                                      "is not started again")
    drain_grace_s: float = Field(60.0, ge=0, description="on SIGTERM or `stop`, how long leased requests may "
                                 "finish before their workers are stopped; keep it below the unit's "
                                 "TimeoutStopSec")
    liveness_timeout_s: float = Field(10.0, gt=0, description="an idle worker that does not answer the pool's "
                                      "liveness ping within this is stopped")
    kill_grace_s: float = Field(5.0, ge=0, description="between SIGTERM and SIGKILL whenever a worker's process "
                                "group is stopped: by the pool, a standalone worker, a pool ending a dead pool's "
                                "workers, or a zygote")
    keepalive_s: float = Field(10.0, gt=0, description="how often the pool tells a client waiting on a long op "
                               "(a cold start, an admission wait) that it lives")
    tick_s: float = Field(0.25, gt=0, le=5, description="the pool's clock: how often it looks at idle, liveness, "
                          "overdue and waiting records")
    max_connections: int = Field(256, ge=4, description="connections the pool serves at once; one over it is "
                                 "told so and closed")
    client_timeout_s: float = Field(60.0, gt=0, description="a client gives up on a pool silent this long (a long "
                                    "op sends a keepalive every 10 s)")
    heartbeat_stale_s: float = Field(30.0, gt=0, description="passed to workers: a heartbeat older than "
                                     "this means the pool is gone (the pool refreshes it every 2 s)")
    orphan_grace_s: float | None = Field(None, gt=0, description="passed to workers, overriding each manifest's "
                                         "orphan_grace_s: a worker whose pool is gone exits after this long "
                                         "without a request")
    artifact_tail_lines: int = Field(20, ge=0, description="transcript lines in a Prefect failure artifact")
    results_dir: Path | None = Field(None, description="the campaign result store: every campaign of this user and "
                                     "provider resumes and deduplicates from it "
                                     "(default $XDG_DATA_HOME/resident-pool/results)")
    max_record_bytes: int = Field(1024 * 1024, ge=1, description="a campaign input record longer than this fails "
                                  "alone as bad_input")
    max_input_bytes: int = Field(10 * 10**9, ge=1, description="a campaign input file that holds more than this "
                                 "(decompressed, for .gz) is refused when the reader passes it; no output is "
                                 "written for it")
    max_input_records: int = Field(50_000_000, ge=1, description="a campaign input file with more records than this "
                                   "is refused when the reader passes it; no output is written for it")
    max_result_bytes: int = Field(64 * 2**20, ge=1, description="a campaign result larger than this once decoded "
                                  "(or once written as JSON) fails its record as bad_answer and is not stored")
    campaign_max_attachment_bytes: int = Field(2**30, ge=0, description="the largest attachment a campaign maps "
                                               "from a worker's answer (direct calls: "
                                               "RESIDENT_POOL_MAX_ATTACHMENT_BYTES); a chunk's answer over it fails "
                                               "and its inputs are retried one by one")
    input_root: Path | None = Field(None, description="the folder under which the screen flow reads inputs; "
                                    "required for a deployment's flow runs (set on the worker host, never in Prefect)")
    output_root: Path | None = Field(None, description="the folder under which the screen flow writes outputs "
                                     "(default: RESIDENT_POOL_INPUT_ROOT); set on the worker host, never in Prefect")
    libcuda: str = Field("libcuda.so.1", description="the CUDA driver library whose checkpoint API hibernates "
                         'workers ([lifecycle] evict = "hibernate"); tests point it at a fake')
    no_cublas_release: bool = Field(False, description="passed to workers: turns off the cuBLAS workspace release "
                                    "after each prediction")
    attach_min_bytes: int = Field(64 * 1024, ge=0, description="arrays and bytes of at least this size travel "
                                  "beside the line as attachments; smaller ones inline, as base64 (the worker "
                                  "reads it too)")
    max_attachment_bytes: int = Field(4 * 1024**3, ge=0, description="the largest attachment a receiver maps; "
                                      "a sender checks the receiver's cap first (the worker reads it too)")
    metrics_port: int | None = Field(None, ge=1, le=65535, description="serve Prometheus metrics on "
                                     "127.0.0.1:PORT (off when unset); any local user can read them")
    transcripts_keep: int = Field(50, ge=1, description="transcripts kept per provider; the oldest beyond it "
                                  "are removed (never one a live worker writes)")
    transcripts_max_mb: float = Field(500.0, gt=0, description="total size of one provider's transcripts; the "
                                      "oldest beyond it are removed (never one a live worker writes)")
    flow_run_poll_s: float = Field(1.0, gt=0, description="the resident-process Prefect worker wakes on Prefect's "
                                   "events for new flow runs; while that stream is down, it asks this often")
    pool_log_max_mb: float = Field(20.0, gt=0, description="the background pool's own log (pool.log) is rotated "
                                   "at this size; 3 old files are kept")

    @field_validator("core_log")
    @classmethod
    def _absolute(cls, path: Path | None) -> Path | None:
        if path is not None and not path.is_absolute():  # the pool runs from its state folder, not the caller's
            raise ValueError("must be an absolute path, to a file in a folder only you can reach (such as the "
                             "pool's log folder, RESIDENT_POOL_LOG_DIR)")
        return path

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings the ``RESIDENT_POOL_*`` variables of ``environ`` (this process's by default) give; a name
        is matched in any case, as pydantic-settings matched it: the whole name lowercased is ``resident_pool_<field>``
        (``name.upper()`` would also take a dotless i or a long s for the prefix's I or S)."""
        given: dict[str, Any] = {}
        for name, value in (os.environ if environ is None else environ).items():
            key = name.lower()
            if key.startswith(PREFIX.lower()) and key[len(PREFIX):] in cls.model_fields:
                given[key[len(PREFIX):]] = value
        return cls.model_validate(given)


_BUILT: dict[tuple[tuple[str, str], ...], Settings] = {}  # the last environment read, and what it gave


def settings() -> Settings:
    """The settings as the environment gives them now; a bad value names its variable.

    Read again only when a ``RESIDENT_POOL_*`` variable changed: building the model costs milliseconds, and the
    client asks for a setting on every call (a 20x slower ``Pool.predict`` when it did not remember).
    """
    key = tuple(sorted((name, value) for name, value in os.environ.items()
                       if name.upper().startswith(PREFIX)))
    built = _BUILT.get(key)
    if built is not None:
        return built
    try:
        built = Settings.from_environment()
        _BUILT.clear()
        _BUILT[key] = built
        return built
    except ValidationError as exc:
        problems = "; ".join(
            f"RESIDENT_POOL_{str(e['loc'][0]).upper()}={e.get('input')!r}: {e['msg']}" for e in exc.errors())
        raise ResidentPoolError(f"bad setting: {problems}; fix or unset the variable",
                                reason="bad_setting") from None


def xdg_dir(kind: str) -> Path:
    """The XDG base folder of ``kind`` (runtime, state, cache, data), with the spec's fallbacks."""
    home = Path(os.path.expanduser("~"))
    variable, fallback = {
        "runtime": ("XDG_RUNTIME_DIR", None),
        "state": ("XDG_STATE_HOME", home / ".local" / "state"),
        "cache": ("XDG_CACHE_HOME", home / ".cache"),
        "data": ("XDG_DATA_HOME", home / ".local" / "share"),
    }[kind]
    value = os.environ.get(variable)
    if value and os.path.isabs(value):
        return Path(value)
    if fallback is None:  # no runtime folder: a per-user one under the temp dir
        return Path(tempfile.gettempdir())
    return fallback
