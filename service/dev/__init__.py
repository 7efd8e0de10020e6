"""Developer tools: the demo (control plane, local Ray head, default job) and the
torchrun demo of the core alone."""
