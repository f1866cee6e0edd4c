import sys

from pdserve.decode_worker.main import main

sys.exit(main())
