"""``glmpost diff-logprobs``: how far two numerical paths' log-probs are apart on the same action
tokens. :mod:`~glmpost.diff.mismatch` measures, :mod:`~glmpost.diff.run` runs the comparison,
:mod:`~glmpost.diff.paths` scores the local and server paths,
:mod:`~glmpost.diff.by_version` splits the engine's part from the version lag's,
:mod:`~glmpost.diff.kv_cache` labels stale-cache tokens, :mod:`~glmpost.diff.indexer_probe` watches
the DSA indexer, :mod:`~glmpost.diff.plots` draws the report."""
