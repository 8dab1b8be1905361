"""``glmpost plan``: the memory plan of a training or rollout role, computed from a model's shape
(:mod:`~glmpost.memory.plan`: the terms; :mod:`~glmpost.memory.native`: the native attention's;
:mod:`~glmpost.memory.roles`: per role; :mod:`~glmpost.memory.recipe`: a recipe's workload)."""
