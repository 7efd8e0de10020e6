"""What runs on Ray: the job's entrypoint (driver), the training loop on the workers, and
what it needs: models (built-in, Hugging Face, a factory by import path), the Muon/AdamW
split of their params, token data, the recipe (schedule, clipping, accumulation, mixed
precision), checkpoints, metrics and export.

Importing this package loads nothing: the control plane imports its torch-free modules
(``shards``, ``model_source``) to check a spec before any worker starts.
"""
