"""carpool past one process: whole carpool replicas on Ray Serve, routed by prompt
prefix and load. Importing this package imports nothing of Ray; its modules
``deployment``, ``router`` and ``launch`` need ``pip install carpool[ray]``.

For a Ray Serve application of your own::

    from ray import serve
    from carpool.config import CarpoolConfig
    from carpool.distributed.deployment import build_app

    serve.run(build_app(CarpoolConfig()), route_prefix="/")
"""
