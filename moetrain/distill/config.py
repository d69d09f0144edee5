"""The `config.distill` section and the loss it asks for."""

import dataclasses

from moetrain.core.fields import check, field
from moetrain.kernels.distill import DIVERGENCES, Divergence

INITS = ('', 'most_used', 'random')


@dataclasses.dataclass(frozen=True)
class DistillConfig:
  """The `config.distill` section: a student learns from a teacher (docs/distillation.md). Per
  scored token the loss is alpha * T^2 * divergence(teacher_T, student_T) + (1 - alpha) * NLL."""

  # The teacher: a Hugging Face checkpoint directory (any supported family) or a moetrain run
  # directory (its latest checkpoint); '' = no distillation.
  teacher: str = field('', role='path')
  alpha: float = field(0.5, check='non_negative')  # weight of the divergence; 0 = labels alone
  temperature: float = field(1.0, check='positive')  # T of both distributions
  loss: str = field('forward_kl', choices=DIVERGENCES)  # KL(p||q), KL(q||p), or generalized JSD
  beta: float = 0.5  # the JSD's mixture weight of the teacher, in (0, 1)
  top_k: int = field(0, check='non_negative', zero='0 = the whole vocabulary')  # teacher's k best
  # A directory of the teacher's cached top-k logits (python -m moetrain.tools.teacher_logits);
  # '' = the teacher runs online, inside the train step.
  teacher_logits: str = field('', role='path')
  teacher_quant: str = field('none', choices=('none', 'int8', 'int4'))  # the teacher's storage
  # The student's initial weights from the teacher: '' = its own init; 'most_used' = layers
  # from init_layers and, with fewer routed experts, the experts init_batches training batches
  # route to most; 'random' = the same layers, a random choice of experts.
  init_from_teacher: str = field('', choices=INITS)
  # The teacher layer each student layer starts from; () = spread evenly (every other one for
  # half as many layers).
  init_layers: tuple = ()
  init_batches: int = field(8, check='positive')  # batches of the expert-load measurement

  @property
  def enabled(self) -> bool:
    return bool(self.teacher)

  @property
  def online(self) -> bool:
    """Whether the train step runs the teacher (alpha 0 needs no teacher's logits)."""
    return self.enabled and self.alpha > 0 and not self.teacher_logits

  def divergence(self) -> Divergence | None:
    """The step's loss; None without a teacher, or at alpha 0 (labels alone)."""
    if not self.enabled or not self.alpha:
      return None
    return Divergence(self.loss, self.alpha, self.temperature, self.beta, self.top_k)

  def validate(self) -> None:
    check(self, 'distill')
    if self.alpha > 1:
      raise ValueError(f'distill.alpha={self.alpha}: must be in [0, 1] (1 = the teacher alone)')
    if not 0 < self.beta < 1:
      raise ValueError(f'distill.beta={self.beta}: must be in (0, 1) (the JSD mixture weight)')
    if self.teacher_logits and not self.top_k:
      raise ValueError(
        f'distill.teacher_logits={self.teacher_logits!r} holds top-k logits: set distill.top_k '
        '(at most the k they were written with)'
      )
    if not self.enabled and (self.teacher_logits or self.init_from_teacher):
      what = 'teacher_logits' if self.teacher_logits else 'init_from_teacher'
      raise ValueError(f'distill.{what} needs distill.teacher (the checkpoint it comes from)')
