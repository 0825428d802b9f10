"""The results of ``check-node``: one line per check, the exit status, and their text and JSON forms.

Pure functions only; the checks themselves are in ``checks.py`` and ``mps.py`` beside this module.
"""

from __future__ import annotations

import json
import textwrap
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Status = Literal["OK", "FAIL", "SKIPPED"]
_DETAIL_WIDTH = 88


class CheckResult(BaseModel):
    """One line of the table: what was checked, how it went, and what was seen or why it failed or did not run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    check: str
    status: Status
    detail: str


class NodeReport(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    simulated: bool = False
    notes: list[str] = Field(default_factory=list)  # printed above the table (e.g. the SIMULATION banner)
    checks: list[CheckResult] = Field(default_factory=list)


def ok(check: str, detail: str) -> CheckResult:
    return CheckResult(check=check, status="OK", detail=detail)


def fail(check: str, detail: str) -> CheckResult:
    return CheckResult(check=check, status="FAIL", detail=detail)


def skipped(check: str, reason: str) -> CheckResult:
    return CheckResult(check=check, status="SKIPPED", detail=reason)


def exit_status(report: NodeReport) -> int:
    """1 if any check failed, else 0: a SKIPPED check is not a failure, it is listed in the summary."""
    return 1 if any(c.status == "FAIL" for c in report.checks) else 0


def counts(report: NodeReport) -> dict[Status, int]:
    tally: dict[Status, int] = {"OK": 0, "FAIL": 0, "SKIPPED": 0}
    for check in report.checks:
        tally[check.status] += 1
    return tally


def render_table(report: NodeReport) -> str:
    """A fixed-width table, long details wrapped under their own column, then a summary."""
    width = max([len("CHECK"), *(len(c.check) for c in report.checks)])
    indent = " " * (width + 2 + 7 + 2)
    lines = [*report.notes, ""] if report.notes else []
    lines.append(f"{'CHECK':<{width}}  {'STATUS':<7}  DETAIL")
    for check in report.checks:
        wrapped = textwrap.wrap(check.detail, _DETAIL_WIDTH, break_long_words=False, break_on_hyphens=False) or [""]
        lines.append(f"{check.check:<{width}}  {check.status:<7}  {wrapped[0]}")
        lines.extend(indent + more for more in wrapped[1:])
    tally = counts(report)
    lines.append("")
    lines.append(f"{tally['OK']} OK, {tally['FAIL']} FAILED, {tally['SKIPPED']} SKIPPED: "
                 + ("this node is NOT ready; fix the FAIL lines (docs/operations.md, 'Checking a new node')"
                    if tally["FAIL"] else "no failures"))
    not_run = [c for c in report.checks if c.status == "SKIPPED"]
    if not_run:
        lines.append("Not run here:" if not report.simulated
                     else "Not run here (SIMULATION: there is no real GPU on a simulated node):")
        lines.extend(f"  - {c.check}: {c.detail}" for c in not_run)
    return "\n".join(lines)


def render_json(report: NodeReport) -> str:
    return json.dumps({**report.model_dump(), "counts": counts(report), "exit_status": exit_status(report)}, indent=2)
