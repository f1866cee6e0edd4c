"""pdserve.cluster: the cluster's shared state and the parts every service uses: the worker
registry and prefix index in Redis (``registry``, ``prefix_index``), cluster authentication
(``auth``), the wire form of requests (``wire``), and a worker's configuration and runtime
(``worker_config``, ``worker_runtime``), and a worker's plain-process loop
(``worker_process``)."""
