"""What a user picks when rendering a job script, and the error a bad pick raises."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mpsync import policies as registry
from mpsync.config import DEFAULTS

__all__ = ["JobSettings", "JobTemplateError", "TEMPLATE_DEFAULTS"]

# Per template: tasks per node (train: 4 workers + the dedicated server) and wall time.
TEMPLATE_DEFAULTS = {
    "train": (5, "01:00:00"),
    "compare": (5, "02:00:00"),
    "bench-kernels": (1, "01:00:00"),
}


class JobTemplateError(ValueError):
    """A setting that cannot go into a job script; the message names it."""


@dataclass(frozen=True)
class JobSettings:
    """What a user picks when rendering a script.  ``None`` means the template's default."""

    # allocation
    nodes: int = 1
    tasks_per_node: int | None = None
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    time: str | None = None          # wall time, [D-]HH:MM:SS
    job_name: str | None = None      # default: mpsync-<template>
    partition: str = ""              # Slurm partition / PBS queue
    account: str = ""
    hosts: str = ""                  # horovodrun: host1:K,host2:K (default localhost:<ranks>)
    # run (defaults of the scripts' ${VAR:-default} settings; those of mpsync's own, SyncConfig)
    policy: str = DEFAULTS.policy
    # Empty: the policy's own topology (its registry entry), chosen by mpsync train / compare,
    # so that POLICY=ssp alone is a valid submission.
    topology: str = ""
    backend: str = DEFAULTS.backend
    server: str = DEFAULTS.server
    epochs: int = 5
    dataset: str = "digits"
    slowdown: str = ""
    target_acc: str = ""
    policies: str = ",".join(  # compare: the policies whose own topology is the ring
        p.name for p in registry.specs() if p.default_topology == "ring")
    venv: str = ""                   # default: <repository>/.venv
    out_dir: str = ""                # default: beside the job's log

    def resolved(self, template: str) -> "JobSettings":
        tasks, time = TEMPLATE_DEFAULTS[template]
        return dataclasses.replace(
            self,
            tasks_per_node=tasks if self.tasks_per_node is None else self.tasks_per_node,
            time=time if self.time is None else self.time,
            job_name=f"mpsync-{template}" if self.job_name is None else self.job_name)
