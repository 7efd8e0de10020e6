"""What runs on Ray: the job's driver (``entrypoint``, with the controller's step records
in ``reports`` and ``tracking``) and each worker's training loop (``loop``) with what only
it needs: the mesh, the data sampler, the recipe, checkpoints, metrics, export and weight
loading. The control plane imports nothing from here (``tests/test_architecture.py``);
the model, the plan and the inputs it shares with the workers live in ``service.models``,
``service.plan`` and ``service.inputs``.
"""
