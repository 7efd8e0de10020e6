"""``dmuon-svc``: the control plane from a terminal.

    dmuon-svc submit job.yaml [--follow] [--dry-run] [--working-dir DIR|gcs://...zip]
    dmuon-svc status [JOB_ID]
    dmuon-svc logs [-f] JOB_ID
    dmuon-svc cancel JOB_ID
    dmuon-svc plan job.yaml
    dmuon-svc export JOB_ID [--no-wait]      sharded safetensors + config.json
    dmuon-svc prepare --tokenizer tokenizer.json --out DIR FILES...   (local, no service)

A spec file is YAML (``.yaml``, ``.yml``), JSON (``.json``) or TOML (``.toml``), by its
extension; one that does not parse is refused with its line and column, exit code 2. The
service is at ``DMUON_URL`` (default http://127.0.0.1:8000); ``DMUON_API_TOKEN`` is sent
as the bearer token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import requests

from .packages import RAY_URI, PackageError, zip_directory
from .spec import SpecError, load_spec
from .spec_files import SpecFileError
from .train.prepare import add_arguments as prepare_args
from .train.prepare import run as run_prepare


class ServiceError(RuntimeError):
    pass


def request(method: str, path: str, body=None, *, stream=False, data=None, content_type=None):
    """The service's answer (parsed JSON, or text), or the open response with
    ``stream``; ``DMUON_API_TOKEN`` goes as the bearer token."""
    url = os.environ.get("DMUON_URL", "http://127.0.0.1:8000").rstrip("/") + path
    token = os.environ.get("DMUON_API_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if content_type:
        headers["Content-Type"] = content_type
    try:
        resp = requests.request(method, url, json=body, data=data, headers=headers,
                                stream=stream,
                                timeout=(10, None if stream else 60))
    except requests.RequestException as e:
        raise ServiceError(f"cannot reach {url}: {e}") from None
    if resp.status_code >= 400:
        raise ServiceError(f"{resp.status_code} {resp.reason}: {resp.text[:2000]}")
    if stream:
        return resp
    try:
        return resp.json()
    except ValueError:
        return resp.text


def follow(job_id: str, total_steps: int, out=sys.stdout) -> str:
    """Progress line (step, loss, ETA) from the event stream; returns the final status.
    The ETA is the pace since the first step seen, so start-up time does not skew it."""
    status, first = "PENDING", None
    with request("GET", f"/v1/jobs/{job_id}/events", stream=True) as resp:
        event = None
        for line in resp.iter_lines(decode_unicode=True):
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if event == "status":
                    status = data["status"]
                elif data.get("rank") == 0:
                    step, now = data["step"], time.time()
                    first = first or (step, now)
                    pace = (now - first[1]) / (step - first[0]) if step > first[0] else 0
                    bar = "#" * int(30 * step / total_steps)
                    out.write(f"\r[{bar:<30}] step {step}/{total_steps} "
                              f"loss {data['loss']:.4f} ETA {pace * (total_steps - step):5.0f}s")
                    out.flush()
    out.write(f"\n{job_id}: {status}\n")
    return status


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dmuon-svc", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("submit")
    p.add_argument("spec")
    p.add_argument("--follow", action="store_true")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--working-dir", default=None,
                   help="a directory to upload with the job (its code), or a Ray package URI")
    sub.add_parser("status").add_argument("job_id", nargs="?")
    p = sub.add_parser("export")
    p.add_argument("job_id")
    p.add_argument("--no-wait", action="store_true")
    prepare_args(sub.add_parser("prepare", help="tokenize text/JSONL into token shards"))
    p = sub.add_parser("logs")
    p.add_argument("job_id")
    p.add_argument("-f", "--follow", action="store_true")
    sub.add_parser("cancel").add_argument("job_id")
    sub.add_parser("plan").add_argument("spec")
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except SpecFileError as e:  # a spec file that does not parse: a usage error
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ServiceError, SpecError, PackageError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def working_dir(reference: str) -> str:
    """An uploaded package id for a local directory; a Ray URI as it is."""
    if RAY_URI.match(reference):
        return reference
    answer = request("POST", "/v1/packages", data=zip_directory(reference),
                     content_type="application/zip")
    return answer["id"]


def export(job_id: str, wait: bool, poll_s: float = 1.0) -> int:
    answer = request("POST", f"/v1/jobs/{job_id}/export")
    print(answer["path"])
    status = None
    while wait and status not in ("SUCCEEDED", "FAILED", "STOPPED"):
        time.sleep(poll_s)
        status = request("GET", f"/v1/jobs/{job_id}/export?submission_id="
                                f"{answer['submission_id']}")["status"]
    if wait and status != "SUCCEEDED":
        print(f"export {answer['submission_id']}: {status}", file=sys.stderr)
    return 0 if not wait or status == "SUCCEEDED" else 1


def _run(args) -> int:
    if args.cmd == "prepare":
        return run_prepare(args)
    if args.cmd == "export":
        return export(args.job_id, not args.no_wait)
    if args.cmd in ("submit", "plan"):
        spec = load_spec(args.spec).model_dump(mode="json")
        if getattr(args, "working_dir", None):
            spec["working_dir"] = working_dir(args.working_dir)
        if args.cmd == "plan":
            print(json.dumps(request("POST", "/v1/plan", spec)["layout"]))
            return 0
        job = request("POST", "/v1/jobs", {"spec": spec, "dry_run": args.dry_run})
        print(job["id"])
        if args.follow:
            return 0 if follow(job["id"], spec["steps"]) == "SUCCEEDED" else 1
        return 0
    if args.cmd == "status":
        path = f"/v1/jobs/{args.job_id}" if args.job_id else "/v1/jobs"
        jobs = request("GET", path)
        for job in jobs if isinstance(jobs, list) else [jobs]:
            print(f"{job['id']}  {job['status']:<9}  {job['name']}")
        return 0
    if args.cmd == "cancel":
        print(request("POST", f"/v1/jobs/{args.job_id}/cancel")["status"])
        return 0
    if not args.follow:  # logs
        sys.stdout.write(request("GET", f"/v1/jobs/{args.job_id}/logs"))
        return 0
    with request("GET", f"/v1/jobs/{args.job_id}/logs?follow=true", stream=True) as resp:
        for chunk in resp.iter_content(chunk_size=None):
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
