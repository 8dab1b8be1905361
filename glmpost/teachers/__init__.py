"""``glmpost score-teacher``: student rollouts scored by their teachers (:mod:`~glmpost.teachers.run`),
once over shards or following a spool (:mod:`~glmpost.teachers.follow`)."""
