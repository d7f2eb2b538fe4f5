"""Stopping a run on a signal: the first Ctrl-C or SIGTERM stops it after the current iteration (with a
checkpoint), a second aborts it at once, and neither is lost where Python would lose it.

Python loses signals in two places. It runs a handler once for a signal delivered several times while the
main thread was inside one C++ call (:class:`StopFlag` counts deliveries instead), and it drops an exception
raised where nothing can catch it, so a KeyboardInterrupt raised by a handler that happened to run in a
``__del__`` or a weakref callback (:func:`dropped_interrupts_raised_again` raises it again).
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from textgym import _is_cli
from textgym.launch import (
    ABORT_SIGNAL,
    DEATH_SIGNAL,
    INTERRUPT_SIGNAL,
    LAUNCHED_VAR,
    LAUNCHER_PID_VAR,
    STOP_SIGNAL,
    rank,
)

__all__ = ["StopFlag", "dropped_interrupts_raised_again"]


class StopFlag:
    """First Ctrl-C or SIGTERM: finish the current iteration, save, exit. A second one: abort at once.

    Signals are counted as they are delivered, not as Python runs the handler. Python runs a handler once for
    a signal delivered any number of times while the main thread was inside one C++ call (a long forward, a
    collective waiting for another process), which turned a double Ctrl-C into a single one. Its C-level
    handler writes a byte per delivery to the wakeup fd: textgym reads the count there (where no other wakeup
    fd is set, and the platform has non-blocking pipes; else it counts the handler's runs).

    A process started by textgym's launcher (``run.processes = N``) also takes ``STOP_SIGNAL`` (SIGUSR1), a
    stop that does not count towards an abort, and ``ABORT_SIGNAL`` (SIGUSR2): the launcher passes on its
    first SIGTERM as the one and its second as the other, since the processes may have had the same SIGTERM
    themselves (one sent to the whole process group), and a first SIGINT as ``INTERRUPT_SIGNAL``, the same
    stop said as a Ctrl-C. ``DEATH_SIGNAL`` (on Linux) is the same stop, said as the launching process's
    death (``launch.follow_the_launcher``).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.stop = False
        self.handled = 0  # the handler's runs
        self.delivered = 0  # the signals delivered, read from the wakeup pipe
        self._pipe: tuple[int, int] | None = None
        self._previous: dict[int, Any] = {}  # the handlers before __enter__, put back by close()

    def __enter__(self) -> StopFlag:
        global _counting
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        if STOP_SIGNAL is not None and ABORT_SIGNAL is not None and os.environ.get(LAUNCHED_VAR):
            self._previous[STOP_SIGNAL] = signal.signal(STOP_SIGNAL, self._stop_from_launcher)
            if INTERRUPT_SIGNAL not in (None, STOP_SIGNAL):
                self._previous[INTERRUPT_SIGNAL] = signal.signal(
                    INTERRUPT_SIGNAL, self._interrupt_from_launcher
                )
            self._previous[ABORT_SIGNAL] = signal.signal(ABORT_SIGNAL, _abort)
            if DEATH_SIGNAL is not None:
                self._previous[DEATH_SIGNAL] = signal.signal(DEATH_SIGNAL, self._launcher_died)
        try:
            read, write = os.pipe()
        except OSError:
            return self
        try:  # (no os.set_blocking on Windows before Python 3.12: there the handler's runs are counted)
            os.set_blocking(read, False)
            os.set_blocking(write, False)
            theirs = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except (AttributeError, OSError, ValueError):
            theirs = None
        if theirs == -1:
            self._pipe = (read, write)
            _counting = self
            return self
        if theirs is not None:  # someone else's (an asyncio loop, say) stays
            signal.set_wakeup_fd(theirs)
        os.close(read)
        os.close(write)
        return self

    def signals(self) -> int:
        """How many SIGINT and SIGTERM this process was sent since ``__enter__``."""
        if self._pipe is not None:
            try:
                while data := os.read(self._pipe[0], 512):
                    self.delivered += sum(byte in self.SIGNALS for byte in data)
            except BlockingIOError:
                pass
        return max(self.handled, self.delivered)

    def _handle(self, signum: int, frame: Any) -> None:
        self.handled += 1
        if self.signals() >= 2:
            _abort(signum, frame)
        self._stop("Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name)

    def _stop_from_launcher(self, signum: int, frame: Any) -> None:
        self._stop("SIGTERM")  # one the launcher passed on

    def _interrupt_from_launcher(self, signum: int, frame: Any) -> None:
        self._stop("Ctrl-C")  # a SIGINT the launcher passed on

    def _launcher_died(self, signum: int, frame: Any) -> None:  # (launch.follow_the_launcher)
        self._stop(f"the launching process ({os.environ.get(LAUNCHER_PID_VAR, '?')}) ended")

    def _stop(self, name: str) -> None:
        if self.stop:
            return
        self.stop = True
        if rank() == 0:  # every process gets the signal; the main one says what happens
            print(
                f"\ntextgym: {name}: stopping after this iteration and saving a checkpoint (again to abort)",
                flush=True,
            )

    def __exit__(self, *exc: Any) -> None:
        # After a first signal another one aborts at once (one line, exit 130), also while the final
        # checkpoint is written: SIGTERM's default handler would kill without a word. The count goes on until
        # close().
        for s, previous in self._previous.items():
            if s in (STOP_SIGNAL, INTERRUPT_SIGNAL, DEATH_SIGNAL):
                signal.signal(s, signal.SIG_IGN if self.stop else previous)  # (stopping already)
            else:
                signal.signal(s, _abort if self.stop else previous)

    def close(self) -> None:
        """The run is over: the count stops. Called from Python (a script, a notebook), the handlers in force
        before ``__enter__`` are back, where a handler textgym set is still in force. The textgym command
        keeps a stopped run's until it exits: its process ends with the run, and a second signal arriving
        late (one a launcher passes on, one sent to the whole process group) aborts in one line instead of
        killing it without a word, or with an exit code its launcher takes for a failure."""
        global _counting
        if not _is_cli():
            ours = (
                self._handle,
                self._stop_from_launcher,
                self._interrupt_from_launcher,
                self._launcher_died,
                _abort,
                signal.default_int_handler,
                signal.SIG_IGN,
            )
            for s, previous in self._previous.items():
                if signal.getsignal(s) in ours:
                    signal.signal(s, previous)
        self._previous = {}
        if self._pipe is None:
            return
        read, write = self._pipe
        current = signal.set_wakeup_fd(-1)
        if current not in (write, -1):  # set by someone since: theirs stays
            signal.set_wakeup_fd(current)
        os.close(read)
        os.close(write)
        self._pipe = None
        _counting = None


_counting: StopFlag | None = None  # the flag whose pipe is the wakeup fd


def _forget_in_child() -> None:
    """A forked child (a plugin's worker pool) keeps the wakeup fd: its own signals would count as this
    process's, and one Ctrl-C to the group would abort the run. The child stops counting."""
    global _counting
    if _counting is not None and _counting._pipe is not None:
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(-1)
        for fd in _counting._pipe:
            with contextlib.suppress(OSError):
                os.close(fd)
        _counting._pipe = None
    _counting = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _abort(signum: int, frame: Any) -> None:
    for s in StopFlag.SIGNALS:  # the abort is under way: another signal is no news
        signal.signal(s, signal.default_int_handler)
    raise KeyboardInterrupt


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (``timeout``, ``docker stop``, a batch scheduler) acts as a Ctrl-C while it is active: outside a
    training loop (whose :class:`StopFlag` handles both, and gives this handler back) it aborts through
    ``KeyboardInterrupt``, so a run stopped while it starts up is cleaned up as after a Ctrl-C. By default
    SIGTERM killed the process without a word, and left a run directory the same command then refused."""
    try:
        theirs = signal.signal(signal.SIGTERM, _terminated)
    except ValueError:  # not in the main thread: signals are not ours to handle
        yield
        return
    try:
        yield
    finally:
        # where a stopped run left its abort handler in place (the command keeps it until it exits: a late
        # second signal is one line, not a silent kill), it stays
        if signal.getsignal(signal.SIGTERM) is _terminated:
            signal.signal(signal.SIGTERM, theirs)


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def dropped_interrupts_raised_again() -> Iterator[None]:
    """Python drops an exception raised where nothing can catch it (a weakref callback, a ``__del__``) with an
    'Exception ignored' message. A Ctrl-C whose handler happens to run there is lost: the second Ctrl-C that
    should abort a training run then only stopped it after the iteration, with exit code 0 (seen once, in
    importlib's module-lock callback during a lazy import). Here a dropped KeyboardInterrupt is raised again
    in the main thread a moment later, once it is out of that callback."""
    previous = sys.unraisablehook
    timers: list[threading.Timer] = []

    def hook(unraisable: Any) -> None:
        if unraisable.exc_type is None or not issubclass(unraisable.exc_type, KeyboardInterrupt):
            previous(unraisable)
            return
        # the SIGINT handler raises KeyboardInterrupt; should it run in a dropping callback again, it is here again
        while True:
            try:
                timer = threading.Timer(0.001, _thread.interrupt_main)
                timer.daemon = True
                timers.append(timer)
                timer.start()
                return
            except KeyboardInterrupt:  # one raised again landed in this hook, which would drop it too
                continue

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous
        for timer in timers:
            timer.cancel()
        if timers:
            _join_quietly(timers)


def _join_quietly(timers: list[threading.Timer]) -> None:
    """Wait for cancelled timers: one already firing interrupts into a handler that does nothing, not after
    the command returned (the command ended)."""
    try:
        try:
            theirs = signal.signal(signal.SIGINT, _ignore)
        except ValueError:  # not in the main thread
            theirs = None
        try:
            for timer in timers:
                # (one a Ctrl-C stopped before it started cannot be joined, and never fires)
                with contextlib.suppress(RuntimeError):
                    timer.join()
            _handlers_run()
        finally:
            if theirs is not None:
                signal.signal(signal.SIGINT, theirs)
    except KeyboardInterrupt:  # one delivered before the handler changed
        pass


def _ignore(signum: int, frame: Any) -> None:
    pass


def _handlers_run() -> None:
    """A Python call: signal handlers pending in the main thread run at its start."""
