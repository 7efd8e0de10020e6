"""Health, version and Prometheus metrics."""

from __future__ import annotations

from importlib import metadata

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from ..guard import guarded

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


def registry_for(store) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCounts(store))
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
