"""The models a job can train: presets (torch-free), the model source, the built-in model,
building any kind on the meta device, and the Muon/AdamW param split. Torch, no Ray."""
