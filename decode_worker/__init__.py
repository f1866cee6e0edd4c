"""pdserve.decode_worker."""
