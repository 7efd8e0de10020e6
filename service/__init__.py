"""The way people run DMuon, in four sides whose imports point one way
(control -> job <- driver -> worker -> job -> dmuon, ``tests/test_architecture.py``):
``job`` (the spec, its inputs, the models and the plan: no Ray, FastAPI, SQLAlchemy or
click), ``control`` (the REST control plane, its store, the submitter, the dashboard and
the CLI), ``driver`` (the Ray job's driver and the Ray Train controller's callbacks) and
``worker`` (what each Ray Train worker runs). ``dev`` holds the demos; ``train`` the old
path of the driver, ``service.train.entrypoint``. See docs/architecture.md."""
