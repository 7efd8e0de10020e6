"""A job started with ``ray job submit`` registers itself with the control plane.

With ``DMUON_URL`` in the job's environment (and ``DMUON_API_TOKEN`` when the service
has one), an entrypoint that the control plane did not start (no ``--job-id``) posts its
spec and its Ray submission id to ``POST /v1/jobs/register``. The service plans it, stores
it under that id and follows it on its cluster like its own jobs; the entrypoint then
runs the stored plan, posts its step records with the job token it got back, and stores
a plan it completes, exactly as for a job the control plane submitted.
"""

from __future__ import annotations

import json
import os
import sys

from service.job.plan_document import PlanDocument

# Ray's job supervisor hands the entrypoint its job config, the submission id included
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
TIMEOUT_S = 120  # the service plans the job on the meta device before it answers


class RegistrationError(RuntimeError):
    """The control plane could not be reached, or refused the job (its answer says why)."""


def submission_id() -> str | None:
    """This process's Ray submission id, when Ray's job API started it."""
    try:
        config = json.loads(os.environ.get(JOB_CONFIG_ENV) or "{}")
    except ValueError:
        return None
    return (config.get("metadata") or {}).get("job_submission_id")


def register_if_submitted(args, spec, plan: PlanDocument | None, token: str | None):
    """(plan, token) to run with. Registered (``DMUON_URL`` set, no job id given, run by
    ``ray job submit``): the service's plan and the job's own token, with ``args``'
    job id and URLs set to the registered job's; otherwise ``plan`` and ``token``."""
    url = (os.environ.get("DMUON_URL") or "").rstrip("/")
    if not url or args.job_id:
        return plan, token
    sid = submission_id()
    if sid is None:
        print("note: DMUON_URL is set, but this run was not started by `ray job submit`: "
              "it is not registered with the control plane", file=sys.stderr)
        return plan, token
    if args.plan:
        raise RegistrationError("--plan with DMUON_URL: a registered job runs the plan "
                                "the control plane stores for it; drop one of them")
    answer = _post(f"{url}/v1/jobs/register",
                   # only what the spec sets: the plan then says which of its
                   # choices (dmuon.mode, say) are the spec's and which the defaults'
                   {"spec": spec.model_dump(mode="json", exclude_unset=True),
                    "submission_id": sid})
    args.job_id = sid
    args.metrics_url = f"{url}/v1/jobs/{sid}/metrics"
    args.plan_url = f"{url}/v1/jobs/{sid}/plan"
    print(f"registered as job {sid} with the control plane at {url}", file=sys.stderr,
          flush=True)
    return PlanDocument.model_validate(answer["plan"]), answer["job_token"]


def _post(url: str, body: dict) -> dict:
    import requests

    admin = os.environ.get("DMUON_API_TOKEN")
    headers = {"Authorization": f"Bearer {admin}"} if admin else {}
    try:
        resp = requests.post(url, json=body, headers=headers, timeout=TIMEOUT_S)
    except requests.RequestException as e:
        raise RegistrationError(f"cannot register with the control plane at {url} "
                                f"(DMUON_URL): {e}") from None
    if resp.status_code != 201:
        try:
            detail = resp.json().get("detail", resp.text)
        except ValueError:
            detail = resp.text
        raise RegistrationError(f"the control plane refused the job ({url}: "
                                f"{resp.status_code}): {json.dumps(detail)}")
    return resp.json()
