"""Spools: directories of shards that stages publish into and claim from, for asynchronous RL
(:mod:`~glmpost.spool.spool`, ``formats/SPEC.md`` §12), and the relay that carries shards from one
spool to the next through a shard-to-shard stage (:mod:`~glmpost.spool.relay`)."""
