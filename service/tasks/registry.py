"""Built-in task names, kept free of heavy imports so the config can validate names cheaply."""

BUILTIN_TASKS: dict[str, str] = {
    "shapes-segmentation": "service.tasks.shapes:build",
    "digits-classification": "service.tasks.digits:build",
}
