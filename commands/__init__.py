"""glmpost stages: one module per command; parse options, read shards, call the library, write shards."""
