"""Provider manifests: ``manifests/<slug>/manifest.toml`` as pydantic models."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import platform
import re
import string
import sys
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import ManifestError
from ..host.trust import check_trusted
from ..messages import SLUG
from ..protocol import DEFAULT_REQUEST_TIMEOUT_S
from .input_rules import Inputs

__all__ = [
    "PLACEHOLDERS",
    "Answers",
    "Manifest",
    "json_schema",
    "load_manifest",
    "load_manifests",
    "manifest_path",
]

PLACEHOLDERS = frozenset({"socket", "slug", "weights_root", "python", "kit", "work_root"})
# fullmatch: "$" alone would let a trailing newline through.
# A variable name: `--env A=B` would set a value the manifest never showed as one.
VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _variable_names(names):
    if names == "*":
        return names
    for name in names or ():
        if not VARIABLE.fullmatch(name):
            raise ValueError(f"{name!r} is not an environment variable name (letters, digits, '_')")
    return names


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class VenvEnv(_Strict):
    """Run the worker with a Python interpreter on this host."""

    kind: Literal["venv"] = "venv"
    python: str = Field("auto", description='Interpreter path, or "auto" for the pool\'s own.')
    passthrough: list[str] | Literal["*"] | None = Field(
        None,
        description="Variables of the pool's environment that reach the worker beside the fixed base (PATH, "
        "HOME, LANG/LC_*, TMPDIR, USER, LD_LIBRARY_PATH, XDG_*, CUDA_*/NVIDIA_*, RESIDENT_POOL_*); \"*\" "
        "passes everything, an explicit opt-in. A secret no manifest names reaches no worker.",
    )

    @field_validator("passthrough")
    @classmethod
    def _names(cls, values):
        return _variable_names(values)


class ContainerEnv(_Strict):
    """Run the worker inside a container image."""

    kind: Literal["container"]
    engine: Literal["apptainer", "docker", "podman"]
    image: str
    python: str = Field("python3", description="The interpreter inside the image.")
    binds: list[str] = Field(default_factory=list, description='Extra binds, "host:container[:ro]".')
    passthrough: list[str] | None = Field(
        None, description="Variables of the pool's environment passed into the container by name."
    )

    @field_validator("passthrough")
    @classmethod
    def _names(cls, values: list[str] | None) -> list[str] | None:
        return _variable_names(values)

    @field_validator("image", "python")
    @classmethod
    def _not_an_option(cls, value: str) -> str:
        # The engine would read a leading '-' as one of its own options.
        if not value or value.startswith("-"):
            raise ValueError(f"{value!r} must not be empty or start with '-'")
        return value

    @field_validator("binds")
    @classmethod
    def _binds(cls, values: list[str]) -> list[str]:
        for value in values:
            parts = value.split(":")
            if parts[-1] in ("ro", "rw") and len(parts) > 1:
                parts = parts[:-1]
            if "," in value or len(parts) > 2 or not all(parts):
                raise ValueError(
                    f"{value!r} must be \"host[:container][:ro]\" with paths holding neither ',' nor ':' "
                    "(the engines' bind syntax cannot carry them)"
                )
            if not all(part.startswith(("/", "~")) for part in parts):
                raise ValueError(f"{value!r}: both paths must be absolute")
        return values


class Gpu(_Strict):
    policy: Literal["none", "recommended", "required"] = "none"
    vram_budget_gb: float | None = Field(None, gt=0)
    over_budget: Literal["warn", "stop"] = Field(
        "warn", description="A worker measured (NVML) above vram_budget_gb is flagged and logged; with \"stop\" "
        "it is also stopped once its current lease ends (never under a running request).")

    @model_validator(mode="after")
    def _budget_when_gpu(self) -> Gpu:
        if self.policy != "none" and self.vram_budget_gb is None:
            raise ValueError(
                f'vram_budget_gb is required when policy = "{self.policy}": admission cannot place '
                "a worker whose memory it does not know"
            )
        return self


class Lifecycle(_Strict):
    idle_timeout_s: float = Field(600.0, ge=0)
    start_timeout_s: float = Field(900.0, gt=0)
    request_timeout_s: float = Field(DEFAULT_REQUEST_TIMEOUT_S, gt=0)
    orphan_grace_s: float = Field(120.0, gt=0)
    max_replicas: int = Field(1, ge=1, le=64)
    admission_timeout_s: float = Field(3600.0, gt=0)
    abandon_grace_s: float = Field(
        30.0, ge=0, description="A request whose client vanished may run this long (its answer is thrown away) "
        "before its worker is stopped and the GPU given back.")
    ping_interval_s: float = Field(
        30.0, gt=0, description="How often the pool pings an idle worker; one that does not answer is stopped.")
    preload: list[str] | None = Field(
        None, description="Modules a zygote (a fork server started as the worker would be) imports once; each "
        "new worker is forked from it, so its imports are paid once per host. Absent: every worker is spawned. "
        "Nothing here may initialize CUDA.")
    load: str | None = Field(
        None, description="A function of the worker script that the zygote calls with the weights root after "
        "its preload (weights into host memory, shared copy-on-write by every fork; CPU only, no torch operation "
        "that starts a thread pool); the worker finds its result with worker_base.staged().")
    evict: Literal["stop", "hibernate"] = Field(
        "stop", description='What admission does to this idle worker to make room: "stop" it, or "hibernate" it '
        "(device memory checkpointed to host memory through the CUDA checkpoint API, driver 570+, the process "
        "kept; its next lease restores it). Where the API is absent or fails, it is stopped.")
    min_replicas: int = Field(
        0, ge=0, le=64, description="Workers the pool keeps warm: started when the pool starts (and after one "
        "ends), exempt from idle retirement, evicted last and only for a request that cannot fit otherwise.")

    @field_validator("preload")
    @classmethod
    def _modules(cls, values: list[str] | None) -> list[str] | None:
        for value in values or ():
            if not all(part.isidentifier() for part in value.split(".")):
                raise ValueError(f"{value!r} is not a module name (dotted identifiers)")
        return values

    @field_validator("load")
    @classmethod
    def _function(cls, value: str | None) -> str | None:
        if value is not None and not value.isidentifier():
            raise ValueError(f"{value!r} is not a function name of the worker script")
        return value

    @model_validator(mode="after")
    def _load_needs_a_zygote(self) -> Lifecycle:
        if self.load is not None and self.preload is None:
            raise ValueError("load runs in the zygote, which preload turns on; add preload = [...] (it may be empty)")
        return self

    @model_validator(mode="after")
    def _min_within_max(self) -> Lifecycle:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas = {self.min_replicas} is above max_replicas = {self.max_replicas}")
        return self


class Batching(_Strict):
    """Several callers share one worker, whose batch function runs what they have queued as one model call
    (``serve(on_predict_batch=...)``; docs/batching.md). Absent: one request at a time, as the original design."""

    max_batch_size: int = Field(64, ge=1, le=65536, description="Items one model call takes at most.")
    max_callers: int | None = Field(
        None, ge=1, le=1024, description="Leases one replica carries at once (default: max_batch_size); a new "
        "replica starts, where max_replicas allows, once every replica is full.")
    max_wait_ms: float = Field(
        0.0, ge=0, le=60_000, description="How long a batch may be held open for more items when fewer than "
        "max_batch_size are queued (0: never; a lone caller is served at once).")
    max_batch_work: int | None = Field(
        None, ge=1, description="A bound on the work one model call holds, by the worker's own size_of(payload) "
        "(sequence lengths, say): a batch is bounded by its work, not only by its count.")
    max_queue_wait_s: float | None = Field(
        None, gt=0, description="Where the worker reports its callers wait longer than this in its queue, "
        "another replica is started (where max_replicas allows) though this one has room.")

    @property
    def callers(self) -> int:
        return self.max_callers if self.max_callers is not None else self.max_batch_size


class WeightFile(_Strict):
    path: str
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    size: int = Field(ge=0)

    @field_validator("path")
    @classmethod
    def _relative(cls, value: str) -> str:
        if Path(value).is_absolute() or ".." in Path(value).parts:
            raise ValueError(f"{value!r} must be relative to the weights root, without '..'")
        return value


class Weights(_Strict):
    root_env: str | None = Field(None, description="Variable naming the weights directory; it wins when set.")
    root: str | None = Field(None, description="Default root (absolute, or relative to the manifest).")
    package: str | None = Field(
        None, description="Default root inside this package, found in the provider's interpreter."
    )
    subdir: str = ""
    files: list[WeightFile] = Field(default_factory=list)


class Kit(_Strict):
    """An optimization kit; the keys and defaults of the original design's ``[kit]`` table hold."""

    name: str | None = Field(None, description="The kit is the package <name>_opt unless package is given.")
    subdir: str | None = Field(None, description="The original design's key for name (the kit's folder).")
    package: str | None = Field(None, description="The kit's package; default <name or subdir>_opt, else <slug>_opt.")
    mode: str = Field("fast", description="The kit mode the worker runs under.")
    mode_env: str | None = Field(None, description="The kit's mode variable, if it must survive the probe's scrub.")
    levers_off: list[str] = Field(default_factory=list)
    env_row: Literal["probe", "none"] = Field(
        "probe", description='"probe": the kit must export an environment row for the mode; "none" (with '
        "env_row_reason): it keeps none.")
    env_row_reason: str | None = None
    jit_root: str | None = Field(
        None, description="The JIT cache (MODEL_OPT_JIT_ROOT); else $MODEL_OPT_JIT_ROOT, else one per provider "
        "in the pool's cache folder."
    )
    model_opt: str | None = Field(
        None, description="The kit tree (MODEL_OPT), for a kit installed without its checkout; "
        "else $MODEL_OPT, else two levels above the kit's package directory."
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Variables the worker gets; a number or a boolean is taken as its text "
        '(0 is "0", true is "True"), as the original launcher\'s str(value) took it.')

    @field_validator("env", mode="before")
    @classmethod
    def _scalars_as_text(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        return {name: str(value) if isinstance(value, int | float) else value for name, value in values.items()}

    @field_validator("env")
    @classmethod
    def _names(cls, values: dict[str, str]) -> dict[str, str]:
        return _variable_names(values)

    @field_validator("env_row", mode="before")
    @classmethod
    def _required_is_probe(cls, value: Any) -> Any:
        return "probe" if value == "required" else value  # this project's earlier word for it

    @field_validator("name", "subdir", "package")
    @classmethod
    def _importable(cls, value: str | None) -> str | None:
        if value is not None and not all(part.isidentifier() for part in value.split(".")):
            raise ValueError(f"{value!r} is not a Python package name (dotted identifiers)")
        return value

    @field_validator("jit_root", "model_opt")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("/", "~")):
            raise ValueError(f"{value!r} must be an absolute path")
        return value

    @model_validator(mode="after")
    def _named(self) -> Kit:
        if not (self.name or self.subdir or self.package):
            raise ValueError("give the kit's name (its package is <name>_opt) or its package: the default, "
                             "<slug>_opt, is no Python package name for this slug")
        if self.name and self.subdir and self.name != self.subdir:
            raise ValueError(f"name = {self.name!r} and subdir = {self.subdir!r} are the same key (subdir is the "
                             "original design's word for it); give one")
        if self.env_row == "none" and not self.env_row_reason:
            raise ValueError('env_row = "none" needs env_row_reason saying why the kit exports nothing')
        return self

    @property
    def package_name(self) -> str:
        return self.package or f"{self.name or self.subdir}_opt"


class Smoke(_Strict):
    """What `resident-pool check --smoke` sends, and the answer it must get back."""

    payload: dict[str, Any] = Field(default_factory=dict)
    inputs: str | None = Field(
        None, description='A file of inputs beside the manifest (FASTA, CSV, TSV or JSONL, e.g. "smoke/inputs.fasta"), '
        "read as a campaign reads one and ruled by [inputs]: they become the payload's \"inputs\", so [answers] can "
        "judge answers over a real range of inputs. Their ids name them in [[answers.relations]].",
    )
    expected: str | None = Field(
        None, description='The expected answer, relative to the manifest (e.g. "smoke/expected.json"); '
        "recorded with `resident-pool check --bless SLUG`. Unset: any answer passes.",
    )
    atol: float = Field(1e-5, ge=0, allow_inf_nan=False, description="Absolute tolerance for every number.")
    rtol: float = Field(1e-4, ge=0, allow_inf_nan=False,
                        description="Relative tolerance: |found - expected| <= atol + rtol * |expected|.")
    cosine_min: float | None = Field(
        None, ge=-1, le=1, description="For lists of numbers (embeddings): the cosine similarity floor, "
        "checked besides atol and rtol.",
    )
    ignore: list[str] = Field(
        default_factory=lambda: ["pid", "device", "elapsed*", "cublas_workspaces_freed_mib"],
        description="Fields that vary between runs and are neither recorded nor compared: a name matches at "
        'any depth, a dotted path from the top ("items.*.tokens"); * globs. Setting it replaces the default.',
    )
    float32_base64: list[str] = Field(
        default_factory=lambda: ["*_f32"],
        description="Fields holding little-endian float32 arrays in base64, compared as numbers.",
    )

    @field_validator("expected", "inputs")
    @classmethod
    def _beside_the_manifest(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.strip() or value.endswith("/") or Path(value).is_absolute() or ".." in Path(value).parts:
            raise ValueError(f"{value!r} must be a file relative to the manifest, without '..'")
        return value

    @field_validator("ignore", "float32_base64")
    @classmethod
    def _patterns(cls, values: list[str]) -> list[str]:
        # A pattern that matches any name compares nothing: a golden check that passes everything.
        probes = ("a", "zz", "items", "embedding_f32", "x1", "value", "tokens", "0")
        for value in values:
            if not value.strip(".[]* ") or all(fnmatch.fnmatchcase(probe, part) for probe in probes
                                                for part in value.split(".")):
                raise ValueError(f"{value!r} matches every field; name the field")
        return values


DISTINCT_COSINE = 0.9999  # answers of two distinct inputs at least this alike are one answer
ANSWER_CHECKS = ("distinct", "finite", "spread", "unknown_tokens", "relations")


class Relation(_Strict):
    """A known relation among the smoke inputs: ``closer``'s answer lies nearer ``anchor``'s than ``farther``'s."""

    anchor: str = Field(description="The id of a smoke input (a FASTA id; an inline payload's inputs are 1, 2, ...).")
    closer: str = Field(description="An input whose answer must lie closer to the anchor's (e.g. a point mutant).")
    farther: str = Field(description="An input whose answer must lie farther from it (e.g. an unrelated protein).")
    why: str = Field("", description="What the relation is, in words, for the report.")


class Answers(_Strict):
    """``[answers]``: what the answers mean, so `resident-pool check` can tell a working model from a degenerate one."""

    embedding: str | None = Field(
        None, description='The field of each answer item that holds its vector ("embedding"; a list of numbers, or '
        'base64 float32 under the same name with "_f32" added). Unset: no check below runs.')
    checks: list[Literal["distinct", "finite", "spread", "unknown_tokens", "relations"]] = Field(
        default_factory=lambda: list(ANSWER_CHECKS),
        description="Which apply: distinct (distinct inputs, distinct answers), finite (no NaN or infinity, and no "
        "answer all zero or one value throughout), spread (the answers vary across inputs), unknown_tokens (the "
        "share the items report, where they report \"unknown_tokens\" and \"tokens\"), relations (those listed "
        "below).")
    distinct_cosine: float = Field(
        DISTINCT_COSINE, gt=0, le=1, allow_inf_nan=False,
        description="Two distinct inputs whose answers lie at this cosine similarity or above count as one answer.")
    max_close_pairs: int = Field(0, ge=0, description="How many such pairs the smoke set may hold.")
    max_unknown_share: float = Field(
        0.0, ge=0, le=1, allow_inf_nan=False, description="The largest share of the tokens read that may be unknown.")
    min_spread: float = Field(
        1e-6, ge=0, allow_inf_nan=False,
        description="The smallest root mean square distance of the answers from their mean.")
    relations: list[Relation] = Field(default_factory=list)

    @field_validator("embedding")
    @classmethod
    def _field_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
            raise ValueError(f"{value!r} must be the name of an answer item's field")
        return value


class Manifest(_Strict):
    """One provider: a model the pool can hold."""

    slug: str
    description: str = ""
    worker: str = Field(description="Worker script, relative to the manifest.")
    worker_args: list[str] = Field(default_factory=lambda: ["{socket}"])
    mode: Literal["resident", "subprocess"] = "resident"
    mode_reason: str | None = None
    work_root: str | None = None
    env: Annotated[VenvEnv | ContainerEnv, Field(discriminator="kind")] = Field(default_factory=VenvEnv)
    gpu: Gpu = Field(default_factory=Gpu)
    lifecycle: Lifecycle = Field(default_factory=Lifecycle)
    weights: Weights = Field(default_factory=Weights)
    kit: Kit | None = None
    inputs: Inputs = Field(default_factory=Inputs)
    smoke: Smoke = Field(default_factory=Smoke)
    batching: Batching | None = None
    answers: Answers = Field(default_factory=Answers)

    # Set by load_manifest; not part of the file.
    path: Path | None = Field(None, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _venv_by_default(cls, data: Any) -> Any:
        env = data.get("env") if isinstance(data, dict) else None
        if isinstance(env, dict) and "kind" not in env:
            data = {**data, "env": {**env, "kind": "venv"}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _kit_named_after_the_slug(cls, data: Any) -> Any:
        """A ``[kit]`` naming no package is ``<slug>_opt``, as in the original design."""
        kit = data.get("kit") if isinstance(data, dict) else None
        slug = data.get("slug") if isinstance(data, dict) else None
        if isinstance(kit, dict) and not any(kit.get(key) for key in ("name", "subdir", "package")) \
                and isinstance(slug, str) and slug.isidentifier():
            data = {**data, "kit": {**kit, "subdir": slug}}
        return data

    @field_validator("slug")
    @classmethod
    def _slug(cls, value: str) -> str:
        if not SLUG.fullmatch(value):
            raise ValueError(f"{value!r} must be lowercase letters, digits, '-' or '_', at most 40 characters")
        return value

    @field_validator("worker_args")
    @classmethod
    def _placeholders(cls, values: list[str]) -> list[str]:
        for value in values:
            for _, name, _, _ in string.Formatter().parse(value):
                if name is not None and name not in PLACEHOLDERS:
                    raise ValueError(
                        f"{{{name}}} in {value!r} is not a placeholder; use one of "
                        + ", ".join(f"{{{p}}}" for p in sorted(PLACEHOLDERS))
                    )
        return values

    @model_validator(mode="after")
    def _mode(self) -> Manifest:
        if self.mode == "subprocess" and not self.mode_reason:
            raise ValueError('mode = "subprocess" needs mode_reason saying why the model cannot be held')
        if self.mode == "subprocess" and self.lifecycle.min_replicas:
            raise ValueError('lifecycle.min_replicas: a mode = "subprocess" worker is started per request and '
                             "cannot be kept warm; set min_replicas = 0")
        if self.mode == "subprocess" and self.batching is not None:
            raise ValueError('batching: a mode = "subprocess" worker serves one lease; remove [batching], or hold '
                             'the model (mode = "resident")')
        return self

    @property
    def directory(self) -> Path:
        return self.path.parent if self.path else Path.cwd()

    @property
    def worker_path(self) -> Path:
        return (self.directory / self.worker).resolve()

    def takes_inputs(self) -> bool:
        """Whether its requests are ``{"inputs": [str, ...]}`` (so [inputs] rules each one): it declares [inputs]
        or [smoke] inputs, or its [smoke] payload looks so; a provider with no example is taken to."""
        example = self.smoke.payload
        if "inputs" in self.model_fields_set or self.smoke.inputs is not None or not example:
            return True
        inputs = example.get("inputs")
        return isinstance(inputs, list) and all(isinstance(text, str) for text in inputs)

    def variant(self, kit_mode: str | None = None, without_kit: bool = False) -> Manifest:
        """This provider built another way (its kit in another mode, or without its kit), e.g. to compare stock."""
        if self.kit is None:
            return self
        if without_kit:
            return self.model_copy(update={"kit": None})
        if kit_mode is not None:
            # A kit's "off" mode rightly exports nothing: the empty-row rule is for the mode a provider runs in.
            kit = self.kit.model_copy(update={"mode": kit_mode, "env_row": "none",
                                              "env_row_reason": f"a comparison run in mode {kit_mode!r}"})
            return self.model_copy(update={"kit": kit})
        return self

    def fingerprint(self) -> str:
        """Changes when anything in the manifest changes (the breaker closes on it)."""
        data = self.model_dump(mode="json")
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    def version(self) -> str:
        """What changes a worker's answers: its script's content, arguments, interpreter and environment,
        kit settings, mode, weights pins and input rule ([inputs] says how an input is read before it is sent).
        Not description, [lifecycle], [gpu], [smoke] or [answers]: editing an idle timeout must neither drain
        warm workers nor invalidate a campaign's results."""
        data = self.model_dump(mode="json", include={"worker", "worker_args", "mode", "env", "kit", "weights"})
        if "inputs" in self.model_fields_set:  # a manifest without [inputs] keeps the version it had before
            data["inputs"] = self.inputs.model_dump(mode="json", by_alias=True)
        if isinstance(self.env, VenvEnv) and self.env.python == "auto":
            data["interpreter"] = auto_interpreter_identity()
        try:
            data["script_sha256"] = hashlib.sha256(self.worker_path.read_bytes()).hexdigest()
        except OSError as exc:
            raise ManifestError(f"{self.path}: worker: cannot read {self.worker_path}: {exc.strerror}",
                                slug=self.slug, details={"field": "worker"}) from None
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def auto_interpreter_identity() -> str:
    """What python = "auto" runs a worker with, as every process reaching it computes it alike: the resolved
    environment (a venv's folder: its packages) and the Python version. Not sys.executable as typed: a pool
    started by .venv/bin/python3 and a flow run by .venv/bin/python (or through a symlinked folder) are the
    same interpreter and must agree on a provider's version."""
    return f"{os.path.realpath(sys.prefix)} {sys.implementation.name}-{platform.python_version()}"


def _field_path(location: tuple[Any, ...]) -> str:
    parts = [str(part) for part in location if not str(part).startswith(("function-", "tagged-union"))]
    if parts[:2] in (["env", "venv"], ["env", "container"]):
        del parts[1]  # the union's tag, not a key the file holds
    return ".".join(parts) or "(top level)"


def manifest_path(directory: str | Path, name: str) -> Path:
    """``<directory>/<name>/manifest.toml`` for a provider name; a name that is not a whole slug is refused.

    Every entry point that takes a provider name comes through here: ``../../elsewhere/evil`` would
    otherwise name a manifest (and so a worker script) outside the folder.
    """
    if not isinstance(name, str) or not SLUG.fullmatch(name):
        raise ManifestError(f"{name!r} is not a provider name: lowercase letters, digits, '-' or '_', at most 40 "
                            f"characters, as the provider's folder under {directory} is named",
                            details={"field": "provider"})
    return Path(directory) / name / "manifest.toml"


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate one manifest; any problem is a ManifestError naming file and field."""
    path = Path(path)
    if not path.exists():
        raise ManifestError(f"{path}: no such manifest file")
    # Whoever can write these can run code as you: check before reading a byte.
    check_trusted(path, "the manifest")
    check_trusted(path.parent, "the provider's folder")
    if path.name == "manifest.toml":
        check_trusted(path.parent.parent, "the manifests folder")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"{path}: no such manifest file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: cannot be read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path}: not valid TOML: {exc}", details={"field": None}) from None
    if "path" in raw:
        raise ManifestError(f"{path}: path: extra inputs are not permitted", details={"field": "path"})
    try:
        manifest = Manifest.model_validate({**raw, "path": path.resolve()})
    except ValidationError as exc:
        problems = [f"{_field_path(e['loc'])}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors()]
        fields = [_field_path(e["loc"]) for e in exc.errors()]
        raise ManifestError(
            f"{path}: " + "; ".join(problems),
            slug=raw.get("slug") if isinstance(raw.get("slug"), str) else None,
            details={"field": fields[0], "fields": fields},
        ) from None
    if not manifest.worker_path.is_file():
        raise ManifestError(
            f"{path}: worker: the script {manifest.worker_path} does not exist; "
            "give its path relative to the manifest",
            slug=manifest.slug,
            details={"field": "worker"},
        )
    # As named (a link on the way is checked, then followed), not as resolved: a link another user owns
    # could be re-pointed after this check.
    check_trusted(path.parent / manifest.worker, "the worker script", manifest.slug, "worker")
    if manifest.worker_path.parent != path.parent.resolve():
        check_trusted(manifest.worker_path.parent, "the worker script's folder", manifest.slug, "worker")
    if manifest.slug != path.parent.name and path.name == "manifest.toml":
        raise ManifestError(
            f"{path}: slug: {manifest.slug!r} differs from its folder {path.parent.name!r}; "
            "name the folder after the slug",
            slug=manifest.slug,
            details={"field": "slug"},
        )
    return manifest


def load_manifests(directory: str | Path) -> dict[str, Manifest]:
    """Every ``<directory>/<slug>/manifest.toml``, keyed by slug."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ManifestError(
            f"{directory}: no manifests directory here; pass --manifests DIR or set RESIDENT_POOL_MANIFESTS"
        )
    manifests = {}
    for path in sorted(directory.glob("*/manifest.toml")):
        manifest = load_manifest(path)
        manifests[manifest.slug] = manifest
    return manifests


def json_schema() -> dict[str, Any]:
    schema = Manifest.model_json_schema()
    schema["properties"].pop("path", None)
    schema["title"] = "resident-pool provider manifest"
    return schema
