ENV_MODE = "LAUNCHING_OPT"


def launch_opts(mode, replicas, profile):
    return ["--route", mode, "--attach", profile]


def jit_cache_key():
    return "launching-1.4-cpu"
