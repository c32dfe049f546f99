"""Where a process learns its place (rank, world, launcher, scheduler) and joins its world."""
