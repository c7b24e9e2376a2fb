"""Stopping a run: SIGTERM (a preemption notice) and Ctrl-C raise :class:`StopRequested` during
the set-up (nothing to save; exit 75 or 130); from the first step they set a notice the loop
checks (it saves, then stops), and an evaluation before each batch (`StopNotice.agreed`).
Imported before JAX loads: it imports JAX only in functions."""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import importlib.machinery
import logging as std_logging
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

from absl import logging

#: This process's stderr: 2, except while `vit_jax.platform` diverts descriptor 2.
stderr_fd = 2

#: Exit codes after SIGTERM (EX_TEMPFAIL: rerun to resume) and Ctrl-C (128 + SIGINT).
PREEMPTED_EXIT_CODE = 75
INTERRUPTED_EXIT_CODE = 130
#: Seconds a process may run after a set-up stop before the watcher ends it (the main thread is in
#: a long C++ call, or the exception was lost in a callback); 4 times as long in `deferred_stop()`.
STOP_GRACE_S = 5.0
#: Seconds `exit_stopped` gives the announcement (the coordinator may be gone).
ANNOUNCE_S = 1.0
#: The coordination service's key that jax's preemption service sets once a process of a pod gets
#: SIGTERM (XLA's preemption_sync_manager.cc), read by `StopNotice.agreed`.
PREEMPTION_NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"


class StopRequested(BaseException):
  """SIGTERM (``exit_code`` 75) or Ctrl-C (130) before the first step: stop at once (a
  BaseException, so that no library's ``except Exception`` swallows it)."""

  def __init__(self, signal_name: str):
    self.signal = signal_name
    interrupted = signal_name == "SIGINT"
    self.exit_code = INTERRUPTED_EXIT_CODE if interrupted else PREEMPTED_EXIT_CODE
    what = "Interrupted (Ctrl-C)" if interrupted else "Preempted (SIGTERM)"
    super().__init__(f"{what} during the set-up, before the first step: stopped at once with "
                     "nothing saved or half-written; rerun the same command.")


class _Stops:
  """The set-up stop handler's state: open `deferred_stop()` sections, the first signal."""
  deferring = 0
  pending: Optional[str] = None
  retrying = False  # `pending` is raised again: it came during an extension module's set-up.
  received: Optional[str] = None  # Read by `_watch_stops`, even while the main thread is busy.
  jax_sigterm: Optional[bytes] = None  # jax's SIGTERM action, set aside by `hold_sigterm`.
  announce: Optional[Callable[[StopRequested], None]] = None  # See `announce_stops_with`.
  exiting = False  # `exit_process` runs: a second copy of a signal must not raise in it.


def _in_extension_import(frame) -> bool:
  """Whether `frame` runs inside the initialisation of a compiled extension module (jaxlib's MLIR
  bindings build Python enums there): an exception raised there aborts the process (SIGABRT)."""
  while frame is not None:
    if frame.f_code.co_name in ("create_module", "exec_module") and isinstance(
        frame.f_locals.get("self"), importlib.machinery.ExtensionFileLoader):
      return True
    frame = frame.f_back
  return False


def _raise_stop(signum, frame) -> None:
  """Raises :class:`StopRequested` (after open ``deferred_stop()`` sections, and 50 ms on while
  an extension module initialises); one lost in a callback is raised again by
  ``StopNotice.training()``, and ``_watch_stops`` bounds the time."""
  name = signal.Signals(signum).name
  if _Stops.exiting:
    return
  if _Stops.pending == name and not _Stops.retrying:
    return  # A second copy (a pod's supervisor passes SIGTERM on): the first is on its way.
  _Stops.pending = _Stops.pending or name
  _Stops.retrying = False
  if _Stops.deferring:
    return
  if _in_extension_import(frame):
    _raise_again(signum)
    return
  raise StopRequested(_Stops.pending)


def _raise_again(signum: int) -> None:
  """Runs the stop handler for `signum` again in 50 ms, in the main thread."""
  _Stops.retrying = True
  threading.Timer(0.05, _thread.interrupt_main, (signum,)).start()


def stop_in(error: BaseException) -> Optional[StopRequested]:
  """The `StopRequested` in `error`'s __cause__ / __context__ chain (Python 3.11 wraps one raised
  in a `__set_name__`), or None."""
  seen = set()
  while error is not None and id(error) not in seen:
    if isinstance(error, StopRequested):
      return error
    seen.add(id(error))
    error = error.__cause__ or error.__context__
  return None


def received_stop() -> Optional[StopRequested]:
  """The set-up stop this process received (its handler may not have run yet), or None."""
  name = _Stops.pending or _Stops.received
  return StopRequested(name) if name else None


@contextlib.contextmanager
def deferred_stop():
  """A section a set-up stop does not cut short (a file write, the lock): raised at its end."""
  _Stops.deferring += 1
  try:
    yield
  finally:
    _Stops.deferring -= 1
    if not _Stops.deferring and _Stops.pending and (
        signal.getsignal(signal.SIGTERM) is _raise_stop
        or signal.getsignal(signal.SIGINT) is _raise_stop):
      name, _Stops.pending = _Stops.pending, None
      raise StopRequested(name)


def _watch_stops(fd: int, grace_s: float) -> None:
  """Reads the signal numbers Python's C handler writes to `fd` (`signal.set_wakeup_fd`) and
  ends a process still running `grace_s` after a set-up stop."""
  while True:
    try:
      received = os.read(fd, 64)
    except OSError:
      return
    for signum in received:
      if signum not in (signal.SIGTERM, signal.SIGINT) or (
          signal.getsignal(signum) is not _raise_stop):
        continue  # The training loop's notice (it saves the step), or not a stop.
      _Stops.received = _Stops.received or signal.Signals(signum).name
      start = time.monotonic()
      while time.monotonic() - start < (4 * grace_s if _Stops.deferring else grace_s):
        time.sleep(0.05)
      exit_stopped(StopRequested(signal.Signals(signum).name))


def _sigaction(new: Optional[bytes]) -> Optional[bytes]:
  """Sets SIGTERM's action to `new` (bytes this returned before; None: keeps it); returns the one
  replaced, or None where libc cannot be reached."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
  except OSError:
    return None
  old = ctypes.create_string_buffer(512)  # More than any libc's struct sigaction.
  action = None if new is None else ctypes.create_string_buffer(new, len(old))
  if libc.sigaction(signal.SIGTERM, action, old) != 0:
    return None
  return old.raw


def hold_sigterm() -> None:
  """On a pod, after ``jax.distributed.initialize`` took SIGTERM: SIGTERM stops the set-up again
  (``StopNotice.training()`` gives it back to jax's preemption service)."""
  if threading.current_thread() is not threading.main_thread():
    return
  _Stops.jax_sigterm = _sigaction(None)
  if _Stops.jax_sigterm is not None:
    signal.signal(signal.SIGTERM, _raise_stop)


def _give_sigterm_back() -> None:
  if _Stops.jax_sigterm is not None:
    _sigaction(_Stops.jax_sigterm)
    _Stops.jax_sigterm = None


def stop_at_once_on_signals(grace_s: float = STOP_GRACE_S) -> None:
  """From now on SIGTERM and Ctrl-C raise :class:`StopRequested` in the main thread (a watcher
  ends the process after ``grace_s``). Call it first thing, before JAX and TensorFlow load."""
  if threading.current_thread() is not threading.main_thread():
    return
  signal.signal(signal.SIGTERM, _raise_stop)
  signal.signal(signal.SIGINT, _raise_stop)
  previous_hook = sys.unraisablehook

  def stop_in_callback(unraisable):  # E.g. raised in jax's gc callback, which only prints it.
    if isinstance(unraisable.exc_value, StopRequested):  # Raised again, out of the callback.
      _raise_again(signal.Signals[unraisable.exc_value.signal])
      return
    previous_hook(unraisable)

  sys.unraisablehook = stop_in_callback
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)
  signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  threading.Thread(target=_watch_stops, args=(read_fd, grace_s), daemon=True,
                   name="vit_jax-stop-watcher").start()


def announce_stops_with(announce: Callable[[StopRequested], None]) -> None:
  """`exit_stopped` calls ``announce(stop)`` first (a pod: the other processes stop too rather
  than wait for this one in a collective); given at most `ANNOUNCE_S`."""
  _Stops.announce = announce


def exit_stopped(stop: StopRequested, message: Optional[str] = None):
  """Ends the process after a set-up stop: `stop`'s exit code and `message` (default: its line),
  once announced (see `announce_stops_with`). Never returns."""
  _Stops.exiting = True
  if _Stops.announce is not None:
    announcing = threading.Thread(target=_announce, args=(_Stops.announce, stop), daemon=True)
    announcing.start()
    announcing.join(ANNOUNCE_S)
  exit_process(stop.exit_code, message or str(stop))


def _announce(announce: Callable[[StopRequested], None], stop: StopRequested) -> None:
  """``announce(stop)``; an error (the coordinator already gone) is logged at DEBUG, no more."""
  try:
    announce(stop)
  except Exception as e:  # pylint: disable=broad-except
    logging.debug("The stop's announcement failed: %s", e)


def exit_process(code: int, message: Optional[str] = None, *, shutdown: bool = False):
  """``os._exit(code)`` (the teardown can hang on tf.data threads or a lost peer): ``message`` on
  stderr, logs flushed, with ``shutdown`` ``jax.distributed.shutdown()`` first. Never returns."""
  _Stops.exiting = True
  _hold_the_log()
  try:
    if message:
      sys.stderr.flush()
      os.write(stderr_fd, (message.rstrip("\n") + "\n").encode())
    if shutdown and "jax" in sys.modules:
      import jax  # pylint: disable=g-import-not-at-top
      if getattr(jax.distributed, "is_initialized", lambda: False)():
        jax.distributed.shutdown()
  except Exception as e:  # pylint: disable=broad-except
    sys.stderr.write(f"(jax.distributed.shutdown: {e})\n")
  finally:
    logging.flush()
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except (OSError, ValueError):
        pass
    os._exit(code)  # pylint: disable=protected-access


def _hold_the_log(wait_s: float = 1.0) -> None:
  """Flushes every log handler and keeps its lock (waiting at most ``wait_s`` for each), so that
  no other thread's log line follows the exit's message: a pod's watcher thread ends the process
  while the main thread may still be logging."""
  loggers = [std_logging.getLogger(), *(
      logger for logger in std_logging.Logger.manager.loggerDict.values()
      if isinstance(logger, std_logging.Logger))]
  handlers = {handler for logger in loggers for handler in logger.handlers}
  handlers |= {handler.python_handler for handler in handlers  # absl's handles through it.
               if isinstance(handler, logging.ABSLHandler)}
  for handler in handlers:
    if handler.lock is not None and not handler.lock.acquire(timeout=wait_s):
      continue  # Held by a thread stuck in a write: its line may still follow.
    try:
      handler.flush()
    except Exception:  # pylint: disable=broad-except  (a closed stream: nothing to flush)
      pass


def peer_lost_message(error: BaseException, workdir: str, latest_step: Optional[int]) -> str:
  """The FATAL line of a multi-process run whose collective failed (`error`), saying what to do."""
  import jax  # pylint: disable=g-import-not-at-top
  first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
  kept = (f"the checkpoint of step {latest_step} in {workdir} is intact" if latest_step
          is not None else f"there is no checkpoint in {workdir} yet")
  return (f"FATAL: Process {jax.process_index()} of {jax.process_count()}: the run lost another "
          f"process ({type(error).__name__}: {first}); its log says why it ended. Stopped; "
          f"{kept}: rerun the same command on every process to resume.")


def _nothing() -> None:
  pass


class StopNotice(threading.Event):
  """Set by SIGTERM or a first Ctrl-C from the first step on; `signal` names which."""

  def __init__(self):
    super().__init__()
    self.signal: Optional[str] = None
    self._on_training = _nothing

  def notify(self, name: str) -> None:
    """Sets the event; the first signal names it ('SIGTERM' or 'SIGINT')."""
    if not self.is_set():
      self.signal = name
      self.set()

  def training(self) -> None:
    """The first step is done: a notice now saves the step, then stops. Raises StopRequested
    for a set-up stop whose exception was lost."""
    if _Stops.pending and self._on_training is not _nothing:
      raise StopRequested(_Stops.pending)
    self._on_training()
    self._on_training = _nothing

  def agreed(self) -> bool:
    """Whether this process or, on a pod, any process has the notice (`PREEMPTION_NOTICE_KEY`):
    one all-gather, so call it at the same point on every process (e.g. before each eval batch)."""
    import jax  # pylint: disable=g-import-not-at-top
    if jax.process_count() == 1:
      return self.is_set()
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    local = self.is_set() or _preemption_noticed()
    return bool(np.any(multihost_utils.process_allgather(np.array(local))))


def _preemption_noticed() -> bool:
  """Whether jax's preemption service of a pod recorded a SIGTERM (`PREEMPTION_NOTICE_KEY`)."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  client = getattr(distributed.global_state, "client", None)
  try:
    return client is not None and client.key_value_try_get(PREEMPTION_NOTICE_KEY) is not None
  except Exception:  # pylint: disable=broad-except  (NOT_FOUND; a lost coordinator: see pod.py)
    return False


@contextlib.contextmanager
def stop_notice():
  """Yields a :class:`StopNotice` (handlers restored after): until ``training()`` signals raise
  :class:`StopRequested`, then SIGTERM and a first Ctrl-C set it. On a pod SIGTERM is jax's
  preemption service's from the first step and Ctrl-C keeps Python's default."""
  import jax  # pylint: disable=g-import-not-at-top  (not at import: imported before JAX loads)
  notice = StopNotice()
  if threading.current_thread() is not threading.main_thread():
    yield notice
    return
  pod = jax.process_count() > 1
  signals = (signal.SIGINT,) if pod else (signal.SIGTERM, signal.SIGINT)
  previous = {sig: signal.getsignal(sig) for sig in signals}

  def on_interrupt(*_):
    logging.warning("Ctrl-C: saving the current step, then stopping; Ctrl-C again stops at once "
                    "(a rerun then resumes from the latest checkpoint).")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    notice.notify("SIGINT")

  def on_training():
    if pod:
      signal.signal(signal.SIGINT, signal.default_int_handler)
      _give_sigterm_back()
      return
    signal.signal(signal.SIGTERM, lambda *_: notice.notify("SIGTERM"))
    signal.signal(signal.SIGINT, on_interrupt)

  notice._on_training = on_training  # pylint: disable=protected-access
  for sig in signals:
    signal.signal(sig, _raise_stop)
  try:
    yield notice
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
    _Stops.pending = _Stops.received = None  # Read (or lost with a run that ended otherwise).
    _Stops.retrying = False
