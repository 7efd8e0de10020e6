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

from service.control.ray_head import stop_recorded

WORLD = 4  # the head's CPUs: each module's jobs run 4 workers
_STARTED: list[Service] = []


@pytest.fixture(scope="session")
def ray_service(tmp_path_factory):
    """Session-scoped, as tests/system is no package: the hook below stops it as soon
    as the tests that use it are done, not at the end of the session."""
    root = str(tmp_path_factory.mktemp("ray-service"))
    service = Service(root, DMUON_MAX_RUNNING="1", DMUON_LOCAL_CPUS=str(WORLD), RAY_ADDRESS="")
    _STARTED.append(service)
    with service.serving():
        yield service


@pytest.fixture(scope="module")
def shared_service(ray_service):
    """The shared service, started again (with a new head) if it was stopped: after
    test_workloads' Ctrl-C, or by the hook below, when modules run in another order."""
    if ray_service.proc.poll() is not None:
        ray_service.start()
    return ray_service


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Once the last test in a row of those that use the shared service has torn down,
    the service and its head stop: no idle head through the tests that follow."""
    result = yield
    if "shared_service" in item.fixturenames and (
            nextitem is None or "shared_service" not in nextitem.fixturenames):
        for service in _STARTED:
            service.kill()
            stop_recorded(service.env["DMUON_STORAGE"])
    return result
