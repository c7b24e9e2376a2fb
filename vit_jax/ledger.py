"""Where an account's time went, per attempt (the goodput ledger of docs/compute_cost.md): the
rows that `python -m vit_jax.cost WORKDIR` prints and draws, and the end-of-run table."""

from __future__ import annotations

from typing import Any

from vit_jax import accounting

#: The parts of an attempt's program seconds, in the figure's order, with their column titles.
SEGMENT_TITLES = {"training": "training", "redone": "redone", "compile": "compile",
                  "eval": "eval", "input": "input wait", "checkpoint": "checkpoint",
                  "setup": "set-up/resume", "other": "other"}
SEGMENTS = tuple(SEGMENT_TITLES)


def ledger(report: dict[str, Any]) -> list[dict[str, Any]]:
  """Per attempt of a `report()`: 'attempt' (1-based), 'start_step', 'end_step', 'steps',
  'units' (cores, else devices), 'unit', 'resumed', 'resume_s', 'redone_steps', 'compile_saved_s',
  'program_s' and 'segments': its program seconds split in `SEGMENTS` ('redone': training that a
  later resume did again; 'setup': the 'other' time before the first step)."""
  attempts = report["attempts"]
  redos = [a["redone"] for a in attempts if a.get("redone") and a["redone"]["from_attempt"]]
  lost = [sum(r["seconds"] or 0.0 for r in redos if r["from_attempt"] == i + 1)
          for i in range(len(attempts))]
  rows = []
  for i, a in enumerate(attempts):
    seconds = a["seconds"]
    redone = min(lost[i], seconds["train"])
    setup = min(a.get("setup_s") or 0.0, seconds["other"])
    segments = {"training": seconds["train"] - redone, "redone": redone,
                **{k: seconds[k] for k in ("compile", "eval", "input", "checkpoint")},
                "setup": setup, "other": seconds["other"] - setup}
    rows.append({
        "attempt": i + 1, "start_step": a["start_step"], "end_step": a["end_step"],
        "steps": a["steps"], "units": accounting.units(a),
        "unit": "core" if a["cores"] else "device",
        "device_kind": a["device_kind"], "resumed": a.get("resumed", i > 0),
        "resume_s": a.get("resume_s"), "redone_steps": (a.get("redone") or {}).get("steps", 0),
        "compile_saved_s": a.get("compile_saved_s") or 0.0, "program_s": seconds["program"],
        "segments": segments})
  return rows


def format_ledger(report: dict[str, Any]) -> str:
  """The ledger of a `report()` as a table of seconds per attempt and the goodput lines."""
  titles = ["attempt", "steps", "on", "program s", *SEGMENT_TITLES.values(), "resume s",
            "redid steps", "cache saved s"]
  table = [titles]
  for row in ledger(report):
    plural = "s" if row["units"] != 1 else ""
    on = f"{row['units']} {row['unit']}{plural}"
    resume = "-" if row["resume_s"] is None else f"{row['resume_s']:.1f}"
    table.append([str(row["attempt"]), f"{row['start_step']}-{row['end_step']}", on,
                  f"{row['program_s']:.1f}",
                  *(f"{row['segments'][k]:.1f}" for k in SEGMENT_TITLES), resume,
                  str(row["redone_steps"]), f"{row['compile_saved_s']:.1f}"])
  widths = [max(len(line[i]) for line in table) for i in range(len(titles))]
  lines = []
  for line in table:
    cells = [c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
    lines.append("  ".join(cells).rstrip())
  unit = report["hardware"]["unit"]
  key = f"{unit}_days"
  program = report["program"][key]
  productive = report.get("productive", {}).get(key)
  value = report.get("goodput")
  share = "unknown" if value is None else f"{value:.1%}"
  days = ("" if None in (program, productive) else
          f": {productive:.4g} {unit}-days in productive training steps of {program:.4g}")
  lines.append(f"goodput {share}{days} ({report['restarts']} restart(s)).")
  redone = report.get("redone", {}).get(key)
  lost = "" if redone is None else f" ({redone:.4g} {unit}-days)"
  lines.append(f"redone after preemptions: {report.get('redone_steps', 0)} step(s){lost}; "
               f"resumes: {report.get('resume_seconds', 0.0):.1f} s; compiling saved by the "
               f"persistent cache: {report.get('compile_saved_seconds', 0.0):.1f} s.")
  return "\n".join(lines)
