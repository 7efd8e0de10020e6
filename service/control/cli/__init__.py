"""dmuon-svc, the control plane from a terminal: the commands (``commands``), HTTP to the
service (``http``), what they print (``output``) and ``--follow`` (``progress``)."""

from .commands import app, main  # noqa: F401 - the console script's entry point
from .progress import follow  # noqa: F401 - re-exported
