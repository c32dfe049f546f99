"""What a job tells: metrics and their sinks, collective timing, the run summary's writers, log lines."""
