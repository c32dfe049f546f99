"""The commands around a job: launch, doctor, preflight checks."""
