"""pdserve.cluster."""
