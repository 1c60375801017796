MODES = ["only"]


def resolve(mode):
    return {"env": {"NOMODE_ROW": "1"}}
