import sys

from pdserve.entrypoints.worker_main import main

sys.exit(main("prefill"))
