"""Rewards for ``glmpost judge``: verifiers and rules, reward models, and the mixture.

- :mod:`glmpost.rewards.verifiers` — verifiers routed by a record's ``domain`` (built in ``math``
  and ``count``, or any ``package.module:function``) and the format / length / truncation rules.
- :mod:`glmpost.rewards.math_answers` — the ``math`` verifier's final answers and their checkers
  (``math-verify``, the default, or glmpost's ``normalise``).
- :mod:`glmpost.rewards.models` — an Outcome Reward Model and a generative judge, run locally.
- :mod:`glmpost.rewards.mixture` — components, the formula
  ``R(tau) = sum_k w_k R_k(tau) - sum_j lambda_j P_j(tau)`` and :class:`RewardMixture`, which adds
  ``rewards``, ``reward`` and ``reward_info`` to records.

Importing this package does not import torch or transformers; the model classes do, when built.
"""

from glmpost.rewards.components import (
    SOURCES,
    ComponentSpec,
    check_components,
    default_components,
    parse_component,
    parse_spec_string,
    uses_domain_routing,
)
from glmpost.rewards.math_answers import MATH_CHECKERS, MathJudgement, canonical_answer, judge_math
from glmpost.rewards.mixture import ComponentResult, RewardMixture, RewardStats, combine, scalarize
from glmpost.rewards.verifiers import (
    VERIFIERS,
    Verdict,
    VerifierError,
    VerifierTable,
    VerifyContext,
    count_verifier,
    extract_math_answer,
    format_score,
    last_boxed,
    length_penalty,
    math_answers_equal,
    math_verifier,
    normalize_math_answer,
    register_verifier,
    resolve_verifier,
    truncated_penalty,
)

__all__ = [
    "MATH_CHECKERS",
    "SOURCES",
    "VERIFIERS",
    "ComponentResult",
    "ComponentSpec",
    "MathJudgement",
    "RewardMixture",
    "RewardStats",
    "Verdict",
    "VerifierError",
    "VerifierTable",
    "VerifyContext",
    "check_components",
    "canonical_answer",
    "combine",
    "count_verifier",
    "default_components",
    "extract_math_answer",
    "format_score",
    "judge_math",
    "last_boxed",
    "length_penalty",
    "math_answers_equal",
    "math_verifier",
    "normalize_math_answer",
    "parse_component",
    "parse_spec_string",
    "register_verifier",
    "resolve_verifier",
    "scalarize",
    "truncated_penalty",
    "uses_domain_routing",
]
