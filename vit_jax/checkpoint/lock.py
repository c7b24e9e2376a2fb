"""One run per workdir: ``WORKDIR/lock.json``, taken before a run writes anything, held for
its life, naming its holder (the protocol: docs/failures.md, "two runs on one workdir"). Local:
a ``fcntl.flock``; release unlinks while holding, and a taker checks the file it locked is still
the one at the path, so they never race. Remote: a heartbeat; write, wait ``settle_s``, read back
(the record there wins); host clocks are assumed synchronised.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any, Dict, Optional

import jax
from jax.experimental import multihost_utils
import numpy as np

from vit_jax import rundir
from vit_jax import storage
from vit_jax.checkpoint import durable

_log = logging.getLogger('absl')


class WorkdirInUseError(RuntimeError):
  """Another live run holds the workdir's lock; the message names it and what to do."""


def _process_start(pid: int) -> Optional[str]:
  """The start time of process ``pid`` (Linux clock ticks; tells a reused pid apart), or None."""
  try:
    with open(f'/proc/{pid}/stat', 'rb') as f:
      stat = f.read().decode('ascii', 'replace')
    return stat.rsplit(')', 1)[1].split()[19]  # Field 22 of proc(5), after the command name.
  except (OSError, IndexError):
    return None


def process_alive(pid: Any, start: Any = None) -> bool:
  """Whether process ``pid`` (an int > 0) of this host runs (another user's too) and, with
  ``start`` (:func:`_process_start`'s), is the one that started then."""
  if not isinstance(pid, int) or pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # Exists, another user's.
  return start is None or _process_start(pid) in (None, start)


def _record(token: str, timeout_s: float) -> Dict[str, Any]:
  now = time.time()
  return {
      'host': socket.gethostname(), 'pid': os.getpid(), 'pid_start': _process_start(os.getpid()),
      'started': datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(
          timespec='seconds'),
      'started_unix': now, 'heartbeat_unix': now, 'timeout_s': timeout_s, 'command': _command(),
      'token': token,
  }


def _command() -> str:
  """This process's command line, ``python -m <module>`` for a module run as a program."""
  spec = getattr(sys.modules.get('__main__'), '__spec__', None)
  module = spec.name.removesuffix('.__main__') if spec is not None and spec.name else None
  program = f'python -m {module}' if module else ' '.join(sys.argv[:1])
  return ' '.join([program, *sys.argv[1:]])[:1000]


def describe(record: Optional[Dict[str, Any]]) -> str:
  """The holder of a lock in words: host, pid, start time (and how long ago), command."""
  if not record:
    return 'a run that left no record'
  started = record.get('started_unix')
  ago = f', {_duration(time.time() - started)} ago' if isinstance(started, (int, float)) else ''
  return (f"host {record.get('host', '?')}, pid {record.get('pid', '?')}, started "
          f"{record.get('started', '?')}{ago}: {record.get('command') or '?'}")


def _duration(seconds: float) -> str:
  seconds = max(0, int(seconds))
  if seconds < 120:
    return f'{seconds} s'
  if seconds < 7200:
    return f'{seconds // 60} min'
  return f'{seconds / 3600:.1f} h'


def _parse(text: str) -> Optional[Dict[str, Any]]:
  try:
    record = rundir.parse_json(text, rundir.LOCK_JSON)
  except ValueError:
    return None
  return record if isinstance(record, dict) else None


class WorkdirLock:
  """The lock of ``workdir`` (local, created if missing, or ``gs://``); a context manager.
  ``timeout_s``, ``settle_s``: a heartbeat's staleness age and read-back wait (s);
  ``heartbeat``: default for remote paths and filesystems without flock."""

  def __init__(self, workdir: str, *, timeout_s: float = 600.0, settle_s: float = 2.0,
               heartbeat: Optional[bool] = None):
    self.workdir = workdir
    self.timeout_s = float(timeout_s)
    self.settle_s = float(settle_s)
    remote = storage.is_remote(workdir)
    self.heartbeat = remote if heartbeat is None else bool(heartbeat)
    self.path = storage.join(storage.absolute(workdir), rundir.LOCK_JSON)
    self._token = uuid.uuid4().hex
    self._fd: Optional[int] = None
    self._created: list[str] = []  # Local directories this lock created.
    self._stop = threading.Event()
    self._heartbeat: Optional[threading.Thread] = None
    self.held = False

  def __enter__(self) -> 'WorkdirLock':
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release(remove_created_dirs=exc[0] is not None)

  def _in_use(self, holder: Optional[Dict[str, Any]], why: str = '') -> WorkdirInUseError:
    # A flock is held by a live process only; a heartbeat lock may outlive its run.
    gone = (f' If that run is gone (e.g. its machine was lost), its lock is taken over once its '
            f'heartbeat is {self.timeout_s:g} s old, or delete {self.path}.'
            if self.heartbeat else '')
    return WorkdirInUseError(
        f'--workdir {self.workdir} is in use by another run ({describe(holder)}){why}. Two runs '
        'in one workdir would overwrite each other\'s checkpoints: wait for it to finish or stop '
        f'it, or choose another --workdir.{gone}')

  def acquire(self) -> None:
    """Takes the lock (a stale one with a WARNING naming its holder). Raises
    WorkdirInUseError (naming the live holder) or OSError (the lock file cannot be written or is
    no file)."""
    local = not storage.is_remote(self.workdir)
    if local:
      self._make_dirs()
    try:
      if local and os.path.lexists(self.path) and not os.path.isfile(self.path):
        what = 'a directory' if os.path.isdir(self.path) else 'not a regular file'
        raise PermissionError(f'The workdir lock {self.path} is {what}: remove it (it is no '
                              'run\'s lock; a run writes lock.json as a file), then rerun.')
      if not self.heartbeat:
        try:
          self._acquire_local()
        except OSError as e:
          if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
          _log.warning('%s: no file locks on this filesystem (%s); holding the lock by '
                       'heartbeat.', self.path, e.strerror)
          self.heartbeat = True
      if self.heartbeat:
        self._acquire_heartbeat()
    except BaseException:
      self._remove_created_dirs()
      raise
    self.held = True

  def live_holder(self) -> Optional[Dict[str, Any]]:
    """The record of the live run holding this lock (``{}``: unreadable), else None (no lock, or
    a stale one that :meth:`acquire` takes over); takes and writes nothing."""
    if not self.heartbeat:
      import fcntl  # pylint: disable=g-import-not-at-top  (POSIX only)
      try:
        fd = os.open(self.path, os.O_RDONLY)
      except (FileNotFoundError, NotADirectoryError):
        return None
      try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # Released by the close.
        return None
      except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
          return _parse(_read_fd(fd)) or {}
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP):
          raise
      finally:
        os.close(fd)
    holder = self._read_record() if storage.exists(self.path) else None  # A heartbeat lock.
    if holder is None:
      return None
    own = holder.get('timeout_s')  # The holder's staleness age, where longer than ours.
    if not isinstance(own, (int, float)):
      own = 0
    longest = max(self.timeout_s, own)
    return None if self._is_stale(holder, longest) else holder

  def _make_dirs(self) -> None:
    missing = []
    path = os.path.dirname(self.path)
    while not os.path.isdir(path):
      missing.append(path)
      path = os.path.dirname(path)
    for directory in reversed(missing):
      with contextlib.suppress(FileExistsError):
        os.mkdir(directory)
        self._created.append(directory)
    above = self._created[:-1]  # Folders above the workdir: a mistyped path, perhaps.
    if above:
      _log.warning("Created the workdir %s and the folders above it, which did not exist: %s.",
                   self._created[-1], ", ".join(above))

  def _acquire_local(self) -> None:
    import fcntl  # pylint: disable=g-import-not-at-top  (POSIX only)
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        holder = _parse(_read_fd(fd))
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
          raise self._in_use(holder) from None
        raise
      try:  # Still the file at the path (not one a releasing run just unlinked)?
        same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
      except FileNotFoundError:
        same = False
      if same:
        break
      os.close(fd)
    previous = _parse(_read_fd(fd))
    if previous:
      _log.warning('Taking over the lock of %s: a run that ended without releasing it (killed, '
                   'or its machine lost); its checkpoints are resumed from.', describe(previous))
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_record(self._token, self.timeout_s), indent=1).encode(), 0)
    os.fsync(fd)
    self._fd = fd

  def _read_record(self) -> Optional[Dict[str, Any]]:
    try:
      data = storage.read_bytes(self.path, rundir.MAX_JSON_BYTES + 1)
      return _parse(data.decode('utf-8', 'replace'))
    except (OSError, ValueError):
      return None if not storage.exists(self.path) else {}

  def _is_stale(self, record: Dict[str, Any], timeout_s: Optional[float] = None) -> bool:
    heartbeat = record.get('heartbeat_unix')
    timeout_s = self.timeout_s if timeout_s is None else timeout_s
    if not isinstance(heartbeat, (int, float)) or time.time() - heartbeat > timeout_s:
      return True
    return record.get('host') == socket.gethostname() and not process_alive(
        record.get('pid'), record.get('pid_start'))

  def _write_record(self, record: Dict[str, Any]) -> None:
    durable.write_atomically(self.path, json.dumps(record, indent=1), f'.{self._token}')

  def _acquire_heartbeat(self) -> None:
    holder = self._read_record() if storage.exists(self.path) else None
    if holder is not None:
      if not self._is_stale(holder):
        beat = holder.get('heartbeat_unix')
        age = f'; its heartbeat is {_duration(time.time() - beat)} old' if isinstance(
            beat, (int, float)) else ''
        raise self._in_use(holder, age)
      _log.warning('Taking over the stale lock of %s (no heartbeat for over %g s, or its process '
                   'is gone).', describe(holder), self.timeout_s)
    record = _record(self._token, self.timeout_s)
    self._write_record(record)
    time.sleep(self.settle_s)
    back = self._read_record()
    if not back or back.get('token') != self._token:
      raise self._in_use(back, ', which wrote the lock at the same moment')
    self._heartbeat = threading.Thread(target=self._beat, args=(record,), daemon=True,
                                       name='workdir-lock-heartbeat')
    self._heartbeat.start()

  def _beat(self, record: Dict[str, Any]) -> None:
    while not self._stop.wait(self.timeout_s / 4):
      try:
        current = self._read_record()
        if current and current.get('token') != self._token:
          _log.error('The lock of %s was taken over by %s, which found it stale: two runs now '
                     'write this workdir.', self.workdir, describe(current))
          return
        self._write_record(dict(record, heartbeat_unix=time.time()))
      except Exception as e:  # pylint: disable=broad-except  (keep training; retry next beat)
        _log.warning('Could not renew the lock %s: %s', self.path, e)

  def release(self, *, remove_created_dirs: bool = False) -> None:
    """Releases the lock (deleting the file), with ``remove_created_dirs`` also the empty
    directories :meth:`acquire` created. Never raises."""
    if not self.held:
      return
    self.held = False
    try:
      if self._fd is not None:
        # While holding the flock (see the module docstring); not a file put there since.
        with contextlib.suppress(FileNotFoundError):
          if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = None
      else:
        self._stop.set()
        if self._heartbeat is not None:
          self._heartbeat.join()
        current = self._read_record()
        if current and current.get('token') == self._token:
          storage.remove(self.path)
    except Exception as e:  # pylint: disable=broad-except  (TensorFlow's are not OSErrors)
      _log.warning('Could not release the lock %s: %s', self.path, e)
    if remove_created_dirs:
      self._remove_created_dirs()

  def _remove_created_dirs(self) -> None:
    for directory in reversed(self._created):  # Innermost first, while they are empty.
      try:
        os.rmdir(directory)
      except OSError:
        break


def _read_fd(fd: int) -> str:
  size = min(os.fstat(fd).st_size, rundir.MAX_JSON_BYTES + 1)  # More: refused by _parse.
  return os.pread(fd, size, 0).decode('utf-8', 'replace')


def acquire_on_all_processes(lock: WorkdirLock) -> None:
  """Process 0 takes ``lock``; every process gets the same outcome (WorkdirInUseError on all)."""
  if jax.process_count() == 1:
    lock.acquire()
    return
  message = b''
  if jax.process_index() == 0:
    try:
      lock.acquire()
    except (WorkdirInUseError, OSError) as e:
      message = str(e).encode()[:4095] or b'?'
  buffer = np.zeros(4096, np.uint8)
  buffer[:len(message)] = np.frombuffer(message, np.uint8)
  try:
    message = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer))).rstrip(b'\0')
  except BaseException:  # A lost process (or a stop): the lock taken here is not kept.
    if jax.process_index() == 0 and not message:
      lock.release(remove_created_dirs=True)
    raise
  if message:
    raise WorkdirInUseError(message.decode('utf-8', 'replace'))
