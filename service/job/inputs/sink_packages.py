"""The packages a job's tracking sinks import, checked before the job is stored or run.

The control plane checks its own environment when a job is submitted, and the entrypoint
checks the Ray driver's before it starts the workers (the Ray Train controller that
writes to the sinks runs on the driver's node, the head node under ``ray job submit``).
A probe of the import system only: a package is not imported until its sink opens."""

from __future__ import annotations

import importlib.util

from ..spec import JobSpec, SpecError
from ..spec.tracking_section import SINK_PACKAGES


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # imported already, without a spec (an interactive session's)
        return True


def check_sink_packages(spec: JobSpec) -> None:
    """SpecError naming ``metrics.<sink>`` for a sink whose package is not installed."""
    for field in spec.metrics.sinks():
        if field not in SINK_PACKAGES:  # tensorboard: a dependency of the service itself
            continue
        module, pin = SINK_PACKAGES[field]
        if not installed(module):
            raise SpecError(f"metrics.{field}: the {module!r} package is not installed where "
                            f"the job was checked ({pin}: pip install 'dmuon[{field}]'); "
                            f"the Ray cluster's head node needs it too")
