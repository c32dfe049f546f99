"""The model as the service runs it: DDP wrapping (SyncBatchNorm, compile, the service's DDP), mixed precision,
the non-finite step guard, the optimizer and its schedule."""
