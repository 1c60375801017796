MODES = ["fast", "safe"]


def resolve(mode):
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode}")
    return {"env": {"TOY_FUSED_KERNELS": "1" if mode == "fast" else "0", "OMP_NUM_THREADS": "1"}}


def jit_cache_key():
    return "toykit-1.0-cpu-py311"
