"""`glmpost eval`: sample n responses per prompt, judge them, report avg@n, pass@k and maj@n."""
