"""What a client knows of one lease, and what each way a call through it can end means.

Shared by ``Pool``'s sessions (client.py) and ``AsyncPool``'s (aio/): they differ only in how they wait for a
socket, never in what a reply or a broken exchange means, nor in what the caller is told.
"""

from __future__ import annotations

import os
import time
from typing import Any

from . import arrays
from . import priority as order
from .errors import RequestTimeout, ResidentPoolError, WorkerRequestError, error_from_dict
from .messages import Release, Used
from .protocol import Inbox, PeerError, ProtocolError

__all__ = ["EXITING", "KEPT_BUFFER_BYTES", "NOTICE_S", "RECALLED_RETRIES", "Held", "failure"]

# A kept lease tells the pool it is in use at most this often: idle retirement counts in seconds, and a
# message per call would cost the pool a decode and its lock for every prediction.
NOTICE_S = 1.0
RECALLED_RETRIES = 5
# What a kept lease keeps of reused array buffers between calls (its own and the worker's it maps): small arrays
# sent call after call stay fast; bigger ones are given back as the call returns (docs/arrays.md).
KEPT_BUFFER_BYTES = 16 << 20
# What Held._outcome gives for a worker that said it exits: its client ends the lease and raises what the pool says.
EXITING = object()


def failure(exc: BaseException) -> str:
    """How an exchange with the worker that raised ``exc`` ends its lease: ``peer`` (the socket is another user's:
    given back as unused), ``bad_reply`` (an answer that cannot be read), ``timeout``, ``broken`` (the connection
    failed), or ``abandoned`` (interrupted: Ctrl-C, a cancelled task), the pool's release outcome for each."""
    if isinstance(exc, PeerError):
        return "peer"
    if isinstance(exc, ProtocolError):
        return "bad_reply"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, OSError):
        return "broken"
    return "abandoned"


class Held:
    """One lease as its client holds it: what the pool granted, what it served, what each reply and each failed
    exchange does to it, and the errors it raises. A client's session adds how it talks: ``_tell`` the pool a line
    that has no answer, find (``_cached_worker``) and drop (``_forget_worker``) its connection to the worker."""

    lease: dict[str, Any]
    _ended: bool
    _forks: int  # the process it was opened in (client._Process.forks then)
    _inbox: Inbox | None  # of the connection its last request went on
    _reacquire: Any  # how a backfilled session acquires again (None: it never does)

    def _tell(self, message: dict[str, Any]) -> None:
        """Send the pool a line that has no answer, without waiting; a pool that is gone is no error here (the
        lease went with its connection)."""
        raise NotImplementedError

    def _cached_worker(self) -> tuple[Any, Inbox] | None:
        raise NotImplementedError

    def _forget_worker(self) -> None:
        raise NotImplementedError

    def _opened_here(self) -> bool:
        raise NotImplementedError

    def _hold(self, lease: dict[str, Any], wait: dict[str, Any] | None) -> None:
        self.lease = lease
        self.wait = wait  # the last report of its wait for GPU admission (None: it did not wait for memory)
        self.slug: str = lease["slug"]
        self.pid: int = lease["pid"]
        self.replica: int = lease["replica"]
        self.cold: bool = lease["cold"]
        self.transcript: str = lease["transcript"]
        self.version: str | None = lease.get("version")
        self.token: str | None = lease.get("token")
        self.priority: str = lease.get("priority", order.DEFAULT)
        self.backfilled: bool = bool(lease.get("backfilled"))
        self.served = 0
        self._unnoticed = 0  # served since the pool last heard (a kept lease tells it now and then)
        self.queue_wait_s: float | None = None  # its last request's wait in a batching worker's queue
        self._noticed_at = -NOTICE_S  # the first call tells at once: a waiting client may then take it back

    def _renews(self) -> bool:
        """A backfilled session's lease may be taken back (every other session's never is): it acquires again."""
        return self.backfilled and self._reacquire is not None

    def _request(self, request_id: int, payload: Any) -> dict[str, Any]:
        message = {"op": "predict", "id": request_id, "payload": payload, "priority": self.priority}
        if self.token is not None:
            message["lease"] = self.token  # a lease the pool took back is refused by the worker
        return message

    def _notice_due(self) -> int | None:
        """The requests to tell the pool of now (at most once a second, a kept lease's), or None: not yet."""
        now = time.monotonic()
        if now - self._noticed_at < NOTICE_S or self._ended:
            return None
        self._noticed_at, served, self._unnoticed = now, self._unnoticed, 0
        return served

    def _answered(self, reply: dict[str, Any] | None, request_id: int) -> dict[str, Any]:
        """``reply`` if it answers ``request_id``; a connection closed instead, or an answer to another request, is
        an exchange that broke (ConnectionResetError, ProtocolError)."""
        if reply is None:
            raise ConnectionResetError("the worker closed the connection without a reply")
        if reply.get("id") != request_id:
            raise ProtocolError(f"the worker answered request {reply.get('id')!r}, not {request_id}")
        return reply

    def _outcome(self, reply: dict[str, Any]) -> Any:
        """What the worker's reply means for the caller: its result, or the error raised; ``EXITING`` for a worker
        that said it exits (the lease is ended, and what the pool answers to that is the caller's error)."""
        if reply.get("reason") == "lease_recalled":
            self._ended = True  # the pool ended it already: nothing to release
            raise self._recalled_error()
        if reply.get("reason") == "worker_stopping":
            self._forget_worker()
            self.release()
            raise self._stopping_error()
        self.served += 1
        wait = reply.get("queue_wait_s")  # a batching worker says how long the request waited in its queue
        self.queue_wait_s = float(wait) if isinstance(wait, int | float) and not isinstance(wait, bool) else None
        self._unnoticed += 1
        if reply.get("ok"):
            return reply.get("result")
        if reply.get("reason") == "worker_exiting":
            self._forget_worker()
            return EXITING
        raise self._failed_error(reply)

    def _dropped(self, kind: str) -> bool:
        """What an exchange that failed (``failure``'s ``kind``) does to this lease before the caller hears: True
        when the pool is to be told, and its answer waited for (the session's ``_end(kind)``)."""
        if kind == "peer":
            self.release()
            return False
        self._forget_worker()
        if kind in ("timeout", "broken"):
            return True
        # Told without waiting for an answer: a bad reply costs no more than its round trip, and an interrupted
        # request (Ctrl-C, a cancelled task) may still be computing: its reply may still come on the connection
        # just dropped, and the pool drains the worker before anyone else gets it.
        self._ended = True
        self._tell(Release(self.lease["lease"], kind, self._unnoticed).to_message())
        return False

    def notice(self) -> None:
        """Tell the pool, at most once a second and without waiting, that this kept lease is in use."""
        served = self._notice_due()
        if served is not None:
            self._tell(Used(self.lease["lease"], served, self.queue_wait_s).to_message())

    def _close_buffers(self) -> None:
        """The session's reused buffers go with it: a connection that carried any is closed, so the worker
        lets go of its mappings of them and of its own reply buffers too."""
        cached = self._cached_worker()
        if cached is not None and cached[1].holds_buffers():
            self._forget_worker()

    def trim(self) -> None:
        """After a call of a kept lease: reused buffers past KEPT_BUFFER_BYTES go with their connection (the worker
        then lets go of its mappings of this side's and of its own answer buffers); the next call connects again."""
        inbox = self._inbox  # no lookup on the way out of a call that sent no array (most calls)
        if inbox is None or (inbox.slabs is None and not inbox.mappings.entries):
            return
        if inbox.buffer_bytes() > KEPT_BUFFER_BYTES:
            self._forget_worker()
            self._inbox = None

    def release(self) -> None:
        """Give the lease back (once; never from a forked child's copy: the parent gives its lease back)."""
        if self._ended or not self._opened_here():
            return
        self._close_buffers()
        self._ended = True
        self._tell(Release(self.lease["lease"], "ok", self._unnoticed).to_message())

    def _check_usable(self) -> None:
        if not self._opened_here():  # its lease and its connections are the parent's, which may still use them
            raise self._forked_error(os.getpid())
        if self._ended:
            raise self._ended_error()

    # -- what the caller is told ---------------------------------------------------------------------------
    def _forked_error(self, pid: int) -> WorkerRequestError:
        return WorkerRequestError(f"{self.slug}: this session was opened before this process was forked (pid "
                                  f"{pid}); its lease is the parent's: open a session in this process",
                                  slug=self.slug, reason="session_forked")

    def _ended_error(self) -> WorkerRequestError:
        return WorkerRequestError(f"{self.slug}: this session has ended; open a new one", slug=self.slug,
                                  reason="session_ended")

    def _taken_back_too_often(self) -> WorkerRequestError:
        return WorkerRequestError(f"{self.slug}: this backfilled session's lease was taken back {RECALLED_RETRIES} "
                                  "times in a row; the card is busy with requests ahead of it: retry",
                                  slug=self.slug, reason="lease_recalled")

    def _recalled_error(self) -> WorkerRequestError:
        return WorkerRequestError(f"{self.slug}: the pool took this lease back (another request waited); "
                                  "acquire again", slug=self.slug, reason="lease_recalled")

    def _stopping_error(self) -> WorkerRequestError:
        """The worker was told to stop before it read the request, and answered it unrun: a kept lease acquires
        again unseen (Pool.predict), a backfilled session likewise, any other session hears it and may send it
        again."""
        if self.lease.get("kept") or self._renews():
            return WorkerRequestError(f"{self.slug}: this lease's worker is stopping; acquire again",
                                      slug=self.slug, reason="lease_recalled")
        return WorkerRequestError(
            f"{self.slug}: the worker (pid {self.pid}) was stopping and did not run this request; send it again "
            f"(transcript {self.transcript})", slug=self.slug, reason="worker_stopping", transcript=self.transcript)

    def _failed_error(self, reply: dict[str, Any]) -> WorkerRequestError:
        return WorkerRequestError(
            f"{self.slug}: request failed: {reply.get('error')} (transcript {self.transcript})",
            slug=self.slug, reason=str(reply.get("reason") or "request_failed"), transcript=self.transcript,
            details={"traceback": reply.get("traceback")},
        )

    def _failure_error(self, kind: str, exc: BaseException, sent: bool, timeout: float,
                       answer: dict[str, Any]) -> BaseException | None:
        """The error a caller gets for an exchange that ended in ``exc`` (``failure(exc)`` is ``kind``; ``answer``:
        the pool's to the release, where it was asked), or None: ``exc`` itself goes on (an interruption).

        ``sent=False``: no request had gone yet (connecting, negotiating)."""
        cause: BaseException | None = exc
        if kind == "peer":
            error: BaseException = ResidentPoolError(f"{self.slug}: {exc}", slug=self.slug, reason="peer_not_you")
            cause = None
        elif kind == "bad_reply":
            # The worker answered in a form this side cannot read (not JSON, an attachment that is no sealed memfd,
            # a reply to another request): its connection went, and the pool checks the worker (a ping) before it
            # serves again.
            ran = "the request may have run" if sent else "the request did not run"
            error = WorkerRequestError(
                f"{self.slug}: its worker (pid {self.pid}) sent a reply that cannot be read ({exc}); {ran}; "
                f"transcript {self.transcript}", slug=self.slug, reason="bad_reply", transcript=self.transcript,
                details={"protocol_error": str(exc)[:500]})
            cause = None
        elif kind == "timeout":
            error = RequestTimeout(self._timeout_words(timeout, answer.get("stopped", True)), slug=self.slug,
                                   transcript=self.transcript, details={"timeout_s": timeout, "pid": self.pid})
        elif kind == "broken":
            error = self._broken_error(exc, sent, answer)
        else:
            return None
        error.__cause__, error.__suppress_context__ = cause, True
        return error

    def _timeout_words(self, timeout: float, stopped: bool) -> str:
        if stopped:
            return (f"{self.slug}: a request outran request_timeout_s = {timeout:g} s; its worker (pid {self.pid}) was "
                    f"stopped and the next request starts a fresh one; transcript {self.transcript}")
        # A batching worker's request may wait in its queue behind other callers' model calls: the pool stops the
        # worker only when a model call itself outruns the limit.
        return (f"{self.slug}: a request outran request_timeout_s = {timeout:g} s waiting in its shared worker's queue "
                f"(pid {self.pid}); no model call outran the limit, so the worker serves on. The request may still "
                f"run there, its answer unread: send it again if it is safe to repeat. If waits this long are usual, "
                f"raise request_timeout_s, lower [batching] max_callers, or set max_queue_wait_s so the pool starts "
                f"another replica sooner; transcript {self.transcript}")

    def _broken_error(self, exc: BaseException, sent: bool, answer: dict[str, Any]) -> BaseException:
        unsent = not sent or isinstance(exc, arrays.NotSent)
        recalled = self.lease.get("kept") or (self.backfilled and answer.get("gone"))
        if recalled and unsent:
            # Between calls of a kept lease the pool took it back, or its worker ended (died, stopped), or the
            # pool took a backfilled session's lease back (it says "gone") and evicted its worker: the request
            # never reached a worker, so Pool.predict (or the session) acquires again and sends it there. (One
            # that broke after it was sent may have run, or killed its worker: that is the caller's to hear.)
            return WorkerRequestError(f"{self.slug}: this lease's worker is gone; acquire again",
                                      slug=self.slug, reason="lease_recalled")
        if answer.get("error"):
            return error_from_dict(answer["error"])
        if unsent:
            return WorkerRequestError(
                f"{self.slug}: could not reach its worker (pid {self.pid}): {type(exc).__name__}: {exc}; the "
                f"request did not run (transcript {self.transcript})", slug=self.slug,
                reason="worker_unreachable", transcript=self.transcript)
        return WorkerRequestError(
            f"{self.slug}: the connection to its worker (pid {self.pid}) broke after the request was sent "
            f"({type(exc).__name__}: {exc}); the request may have run. Send it again if it is safe to repeat "
            f"(transcript {self.transcript}: what the worker did)", slug=self.slug, reason="connection_broken",
            transcript=self.transcript)
