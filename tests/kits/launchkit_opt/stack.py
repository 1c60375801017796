ENV_MODE = "LAUNCHKIT_OPT_MODE"


def launch_opts(mode, replicas, profile):
    return ["--route", mode, "--replicas", str(replicas), "--profile", profile]


def jit_cache_key():
    raise RuntimeError("no compiler found for the JIT cache key")
