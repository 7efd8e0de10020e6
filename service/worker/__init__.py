"""What each Ray Train worker runs: the training loop (``loop``) with what only it needs:
the mesh, the batches, the recipe, checkpoints, step metrics, export and weight loading.
Imports ``service.job`` (the spec, the models, the plan) and ``dmuon``, nothing of the
driver or the control plane (``tests/test_architecture.py``)."""
