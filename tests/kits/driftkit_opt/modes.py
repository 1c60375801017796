ENV = "DRIFTKIT_OPT_MODE"
# fast: a "fused" predict that is 1% off; idle: engages nothing (and says so); off: stock.
MODES = ["fast", "idle", "off"]


def resolve(mode):
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode}")
    return {"env": {"DRIFTKIT_FUSED": "1" if mode == "fast" else "0"}}


def jit_cache_key():
    return "driftkit-0.3-cpu-py311"
