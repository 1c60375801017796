"""The kit's kernels: a compiled extension, built for the GPU host only."""

from . import _kernels  # noqa: F401 - not built here

LAUNCH_PROFILE = "defaults"
