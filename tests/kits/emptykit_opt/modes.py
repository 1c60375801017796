ENV = "EMPTYKIT_OPT_MODE"
MODES = ["any"]


def resolve(mode):
    return {"env": {}}
