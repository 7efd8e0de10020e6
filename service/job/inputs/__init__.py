"""A job's inputs: the paths and sizes a spec names, resolved and checked before any
worker starts (``resolve``); token shards (``shards``), ``dmuon-svc prepare``
(``prepare``), working directories (``working_dir``) and the tracking sinks' packages
(``sink_packages``)."""

from .resolve import (  # noqa: F401 - re-exported
    MANIFEST,
    inputs_json,
    resolve_inputs,
    resolve_model,
    stored_inputs,
)
