"""Put on PYTHONPATH, this makes ``wandb`` unimportable in that process, as in an
environment without it: ``sys.modules[name] = None`` is the import system's own mark of a
module that cannot be imported (``import wandb`` raises ModuleNotFoundError and
``importlib.util.find_spec("wandb")`` is None)."""

import sys

sys.modules["wandb"] = None
