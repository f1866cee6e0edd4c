"""pdserve.router."""
