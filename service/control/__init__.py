"""The control plane: the FastAPI app and its routes, the job store and its migrations,
the submitter that moves jobs onto Ray, the dashboard, the local Ray head and the CLI
(``cli``). Imports ``service.job`` only, no module of the driver or workers; it plans in
process, so torch and dmuon load with the planner."""
