"""Multi-process runs (TPU pods, CPU and GPU clusters): ``jax.distributed`` with registration
and peer silence bounded (``--distributed_timeout``: one FATAL line, ``POD_FAULT_EXIT_CODE``);
:func:`supervise` reports the coordinator's loss, which jax ends in C++. Imported before JAX
loads (the supervisor never loads it): JAX is imported in functions only."""

from __future__ import annotations

import ctypes
import inspect
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

from absl import logging

from vit_jax import hardware
from vit_jax import stops

#: Default --distributed_timeout (s): the wait for registration and the longest heartbeat gap.
DISTRIBUTED_TIMEOUT_S = 60
#: Exit code of a pod fault: a process that never registered, or was lost.
POD_FAULT_EXIT_CODE = 1
#: How a pod fault's FATAL line ends.
_RERUN = "rerun the same command on every process to resume from the latest checkpoint."
#: Seconds that jax's own heartbeat timeout exceeds --distributed_timeout (see `_watch_peers`).
_JAX_HEARTBEAT_MARGIN_S = 30
#: Seconds between two heartbeats of `_watch_peers`.
_BEAT_S = 1.0
#: The coordination service's directory of heartbeats: one key per process.
_ALIVE = "vit_jax/alive/"
#: A process's heartbeat value once it stops in the set-up (then the signal's name).
_STOPPED = "stopped "
#: Set in the environment of the command that `supervise` runs (to the supervisor's pid).
SUPERVISOR_ENV = "VIT_JAX_SUPERVISOR"


def _on_multi_host_tpu() -> bool:
  """A Cloud TPU VM that is one worker of several (before any JAX backend starts)."""
  return ("," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
          or hardware.is_multi_host_slice(os.environ.get("TPU_ACCELERATOR_TYPE", "")))


def _distributed_timeouts(timeout_s: int) -> dict[str, int]:
  """``jax.distributed.initialize``'s timeout keywords (those this jax accepts), longer than ours
  so that our FATAL line comes before jax's abort in C++ (exit 134)."""
  import jax  # pylint: disable=g-import-not-at-top
  wanted = {"initialization_timeout": timeout_s + 10,
            "heartbeat_timeout_seconds": timeout_s + _JAX_HEARTBEAT_MARGIN_S,
            "shutdown_timeout_seconds": timeout_s}
  accepted = inspect.signature(jax.distributed.initialize).parameters
  return {k: v for k, v in wanted.items() if k in accepted}


def _watch_peers(client, process_id: int, num_processes: int, timeout_s: float) -> None:
  """Ends this process (one FATAL line) when a peer or the coordinator is silent ``timeout_s``
  (jax's own heartbeat check aborts without a word)."""
  start = time.monotonic()
  changed = {p: start for p in range(num_processes) if p != process_id}
  seen: dict[int, str] = {}
  failing_since, beat = None, 0
  while True:
    beat += 1
    now = time.monotonic()
    try:
      stop = stops.received_stop()  # Written as it stops too (`_start_watching_peers`).
      client.key_value_set(f"{_ALIVE}{process_id}", _STOPPED + stop.signal if stop else str(beat),
                           allow_overwrite=True)
      values = {k.rsplit("/", 1)[-1]: v for k, v in client.key_value_dir_get(_ALIVE)}
      failing_since = None
    except (TypeError, AttributeError) as e:  # Another jax's client: no watch, jax's own abort.
      logging.warning("No heartbeat watch of the other processes (%s).", e)
      return
    except Exception as e:  # pylint: disable=broad-except  (the coordinator is gone)
      failing_since = failing_since or now
      if now - failing_since > timeout_s:
        _exit_if_stopped()
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        stops.exit_process(POD_FAULT_EXIT_CODE, (
            f"FATAL: Process {process_id} of {num_processes}: the coordinator (process 0) has "
            f"not answered for {timeout_s:g} s (--distributed_timeout; {first}): it died or "
            f"hangs, its log says why. Stopped; {_RERUN}"))
      time.sleep(_BEAT_S)
      continue
    for peer in changed:
      value = values.get(str(peer))
      if value and value.startswith(_STOPPED):  # It stopped in the set-up: so does this one.
        _exit_if_stopped()
        stop = stops.StopRequested(value[len(_STOPPED):])
        stops.exit_stopped(stop, f"Process {process_id} of {num_processes}: process {peer} "
                           f"stopped. {stop}")
      if value != seen.get(peer):
        seen[peer], changed[peer] = value, now
      elif now - changed[peer] > timeout_s:
        _exit_if_stopped()
        stops.exit_process(POD_FAULT_EXIT_CODE, (
            f"FATAL: Process {process_id} of {num_processes}: process {peer} has sent no "
            f"heartbeat for {timeout_s:g} s (--distributed_timeout): it died or hangs, its log "
            f"says why. Stopped; {_RERUN}"))
    time.sleep(_BEAT_S)


def _exit_if_stopped() -> None:
  """Ends the process as a stop does when it received one (`stops.received_stop`)."""
  stop = stops.received_stop()
  if stop is not None:
    stops.exit_stopped(stop)


def _start_watching_peers(timeout_s: float) -> None:
  """`_watch_peers` in a daemon thread, once jax.distributed is initialised."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  client = getattr(distributed.global_state, "client", None)
  if client is None or jax.process_count() == 1:
    return
  key = f"{_ALIVE}{jax.process_index()}"
  stops.announce_stops_with(lambda stop: client.key_value_set(
      key, _STOPPED + stop.signal, allow_overwrite=True))
  threading.Thread(target=_watch_peers, daemon=True, name="vit_jax-peer-watcher", args=(
      client, jax.process_index(), jax.process_count(), timeout_s)).start()


def initialize_distributed(coordinator_address: Optional[str] = None,
                           num_processes: Optional[int] = None,
                           process_id: Optional[int] = None,
                           timeout_s: int = DISTRIBUTED_TIMEOUT_S) -> None:
  """``jax.distributed.initialize`` when this is one process of several (the arguments, the
  ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` environment or a
  multi-host Cloud TPU slice). ``timeout_s`` (seconds) bounds the wait for every process to
  register and a peer's heartbeat silence; past it this process exits ``POD_FAULT_EXIT_CODE``
  with one FATAL line. ValueError: an address without the process count or index."""
  import jax  # pylint: disable=g-import-not-at-top
  timeouts = _distributed_timeouts(timeout_s)
  address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if address:
    num = num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0")) or None
    pid = process_id if process_id is not None else (
        int(os.environ["JAX_PROCESS_ID"]) if "JAX_PROCESS_ID" in os.environ else None)
    if num is None or pid is None:
      raise ValueError("--coordinator_address needs --num_processes and --process_id (or "
                       "JAX_NUM_PROCESSES and JAX_PROCESS_ID).")
    if (jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS") or "").startswith("cpu"):
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeouts.update(coordinator_address=address, num_processes=num, process_id=pid)
    unregistered = (
        f"FATAL: Process {pid} of {num}: not all {num} processes registered with the "
        f"coordinator {address} within {timeout_s} s (--distributed_timeout): start every "
        f"process with the same --coordinator_address and --num_processes={num} and its own "
        "--process_id (or raise --distributed_timeout), then rerun.")
  else:  # On a TPU slice jax finds the coordinator and the workers from the TPU metadata.
    unregistered = (
        f"FATAL: not every worker of this TPU slice registered with jax.distributed within "
        f"{timeout_s} s (--distributed_timeout): run the same command on every worker (launch/"
        "tpu.sh run), or raise --distributed_timeout, then rerun.")
  if address or _on_multi_host_tpu():
    deadline = threading.Timer(timeout_s, stops.exit_process, (POD_FAULT_EXIT_CODE, unregistered))
    deadline.daemon = True
    deadline.start()
    try:
      jax.distributed.initialize(**timeouts)
    finally:
      deadline.cancel()
    stops.hold_sigterm()  # The set-up stops at once; jax's preemption service from step 1.
    _start_watching_peers(timeout_s)
  if jax.process_count() > 1:
    logging.info("Process %d of %d; %d local of %d devices.", jax.process_index(),
                 jax.process_count(), jax.local_device_count(), jax.device_count())


def _several_processes(argv: list[str]) -> bool:
  """Whether main's `argv` or the environment asks for several processes."""
  flag = "--coordinator_address"
  return (any(a == flag or a.startswith(flag + "=") for a in argv)
          or bool(os.environ.get("JAX_COORDINATOR_ADDRESS")) or _on_multi_host_tpu())


def supervise(argv: list[str]) -> None:
  """On a pod (Linux), runs this command as a child and ends as it ends (SIGTERM forwarded); a
  child aborted by jax (SIGABRT: the coordinator died) gets a FATAL line, or after a SIGTERM
  (the others stopped first) the preemption's exit code 75. Call first."""
  if (os.environ.get(SUPERVISOR_ENV) or not sys.platform.startswith("linux")
      or not getattr(sys, "orig_argv", None) or not _several_processes(argv)):
    return
  prctl = ctypes.CDLL(None, use_errno=True).prctl  # Looked up before the fork.
  children: list[subprocess.Popen] = []
  forwarded: list[int] = []

  def forward(signum, _):
    forwarded.append(signum)
    for child in children:
      child.send_signal(signum)

  signal.signal(signal.SIGTERM, forward)
  signal.signal(signal.SIGINT, lambda *_: None)  # Default again in the child (exec).
  children.append(subprocess.Popen(
      [sys.executable, *sys.orig_argv[1:]], env=dict(os.environ, **{SUPERVISOR_ENV: str(
          os.getpid())}), preexec_fn=lambda: prctl(1, signal.SIGKILL)))  # 1: PR_SET_PDEATHSIG
  code = children[0].wait()
  if code == -signal.SIGABRT and forwarded:  # Stopped as asked; the others stopped first.
    stops.exit_process(stops.PREEMPTED_EXIT_CODE, (
        "Preempted (SIGTERM): stopped; JAX's distributed runtime then ended this process (SIGABRT) "
        "as the other processes had stopped too. Rerun the same command on every process to "
        "resume from the latest checkpoint."))
  if code == -signal.SIGABRT:
    stops.exit_process(POD_FAULT_EXIT_CODE, (
        "FATAL: This process was aborted by JAX's distributed runtime (SIGABRT; the lines above "
        "say why: on a pod, the coordinator, process 0, or another process died). Stopped; "
        f"{_RERUN}"))
  if code < 0:  # Killed by a signal: end the same way.
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
  stops.exit_process(code)
