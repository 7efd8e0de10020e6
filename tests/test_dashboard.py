"""The dashboard in Debian's Chromium against a real control plane (uvicorn, no Ray),
issue 43 item 10: a chart's right-axis tick labels are not under its legend (their boxes
against the legend's, as the page lays them out), the token form stays in view wherever
the page is scrolled, and the log view shows the log once the token is entered, without
closing and reopening it. Reads are public here (the default); the log needs the token."""

from __future__ import annotations

import os

import pytest
from _browser import ARTIFACTS, page_with_errors
from _http import Service

STEPS, RANKS = 20, 4
TOKEN_NEEDED = "this service needs an API token"
BOXES = """(id) => {
  const box = (e) => { const b = e.getBoundingClientRect();
                       return [b.left, b.top, b.right, b.bottom]; };
  const chart = document.getElementById(id);
  return { chart: box(chart), legend: box(chart.querySelector(".legend .bg")),
           labels: [...chart.querySelectorAll(".ytick text, .y2tick text")].map(
             (t) => [t.textContent, t.closest(".y2tick") ? "right" : "left", ...box(t)]) };
}"""


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    os.makedirs(ARTIFACTS, exist_ok=True)
    service = Service(str(tmp_path_factory.mktemp("dashboard")), DMUON_LOCAL_RAY="0")
    yield service
    service.kill()


@pytest.fixture(scope="module")
def job(svc):
    """A dry run with step records as a job's ranks post them: the LR of two groups, a
    gradient norm a thousand times larger (its own axis, on the right), throughput and
    MFU (on the right of the throughput chart)."""
    status, job = svc.request("POST", "/v1/jobs", {"spec": {"model": "tiny", "steps": STEPS},
                                                   "dry_run": True})
    assert status == 201, job
    records = [{"job_id": job["id"], "step": s, "rank": r, "loss": 5.0 - s / 10,
                "lr": {"muon": 0.02 * s / STEPS, "adamw": 0.003 * s / STEPS},
                "grad_norm": 1000.0 + 1234.5 * s, "tokens_per_s_total": 5000.0 + 10 * s,
                "mfu": 0.3 + s / 1000, "step_time_s": 0.1}
               for s in range(1, STEPS + 1) for r in range(RANKS)]
    assert svc.request("POST", f"/v1/jobs/{job['id']}/metrics", records)[1] == {
        "inserted": STEPS * RANKS}
    return job


def _overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


@pytest.mark.parametrize("chart", ["lr-chart", "throughput-chart"])
def test_no_axis_label_is_under_the_legend_or_outside_the_chart(svc, job, chart):
    with page_with_errors() as (page, errors):
        page.goto(f"{svc.url}/#job={job['id']}")
        page.wait_for_function(f"document.querySelectorAll('#{chart} .y2tick text').length "
                               f"> 1 && document.querySelector('#{chart} .legend .bg')",
                               timeout=60_000)
        boxes = page.evaluate(BOXES, chart)
        page.locator(f"#{chart}").screenshot(path=os.path.join(ARTIFACTS, f"{chart}.png"))
        assert errors == []
    right = [label for label in boxes["labels"] if label[1] == "right"]
    assert len(right) >= 2, boxes
    for text, side, *label in boxes["labels"]:
        assert not _overlap(label, boxes["legend"]), (text, side, label, boxes["legend"])
        chart_box = boxes["chart"]  # drawn whole, not cut at the chart's edge
        assert chart_box[0] <= label[0] and label[2] <= chart_box[2], (text, label, chart_box)


def test_the_log_view_shows_the_log_once_the_token_is_entered(svc, job):
    """Scrolled to the log view at the bottom and opened: refused (no token yet), the
    token form in view and not covered; the token entered there, the same open view
    shows the log. A dry run has no driver output on the service, so the log the
    browser receives with the token is given here; the request proves the token went."""
    log = "step 1  loss 4.9000 (mean of 4 ranks)\nstep 2  loss 4.8000 (mean of 4 ranks)\n"
    sent = []

    def with_token(route, request):
        sent.append(request.headers.get("authorization"))
        if request.headers.get("authorization") == f"Bearer {svc.token}":
            route.fulfill(status=200, content_type="text/plain", body=log)
        else:
            route.continue_()

    with page_with_errors() as (page, errors):
        page.route("**/v1/jobs/*/logs?tail=*", with_token)
        page.goto(f"{svc.url}/#job={job['id']}")
        page.wait_for_function("document.getElementById('job-facts').innerText"
                               ".includes('dry run')", timeout=60_000)
        page.evaluate("window.scrollTo(0, document.body.scrollHeight)")
        page.click("#log-view summary")
        page.wait_for_function(f"document.getElementById('log-note').textContent === "
                               f"'{TOKEN_NEEDED}'", timeout=30_000)
        form = page.evaluate("""() => {
          const input = document.getElementById('token'), b = input.getBoundingClientRect();
          return { top: b.top, bottom: b.bottom, height: innerHeight, focused:
                   document.activeElement === input, hit: document.elementFromPoint(
                     (b.left + b.right) / 2, (b.top + b.bottom) / 2) === input,
                   scrolled: scrollY }; }""")
        assert form["scrolled"] > 0 and form["focused"] and form["hit"], form
        assert 0 <= form["top"] and form["bottom"] <= form["height"], form
        page.fill("#token", svc.token)
        page.press("#token", "Enter")
        page.wait_for_function("document.getElementById('job-log').textContent.length > 0",
                               timeout=30_000)
        assert page.locator("#job-log").inner_text() == log.rstrip("\n")
        assert page.locator("#log-note").inner_text().startswith("read ")
        assert page.evaluate("document.getElementById('log-view').open")
        page.screenshot(path=os.path.join(ARTIFACTS, "log-view-after-token.png"))
    # The open view polls a running job's log every 3 s, so the wait for the token can
    # see more than one refusal; every request before the token is entered goes without
    # one, every request after it with it.
    bearer = f"Bearer {svc.token}"
    refused = sent[:sent.index(bearer)] if bearer in sent else sent
    assert refused and all(header is None for header in refused), sent
    assert sent[len(refused):] and all(h == bearer for h in sent[len(refused):]), sent
    assert errors and all("401" in e for e in errors), errors  # only the refusals
