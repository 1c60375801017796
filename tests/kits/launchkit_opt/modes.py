MODES = ("triton", "eager")


class Row:
    def __init__(self, exports):
        self.exports = exports


def resolve(mode, home):
    return Row({"LAUNCHKIT_HOME": home, "LAUNCHKIT_FAST_PATH": mode})
