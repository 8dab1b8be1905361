"""``glmpost serve``: the embedded engine behind the subset of SGLang's native HTTP API glmpost uses
(:mod:`~glmpost.server.engine`; requests parsed by :mod:`~glmpost.server.parsing`, answers shaped by
:mod:`~glmpost.server.answers`, the HTTP side in :mod:`~glmpost.server.http`)."""
