ENV = "OPTLESSKIT_OPT_MODE"
MODES = ["route"]


def resolve(mode):
    return {"env": {"OPTLESS_ROW": "1"}}
