# DMuon image: the control plane (`dmuon-serve`) and the training entrypoint
# (`python -m service.driver.job_driver`), on the official Ray image of the pinned Ray version.
# Tags of rayproject/ray read {ray version}-py{XY}-{cpu|gpu|cuXYZ}; -gpu aliases a CUDA one.
#
#   CPU (default): docker build -t REGISTRY/dmuon:0.1.0-cpu .
#   GPU:           docker build -t REGISTRY/dmuon:0.1.0-gpu \
#                    --build-arg RAY_IMAGE=rayproject/ray:2.60.0-py311-gpu \
#                    --build-arg TORCH_INDEX_URL= .
#   Offline torch: add --build-arg PIP_FIND_LINKS=/opt/wheels and mount the folder during
#                  the build (buildah bud -v /opt/wheels:/opt/wheels:ro); see deploy/BUILD_REPORT.md.
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-cpu
FROM ${RAY_IMAGE}

ARG DMUON_VERSION=0.1.0
# torch==2.13.0 on PyPI is the CUDA build. The -cpu image takes the CPU build from this
# index (2.13.0+cpu sorts above 2.13.0, so pip prefers it); empty: PyPI's default build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# an extra local wheel folder pip may use (empty: none)
ARG PIP_FIND_LINKS=

LABEL org.opencontainers.image.title="dmuon" \
      org.opencontainers.image.version="${DMUON_VERSION}" \
      org.opencontainers.image.description="Distributed Muon on Ray: control plane and training entrypoint"

# Ray images run as user `ray` (uid 1000, gid 100) with Python in /home/ray/anaconda3.
USER 1000:100

# dependencies first (a layer that changes only with the lock file), then the project;
# COPY --chown creates /home/ray/dmuon owned by the user, so pip can build in it
COPY --chown=1000:100 requirements.lock /home/ray/dmuon/
WORKDIR /home/ray/dmuon
RUN python -m pip install --no-cache-dir \
        ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
        ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"} \
        -r requirements.lock

COPY --chown=1000:100 pyproject.toml README.md ./
COPY --chown=1000:100 dmuon ./dmuon
COPY --chown=1000:100 service ./service
RUN python -m pip install --no-cache-dir --no-deps . \
    && rm -rf build ./*.egg-info \
    && mkdir -p /home/ray/dmuon_runs \
    && python -c "import dmuon, service.driver.job_driver, service.control.serve" \
    && python -c "import service.train.entrypoint"

COPY --chown=1000:100 --chmod=755 deploy/docker-entrypoint.sh /usr/local/bin/dmuon-entrypoint

# the control plane listens on all interfaces inside the container; jobs find it by
# DMUON_SERVICE_URL, set by the deployment (deploy/base/control-plane.yaml)
ENV DMUON_HOST=0.0.0.0 \
    DMUON_PORT=8000 \
    DMUON_STORAGE=/home/ray/dmuon_runs \
    DMUON_DB=/home/ray/dmuon_runs/dmuon.db \
    PYTHONUNBUFFERED=1
WORKDIR /home/ray
EXPOSE 8000

# checks the control plane only (`serve`); Ray pods get their probes from KubeRay
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('DMUON_PORT', '8000'), timeout=4).read()"]

ENTRYPOINT ["dmuon-entrypoint"]
CMD ["serve"]
