"""Ask an optimization kit how it wants to run; prints one ``KITROW <json>`` line.

Runs IN THE PROVIDER'S INTERPRETER (the kit's stack cannot be imported in the
pool's), standard library only: ``python kit_probe.py <package> <mode>``.
"""

import importlib
import json
import os
import site
import sys
import traceback
from pathlib import Path


class _Parts:
    """The kit's submodules, each imported the first time it is asked for, and only then.

    A kit's ``stack`` may need a compiled extension this interpreter cannot load; it is
    reached for only where the answer needs it, and a failure to import it is recorded,
    not fatal, wherever the original design's probe tolerated it.
    """

    def __init__(self, package):
        self.package = package
        self.found = {}
        self.failures = {}

    def get(self, name):
        """The module ``<package>.<name>``, or None when it is absent or would not import (see ``failures``)."""
        if name not in self.found:
            full = f"{self.package}.{name}"
            try:
                self.found[name] = importlib.import_module(full)
            except ModuleNotFoundError as exc:
                self.found[name] = None
                if exc.name != full:  # the module is there; something it imports is not
                    self.failures[name] = f"{type(exc).__name__}: {exc}"
            except Exception as exc:  # noqa: BLE001 - a broken submodule is reported in the row, as the seed tolerates it
                self.found[name] = None
                self.failures[name] = f"{type(exc).__name__}: {exc}"
        return self.found[name]

    def failure(self, name):
        return f"{self.package}.{name} would not import: {self.failures[name]}" if name in self.failures else None


def _vars(row):
    """A resolve() answer's variables, under env or exports (None: neither), read as the original's probe reads
    them: the attribute, else the key, so an object, a dict or any other mapping (a read-only
    MappingProxyType, a UserDict) answers, and so does a variables table of any of those kinds."""
    for key in ("env", "exports"):
        value = getattr(row, key, None)
        if value is None:
            try:
                value = row[key]
            except Exception:  # noqa: BLE001, S112 - no such key, or no subscript: the next spelling, as the original
                continue
        if value is not None:
            return {str(k): str(v) for k, v in dict(value).items()}
    return None


def _site_dirs():
    found = {*site.getsitepackages(), site.getusersitepackages()}
    return {Path(folder).resolve() for folder in found}


def _model_opt(package, kit):
    """MODEL_OPT as the seed sets it: an exported value wins, else the kit tree two levels up.

    A kit copied into site-packages (not installed from its checkout) has no
    kit tree there; a path derived from it would be meaningless, so none is given.
    """
    package_dir = Path(kit.__file__ or next(iter(kit.__path__)) + "/__init__.py").resolve().parent
    exported = os.environ.get("MODEL_OPT")
    if exported:
        return exported, "environment", None
    holder = package_dir.parent
    if holder in _site_dirs() or holder.name in ("site-packages", "dist-packages"):
        return None, None, (
            f"{package} is installed in {holder}, not from its kit checkout: there is no kit tree two "
            f"levels above {package_dir}; export MODEL_OPT or set [kit] model_opt to the kit's tree"
        )
    tree = str(package_dir.parents[1])
    os.environ.setdefault("MODEL_OPT", tree)
    return tree, "kit tree", None


def probe(package, mode):
    out = {"package": package, "errors": []}
    kit = importlib.import_module(package)
    out["model_opt"], out["model_opt_source"], out["model_opt_error"] = _model_opt(package, kit)
    out["version"] = getattr(kit, "__version__", None)
    parts = _Parts(package)

    out["mode_env"] = _mode_env(parts)

    modes = parts.get("modes")
    listed = getattr(modes, "MODES", None) if modes is not None else None
    out["modes"] = list(listed() if callable(listed) else listed or [])

    out["row"], out["resolve_shape"] = {}, None
    resolve = getattr(modes, "resolve", None) if modes is not None else None
    if resolve is not None:
        out["row"], out["resolve_shape"], tried = _resolve(resolve, mode, out["model_opt"])
        if out["resolve_shape"] is None:
            out["errors"].extend(tried)

    out["jit_cache_key"], out["jit_cache_key_error"] = _jit_cache_key(parts)

    out["extra_rows"] = {}
    alloc = parts.get("alloc")
    if alloc is not None and callable(getattr(alloc, "env_row", None)):
        try:
            out["extra_rows"]["alloc"] = {str(k): str(v) for k, v in dict(alloc.env_row()).items()}
        except Exception as exc:  # noqa: BLE001 - an extra row is optional; its failure is recorded
            out["errors"].append(f"{package}.alloc.env_row(): {type(exc).__name__}: {exc}")

    out["activation"], out["launch_opts"], out["launch_opts_error"] = "autoload", [], None
    if parts.get("worker_launch") is not None:
        out["activation"] = "worker_launch"
        stack = parts.get("stack")
        if stack is not None and callable(getattr(stack, "launch_opts", None)):
            try:
                out["launch_opts"] = [str(option) for option in stack.launch_opts(mode, 1, "defaults")]
            except Exception as exc:  # noqa: BLE001 - refused at start, with these words
                out["launch_opts"] = None
                out["launch_opts_error"] = f"{package}.stack.launch_opts({mode!r}, 1, 'defaults'): " \
                                           f"{type(exc).__name__}: {exc}"
        else:
            out["launch_opts"] = None
            out["launch_opts_error"] = parts.failure("stack") or (
                f"{package}.worker_launch exists but {package}.stack has no launch_opts(mode, replicas, profile): "
                "the kit's launcher cannot be given its options"
            )
    out["errors"].extend(parts.failure(name) for name in parts.failures)
    return out


def _mode_env(parts):
    """The kit's mode variable: ENV or ENV_MODE on .modes, else ._autoload, else .stack (the seed's order)."""
    for name in ("modes", "_autoload", "stack"):
        module = parts.get(name)
        for attribute in ("ENV", "ENV_MODE"):
            value = getattr(module, attribute, None) if module is not None else None
            if isinstance(value, str) and value:
                return value
    return None


def _jit_cache_key(parts):
    """``jit_cache_key()`` from .modes, else from .stack (some kits keep it there), and why there is none."""
    modes = parts.get("modes")
    function = getattr(modes, "jit_cache_key", None) if modes is not None else None
    error = None
    if function is None:
        stack = parts.get("stack")
        function = getattr(stack, "jit_cache_key", None) if stack is not None else None
        error = parts.failure("stack")
    if function is None:
        return None, error
    try:
        return str(function()), None
    except Exception as exc:  # noqa: BLE001 - recorded in the row, shown by `check`
        return None, f"{type(exc).__name__}: {exc}"


def _resolve(resolve, mode, home):
    """The row from ``resolve(mode)``, else ``resolve(mode, home)`` (the seed's order), the shape that
    answered, and what each shape tried said when none did."""
    shapes = [("resolve(mode)", (mode,))]
    if home is not None:
        shapes.append(("resolve(mode, home)", (mode, home)))
    tried = []
    for label, arguments in shapes:
        try:
            row = _vars(resolve(*arguments))
        except Exception as exc:  # noqa: BLE001 - the next shape may answer; all failures are reported
            tried.append(f"{label}: {type(exc).__name__}: {exc}")
            continue
        if row is not None:
            return row, label, []
        tried.append(f"{label}: the answer has neither env nor exports")
    if home is None:
        tried.append("resolve(mode, home) not called: the kit tree is unknown")
    return {}, None, tried


def main():
    package, mode = sys.argv[1], sys.argv[2]
    try:
        row = probe(package, mode)
    except Exception:  # noqa: BLE001 - the traceback is the probe's answer; no KITROW line follows
        traceback.print_exc()
        sys.exit(1)
    print("KITROW " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
