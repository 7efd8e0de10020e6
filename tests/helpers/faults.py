"""Faults at exact steps, for tests only: a wrapper around the production train loop,
entrypoint and service, so production code carries no test hook.

``FAULT`` forms: ``rank:step:marker`` makes that rank exit abruptly as the step begins
(once: the marker file records it); ``hold:<dir>`` makes every rank wait before step s
while ``<dir>/step_<s>`` exists, so a test can inject a fault at an exact step however
far the metrics lag behind the workers.

    python tests/helpers/faults.py entrypoint FAULT -- <service.driver.job_driver arguments>
    python tests/helpers/faults.py serve FAULT -- <dmuon-serve arguments>   (its jobs get FAULT)
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT]  # run as a script: the checkout, not an installed copy


def before_step(rank: int, step: int, fault: str) -> None:
    if fault.startswith("hold:"):
        while os.path.exists(os.path.join(fault[len("hold:"):], f"step_{step}")):
            time.sleep(0.05)
        return
    f_rank, f_step, marker = fault.split(":", 2)
    if rank == int(f_rank) and step == int(f_step) and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(17)  # abrupt: no cleanup, no exception for Ray to catch


def faulty_loop(config: dict, fault: str) -> None:
    """The production loop, with ``before_step`` run after each report (a step's report
    is the last thing before the next step begins) and before step 1."""
    import ray.train
    import torch.distributed as dist

    from service.worker import loop as train

    report = ray.train.report

    def report_then_fault(metrics, *args, **kwargs):
        report(metrics, *args, **kwargs)
        before_step(dist.get_rank(), metrics["step"] + 1, fault)

    ray.train.report = report_then_fault  # this worker process only
    before_step(dist.get_rank(), 1, fault)  # a held job is RUNNING with no record yet
    train.train_loop_per_worker(config)


@contextlib.contextmanager
def installed(fault: str):
    """While open, ``service.driver.job_driver.run_job`` trains with ``faulty_loop``."""
    import ray.cloudpickle

    from service.worker import loop as train

    if __name__ != "__main__":  # workers cannot import tests/: ship this module's code
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    production = train.train_loop_per_worker
    train.train_loop_per_worker = functools.partial(faulty_loop, fault=fault)
    try:
        yield
    finally:
        train.train_loop_per_worker = production


def main(argv: list[str]) -> int:
    role, fault, _, *rest = argv
    if role == "entrypoint":
        from service.driver import job_driver as entrypoint

        with installed(fault):
            return entrypoint.main(rest)
    from service.control import serve
    from service.control import submitter as runner

    # the service's jobs run this wrapper's entrypoint with the same fault
    runner.ENTRYPOINT = (sys.executable, os.path.abspath(__file__), "entrypoint", fault, "--")
    return serve.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
