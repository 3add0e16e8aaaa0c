"""The package version, in one place for pyproject.toml and the OpenTelemetry scope."""

__version__ = "0.1.0"
