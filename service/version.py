"""The package's version (``service.__version__``), in a leaf module that imports nothing: the checkpoint
manifests (state), the build-info metric (telemetry) and the resume state (loop) read it without importing the
root package, which reaches up to loop for the public API."""

__version__ = "0.1.0"
