"""The run and its one step boundary, and both doors on it: the runtime, the steps and the boundary, the public
``Session`` and its tools, the built-in task loop and the task's side of a step, what is kept, the log window,
the rank roles."""
