"""Spools: directories of shards that stages publish into and claim from, for asynchronous RL
(:mod:`~glmpost.spool.spool`, ``formats/SPEC.md`` §12). The driver that runs a shard stage between
two spools is :func:`glmpost.drivers.follow_shards`; every consumer claims with
:class:`~glmpost.spool.claims.Claims`."""
