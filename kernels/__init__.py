"""pdserve.kernels."""
