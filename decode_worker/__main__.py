import sys

from pdserve.cluster.worker_main import main

sys.exit(main("decode"))
