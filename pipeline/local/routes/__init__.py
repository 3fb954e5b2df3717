"""The local rollout server's HTTP routes, one module per concern: ``generate`` (``/generate``),
``health`` (``/health``, ``/health_generate``, ``/ready``), ``info`` (model / server info, loads),
``control`` (flush, abort, pause, memory) and ``weights`` (weight updates, update groups,
versions, checks). Each module's handlers are plain functions that find the
:class:`~pipeline.local.state.ServerState` at ``request.app.state.server``; its ``register(app)``
adds them to the app (``pipeline.local.server.LocalRolloutServer``)."""
