"""The training step and what feeds it: the job, the loop, data, sampling, DDP wrapping, rank roles."""
