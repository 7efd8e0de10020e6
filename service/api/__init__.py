"""The control plane: REST routers, the job store, the runner that moves jobs onto Ray."""
