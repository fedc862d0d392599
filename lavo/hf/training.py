"""Training a ``LavoLMForCausalLM`` with ``transformers.Trainer`` as ``lavo train`` trains it.

``Trainer`` knows nothing of what lavo's mechanisms ask of a training loop. Pass all three:

* :class:`LanguageModelingCollator` as ``data_collator``: ``DataCollatorForLanguageModeling(mlm=False)`` ignores
  every label equal to the pad token, which for a LAVO tokenizer is the end-of-text token, so a model trained
  with it never learns to end a document;
* :func:`lavo_optimizer` in ``optimizers``: Trainer's own AdamW decays what the mechanisms keep from weight decay
  (S4D's state parameters, LAVO's learned basis) and ignores their learning-rate caps;
* :class:`MechanismCallback` in ``callbacks``: it tells the mechanisms of each optimizer step (Performer redraws
  its features every ``redraw_interval`` steps).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import TrainerCallback

from ..layers.base import after_optimizer_step
from ..model import parameter_groups


@dataclass
class LanguageModelingCollator:
    """Batches features ``{"input_ids": [...]}`` for the next-token loss: padded on the right with ``pad_id``
    (to a multiple of ``pad_to_multiple_of`` when given), ``attention_mask`` 1 on real tokens, and ``labels`` the
    ids with -100 at padding only, so every real token, the end-of-text token included, is a target. A feature
    that has its own ``attention_mask`` (one the tokenizer padded, on the left by default) keeps only the ids
    where it is 1: its padding would otherwise be taken for end-of-text tokens, fed and trained on."""

    pad_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        rows = [real_ids(feature) for feature in features]
        width = max(len(row) for row in rows)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row, dtype=torch.long), 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def real_ids(feature: dict) -> list[int]:
    """The ids of ``feature`` where its ``attention_mask``, if it has one, is 1."""
    ids = [int(token) for token in feature["input_ids"]]
    if "attention_mask" not in feature:
        return ids
    mask = feature["attention_mask"]
    if len(mask) != len(ids):
        raise ValueError(f"a feature's attention_mask has {len(mask)} entries for its {len(ids)} input_ids: "
                         "give one entry per id")
    return [token for token, keep in zip(ids, mask) if keep]


def lavo_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0, **adamw) -> torch.optim.AdamW:
    """AdamW over :func:`lavo.model.parameter_groups`, as ``lavo train`` builds it: no weight decay on vectors
    and on what the mechanisms exclude, and each mechanism's learning-rate cap (a schedule scales every group
    alike). ``adamw``: AdamW's other arguments (``betas``, ``eps``)."""
    return torch.optim.AdamW(parameter_groups(model, weight_decay, lr), lr=lr, **adamw)


class MechanismCallback(TrainerCallback):
    """Calls :func:`lavo.layers.after_optimizer_step` on the trained model after each optimizer step, as
    ``lavo train`` does."""

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is not None:
            after_optimizer_step(model)
