"""Planning: a cluster inventory and a job spec in, one ``PlanDocument`` out (layout,
mode, Muon/AdamW split, partition, per-rank predictions). Made once per submission,
stored with the job, and applied as it is by the workers."""
