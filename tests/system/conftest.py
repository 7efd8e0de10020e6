"""The control plane that test_param_policy_job, test_pp_jobs and test_workloads share:
one ``dmuon-serve`` with its own local Ray head (4 CPU workers, one job at a time), the
configuration each module started for itself before. Its start and stop (a Ray head's,
about 15 s on 2 cores) are paid once, not once a module; the three run last in this
package, one after the other, so the head never idles through other modules' tests.

Each module reads its own jobs, by id, and its own files; none counts every job the
service holds (test_workloads' refusals count the jobs before and after)."""

from __future__ import annotations

import pytest
from helpers.service_http import Service

WORLD = 4  # the head's CPUs: each module's jobs run 4 workers


@pytest.fixture(scope="package")
def ray_service(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ray-service"))
    service = Service(root, DMUON_MAX_RUNNING="1", DMUON_LOCAL_CPUS=str(WORLD), RAY_ADDRESS="")
    with service.serving():
        yield service


@pytest.fixture(scope="module")
def shared_service(ray_service):
    """The shared service, started again (with a new head) if a module before stopped
    it: test_workloads ends with its Ctrl-C, so a module that runs after it (modules
    named out of order on the command line) still gets a live one."""
    if ray_service.proc.poll() is not None:
        ray_service.start()
    return ray_service
