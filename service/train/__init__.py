"""The old home of the driver and workers, kept for one module path:
``service.train.entrypoint`` (``ray job submit`` commands, deploy files and users'
scripts name it), now ``service.driver.job_driver``."""
