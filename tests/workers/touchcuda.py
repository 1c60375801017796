"""A module that initializes CUDA when imported (through the fake libcuda at $FAKE_LIBCUDA), as a careless one would."""

import ctypes
import os

ctypes.CDLL(os.environ["FAKE_LIBCUDA"]).cuInit(0)
