#!/bin/sh
# Container entrypoint of the DMuon image.
#   serve [ARGS]   the control plane: dmuon-serve (binds $DMUON_HOST:$DMUON_PORT)
#   train ARGS     a job: python -m service.driver.job_driver ARGS (e.g. --spec /etc/dmuon/job.yaml)
#   anything else  run as given (e.g. `ray start ...`, `bash`); KubeRay sets its own command
set -e
case "${1:-serve}" in
    serve) [ "$#" -gt 0 ] && shift; exec dmuon-serve "$@" ;;
    train) shift; exec python -m service.driver.job_driver "$@" ;;
    *) exec "$@" ;;
esac
