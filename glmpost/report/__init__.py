"""glmpost report: a static HTML page of a run's curves."""
