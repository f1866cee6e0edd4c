"""pdserve.engine.models."""
