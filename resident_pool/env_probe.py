"""Report a provider's interpreter and key package versions; prints one ``ENVROW <json>`` line.

Runs IN THE PROVIDER'S INTERPRETER, standard library only:
``python env_probe.py <distribution>...``. It imports none of the packages it
reports (importing torch alone takes seconds): versions come from installed
metadata, and the CUDA runtime torch was built for from ``torch/version.py``
read as text.
"""

import ast
import importlib.metadata
import importlib.util
import json
import platform
import sys


def _literals(path):
    """Top-level ``name = <literal>`` assignments of a Python file, without running it."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        elif isinstance(node, ast.AnnAssign):
            target = node.target
        else:
            continue
        if isinstance(target, ast.Name) and node.value is not None:
            try:
                found[target.id] = ast.literal_eval(node.value)
            except ValueError:
                continue  # not a literal: not something this report needs
    return found


def torch_build():
    spec = importlib.util.find_spec("torch")  # a top-level name is located, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        try:
            values = _literals(f"{location}/version.py")
        except (OSError, SyntaxError):
            continue
        return {"version": values.get("__version__"), "cuda": values.get("cuda"), "hip": values.get("hip")}
    return None


def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main():
    row = {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "packages": {name: version(name) for name in sys.argv[1:]},
        "torch": torch_build(),
    }
    print("ENVROW " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
