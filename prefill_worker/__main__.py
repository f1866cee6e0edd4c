import sys

from pdserve.prefill_worker.main import main

sys.exit(main())
