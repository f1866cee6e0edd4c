"""pdserve.entrypoints: the top of the program, above the services: the ``pdserve`` command
(``cli``), ``pdserve serve`` (``serve``), either worker role's ``make_worker`` and
``main`` (``worker_main``), the Ray launcher (``launcher``) and the private Redis it may
start (``redis_server``)."""
