ENV = "RESOLVING_OPT"
MODES = ("fast", "exact")


def resolve(mode, profile="default"):
    """The row for ``mode``; ``profile`` picks a tuning table (not a path)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    return {"env": {"RESOLVING_PROFILE": profile, "RESOLVING_FUSED": "1" if mode == "fast" else "0"}}


def jit_cache_key():
    return "resolving-2.1-cpu"
