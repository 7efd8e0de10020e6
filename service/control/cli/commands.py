"""dmuon-svc: the control plane from a terminal (click).

    dmuon-svc submit job.yaml [--follow] [--dry-run] [--working-dir DIR|gcs://...zip]
    dmuon-svc list [--status S] [--limit N] [--json]
    dmuon-svc status [JOB_ID] [--json]
    dmuon-svc logs [-f] [--raw] JOB_ID
    dmuon-svc cancel JOB_ID
    dmuon-svc plan job.yaml [--json] [--nodes N --gpus-per-node G --gpu-memory-gb M]
    dmuon-svc export JOB_ID [--no-wait]      sharded safetensors + config.json
    dmuon-svc prepare --tokenizer tokenizer.json --out DIR FILES...   (local, no service)

Command output (job ids, statuses, tables, JSON) goes to stdout; diagnostics (phases,
progress, warnings, errors) go to stderr through ``logging``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import click

from service.job.failure import strip_ansi
from service.job.inputs.prepare import add_arguments as prepare_args
from service.job.inputs.prepare import run as run_prepare
from service.job.inputs.working_dir import RAY_URI, PackageError, zip_directory
from service.job.spec import SpecError, load_spec
from service.job.spec.spec_files import SpecFileError

from .http import DEFAULT_URL, ServiceError, request
from .output import failure_line, losses_line, plan_text, reason_details, setup_logging
from .progress import follow

__all__ = ["ServiceError", "follow", "main", "request"]
log = logging.getLogger("service.control.cli")
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
ENV = ("\b\nEnvironment:\n"
       f"  DMUON_URL        the control plane's address (default {DEFAULT_URL})\n"
       "  DMUON_API_TOKEN  sent as the bearer token (unset: no Authorization header)")
SPEC_FILES = ("SPEC_FILE is YAML (.yaml, .yml), JSON (.json) or TOML (.toml), by its "
              "extension; a file that does not parse is refused with its line and column, "
              "exit code 2.")


@click.group(context_settings=CONTEXT, epilog=ENV)
@click.option("-v", "--verbose", is_flag=True, help="Also print debug diagnostics.")
@click.option("-q", "--quiet", is_flag=True,
              help="Print only warnings and errors on stderr (no phase or step lines).")
def app(verbose: bool, quiet: bool) -> None:
    """Submit, follow and inspect dmuon training jobs on the control plane.

    Command output (job ids, statuses, tables, JSON) goes to stdout; diagnostics
    (start-up phases, progress, warnings, errors) to stderr.

    \b
    Exit codes:
      0  done (with --follow: the job SUCCEEDED)
      1  the service refused or could not be reached, or the job did not succeed
      2  a usage error, or a spec file that does not parse
    """
    setup_logging(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)


def _spec(path: str, working_dir: str | None = None) -> dict:
    """The spec as the file sets it: checked here, sent without the defaults it leaves
    unset, so the service knows what the spec chose (``plan`` says ``dmuon.mode: z3``
    came from the spec or is the default)."""
    spec = load_spec(path).model_dump(mode="json", exclude_unset=True)
    if working_dir:
        spec["working_dir"] = upload_working_dir(working_dir)
    return spec


def upload_working_dir(reference: str) -> str:
    """An uploaded package id for a local directory; a Ray URI as it is."""
    if RAY_URI.match(reference):
        return reference
    log.info("uploading %s ...", reference)
    answer = request("POST", "/v1/packages", data=zip_directory(reference),
                     content_type="application/zip")
    return answer["id"]


@app.command(epilog=ENV, short_help="Submit a job spec; print its id (--follow: to its end).")
@click.argument("spec_file")
@click.option("--follow", "follow_job", is_flag=True,
              help="Show the start-up phases, then a progress bar (step, loss, ETA) until "
                   "the job ends; the exit code is 0 only if it SUCCEEDED, and a failed "
                   "job's reason is printed.")
@click.option("--dry-run", is_flag=True,
              help="Plan and store the job without running it.")
@click.option("--working-dir", metavar="DIR|URI",
              help="A directory to upload with the job (a factory model's code), or a Ray "
                   "package URI (gcs://..., s3://..., https://... ending in .zip).")
def submit(spec_file: str, follow_job: bool, dry_run: bool, working_dir: str | None) -> int:
    """Submit the job SPEC_FILE describes; print its id.

    {spec_files}
    """
    spec = _spec(spec_file, working_dir)
    job = request("POST", "/v1/jobs", {"spec": spec, "dry_run": dry_run})
    click.echo(job["id"])
    if follow_job:
        return 0 if follow(job["id"], job["spec"]["steps"]) == "SUCCEEDED" else 1
    return 0


# the job store's (service.control.sql_tables.STATES), kept here: the CLI imports no SQLAlchemy
STATES = ("PENDING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED")


@app.command("list", epilog=ENV, short_help="List the jobs, newest first, with their status.")
@click.option("--status", "only", type=click.Choice(STATES), help="Only the jobs in this "
              "status.")
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True,
              help="At most this many jobs.")
@click.option("--json", "as_json", is_flag=True, help="Print the service's JSON instead.")
def list_jobs(only: str | None, limit: int, as_json: bool) -> int:
    """Every job, newest first: id, status, name; a failed job's reason (exception
    type, message, rank and step) follows its line when the service gives one.
    "dmuon-svc status JOB_ID" shows one job with its last frames."""
    query = f"?limit={limit}" + (f"&status={only}" if only else "")
    jobs = request("GET", f"/v1/jobs{query}")
    if as_json:
        click.echo(json.dumps(jobs, indent=2))
    else:
        _print_jobs(jobs, details=False)
    return 0


@app.command(epilog=ENV, short_help="Show one job (no JOB_ID: list them), with why it failed.")
@click.argument("job_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the service's JSON instead.")
def status(job_id: str | None, as_json: bool) -> int:
    """One job (JOB_ID) with its status; without JOB_ID every job, as "list" prints
    them.

    A failed job's reason (exception type, message, rank and step), when the service
    gives one, follows its line; for one job, with its last frames.
    """
    jobs = request("GET", f"/v1/jobs/{job_id}" if job_id else "/v1/jobs")
    if as_json:
        click.echo(json.dumps(jobs, indent=2))
    else:
        _print_jobs(jobs if isinstance(jobs, list) else [jobs], details=bool(job_id))
    return 0


def _print_jobs(jobs: list[dict], details: bool) -> None:
    """``id  status  name`` a line, a failed job's reason under it (``details``: the
    reason's further lines and last frames too)."""
    for job in jobs:
        click.echo(f"{job['id']}  {job['status']:<9}  {job['name']}")
        if details and job.get("last"):
            click.echo(f"  {losses_line(job['last'])}")
        failed = failure_line(job)
        if failed:
            click.echo(f"  {failed}")
            for line in reason_details(job) if details else []:
                click.echo(line)


@app.command(epilog=ENV, short_help="Print or stream a job's driver output.")
@click.argument("job_id")
@click.option("-f", "--follow", "stream", is_flag=True,
              help="Stream the output until the job ends.")
@click.option("--raw", is_flag=True,
              help="The log exactly as Ray keeps it, terminal escape codes included.")
def logs(job_id: str, stream: bool, raw: bool) -> int:
    """The job's driver output (Ray's job logs) for JOB_ID: a line per step (the loss
    averaged over the ranks, rank 0's LR and step time), Ray's and the job's warnings
    and errors in full, and the final summary. Without a terminal on stdout, Ray's
    colour codes are taken out unless --raw is given."""
    plain = not raw and not sys.stdout.isatty()
    if not stream:
        text = request("GET", f"/v1/jobs/{job_id}/logs")
        sys.stdout.write(strip_ansi(text) if plain else text)
        return 0
    with request("GET", f"/v1/jobs/{job_id}/logs?follow=true", stream=True) as resp:
        # by line: an escape code split between two chunks is still taken out whole
        pieces = ((strip_ansi(line.decode(errors="replace")) + "\n"
                   for line in resp.iter_lines()) if plain else
                  (chunk.decode(errors="replace") for chunk in resp.iter_content(None)))
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
    return 0


@app.command(epilog=ENV, short_help="Stop a queued or running job.")
@click.argument("job_id")
def cancel(job_id: str) -> int:
    """Cancel JOB_ID (queued or running: it becomes STOPPED); print its status."""
    click.echo(request("POST", f"/v1/jobs/{job_id}/cancel")["status"])
    return 0


@app.command(epilog=ENV, short_help="The layout, mode and per-rank predictions of a spec.")
@click.argument("spec_file")
@click.option("--json", "as_json", is_flag=True,
              help="Print the plan document (layout, inventory, modes, per-rank "
                   "predictions, partition) as JSON instead of tables.")
@click.option("--nodes", type=click.IntRange(1), metavar="N",
              help="Plan on N hypothetical nodes, here, without the service.")
@click.option("--gpus-per-node", type=click.IntRange(0), default=8, show_default=True,
              help="With --nodes: the GPUs of each node (one per worker; 0: CPU workers).")
@click.option("--gpu-memory-gb", type=click.FloatRange(min=0, min_open=True),
              help="With --nodes: one GPU's memory (default: the spec's "
                   "dmuon.device_memory_gb, else 80).")
def plan(spec_file: str, as_json: bool, nodes: int | None, gpus_per_node: int,
         gpu_memory_gb: float | None) -> int:
    """Plan SPEC_FILE without a job: the layout, the mode and why, and per rank the
    owned Muon elements, Newton-Schulz FLOPs, bytes held by kind and bytes sent per
    step by mesh dim and phase. With --nodes, on a hypothetical cluster of that many
    nodes, on this machine (a GPU plan from a CPU machine; no service needed).

    {spec_files}
    """
    if nodes is not None:
        from .local_plan import local_plan

        try:
            answer = local_plan(spec_file, nodes, gpus_per_node, gpu_memory_gb)
        except ImportError as e:  # the client alone: no torch here
            raise click.UsageError(f"--nodes plans here, which needs the dmuon package "
                                   f"and torch installed ({e})") from None
        click.echo(json.dumps(answer) if as_json else plan_text(answer))
        return 0
    answer = request("POST", "/v1/plan", _spec(spec_file))
    click.echo(json.dumps(answer) if as_json else plan_text(answer))
    return 0


@app.command(epilog=ENV, short_help="Export a job's newest checkpoint as safetensors.")
@click.argument("job_id")
@click.option("--no-wait", is_flag=True, help="Print the export directory and return "
                                              "without waiting for the export job.")
def export(job_id: str, no_wait: bool) -> int:
    """Export an ended job's newest checkpoint (sharded safetensors + config.json) by a
    Ray job of its own; print the export directory, then wait for it to end."""
    return export_job(job_id, not no_wait)


def export_job(job_id: str, wait: bool, poll_s: float = 1.0) -> int:
    answer = request("POST", f"/v1/jobs/{job_id}/export")
    click.echo(answer["path"])
    status = None
    while wait and status not in ("SUCCEEDED", "FAILED", "STOPPED"):
        time.sleep(poll_s)
        status = request("GET", f"/v1/jobs/{job_id}/export?submission_id="
                                f"{answer['submission_id']}")["status"]
    if wait and status != "SUCCEEDED":
        log.error("export %s: %s", answer["submission_id"], status)
    return 0 if not wait or status == "SUCCEEDED" else 1


for _command in (submit, plan):
    _command.help = _command.help.format(spec_files=SPEC_FILES)


# -- prepare: its options are service.job.inputs.prepare's (one definition for both entry points)
PREPARE_HELP = {"shard_tokens": "At most this many tokens per shard file."}
PREPARE_METAVAR = {"tokenizer": "FILE", "out": "DIR", "field": "NAME", "val_every": "K",
                   "shard_tokens": "N"}
PREPARE_ENV = ("\b\nEnvironment:\n"
               "  RAY_ADDRESS  with --ray, the cluster Ray Data runs on (unset: Ray's default,\n"
               "               a cluster started on this machine, else a new local one)")


def _click_param(action: argparse.Action) -> click.Parameter:
    """A click parameter for one of ``prepare``'s argparse arguments."""
    if not action.option_strings:
        return click.Argument([action.dest], nargs=-1 if action.nargs in ("+", "*") else 1,
                              required=action.nargs != "*")
    text = action.help or PREPARE_HELP[action.dest]
    text = text[0].upper() + text[1:] + ("" if text.endswith(".") else ".")
    if isinstance(action, argparse._StoreTrueAction):
        return click.Option([action.dest, *action.option_strings], is_flag=True, help=text)
    return click.Option([action.dest, *action.option_strings], type=action.type or str,
                        default=action.default, required=action.required,
                        show_default=not action.required, help=text,
                        metavar=action.metavar or PREPARE_METAVAR.get(action.dest))


def _prepare_command() -> click.Command:
    parser = argparse.ArgumentParser(add_help=False)
    prepare_args(parser)
    actions = [a for a in parser._actions if a.dest != "help"]  # argparse's own list
    inputs = [a for a in actions if not a.option_strings]
    described = "; ".join(f"{a.dest.upper()}: {a.help}" for a in inputs)

    def callback(**values) -> int:
        values = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
        return run_prepare(argparse.Namespace(**values))

    return click.Command(
        "prepare", callback=callback, params=[_click_param(a) for a in actions],
        epilog=PREPARE_ENV, context_settings=CONTEXT,
        short_help="Tokenize text or JSONL into token shards (local).",
        help="Tokenize text or JSONL files into token shards for data.source, on this "
             "machine (no service): train_NNNNNN.bin and val_NNNNNN.bin (llm.c's "
             f"header) and meta.json under --out. {described}.")


app.add_command(_prepare_command())


def main(argv=None) -> int:
    """The exit code: 0, 1 (the service or the job), 2 (usage, a spec file that does
    not parse), 130 (interrupted)."""
    setup_logging()
    try:
        return app.main(args=argv, prog_name="dmuon-svc", standalone_mode=False) or 0
    except click.ClickException as e:  # usage errors: 2
        e.show()
        return e.exit_code
    except click.Abort:  # Ctrl-C
        log.error("interrupted (a submitted job goes on: dmuon-svc cancel JOB_ID stops it)")
        return 130
    except SpecFileError as e:  # a spec file that does not parse: a usage error
        log.error("%s", e)
        return 2
    except SpecError as e:  # one line per field a spec file gets wrong
        # as a 422's: a head, then a line per field (the service refusing the same spec)
        log.error("%s", "\n".join(["invalid job spec:", *(f"  {f}" for f in e.fields)])
                  if e.fields else e)
        return 1
    except (ServiceError, PackageError, OSError) as e:
        log.error("%s", e)
        return 1
