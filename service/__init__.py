"""The way people run DMuon: job specs (``spec``), their inputs (``inputs``), the
models (``models``), the plan made once per job (``plan``), the cluster (``cluster``),
the control plane (``api``, ``cli``) and what runs on Ray (``train``). See
docs/architecture.md."""
