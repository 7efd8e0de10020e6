"""``python -m service.train.entrypoint``: the old module path of the job's driver, kept
because ``ray job submit`` commands, deploy files and users' scripts name it. It runs
``service.driver.job_driver``; imported, it is that module (patches reach the driver)."""

import sys

from service.driver import job_driver

if __name__ == "__main__":
    sys.exit(job_driver.main())
sys.modules[__name__] = job_driver
