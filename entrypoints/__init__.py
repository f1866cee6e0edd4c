"""pdserve.entrypoints: the top of the program, above the services: the ``pdserve`` command
(``cli``), ``pdserve serve`` (``serve``), the plain-process worker mains (``worker_main``), the
Ray launcher (``launcher``) and the private Redis it may start (``redis_server``)."""
