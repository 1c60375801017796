"""The kit's modes. Its rows are handed out read-only (a mappingproxy), so no caller edits the kit's table."""
import types

ENV = "PROXIED_OPT"
MODES = ("off", "fast")

_ROWS = {
    "off": types.MappingProxyType({"env": types.MappingProxyType({"PROXIED_OPT_ROUTE": "stock"})}),
    "fast": types.MappingProxyType({"env": types.MappingProxyType({"PROXIED_OPT_ROUTE": "triton"})}),
}


def resolve(mode):
    # The original launcher reads `env` with resolution["env"] when it is no attribute: any mapping answers.
    return _ROWS[mode]
