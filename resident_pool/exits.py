"""The operator's table of worker exit codes; no internal imports.

One table serves the start path and the request path so the words for a code
cannot drift between them.
"""

from __future__ import annotations

import signal

__all__ = ["EXIT_HINTS", "LOST_EXIT", "REFUSAL_CODES", "describe_exit", "exit_hint"]

EXIT_HINTS: dict[int, str] = {
    0: "clean exit",
    1: "the worker raised an unhandled error; its traceback is in the transcript",
    2: "usage error: the worker's command line or arguments are wrong",
    3: "refusal: the worker refused to run; its last stderr line names what it refused and why",
    5: (
        "expected accelerator absent: the kit's kernel census refused because the route it "
        "required is not the route that loaded; its KERNELS line names it"
    ),
}

# Not an exit status (those are 0-255, or a negative signal): a forked worker ended after its
# zygote, the only process that could reap it and read its status, had died.
LOST_EXIT = 256
EXIT_HINTS[LOST_EXIT] = "exit status lost: the zygote that forked this worker died before it, and only it could read it"

# Codes that mean "do not try again until something changes": a refusal and
# an absent accelerator are properties of the install, not of the request.
REFUSAL_CODES = frozenset({3, 5})

_SIGNAL_CAUSES: dict[int, str] = {
    signal.SIGKILL: "often the kernel's OOM killer or a hard kill",
    signal.SIGSEGV: "a crash in native code",
    signal.SIGABRT: "a crash in native code (abort)",
    signal.SIGBUS: "a crash in native code (bus error)",
    signal.SIGFPE: "a crash in native code (arithmetic fault)",
    signal.SIGILL: "a crash in native code (illegal instruction)",
    signal.SIGTERM: "asked to stop (SIGTERM), by the pool or someone else",
    signal.SIGINT: "interrupted (SIGINT)",
}


def exit_hint(rc: int | None) -> str | None:
    """The words for a return code as ``Popen.returncode`` gives it, or None."""
    if rc is None:
        return None
    if rc < 0:
        signum = -rc
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        cause = _SIGNAL_CAUSES.get(signum)
        return f"killed by {name}" + (f": {cause}" if cause else "")
    return EXIT_HINTS.get(rc)


def describe_exit(rc: int | None) -> str:
    """``exit code 3 (refusal: ...)``, ``killed by SIGKILL: ...``, or the bare code."""
    if rc is None:
        return "exit code unknown"
    if rc == LOST_EXIT:
        return EXIT_HINTS[LOST_EXIT]
    hint = exit_hint(rc)
    if rc < 0:
        return hint or f"killed by signal {-rc}"
    return f"exit code {rc}" + (f" ({hint})" if hint else "")
