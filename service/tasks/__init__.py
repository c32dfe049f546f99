"""Tasks: built-in ones by name (``registry``), user ones as ``package.module:function``.

A task's build function takes a ``base.TaskSpec`` and returns a ``base.Task``;
``loader.load_task`` resolves and calls it. This package's ``__init__`` imports
nothing, so validating a config does not load torch.
"""
