"""Run a job spec on Ray Train: ``python -m service.driver.job_driver --spec job.yaml``.

Works under ``ray job submit --address ... --working-dir DIR -- python -m
service.driver.job_driver --spec job.yaml`` (it attaches to the cluster the job runs on)
and on its own (it then starts a local Ray on 127.0.0.1). With ``--plan`` (the control
plane's jobs) it runs the plan stored with the job, after checking that the live cluster
can still hold it, and completes a plan the control plane deferred (a model only the
job can import); without, it plans on the cluster it finds. Either way an impossible
layout, or an input path or size that cannot run (``service.job.inputs``), is refused with
the reason before any worker starts. ``--export-only`` exports the newest checkpoint.
Prints one line per step (``service.driver.reports.step_line``: the loss averaged over
the ranks, rank 0's LR and step time) and a final JSON summary; exits non-zero on
failure. Every rank's record is in ``<storage>/<job>/metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
import uuid

LOOPBACK_ENV = {
    # read when ray is imported: a local Ray then keeps 127.0.0.1 as its node address
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "GLOO_SOCKET_IFNAME": "lo",
    "OMP_NUM_THREADS": "1",
}
REPORT_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
# Ray Train's preemption watcher lets a training function take a just-in-time checkpoint
# when a node is drained (ray.train.get_preemption_info); this loop never asks, so it
# resumes from its last checkpoint as after any failure. The watcher's actor costs an
# E-level core-worker line in every job's log ("PreemptionWatcher ... max_restarts > 0");
# set RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=1 to have it anyway
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
STOPPED_EXIT = 130  # a shell's exit code for a process ended by Ctrl-C
if not os.environ.get("RAY_ADDRESS"):
    for _key, _value in LOOPBACK_ENV.items():
        os.environ.setdefault(_key, _value)

# torch and Ray are imported once the spec and its inputs have been checked: a spec
# that cannot run is refused in a second, not after the imports
from service.job import failure  # noqa: E402
from service.job.inputs import resolve_inputs, stored_inputs  # noqa: E402
from service.job.job import Job  # noqa: E402
from service.job.job_dir import EXPORT_FAILURE, FAILURE, INPUTS, PLAN  # noqa: E402
from service.job.plan_document import PlanDocument  # noqa: E402
from service.job.spec import SpecError, load_spec  # noqa: E402

from . import register  # noqa: E402
from .local_ray import init_local, shutdown_local  # noqa: E402

# --help's usage line: argparse would name the file
PROG = "python -m service.driver.job_driver"


def connect_ray(num_cpus: int | None = None) -> str | None:
    """Attach to ``RAY_ADDRESS`` (as under ``ray job submit``) or start Ray on loopback;
    the directory of a Ray started here (``local_ray``: removed at the end), else None."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray Train's controller collects reports when it polls the workers (every 2 s by
    # default): polling every 0.5 s gets each step's metrics to the service within 2 s
    os.environ.setdefault(REPORT_POLL_ENV, "0.5")
    os.environ.setdefault(PREEMPTION_WATCHER_ENV, "0")  # Ray Train passes it on
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        # no colour codes into a file or a pipe: in the prefix of the workers' lines
        # relayed here ("(TrainController pid=...)"), nor in Ray's own log lines
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
        for handler in logging.getLogger("ray").handlers:
            handler.addFilter(_plain_text)
    # the workers' collectives use these too (GLOO_SOCKET_IFNAME names the NIC)
    runtime_env = {"env_vars": {k: os.environ[k] for k in (*LOOPBACK_ENV, "RAY_AUTH_MODE",
                                                           REPORT_POLL_ENV)
                                if k in os.environ},
                   # every worker knows its own cluster: no search among the machine's
                   "worker_process_setup_hook": "service.worker.worker_env.name_the_cluster"}
    if os.environ.get("RAY_ADDRESS"):
        # under `ray job submit` the job's own runtime env may set the same variables:
        # combine the two rather than refuse
        os.environ.setdefault("RAY_OVERRIDE_JOB_RUNTIME_ENV", "1")
        ray.init(runtime_env=runtime_env, log_to_driver=True)
        return None
    return init_local(ray, num_cpus=num_cpus, _node_ip_address="127.0.0.1",
                      runtime_env=runtime_env, dashboard_host="127.0.0.1")


def _plain_text(record: logging.LogRecord) -> bool:
    """A log record's text without terminal escape codes (Ray colours the dashboard's
    address in "Started a local Ray instance" whatever the output is)."""
    record.msg, record.args = failure.strip_ansi(record.getMessage()), None
    return True


def local_cpus(spec, given: int | None = None) -> int:
    """The CPUs of a local Ray started here: ``given`` (``--num-cpus``), else
    ``DMUON_LOCAL_CPUS`` (the control plane's local head reads it too), else the
    machine's CPUs or what the spec's explicit layout asks for, whichever is more: Ray
    counts logical CPUs, so a 2 x 2 job runs on a 2-core machine as the control plane's
    head runs it (4 by default)."""
    if given is not None:
        return given
    if os.environ.get("DMUON_LOCAL_CPUS"):
        return int(os.environ["DMUON_LOCAL_CPUS"])
    lay = spec.layout
    tp = lay.tp if lay.tp != "auto" else 1
    workers = (lay.replicate * lay.shard * tp if lay.replicate and lay.shard else
               lay.nodes * lay.workers_per_node if "auto" not in (lay.nodes,
                                                                   lay.workers_per_node)
               else 0)
    return max(os.cpu_count() or 1, math.ceil(workers * spec.resources_per_worker.CPU))


def plan_to_run(spec, plan: PlanDocument | None, model_source: dict) -> PlanDocument:
    """The plan the workers run: the stored one, once the live cluster is seen to hold it
    (else PlacementError with the reason), completed here when the control plane could
    not build the model (a factory from the job's working_dir); or one made now."""
    from service.job.plan.layout_choice import check_fits
    from service.job.plan.make import elastic_plan, placement_document, with_batch_splits
    from service.job.plan.predict import predict

    from .ray_inventory import inventory_from_ray

    nodes = inventory_from_ray()
    if plan is None or (plan.elastic is not None and not plan.complete):
        if spec.layout.elastic is not None:
            made = elastic_plan(spec, nodes, 0, model_source)
            return made if plan is None else made.model_copy(
                update={"completed_by": "driver", "inventory": plan.inventory})
        placement = predict(spec, nodes, model_source=model_source)
        return placement_document(placement, {"source": "cluster", "nodes": len(nodes)})
    plan = with_batch_splits(spec, plan)  # a document stored before layouts carried it
    if plan.elastic is not None:  # Ray Train waits for the range's smallest count of nodes
        check_fits(plan.layout.replace(replicate=1, nodes=1), spec, nodes)
        return plan
    check_fits(plan.layout, spec, nodes)
    if plan.complete:
        return plan
    placement = predict(spec, nodes, model_source=model_source, layout=plan.layout)
    completed = placement_document(placement, plan.inventory.model_dump())
    return completed.model_copy(update={"completed_by": "driver"})


def run_job(spec, *, job_id: str, storage: str, plan: dict | None = None,
            inputs: dict | None = None, return_params: str | None = None,
            post_url: str | None = None, token: str | None = None, export_only=False,
            plan_url: str | None = None):
    """Fit a TorchTrainer on the layout; returns (ray Result, layout, last step reported)."""
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from service.worker import layout_events
    from service.worker import loop as train

    from . import tracking_callback
    from .reports import MetricsCallback, send

    job_dir = os.path.join(storage, job_id)
    failure_file = failure_path(storage, job_id, export_only)
    with contextlib.suppress(FileNotFoundError):  # a reason from an earlier run of this id
        os.remove(failure_file)
    inputs = inputs or resolve_inputs(spec, os.path.join(storage, "data"), storage)
    stored = plan
    plan = plan_to_run(spec, plan, inputs["model"])
    os.makedirs(job_dir, exist_ok=True)
    with open(os.path.join(job_dir, PLAN), "w") as fh:  # what the workers run
        fh.write(plan.model_dump_json())
    if plan_url and stored is not None and not stored.complete:  # completed here: stored
        send(plan_url, plan.model_dump(mode="json"), token, method="put")
    # made once, from the plan just stored, and handed to every worker as it is
    config = {"job": Job.stored(spec, plan, inputs, job_dir, export_only),
              "return_params": return_params, "failure_file": failure_file}
    metrics = MetricsCallback(job_id, job_dir, post_url, token)
    waits = _elastic_controls(spec.layout.elastic, plan, failure_file)
    trainer = TorchTrainer(
        train.train_loop_per_worker, train_loop_config=config,
        scaling_config=ScalingConfig(**plan.scaling.config_kwargs()),
        torch_config=TorchConfig(backend="nccl" if spec.resources_per_worker.GPU
                                 else "gloo", timeout_s=120),
        run_config=RunConfig(
            name=f"{job_id}-export" if export_only else job_id, storage_path=storage,
            # checkpoints are stored once, in <job>/dcp, never handed to Ray Train: a
            # restarted group resumes from the newest committed one there
            failure_config=FailureConfig(max_failures=spec.max_failures),
            # Ray Train's own INFO lines (every rank's every report, in full) stay in
            # its session log files; its warnings and errors still reach the job's log
            logging_config=LoggingConfig(log_level="WARNING"),
            callbacks=[metrics, *tracking_callback.callbacks(
                spec, job_dir, plan.scaling.num_workers, export_only), *waits],
        ),
    )
    result = trainer.fit()
    # the callback ran on Ray Train's controller actor; its spool is on shared storage
    ran = layout_events.last_layout(job_dir)  # an elastic job's may differ from the plan's
    layout = plan.layout if ran is None else plan.for_world(math.prod(ran)).layout
    return result, layout, layout_events.last_step(metrics.path)


def _elastic_controls(elastic, plan: PlanDocument, failure_file: str) -> list:
    """An elastic job's settings for Ray Train's controller: its worker-group start
    timeout, and the callback that bounds its wait for capacity (``max_wait_s``)."""
    if elastic is None:
        return []
    # read by the controller from its environment, which Ray Train copies from here
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(elastic.start_timeout_s)
    if elastic.max_wait_s is None:
        return []
    from .deadline import CapacityDeadline

    return [CapacityDeadline(plan, elastic.max_wait_s, failure_file)]


def failure_path(storage: str, job_id: str, export_only: bool = False) -> str:
    name = EXPORT_FAILURE if export_only else FAILURE
    return os.path.join(os.path.abspath(storage), job_id, name)


def failure_reason(error: BaseException, path: str) -> dict:
    """The job's reason: the one its first failing worker wrote, else one made here from
    what Ray Train raised (a worker that died without a Python exception, a refused
    layout), written for the control plane too."""
    found = failure.read_reason(path)
    if found is not None:
        return found
    rank, cause, frames = None, error, None
    workers = getattr(error, "worker_failures", None)  # ray.train.WorkerGroupError
    if workers:
        rank = min(workers)
        cause = workers[rank]
        base = getattr(cause, "_base_exc", None)  # Ray's wrapper with the traceback text
        if base is not None:
            frames = failure.frames_from_text(str(cause))
            cause = base
    reason = failure.describe(cause, rank=rank, step=None, phase=None, source="entrypoint",
                              frames=frames)
    failure.record_first(path, reason)
    return failure.read_reason(path) or reason


def _arguments(argv):
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True,
                    help="job spec: .yaml/.yml, .json or .toml (a file that does not "
                         "parse exits 2 with its line and column)")
    ap.add_argument("--plan", default=None,
                    help="the stored plan (JSON) to run, checked against the live cluster")
    ap.add_argument("--storage", default=os.environ.get("DMUON_STORAGE",
                                                        os.path.abspath("dmuon_runs")))
    ap.add_argument("--data-root", default=os.environ.get("DMUON_DATA_ROOT"),
                    help="where data.source files live (default <storage>/data)")
    ap.add_argument("--job-id", default=os.environ.get("DMUON_JOB_ID"))
    ap.add_argument("--num-cpus", type=int, default=None,
                    help="CPUs of the local Ray this starts when RAY_ADDRESS is unset "
                         "(default: DMUON_LOCAL_CPUS, else the machine's CPUs or the "
                         "spec's workers x resources_per_worker.CPU, whichever is more)")
    ap.add_argument("--metrics-url", default=os.environ.get("DMUON_METRICS_URL"))
    ap.add_argument("--plan-url", default=None,
                    help="where to store a plan this entrypoint completes (the control plane)")
    ap.add_argument("--token-file", default=None,
                    help="the job's own token for its metric posts")
    ap.add_argument("--export-only", action="store_true",
                    help="no training: export the newest checkpoint to <storage>/<job>/export")
    ap.add_argument("--final-params", default=None,
                    help="write every parameter in full (torch.save) here at the end")
    return ap.parse_args(argv)


def _inputs(args) -> tuple:
    """(spec, plan, inputs, token): everything read and checked before Ray starts."""
    spec = load_spec(args.spec)
    plan = None
    if args.plan:
        with open(args.plan) as fh:
            plan = PlanDocument.model_validate_json(fh.read())
    storage = os.path.abspath(args.storage)
    kept = os.path.join(os.path.dirname(args.plan), INPUTS) if args.plan else None
    if kept and os.path.isfile(kept):  # resolved by the control plane: not again
        with open(kept) as fh:
            inputs = stored_inputs(fh.read())
    else:
        inputs = resolve_inputs(spec, args.data_root or os.path.join(storage, "data"),
                                storage)
    token = None
    if args.token_file:
        with open(args.token_file) as fh:
            token = fh.read().strip()
    return spec, plan, inputs, token


def main(argv=None) -> int:
    args = _arguments(argv)
    try:
        spec, plan, inputs, token = _inputs(args)
        plan, token = register.register_if_submitted(args, spec, plan, token)
    except (SpecError, OSError, ValueError, register.RegistrationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _run(args, spec, plan, inputs, token)


def _run(args, spec, plan, inputs, token) -> int:
    job_id = args.job_id or f"{spec.name}-{uuid.uuid4().hex[:8]}"
    failed = failure_path(args.storage, job_id, args.export_only)
    # a complete plan was checked against the model where it was made (the planner
    # partitioned that model), and each worker's dedicate_params(plan=...) checks it
    # again before any collective: no third build of the model here
    local = connect_ray(local_cpus(spec, args.num_cpus))
    try:
        return _run_on_ray(args, spec, plan, inputs, token, job_id, failed)
    finally:
        if local is not None:  # the Ray started here, and its session directory
            import ray

            shutdown_local(ray, local)


def _run_on_ray(args, spec, plan, inputs, token, job_id: str, failed: str) -> int:
    from service.job.models.params import ParamRuleError
    from service.job.plan.layout_choice import PlacementError

    signal.signal(signal.SIGTERM, _stop_as_on_ctrl_c)
    start = time.time()
    summary = {"job_id": job_id, "status": "SUCCEEDED", "error": None}
    try:
        result, layout, last_step = run_job(
            spec, job_id=job_id, storage=os.path.abspath(args.storage), plan=plan,
            inputs=inputs, return_params=args.final_params,
            post_url=args.metrics_url, token=token, export_only=args.export_only,
            plan_url=args.plan_url)
        # Ray Train's Result keeps metrics only with a checkpoint
        summary.update(layout=list(layout.mesh_shape), final_step=last_step)
        if result.error:
            summary.update(status="FAILED", error=str(result.error),
                           reason=failure_reason(result.error, failed))
    except PlacementError as e:
        failure_reason(e, failed)
        hint = "" if os.environ.get("RAY_ADDRESS") else (
            " (the local Ray started here has the CPUs --num-cpus or DMUON_LOCAL_CPUS "
            "gives it)")
        print(f"error: layout refused: {e}{hint}", file=sys.stderr)
        return 2
    except (ParamRuleError, SpecError) as e:
        failure_reason(e, failed)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - Ray Train raises its own errors on failure
        summary.update(status="FAILED", error=f"{type(e).__name__}: {e}",
                       reason=failure_reason(e, failed))
    except (KeyboardInterrupt, SystemExit):  # Ray Train's handler aborted the run
        summary.update(status="STOPPED", error="stopped (Ctrl-C, SIGTERM or a cancel)")
    summary["seconds"] = round(time.time() - start, 2)
    print(json.dumps({"summary": summary}), flush=True)
    return {"SUCCEEDED": 0, "STOPPED": STOPPED_EXIT}.get(summary["status"], 1)


def _stop_as_on_ctrl_c(signum, frame) -> None:
    """SIGTERM (``ray job stop``, a cancel through the control plane) does what Ctrl-C
    does: Ray Train's SIGINT handler, set while ``fit`` runs, aborts the run through its
    controller, whose abort hook ends the trackers' runs KILLED; the default SIGTERM
    would end this driver at once, and with it the controller, its runs left RUNNING.
    Before ``fit``, the driver ends as it would have."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler) and handler is not signal.default_int_handler:
        print(f"stopping: {signal.Signals(signum).name} received; aborting the run",
              file=sys.stderr, flush=True)
        handler(signal.SIGINT, frame)
    else:
        raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
