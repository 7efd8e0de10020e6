"""The job spec (``job_spec``: ``JobSpec``, parsing and its errors) and its sections,
one module each; torch-free, like the whole of ``service.job`` but ``models``."""

from .job_spec import (  # noqa: F401 - the names the other sides import from here
    MAX_DATA_BYTES,
    JobSpec,
    OptimizerSpec,
    SpecError,
    field_path,
    load_spec,
    named_field,
    parse_spec,
    text,
)
