"""Numerical closure: chunked log-probs, train-vs-rollout mismatch statistics, the DSA indexer probe
and the report's plots."""
