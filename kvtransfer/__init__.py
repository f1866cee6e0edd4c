"""pdserve.kvtransfer."""
