"""The LMDB storage backend (the embedded default L3): ``store.py`` (:class:`LMDBStore`, the
layout, capacity, eviction and crash-safety rules; a key to its shard), ``layout.py`` (the
directory's shards, which shard a key belongs to, another count refused), ``shard.py``
(:class:`LMDBShard`: one environment's transactions and writes), ``accounting.py`` (sizes, recency stamps,
map growth, eviction), ``handles.py`` (the environment and its databases, opening them),
``disk.py`` (writemap's guard against a full disk, a failed write's cause), ``rwlock.py`` (the
lock around map resizes), ``malloc.py`` (freed heap kept for the next write), ``config.py``
(:class:`LMDBConfig`)."""
