"""What feeds a step: the feeds of both doors (map-style through the sampler, streams), the step's sample plan
over the world, the loaders, batches of any nesting, the batch geometry at this world size, a session's data."""
