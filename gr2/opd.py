"""On-policy distillation (docs/PAPER.md, OPD): the diffusion student learns from the AR teacher on its OWN rollouts.

1. The student samples G' rollouts per prompt with its real block-diffusion decoder (`gr2.rl.sample`).
2. The frozen AR teacher scores exactly those tokens once per trajectory (one causal forward, no grad); its
   log-probs over the full vocabulary are cached in the batch (`RolloutBatch.teacher_logprobs`).
3. The student's distribution at each committed token is computed on its own decoding canvas (trajectory
   replay, as in RL), and the loss is the per-token KL on the scored positions, averaged per sequence
   (1/|o| sum_t) and then over sequences:
       direction "forward": KL(teacher || student) = sum_v p_T (log p_T - log p_S)  (the paper's write-up)
       direction "reverse": KL(student || teacher) = sum_v p_S (log p_S - log p_T)  (Thinking-Machines / GR2 TR)
   The sources disagree, so the direction is a parameter.

Rules. OPD samples and replays its student under `OPD_RULES`, which are no rules, where RL and every served
decoder apply `unique` and `follow` (gr2/rules.py). Why: the loss compares the student's full next-token
distribution with the teacher's, and the teacher's are raw (its forward applies no rules). The ruled logits hold
-inf at banned tokens, which would make this KL infinite (forward) or NaN (reverse: 0 * -inf). And a rollout
sampled under the rules but replayed without them is not the student's own (off-policy). So the rules stay a
decoding constraint that OPD leaves alone. This is what OPD has always done: the rules came after it and changed
RL's sampler and replay, not OPD's. Changing it would change the `opd` bundles, so it would need new
bench figures (issue 39).
"""

from __future__ import annotations

import torch

from gr2.rl import RolloutBatch, Sampling, policy_logits, rollout_batch, sample
from gr2.rules import NO_RULES, DecodeRules

DIRECTIONS = ("forward", "reverse")
OPD_RULES: DecodeRules = NO_RULES  # the rules OPD samples and replays its student under (module docstring)


@torch.no_grad()
def teacher_logprobs(teacher: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
    """[B, R, V] log-probs of the AR teacher at every response position (causal attention, token shift)."""
    return policy_logits(teacher, batch, 0).float().log_softmax(-1)


def kl_per_token(student_lp: torch.Tensor, teacher_lp: torch.Tensor, direction: str) -> torch.Tensor:
    """Full-vocabulary KL per position from log-probs [..., V]; direction "forward" (T||S) or "reverse" (S||T)."""
    if direction == "forward":
        return (teacher_lp.exp() * (teacher_lp - student_lp)).sum(-1)
    if direction == "reverse":
        return (student_lp.exp() * (student_lp - teacher_lp)).sum(-1)
    raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")


def sequence_mean(x: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Mean over each row's scored positions, then over rows that have any (the paper's E_o[(1/|o|) sum_t])."""
    m = scored.float()
    n = m.sum(-1)
    per_seq = (x * m).sum(-1) / n.clamp(min=1)
    has = n > 0
    return per_seq[has].mean() if bool(has.any()) else (x * 0).sum()


def opd_loss(
    model: torch.nn.Module,
    batch: RolloutBatch,
    block_size: int,
    mask_id: int | None,
    direction: str,
    rules: DecodeRules = OPD_RULES,
) -> tuple[torch.Tensor, dict]:
    """Per-token KL between the replayed student and the cached teacher, on the committed tokens. `rules`: the
    ones the rollouts were sampled under (`OPD_RULES`)."""
    if batch.teacher_logprobs is None:
        raise ValueError("the batch carries no teacher log-probs (build it with make_opd_batch)")
    student_lp = policy_logits(model, batch, block_size, mask_id, rules).float().log_softmax(-1)
    kl = kl_per_token(student_lp, batch.teacher_logprobs, direction)
    loss = sequence_mean(kl, batch.scored)
    with torch.no_grad():
        other = "reverse" if direction == "forward" else "forward"
        stats = {
            f"kl_{direction}": float(loss),
            f"kl_{other}": float(
                sequence_mean(kl_per_token(student_lp, batch.teacher_logprobs, other), batch.scored)
            ),
        }
    return loss, stats


def make_opd_batch(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    prompts: list[list[int]],
    rollouts_per_prompt: int,
    how: Sampling,
    generator: torch.Generator | None,
) -> RolloutBatch:
    """Sample G' student rollouts per prompt (`how`: OPD's stage samples under `OPD_RULES`), then cache the
    teacher's log-probs on them (one forward)."""
    rep = [p for p in prompts for _ in range(rollouts_per_prompt)]
    ro = sample(student, rep, how, generator)
    batch = rollout_batch(ro, how.eos_id)
    batch.teacher_logprobs = teacher_logprobs(teacher, batch)
    batch.stats["nfe"] = ro.nfe
    return batch
