"""The LMDB storage backend (the embedded default L3): ``store.py`` (:class:`LMDBStore`, the
layout, capacity, eviction and crash-safety rules), ``accounting.py`` (sizes, recency stamps,
map growth, eviction), ``handles.py`` (the environment and its databases, opening them),
``disk.py`` (writemap's guard against a full disk, a failed write's cause), ``rwlock.py`` (the
lock around map resizes), ``config.py`` (:class:`LMDBConfig`)."""
