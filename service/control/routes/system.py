"""Health, version and Prometheus metrics."""

from __future__ import annotations

from importlib import metadata

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from ..auth import guarded

VERSION = metadata.version("dmuon")
public = APIRouter(route_class=guarded("public"), tags=["system"])
reads = APIRouter(route_class=guarded("read"), tags=["system"])


class JobCounts:
    """Jobs by status, read from the store at each scrape (every replica agrees)."""

    def __init__(self, store):
        self.store = store

    def collect(self):
        gauge = GaugeMetricFamily("dmuon_jobs", "jobs in the store by status",
                                  labels=["status"])
        for status, n in self.store.counts().items():
            gauge.add_metric([status], n)
        yield gauge


class RunningJobs:
    """The newest step of every running job: loss, the newest validation loss (kept
    between validation steps), throughput per rank and in total, MFU, gradient norm and
    LR per group (read at each scrape)."""

    FIELDS = (("loss", "training loss"), ("val_loss", "validation loss"),
              ("tokens_per_s_total", "tokens per second, all ranks"),
              ("mfu", "model FLOPs utilisation"), ("grad_norm", "gradient norm"))

    def __init__(self, store):
        self.store = store

    def collect(self):
        gauges = {f: GaugeMetricFamily(f"dmuon_job_{f}", doc, labels=["job"])
                  for f, doc in self.FIELDS}
        step = GaugeMetricFamily("dmuon_job_step", "newest step", labels=["job"])
        rate = GaugeMetricFamily("dmuon_job_tokens_per_s", "tokens per second of one rank",
                                 labels=["job", "rank"])
        lr = GaugeMetricFamily("dmuon_job_lr", "learning rate", labels=["job", "group"])
        for job in self.store.list_jobs("RUNNING", 1000):
            records = self.store.records.latest(job["id"])
            if not records:
                continue
            first = records[0]
            step.add_metric([job["id"]], first["step"])
            for f, gauge in gauges.items():
                value = next((r[f] for r in records if r.get(f) is not None), None)
                if value is None and f == "val_loss":  # between validations: the last
                    value = (self.store.records.last_validation(job["id"]) or {}).get(f)
                if value is not None:
                    gauge.add_metric([job["id"]], value)
            for r in records:
                if r.get("tokens_per_s") is not None:
                    rate.add_metric([job["id"], str(r["rank"])], r["tokens_per_s"])
            for group, value in (first.get("lr") or {}).items():
                if value is not None:
                    lr.add_metric([job["id"], group], value)
        yield from (step, *gauges.values(), rate, lr)


def registry_for(store) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCounts(store))
    registry.register(RunningJobs(store))
    return registry


@public.get("/healthz")
def healthz():
    return {"status": "ok"}


@public.get("/version")
def version():
    return {"dmuon": VERSION, "torch": metadata.version("torch")}


@reads.get("/metrics")
def prometheus(request: Request):
    return Response(generate_latest(request.app.state.prometheus),
                    media_type=CONTENT_TYPE_LATEST)
