"""The settings of the policy-gradient updates: GRPO (+ IcePop / DIS, and the variants issue 46 added:
GSPO, CISPO, Dr. GRPO, DAPO's token-level loss, TIS / MIS) and OPD / MOPD, each naming the estimator,
scalings, trust masks, importance correction, loss terms and diagnostics the algorithm-blind
:class:`~glmpost.rl.trainer.PolicyTrainer` composes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from glmpost.config import SettingError, setting
from glmpost.kernel.logprobs import DEFAULT_CHUNK_SIZE
from glmpost.kernel.trust_masks import IMPORTANCE_CORRECTIONS, TRUST_MASKS
from glmpost.rl.advantages import REWARD_SCALINGS
from glmpost.rl.distributed import OptimizerConfig
from glmpost.rl.losses import LOSS_NORMALIZATIONS
from glmpost.rl.micro_batches import micro_batch_tokens_setting, pack_sequences_setting
from glmpost.rl.routing_replay import routing_replay_setting

LOSS_DENOMINATORS = ("trusted", "action")
PER_STEP_MASKS = ("dis",)  # taken on the weights of each optimizer step, not once before the update
# --policy-loss -> the registered loss term (glmpost.rl.losses.LOSS_TERMS) that is the policy term.
POLICY_LOSSES = {"ppo": "policy", "gspo": "gspo", "cispo": "cispo"}


@dataclass
class PolicyGradientConfig(OptimizerConfig):
    """What every policy-gradient update shares (GRPO, OPD / MOPD, SAO): the optimiser, the batches,
    the PPO clip, the trust masks (IcePop, DIS) and the loss's normalisation. Defaults are GLM-5's
    Reasoning RL values where the brief gives them. The distribution log-probs are taken under is
    not a setting: it is the records' (:func:`~glmpost.rl.admission.admit`), handed to the trainer
    with each update."""

    epochs: int = setting(1, "Passes over the batch (PPO epochs).", min=1)
    mini_batches: int = setting(1, "Optimizer steps per epoch (the batch is split into this many mini-batches).", min=1)
    micro_batch_size: int = setting(8, "Trajectories per forward/backward on each rank (gradient accumulation).", min=1)
    micro_batch_tokens: int = micro_batch_tokens_setting()
    pack_sequences: bool = pack_sequences_setting()
    eps_low: float = setting(0.2, "PPO clip below 1 (GLM-5: 0.2).")  # brief: eps_l = 0.2
    eps_high: float = setting(0.28, "PPO clip above 1 (GLM-5: 0.28).", min=0.0)  # brief: eps_h = 0.28
    icepop: bool = setting(True, "Mask tokens whose train/infer probability ratio leaves [1/beta, beta].",
                           flag="--icepop/--no-icepop")
    icepop_beta: float = setting(2.0, "IcePop beta (GLM-5: 2).")  # brief: beta = 2
    # brief, "Direct Double-Sided Importance Sampling": "双边可信区间" 1 - eps_l < r_t < 1 + eps_h, a band of its
    # own (the PPO clip above is another role of the same two symbols); glmpost's defaults are the clip's values.
    dis_low: float = setting(0.2, "DIS trust band below 1: with --trust-mask dis a token is kept only where "
                             "1 - dis-low < pi_theta / pi_rollout.", min=0.0, max=1.0)
    dis_high: float = setting(0.28, "DIS trust band above 1: with --trust-mask dis a token is kept only where "
                              "pi_theta / pi_rollout < 1 + dis-high.", min=0.0)
    # brief, "IcePop 为什么有两层 ratio": m_t multiplies the token loss; what it is averaged over is a choice.
    loss_denominator: str = setting(
        "trusted", "Tokens the loss is averaged over, across the whole mini-batch and every rank: trusted (the action "
        "tokens the trust mask keeps; when many are masked the survivors are up-weighted) or action (every action "
        "token; a masked token counts as a zero, so the step shrinks with the trusted fraction).")
    trust_mask: list[str] = setting(
        ["icepop"], "Trust masks ANDed into the action mask, by name (repeat for several): icepop (train vs rollout "
        "engine on the weights before the update; --no-icepop drops it) or dis (brief's Direct Double-Sided IS: the "
        "policy term becomes -m r A with r = pi_theta / pi_rollout and m = 1[1 - dis-low < r < 1 + dis-high], "
        "evaluated on the weights of each optimizer step). The brief warns against reading DIS as an engine check.",
        flag="--trust-mask")
    max_version_lag: int = setting(
        0, "Accept records sampled up to this many policy versions before --checkpoint (a larger lag is refused); "
        "the trust mask is then DIS instead of IcePop. 0: every record comes from --checkpoint's version.", min=0)
    # brief, "Direct Double-Sided Importance Sampling": GLM-5 drops samples with v_train - v_rollout > tau.
    max_staleness: Optional[int] = setting(
        None, "Drop whole trajectories whose oldest action token is more than TAU policy versions behind --checkpoint, "
        "before any token check (counted, with their lengths and rewards, in the metrics); the rest are trained "
        "with DIS. Unset: none dropped.", min=0)
    advantage_eps: float = setting(1e-6, "eps in the group advantage (R - mean) / (std + eps).", above=0.0)
    # brief, CompactionRL: "在全部可训练 token 集合 M 上归一化 PPO loss"
    loss_normalization: str = setting(
        "token", "How a mini-batch's token losses are averaged, by name: token (every trusted token weighs the same: "
        "CompactionRL's normalisation over all trainable tokens, so a trajectory compacted into more segments is not "
        "up-weighted); segment (each context window's mean, then the mean over windows: the per-segment mean it "
        "replaces, TRL's grpo); dapo (DAPO's token-level loss over the global batch: the same as token); bnpo (TRL's "
        "bnpo; glmpost's batch is always the whole mini-batch, so the same as token); dr_grpo (Dr. GRPO: the sum "
        "over tokens divided by sequences x --dr-grpo-max-tokens).")
    # issue 46: Dr. GRPO's constant (arXiv 2503.20783, Sec. 3.1); TRL's is max_completion_length.
    dr_grpo_max_tokens: int = setting(
        0, "The constant of --loss-normalization dr_grpo (Dr. GRPO's MAX_TOKENS; TRL's max_completion_length): the "
        "mini-batch's token losses are summed and divided by (its sequences x this). Set it to the rollout's "
        "--max-new-tokens; required with dr_grpo, unused otherwise.", min=0)
    # issue 46: a weight on the policy term from rho = pi_train_old / pi_rollout (the IcePop / DIS masks only mask).
    importance_correction: str = setting(
        "none", "Train-inference importance correction on the policy term, from rho_t = pi_train_old / pi_rollout "
        "on the weights before the update: none; tis (the token loss times min(rho_t, C), token-level TIS as slime "
        "--use-tis, verl rollout_is token, TRL token_truncate); seq-tis (every token of a sequence times "
        "min(prod_t rho_t, C), the product form of verl rollout_is sequence and TRL sequence_truncate); mis (a "
        "sequence whose prod_t rho_t exceeds C is masked whole, the others weighted by it: TRL sequence_mask). C is "
        "--importance-cap. Not with --trust-mask dis (its policy term already divides by pi_rollout).")
    importance_cap: float = setting(2.0, "C of --importance-correction: the truncation of tis / seq-tis, the "
                                    "rejection threshold of mis (verl's default 2; TRL's 3).", above=0.0)
    entropy_coef: float = setting(0.0, "Entropy bonus weight (0 = off, the default).", min=0.0)
    routing_replay: bool = routing_replay_setting()  # issue 33: MoE routing is part of the executed policy (R3)
    chunk_size: int = setting(DEFAULT_CHUNK_SIZE, "Positions per chunk of the log-prob computation (bounds [chunk, V] memory).", min=1)
    seed: int = setting(0, "Seed of the mini-batch shuffling.")

    def validate(self) -> None:
        super().validate()
        self._require({
            "eps_low": 0 <= self.eps_low < 1,
            "dis_low": 0 <= self.dis_low < 1,
            "icepop_beta": self.icepop_beta >= 1,
        }, eps_low="in [0, 1)", dis_low="in [0, 1)", icepop_beta=">= 1")
        unknown = [n for n in self.trust_mask if n not in TRUST_MASKS]
        if unknown or not self.trust_mask:
            raise SettingError("trust_mask", unknown[0] if unknown else self.trust_mask,
                               f"is not one of {', '.join(TRUST_MASKS)}")
        if self.loss_denominator not in LOSS_DENOMINATORS:
            raise SettingError("loss_denominator", self.loss_denominator, f"is not one of {', '.join(LOSS_DENOMINATORS)}")
        if self.loss_normalization not in LOSS_NORMALIZATIONS:
            raise SettingError("loss_normalization", self.loss_normalization,
                               f"is not one of {', '.join(LOSS_NORMALIZATIONS)}")
        if self.loss_normalization == "dr_grpo" and self.dr_grpo_max_tokens <= 0:
            raise SettingError("dr_grpo_max_tokens", self.dr_grpo_max_tokens, "must be set (> 0) with loss_normalization "
                               "dr_grpo: the rollout's max-new-tokens")
        if self.importance_correction != "none" and self.importance_correction not in IMPORTANCE_CORRECTIONS:
            raise SettingError("importance_correction", self.importance_correction,
                               f"is not one of none, {', '.join(IMPORTANCE_CORRECTIONS)}")
        if self.importance_correction != "none" and "dis" in self.trust_masks():
            raise SettingError("importance_correction", self.importance_correction, "does not go with the dis trust mask "
                               "(its policy term is already -r A with r = pi_theta / pi_rollout)")

    # What the trainer composes (glmpost.rl.advantages / masks / losses / diagnostics), by name.

    def advantage_scalings(self) -> tuple[str, ...]:
        """Applied to the estimator's advantages, in order (:data:`~glmpost.rl.advantages.ADVANTAGE_SCALINGS`)."""
        return ()

    def trust_masks(self) -> tuple[str, ...]:
        names = [n for n in dict.fromkeys(self.trust_mask) if n != "icepop" or self.icepop]
        if self.accepted_lag() > 0 and "dis" not in names:  # brief: DIS is the tool for lagged (off-policy) samples
            names = [n for n in names if n != "icepop"] + ["dis"]
        return tuple(names)

    def accepted_lag(self) -> int:
        """The most policy versions a trained record may lag the checkpoint."""
        return max(self.max_version_lag, self.max_staleness or 0)

    def importance_correction_name(self) -> str | None:
        """The registered importance correction (:data:`~glmpost.kernel.trust_masks.IMPORTANCE_CORRECTIONS`), or None."""
        return None if self.importance_correction == "none" else self.importance_correction

    def policy_term(self) -> str:
        """The loss term that is the policy gradient: DIS's with the dis mask, else PPO's clipped one."""
        return "dis_policy" if "dis" in self.trust_masks() else "policy"

    def loss_terms(self) -> tuple[str, ...]:
        return (self.policy_term(),) + (("entropy",) if self.entropy_coef > 0 else ())

    def diagnostics(self) -> tuple[str, ...]:
        return ("mismatch",)


@dataclass
class GRPOConfig(PolicyGradientConfig):
    """GRPO + IcePop (train-grpo): group advantages, an optional KL to a reference, CompactionRL's
    cross-segment factor."""

    segment_decay: float = setting(
        1.0, "CompactionRL's cross-segment factor for compacted trajectories: each context window's advantages times "
        "segment-decay^N, N = trainable tokens in its later windows (the brief's (gamma*lambda)^N_later); 1 = every "
        "window takes the trajectory's advantage.", min=0.0, max=1.0)
    kl_coef: float = setting(0.0, "Weight of the k3 KL to --ref-checkpoint (0 = off, the default).", min=0.0)
    # issue 46: the policy-optimisation variants, each a registered piece (glmpost.rl.losses, glmpost.rl.advantages).
    policy_loss: str = setting(
        "ppo", "The policy term: ppo (PPO/GRPO's per-token clipped ratio, --eps-low / --eps-high); gspo (GSPO: one "
        "length-normalised ratio per sequence, exp(mean_t log(pi_theta / pi_old)), clipped per sequence with --eps-low "
        "/ --eps-high, the paper's 3e-4 / 4e-4; TRL importance_sampling_level sequence); cispo (CISPO, MiniMax-M1: "
        "-sg(clip(r_t, 1 - cispo-eps-low, 1 + cispo-eps-high)) A_t log pi_theta, every token kept). Not with --trust-mask dis.")
    cispo_eps_low: float = setting(1.0, "CISPO's eps_low^IS: the weight is clipped below at 1 - this (1: no lower "
                                   "bound, MiniMax-M1's choice).", min=0.0, max=1.0)
    cispo_eps_high: float = setting(4.0, "CISPO's eps_high^IS: the weight is clipped above at 1 + this (4: the bound "
                                    "5 TRL recommends after ScaleRL).", min=0.0)
    advantage_scaling: str = setting(
        "group", "How a group's rewards become advantages (TRL's scale_rewards): group ((R - mean) / (std + eps), GRPO's; "
        "the default), batch ((R - group mean) / (the batch's std + eps)) or none (R - mean: Dr. GRPO, no std division, "
        "which weighs every question alike). Groups with equal rewards get 0 in each.")

    def validate(self) -> None:
        super().validate()
        if self.policy_loss not in POLICY_LOSSES:
            raise SettingError("policy_loss", self.policy_loss, f"is not one of {', '.join(POLICY_LOSSES)}")
        if self.policy_loss != "ppo" and "dis" in self.trust_masks():
            raise SettingError("policy_loss", self.policy_loss, "does not go with the dis trust mask (its policy term "
                               "replaces the policy loss)")
        if self.advantage_scaling not in REWARD_SCALINGS:
            raise SettingError("advantage_scaling", self.advantage_scaling, f"is not one of {', '.join(REWARD_SCALINGS)}")

    def policy_term(self) -> str:
        return "dis_policy" if "dis" in self.trust_masks() else POLICY_LOSSES[self.policy_loss]

    def advantage_estimator(self) -> str:
        return "grpo"

    def advantage_scalings(self) -> tuple[str, ...]:
        return ("cross_segment",)

    def segment_decay_base(self) -> float:
        """The base of CompactionRL's cross-segment factor (``gamma * lambda``): ``segment_decay``."""
        return self.segment_decay

    def loss_terms(self) -> tuple[str, ...]:
        policy, *rest = super().loss_terms()
        return (policy, *(("kl",) if self.kl_coef > 0 else ()), *rest)


OPD_LOSSES = ("sampled", "topk")


@dataclass
class OPDConfig(PolicyGradientConfig):
    """OPD / MOPD update (brief, "OPD：把教师变成逐 token 优势"): group size 1, advantages from the teacher.

    ``loss = "sampled"``: ``A_t = sg(log pi_T - log pi_theta) + w * A_task`` in the clipped
    policy-gradient loss; ``"topk"``: the reverse KL over the teacher's top-k set with the MOPD
    ``pi_T - pi_theta`` correction (plus ``w * A_task`` in the policy-gradient term).
    """

    loss: str = setting("sampled", "sampled: OPD advantage in the policy-gradient loss; topk: MOPD top-k reverse KL.")
    task_advantage_weight: float = setting(
        0.0, "Weight of the GRPO task advantage added to the OPD advantage (needs judged shards; 0 = pure distillation).", min=0.0)
    topk_correction: bool = setting(
        True, "Add MOPD's pi_T - pi_theta term to the top-k loss (the optimum is then teacher = student on the set).",
        flag="--topk-correction/--no-topk-correction")

    def validate(self) -> None:
        super().validate()
        if self.loss not in OPD_LOSSES:
            raise SettingError("loss", self.loss, f"is not one of {', '.join(OPD_LOSSES)}")

    def advantage_estimator(self) -> str:
        return "task" if self.loss == "topk" else "opd"

    def loss_terms(self) -> tuple[str, ...]:
        policy, *rest = super().loss_terms()
        return (policy, *(("topk_reverse_kl",) if self.loss == "topk" else ()), *rest)

    def diagnostics(self) -> tuple[str, ...]:
        return ("mismatch", "teacher_kl")

    def advantage_scalings(self) -> tuple[str, ...]:
        return ()  # the teacher's per-token advantage needs no credit assignment across segments
