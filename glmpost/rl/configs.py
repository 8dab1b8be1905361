"""The settings of the policy-gradient updates: GRPO (+ IcePop / DIS) and OPD / MOPD, each naming the
estimator, scalings, trust masks, loss terms and diagnostics the algorithm-blind
:class:`~glmpost.rl.trainer.PolicyTrainer` composes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from glmpost.config import SettingError, setting
from glmpost.kernel.logprobs import DEFAULT_CHUNK_SIZE
from glmpost.kernel.trust_masks import TRUST_MASKS
from glmpost.rl.distributed import OptimizerConfig
from glmpost.rl.losses import LOSS_NORMALIZATIONS
from glmpost.rl.micro_batches import micro_batch_tokens_setting, pack_sequences_setting
from glmpost.rl.routing_replay import routing_replay_setting

LOSS_DENOMINATORS = ("trusted", "action")
PER_STEP_MASKS = ("dis",)  # taken on the weights of each optimizer step, not once before the update


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
        "up-weighted) or segment (each context window's mean, then the mean over windows: the per-segment mean it "
        "replaces).")
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

    def loss_terms(self) -> tuple[str, ...]:
        policy = "dis_policy" if "dis" in self.trust_masks() else "policy"
        return (policy,) + (("entropy",) if self.entropy_coef > 0 else ())

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
