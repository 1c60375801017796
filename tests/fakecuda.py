"""A fake libcuda for tests: a tiny shared object built with gcc that records the driver calls it gets.

It answers the calls resident-pool makes: cuInit, cuDeviceGetCount (CUDA_ERROR_NOT_INITIALIZED
until cuInit ran, as the real driver does), cuGetErrorName and the checkpoint API
(cuCheckpointProcessLock / Checkpoint / Restore / Unlock). Each call appends a line
``<call> <pid>`` to the file named by FAKE_LIBCUDA_LOG; a call whose name is in the file
named by FAKE_LIBCUDA_FAIL (read at every call) fails with CUDA_ERROR_NOT_SUPPORTED.
Built without the checkpoint API, it stands for a driver older than branch 570.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NOT_INITIALIZED 3
#define NOT_SUPPORTED 801

static int initialized = 0;

static void record(const char *call, int pid, unsigned int extra) {
    const char *path = getenv("FAKE_LIBCUDA_LOG");
    if (!path) return;
    FILE *log = fopen(path, "a");
    if (!log) return;
    if (extra) fprintf(log, "%s %d %u\n", call, pid, extra); else fprintf(log, "%s %d\n", call, pid);
    fclose(log);
}

static int fails(const char *call) {
    const char *path = getenv("FAKE_LIBCUDA_FAIL");
    char text[256] = {0};
    if (!path) return 0;
    FILE *file = fopen(path, "r");
    if (!file) return 0;
    size_t n = fread(text, 1, sizeof text - 1, file);
    fclose(file);
    text[n] = 0;
    return strstr(text, call) != NULL;
}

int cuInit(unsigned int flags) { initialized = 1; record("init", 0, 0); return 0; }
int cuDriverGetVersion(int *version) { *version = 12080; return 0; }
int cuDeviceGetCount(int *count) { if (!initialized) return NOT_INITIALIZED; *count = 1; return 0; }
int cuGetErrorName(int error, const char **name) {
    *name = error == NOT_SUPPORTED ? "CUDA_ERROR_NOT_SUPPORTED" : "CUDA_ERROR_UNKNOWN";
    return 0;
}

#ifndef NO_CHECKPOINT
typedef struct { unsigned int timeoutMs; unsigned int reserved0; unsigned long long reserved1[7]; } LockArgs;

static int step(const char *call, int pid, unsigned int extra) {
    record(call, pid, extra);
    return fails(call) ? NOT_SUPPORTED : 0;
}
int cuCheckpointProcessLock(int pid, LockArgs *args) { return step("lock", pid, args ? args->timeoutMs : 0); }
int cuCheckpointProcessCheckpoint(int pid, void *args) { return step("checkpoint", pid, 0); }
int cuCheckpointProcessRestore(int pid, void *args) { return step("restore", pid, 0); }
int cuCheckpointProcessUnlock(int pid, void *args) { return step("unlock", pid, 0); }
#endif
"""


def build(directory: Path, checkpoint: bool = True) -> Path:
    """``directory/libcuda.so.1``; without ``checkpoint``, a driver that lacks the checkpoint API."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler (gcc or cc) on PATH to build the fake libcuda these tests load")
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "fakecuda.c"
    source.write_text(SOURCE)
    library = directory / "libcuda.so.1"
    flags = [] if checkpoint else ["-DNO_CHECKPOINT"]
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", *flags, "-o", str(library), str(source)], check=True,
                   capture_output=True)
    return library


def calls(log: Path) -> list[str]:
    """The recorded calls, in order."""
    return log.read_text().splitlines() if log.exists() else []
