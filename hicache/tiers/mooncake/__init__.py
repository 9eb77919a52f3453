"""The Mooncake Store backend (the distributed L3): ``store.py`` (:class:`MooncakeStore`, the
calls used and the fault model), ``connection.py`` (:class:`MooncakeConnection`: calls with a
timeout, marking down, probing and reconnecting), ``lanes.py`` (the I/O lanes and the client
wrapper), ``config.py`` (:class:`MooncakeConfig`)."""
