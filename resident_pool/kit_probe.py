"""Ask an optimization kit how it wants to run; prints one ``KITROW <json>`` line.

Runs IN THE PROVIDER'S INTERPRETER (the kit's stack cannot be imported in the
pool's), standard library only: ``python kit_probe.py <package> <mode>``.
"""

import importlib
import inspect
import json
import os
import site
import sys
import traceback
from pathlib import Path


def _optional(name):
    """Import ``name``; None only when that module itself is absent."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            return None
        raise


def _vars(row):
    """A resolve() answer is a mapping or an object; its variables sit under env or exports."""
    for key in ("env", "exports"):
        value = row.get(key) if isinstance(row, dict) else getattr(row, key, None)
        if value is not None:
            return {str(k): str(v) for k, v in dict(value).items()}
    return {}


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
    modules = {name: _optional(f"{package}.{name}") for name in ("modes", "_autoload", "stack")}

    out["mode_env"] = None
    for name in ("modes", "_autoload", "stack"):
        module = modules[name]
        for attribute in ("ENV", "ENV_MODE"):
            if module is not None and isinstance(getattr(module, attribute, None), str):
                out["mode_env"] = getattr(module, attribute)
                break
        if out["mode_env"]:
            break

    modes = modules["modes"]
    listed = getattr(modes, "MODES", None) if modes is not None else None
    out["modes"] = list(listed() if callable(listed) else listed or [])

    out["row"], out["resolve_shape"] = {}, None
    resolve = getattr(modes, "resolve", None) if modes is not None else None
    if resolve is not None:
        try:
            takes_home = len(inspect.signature(resolve).parameters) >= 2
        except (TypeError, ValueError):
            takes_home = False
        if takes_home and out["model_opt"] is None:
            out["resolve_shape"] = "resolve(mode, home)"
            out["errors"].append("resolve(mode, home) not called: the kit tree is unknown")
        elif takes_home:
            out["row"], out["resolve_shape"] = _vars(resolve(mode, out["model_opt"])), "resolve(mode, home)"
        else:
            out["row"], out["resolve_shape"] = _vars(resolve(mode)), "resolve(mode)"

    out["jit_cache_key"], out["jit_cache_key_error"] = None, None
    for name in ("modes", "stack"):
        function = getattr(modules[name], "jit_cache_key", None) if modules[name] is not None else None
        if function is not None:
            try:
                out["jit_cache_key"] = str(function())
            except Exception as exc:  # noqa: BLE001 - recorded in the row, shown by `check`
                out["jit_cache_key_error"] = f"{type(exc).__name__}: {exc}"
            break

    out["extra_rows"] = {}
    alloc = _optional(f"{package}.alloc")
    if alloc is not None and callable(getattr(alloc, "env_row", None)):
        out["extra_rows"]["alloc"] = {str(k): str(v) for k, v in dict(alloc.env_row()).items()}

    out["activation"], out["launch_opts"], out["launch_opts_error"] = "autoload", [], None
    if _optional(f"{package}.worker_launch") is not None:
        out["activation"] = "worker_launch"
        stack = modules["stack"]
        if stack is not None and callable(getattr(stack, "launch_opts", None)):
            out["launch_opts"] = [str(option) for option in stack.launch_opts(mode, 1, "defaults")]
        else:
            out["launch_opts"] = None
            out["launch_opts_error"] = (
                f"{package}.worker_launch exists but {package}.stack has no launch_opts(mode, replicas, profile): "
                "the kit's launcher cannot be given its options"
            )
    return out


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
