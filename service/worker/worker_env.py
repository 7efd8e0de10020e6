"""Run in every Ray worker process of a job, before its first task (the runtime env's
``worker_process_setup_hook``, set by ``entrypoint.connect_ray``): ``RAY_ADDRESS`` names
the cluster the process belongs to.

Why: Ray Train's detached ``PlacementGroupCleaner`` asks Ray's state API about the
controller with no address, and that API then looks for Ray instances on the machine
(``ray._private.services.get_ray_address_from_environment``, ray 2.60). Only the
driver gets ``RAY_ADDRESS`` from Ray; in a worker, a second instance on the machine (a
service's head, a kept one, a colleague's) makes every poll raise ``ConnectionError:
Found multiple active Ray instances``, a 27-line traceback in the job's log, and a
cleaner that cannot clean up after a controller that died. Kept apart from the
entrypoint so a worker imports nothing else."""

from __future__ import annotations

import os


def name_the_cluster() -> None:
    import ray

    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
