"""A job file: a job of tasks that differ (``megha submit --file job.yaml``).

``megha submit --command ...`` builds a job of identical tasks; a job file lists them,
each with its own command, image, resources and so on, in YAML (or JSON)::

    job_id: sweep-1                  # optional: a retried submission is then safe
    queue: research                  # optional: the federation's first queue
    defaults:                        # optional: what every task has unless it says
      resources: cpu=500m,mem=256Mi
      retries: 1
      env: {DATA: /srv/data}         # a task's env is added to these
    tasks:
      - command: [python3, train.py, --lr, "0.1"]
      - command: python3 train.py --lr 0.01   # a string runs under sh -c
        resources: cpu=2,mem=2Gi
      - image: megha-offline/debian:bookworm
        command: [sh, -c, "echo $MEGHA_TASK_INDEX"]
        count: 4                     # four tasks like this one
      - duration: 2.5                # neither command nor image: simulated

Everything is checked before anything is sent, and every mistake is named by where it
is (``tasks[2].resources: ...``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from services.common.argtypes import ENV_NAME
from services.common.client import TaskTemplate
from services.common.convert import MAX_RETRIES, PRIORITY_RANGE
from services.core.constraints import ConstraintError, from_mask, parse_constraints
from services.core.resources import ResourceError, parse_resources

DEFAULT_RESOURCES = "cpu=1,mem=512Mi"  # megha submit's own default
MAX_TASKS = 100_000  # tasks in one job file (count included)


class JobFileError(ValueError):
    """What is wrong with a job file, one line per mistake."""


class JobFileTask(BaseModel):
    """One entry of ``tasks`` (or the ``defaults``)."""

    model_config = ConfigDict(extra="forbid")

    command: list[str] | None = None  # a string is run under sh -c
    image: str | None = None
    duration: float | None = Field(None, ge=0)
    resources: str | None = None
    constraints: str | None = None  # "1,4,7" or "ssd,gpu" (constraint_names), or a list
    timeout: float | None = Field(None, ge=0)
    retries: int | None = Field(None, ge=0, le=MAX_RETRIES)
    env: dict[str, str] | None = None
    count: int | None = Field(None, ge=1, le=MAX_TASKS)
    priority: int | None = Field(None, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])

    @field_validator("command", mode="before")
    @classmethod
    def _command(cls, value: Any) -> Any:
        if isinstance(value, str):
            return ["sh", "-c", value]
        if isinstance(value, list) and not value:
            raise ValueError("an empty command runs nothing: leave it out for a simulated task")
        for i, arg in enumerate(value if isinstance(value, list) else ()):
            if not isinstance(arg, str):  # YAML reads 5, 0.10, 010 and yes as others
                raise ValueError(f"argument {i} ({arg!r}) is not a string: quote it")
        return value

    @field_validator("constraints", mode="before")
    @classmethod
    def _constraints(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, list):
            if not all(isinstance(c, int | str) and not isinstance(c, bool) for c in value):
                raise ValueError(f"constraints are ids or names, got {value!r}")
            return ",".join(str(c) for c in value)
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for name in value or {}:
            if not ENV_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a variable name (letters, digits, _)")
        return value


class JobFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_id: str = ""
    queue: str = ""
    defaults: JobFileTask = Field(default_factory=JobFileTask)
    tasks: list[JobFileTask] = Field(min_length=1)


def load_job(
    text: str, num_constraints: int, constraint_names: Mapping[str, int] | None = None
) -> tuple[JobFile, list[TaskTemplate]]:
    """The job a file describes, and one template per task (``count`` expanded);
    ``JobFileError`` says everything that is wrong with it. ``constraint_names``: the
    federation's, for constraints given by name."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f"line {where.line + 1}, column {where.column + 1}: " if where is not None else ""
        raise JobFileError(f"{at}not YAML: {getattr(err, 'problem', None) or err}") from None
    if not isinstance(data, Mapping):
        raise JobFileError("a job file is a mapping with a list of tasks (tasks: [...])")
    try:
        job = JobFile.model_validate(data)
    except ValidationError as err:
        raise JobFileError("\n".join(_describe(error) for error in err.errors())) from None
    templates: list[TaskTemplate] = []
    problems: list[str] = []
    for i, spec in enumerate(job.tasks):
        try:
            template = build_template(spec, num_constraints, job.defaults, constraint_names)
        except (ResourceError, ConstraintError, ValueError) as err:
            problems.append(f"tasks[{i}]: {err}")
            continue
        templates.extend([template] * (_pick(spec, job.defaults, "count") or 1))
    if problems:
        raise JobFileError("\n".join(problems))
    if len(templates) > MAX_TASKS:
        raise JobFileError(f"{len(templates):,} tasks: a job file holds at most {MAX_TASKS:,}")
    return job, templates


def build_template(
    spec: JobFileTask,
    num_constraints: int,
    defaults: JobFileTask | None = None,
    constraint_names: Mapping[str, int] | None = None,
) -> TaskTemplate:
    """What ``megha submit`` builds its tasks from, for a task of a job file under its
    ``defaults``, or for the task the command line describes; ``ResourceError``,
    ``ConstraintError`` or ``ValueError`` say what is wrong."""
    defaults = JobFileTask() if defaults is None else defaults
    command = _pick(spec, defaults, "command") or []
    image = _pick(spec, defaults, "image") or ""
    if spec.env and not (command or image):
        raise ValueError("env is for a process (command) or a container (image)")
    # The defaults' env goes to the tasks that run something, not to simulated ones.
    env = {**(defaults.env or {}), **(spec.env or {})} if command or image else {}
    resources = parse_resources(_pick(spec, defaults, "resources") or DEFAULT_RESOURCES)
    constraints = _pick(spec, defaults, "constraints") or ""
    duration = _pick(spec, defaults, "duration")
    return TaskTemplate(
        resources,
        1.0 if duration is None else duration,
        command,
        image,
        _pick(spec, defaults, "timeout") or 0.0,
        from_mask(parse_constraints(constraints, num_constraints, constraint_names)),
        _pick(spec, defaults, "retries") or 0,
        env,
        _pick(spec, defaults, "priority") or 0,
    )


def _pick(spec: JobFileTask, defaults: JobFileTask, name: str) -> Any:
    """The task's own value, else the default's."""
    value = getattr(spec, name)
    return getattr(defaults, name) if value is None else value


def _describe(error: Mapping[str, Any]) -> str:
    """``tasks[2].resources: Input should be a valid string``."""
    where = ""
    for part in error["loc"]:
        where += f"[{part}]" if isinstance(part, int) else f".{part}" if where else str(part)
    message = error["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message
