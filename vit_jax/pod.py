"""Multi-process runs (TPU pods, CPU and GPU clusters; docs/pods.md): ``jax.distributed`` with
registration and peer silence bounded by ``--distributed_timeout``, the coordinator's loss
reported (:func:`supervise`), different commands refused (:func:`check_same_command`). Imported
before JAX loads: JAX is imported in functions only."""

from __future__ import annotations

import ctypes
import inspect
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Mapping, Optional

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
#: The coordination service's keys of `check_same_command`: process 0's command, the verdicts.
_COMMAND = "vit_jax/command/0"
_VERDICTS = "vit_jax/command_differences/"
#: Exit code of a refused command (vit_jax.main's of a bad config or flag).
_COMMAND_EXIT_CODE = 2
#: Differences that a refusal's FATAL line names (the others are counted).
_SHOWN = 4


class _Absent:

  def __repr__(self) -> str:
    return "absent"


#: `command_differences`' value of a key absent on one side.
ABSENT = _Absent()


class _Pod:
  """This process's --distributed_timeout (s), set by `initialize_distributed`."""
  timeout_s: float = DISTRIBUTED_TIMEOUT_S


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


class _Call:
  """When `_watch_peers`' call of the coordination service in flight began (None: none)."""
  since: Optional[float] = None


def _watch_peers(client, process_id: int, num_processes: int, timeout_s: float,
                 call: _Call) -> None:
  """Ends this process (one FATAL line) when a peer or the coordinator is silent ``timeout_s``
  (jax's own heartbeat check aborts without a word)."""
  start = time.monotonic()
  changed = {p: start for p in range(num_processes) if p != process_id}
  seen: dict[int, str] = {}
  failing_since = None
  beat = 0
  while True:
    beat += 1
    now = time.monotonic()
    try:
      call.since = now
      stop = stops.received_stop()  # Written as it stops too (`_start_watching_peers`).
      alive = _STOPPED + stop.signal if stop else str(beat)
      client.key_value_set(f"{_ALIVE}{process_id}", alive, allow_overwrite=True)
      values = {k.rsplit("/", 1)[-1]: v for k, v in client.key_value_dir_get(_ALIVE)}
      failing_since = call.since = None
    except (TypeError, AttributeError) as e:  # Another jax's client: no watch, jax's own abort.
      call.since = None
      logging.warning("No heartbeat watch of the other processes (%s).", e)
      return
    except Exception as e:  # pylint: disable=broad-except  (the coordinator is gone)
      call.since = None
      failing_since = failing_since or now
      if now - failing_since > timeout_s:
        _exit_coordinator_silent(process_id, num_processes, timeout_s, e)
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
        seen[peer] = value
        changed[peer] = now
      elif now - changed[peer] > timeout_s:
        _exit_if_stopped()
        stops.exit_process(POD_FAULT_EXIT_CODE, (
            f"FATAL: Process {process_id} of {num_processes}: process {peer} has sent no "
            f"heartbeat for {timeout_s:g} s (--distributed_timeout): it died or hangs, its log "
            f"says why. Stopped; {_RERUN}"))
    time.sleep(_BEAT_S)


def _watch_call(call: _Call, process_id: int, num_processes: int, timeout_s: float) -> None:
  """Ends this process (one FATAL line) when a call of `_watch_peers` has not returned for
  ``timeout_s`` (a SIGSTOPped coordinator); skipped after this thread itself waited long."""
  last = time.monotonic()
  while True:
    time.sleep(_BEAT_S)
    now = time.monotonic()
    starved = now - last > 2 * _BEAT_S
    last = now
    since = call.since
    if since is not None and not starved and now - since > timeout_s:
      _exit_coordinator_silent(process_id, num_processes, timeout_s, None)


def _exit_coordinator_silent(process_id: int, num_processes: int, timeout_s: float,
                             error: Optional[BaseException]) -> None:
  """Ends this process: the coordination service failed (`error`) or hung for ``timeout_s``."""
  _exit_if_stopped()
  first = ("its calls do not return" if error is None else
           (str(error).strip().splitlines() or [type(error).__name__])[0][:200])
  stops.exit_process(POD_FAULT_EXIT_CODE, (
      f"FATAL: Process {process_id} of {num_processes}: the coordinator (process 0) has not "
      f"answered for {timeout_s:g} s (--distributed_timeout; {first}): it died or hangs, its "
      f"log says why. Stopped; {_RERUN}"))


def _exit_if_stopped() -> None:
  """Ends the process as a stop does when it received one (`stops.received_stop`)."""
  stop = stops.received_stop()
  if stop is not None:
    stops.exit_stopped(stop)


def _coordination_client():
  """jax.distributed's client of the coordination service, or None (a single process)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  client = getattr(distributed.global_state, "client", None)
  return None if client is None or jax.process_count() == 1 else client


def _start_watching_peers(timeout_s: float) -> None:
  """`_watch_peers` in a daemon thread, once jax.distributed is initialised."""
  import jax  # pylint: disable=g-import-not-at-top
  client = _coordination_client()
  if client is None:
    return
  key = f"{_ALIVE}{jax.process_index()}"
  stops.announce_stops_with(lambda stop: client.key_value_set(
      key, _STOPPED + stop.signal, allow_overwrite=True))
  call = _Call()
  who = (jax.process_index(), jax.process_count(), timeout_s)
  threading.Thread(target=_watch_peers, daemon=True, name="vit_jax-peer-watcher",
                   args=(client, *who, call)).start()
  threading.Thread(target=_watch_call, daemon=True, name="vit_jax-call-watcher",
                   args=(call, *who)).start()


def initialize_distributed(coordinator_address: Optional[str] = None,
                           num_processes: Optional[int] = None,
                           process_id: Optional[int] = None,
                           timeout_s: int = DISTRIBUTED_TIMEOUT_S) -> None:
  """``jax.distributed.initialize`` when this is one process of several (the arguments, the
  ``JAX_*`` environment or a multi-host Cloud TPU slice); past ``timeout_s`` of registration or
  peer silence, exits ``POD_FAULT_EXIT_CODE``. ValueError: an address without the process count
  or index."""
  import jax  # pylint: disable=g-import-not-at-top
  timeouts = _distributed_timeouts(timeout_s)
  _Pod.timeout_s = timeout_s
  address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if address:
    num = num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0")) or None
    pid = process_id
    if pid is None and "JAX_PROCESS_ID" in os.environ:
      pid = int(os.environ["JAX_PROCESS_ID"])
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


def command_differences(mine: Mapping[str, Any],
                        reference: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
  """The leaves of two nested dicts that differ by their JSON text, as `(dotted key, mine,
  reference)` sorted by key (`ABSENT` on the side that lacks the key)."""
  ours = _leaves(mine)
  theirs = _leaves(reference)
  return [(key, ours.get(key, ABSENT), theirs.get(key, ABSENT))
          for key in sorted(ours.keys() | theirs.keys())
          if _json_text(ours.get(key, ABSENT)) != _json_text(theirs.get(key, ABSENT))]


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  leaves = {}
  for key, value in tree.items():
    name = f"{prefix}.{key}" if prefix else str(key)
    if isinstance(value, Mapping) and value:
      leaves.update(_leaves(value, name))
    else:
      leaves[name] = value
  return leaves


def _json_text(value: Any) -> str:
  return "\0absent" if value is ABSENT else json.dumps(value, sort_keys=True, default=str)


def check_same_command(config: Mapping[str, Any], workdir: str) -> None:
  """On a pod, before anything is written: every process compares its resolved `config` (a
  `to_dict()`) and `workdir` with process 0's, and on any difference every process exits 2 with
  one FATAL line naming the keys and values. Each wait is bounded by --distributed_timeout."""
  client = _coordination_client()
  if client is None:
    return
  import jax  # pylint: disable=g-import-not-at-top
  from vit_jax import storage  # pylint: disable=g-import-not-at-top
  me = jax.process_index()
  num = jax.process_count()
  where = storage.clean(storage.absolute(workdir))
  mine = {"--config": dict(config), "--workdir": where}
  mine = json.loads(json.dumps(mine, sort_keys=True, default=str))  # As process 0's arrives.
  deadline = time.monotonic() + _Pod.timeout_s
  try:
    if me == 0:
      client.key_value_set(_COMMAND, json.dumps(mine))
      reference = mine
    else:
      reference = _wait_for(lambda: client.blocking_key_value_get(_COMMAND, 200), deadline)
      if reference is None:
        _exit_not_compared(me, num, [0])
      reference = json.loads(reference)
    differences = command_differences(mine, reference)
    client.key_value_set(f"{_VERDICTS}{me}", json.dumps({"count": len(differences), "shown": [
        (key, _shown(value), _shown(theirs)) for key, value, theirs in differences[:_SHOWN]]}))

    found: dict[int, str] = {}

    def all_verdicts():
      found.update((int(k.rsplit("/", 1)[-1]), v) for k, v in client.key_value_dir_get(_VERDICTS))
      return found if len(found) == num else None

    if _wait_for(all_verdicts, deadline, pause_s=0.1) is None:
      _exit_not_compared(me, num, sorted(set(range(num)) - found.keys()))
  except (TypeError, AttributeError) as e:  # Another jax's client: not compared.
    logging.warning("The processes' commands were not compared (%s).", e)
    return
  differing = sorted(p for p, v in found.items() if json.loads(v)["count"])
  if not differing:
    return
  if differences:
    line = f"Process {me} of {num} got another command than process 0: "
    count = len(differences)
    items = [f"{k}={_shown(v)} here, {_shown(t)} on process 0" for k, v, t in differences]
  else:
    other = differing[0]
    verdict = json.loads(found[other])
    others = f" (and {len(differing) - 1} more)" if len(differing) > 1 else ""
    if me == 0:
      line = f"Process 0 of {num}: process {other}{others} got another command than this one: "
      here = "here"
    else:
      line = (f"Process {me} of {num}: process {other}{others} got another command than "
              "process 0 and this one: ")
      here = "on process 0 and here"
    count = verdict["count"]
    items = [f"{k}={v} on process {other}, {t} {here}" for k, v, t in verdict["shown"]]
  more = f"; {count - _SHOWN} more key(s)" if count > _SHOWN else ""
  stops.exit_process(_COMMAND_EXIT_CODE, (
      f"FATAL: {line}{'; '.join(items[:_SHOWN])}{more}. Every process of a pod runs the same "
      "command (--config, its overrides and --workdir; only --process_id differs): give every "
      "process the same command, then rerun."), shutdown=True)


def _shown(value: Any, width: int = 100) -> str:
  text = repr(value)
  return text if len(text) <= width else text[:width - 3] + "..."


def _wait_for(read, deadline: float, pause_s: float = 0.0):
  """`read()` until it returns a value other than None (an error: not yet), None at `deadline`.
  TypeError, AttributeError: raised."""
  while True:
    try:
      value = read()
      if value is not None:
        return value
    except (TypeError, AttributeError):
      raise
    except Exception:  # pylint: disable=broad-except  (not there yet: DEADLINE_EXCEEDED, ...)
      pass
    if time.monotonic() > deadline:
      return None
    time.sleep(pause_s)


def _exit_not_compared(me: int, num: int, missing: list[int]) -> None:
  """Ends this process: the processes `missing` did not publish their command in time."""
  who = ", ".join(map(str, missing)) or "?"
  stops.exit_process(POD_FAULT_EXIT_CODE, (
      f"FATAL: Process {me} of {num}: process(es) {who} did not reach the comparison of the "
      f"processes' commands within {_Pod.timeout_s:g} s (--distributed_timeout): it failed or "
      "hangs in the set-up, its log says why (or raise --distributed_timeout if it is only "
      "slower). Stopped; give every process the same command, then rerun."))


def _several_processes(argv: list[str]) -> bool:
  """Whether main's `argv` or the environment asks for several processes."""
  flag = "--coordinator_address"
  return (any(a == flag or a.startswith(flag + "=") for a in argv)
          or bool(os.environ.get("JAX_COORDINATOR_ADDRESS")) or _on_multi_host_tpu())


def supervise(argv: list[str]) -> None:
  """On a pod (Linux), runs this command as a child and ends as it ends (SIGTERM forwarded); a
  child aborted by jax (SIGABRT) gets a FATAL line, or after a SIGTERM exit code 75. Call first."""
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
