"""What a launch target is: one way to start mpsync's ranks, as data the registry holds.

A target may start ranks from here (``argv``: the command line, built as a list) and may write
job scripts (``templates``, with the text only it knows: the scheduler's header, the prologue
that reads where the job runs, the lines that start the ranks).  What every script shares (the
settings, their checks, the ``mpsync train`` / ``compare`` / ``bench`` command) is in
:mod:`mpsync.launch._text`; :func:`mpsync.launch.jobs.render` puts the two together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from mpsync.launch.settings import JobSettings, JobTemplateError

__all__ = ["LaunchTarget", "LaunchError", "Variable", "reject_hosts"]

# One ``${NAME:-default}`` setting of a script: (NAME, default as shell text, documentation).
Variable = tuple[str, str, str]


class LaunchError(ValueError):
    """An unknown target, a malformed registration, or a launch the target cannot make."""


def _no_header(template: str, s: JobSettings) -> list[str]:
    return []


def _no_variables(template: str, s: JobSettings) -> list[Variable]:
    return []


def _no_check(template: str, s: JobSettings) -> None:
    return None


def reject_hosts(name: str) -> Callable[[str, JobSettings], None]:
    """The check of a scheduler that takes its hosts from the allocation: ``--hosts`` is an
    error there."""
    def check(template: str, s: JobSettings) -> None:
        if s.hosts:
            raise JobTemplateError(f"--hosts is for horovodrun; {name} takes the hosts from "
                                   f"its allocation")
    return check


@dataclass(frozen=True)
class LaunchTarget:
    """One launch target.

    ``argv(nprocs, command, **options)``: the command line that starts ``nprocs`` ranks of
    ``command`` from this machine (None: this target starts ranks only from a job script).
    ``templates``: template name (``train``, ``compare``, ``bench-kernels``) -> path of its
    default script under ``jobs/``; empty when the target writes no scripts.  The rest is
    the script's text:

    - ``words``: (what the script is, what starts its ranks), for its opening comment;
    - ``usage`` / ``tested``: per template, the comment's usage lines and what was tested;
    - ``header(template, settings)``: directive lines after ``#!/bin/bash`` (``#SBATCH``...);
    - ``prologue``: shell that sets JOB_ID, LOG_DIR, REPO, TASKS (and HOSTFILE) from where the
      job runs; ``{ranks}`` stands for the rank count of the settings;
    - ``launch_text``: shell that sets ``command=(...)`` from the ``train`` array;
    - ``variables(template, settings)``: the target's own settings, after ``NP``;
    - ``check(template, settings)``: raises JobTemplateError for settings it cannot take;
    - ``allocated``: the ranks come from a scheduler's allocation (False: started in place,
      the rank count and the run folder are set by the script itself).
    """

    name: str
    description: str
    argv: Callable[..., list[str]] | None = None
    templates: Mapping[str, str] = field(default_factory=dict)
    words: tuple[str, str] = ("", "")
    usage: Mapping[str, Sequence[str]] = field(default_factory=dict)
    tested: Mapping[str, Sequence[str]] = field(default_factory=dict)
    header: Callable[[str, JobSettings], list[str]] = _no_header
    prologue: str = ""
    launch_text: str = ""
    variables: Callable[[str, JobSettings], list[Variable]] = _no_variables
    check: Callable[[str, JobSettings], None] = _no_check
    allocated: bool = True

    def launch_argv(self, nprocs: int, command: Sequence[str], **options) -> list[str]:
        """``argv`` with a clear error where this target has none."""
        if self.argv is None:
            raise LaunchError(f"launch target {self.name!r} starts ranks only from a job "
                              f"script: mpsync jobs render --scheduler {self.name}")
        return self.argv(nprocs, command, **options)
