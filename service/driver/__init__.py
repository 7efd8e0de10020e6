"""The Ray job's driver (``job_driver``, run as ``python -m service.driver.job_driver``):
the stored plan checked against the live cluster and the model, the Ray Train
``TorchTrainer`` started on it, and the Ray Train controller's callbacks (step reports,
tracking sinks, the deadline). Imports ``service.job`` and ``service.worker``."""
