"""The jobs the routes know of, by task id and by caller: what progress, interrupt and skip look up.

A caller sees only its own jobs: by the task id it chose (`force_task_id`) or was given, or, without one, its
oldest unfinished job (else its last). Finished jobs are kept, the latest `keep`, for progress to say they ended.
Only the event loop's thread touches this registry; the jobs themselves change on the engine's thread.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict

from serve.engine import Job


def new_task_id(kind: str) -> str:
    """A1111's form of a task id: task(<random>)."""
    return f"task({kind}-{secrets.token_hex(8)})"


class Tasks:
    def __init__(self, keep: int = 256):
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._keep = keep

    def __contains__(self, task_id: str) -> bool:
        return task_id in self._jobs

    def add(self, job: Job) -> None:
        self._jobs[job.task_id] = job
        finished = [t for t, j in self._jobs.items() if j.done.is_set()]
        for task_id in finished[: max(0, len(self._jobs) - self._keep)]:
            del self._jobs[task_id]

    def find(self, caller: str, task_id: str | None = None) -> Job | None:
        """The caller's job `task_id`, or without one its oldest unfinished job, else its latest."""
        if task_id is not None:
            job = self._jobs.get(task_id)
            return job if job is not None and job.caller == caller else None
        mine = [j for j in self._jobs.values() if j.caller == caller]
        return next((j for j in mine if not j.done.is_set()), mine[-1] if mine else None)

    def unfinished(self, caller: str) -> list[Job]:
        return [j for j in self._jobs.values() if j.caller == caller and not j.done.is_set()]
