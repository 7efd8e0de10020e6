"""The job model, shared by every side: the spec (``spec``), its inputs (``inputs``), the
models (``models``), the plan made once per job (``plan``), the job directory's names
(``job_dir``) and failure reasons (``failure``). No Ray, FastAPI, SQLAlchemy or click;
torch in ``models`` and the planner only."""
