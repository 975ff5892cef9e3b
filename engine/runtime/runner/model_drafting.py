"""Drafts from a small model (``--draft-model``): the other way to guess a sequence's next tokens.

Lookup drafts (``drafting.LookupDrafter``) are free but exist only where the
output copies its context. A draft model with the served model's tokenizer
guesses everywhere, at the price of running it: ``k`` of its decode steps per
``k`` drafts. Its drafts are greedy (its argmax), so the proposal is a point
mass and the batch's acceptance rule (``speculation.accepted_tokens``) keeps
the served model's distribution exactly, as for lookup drafts.

:class:`ModelDrafter` keeps the draft model's own KV cache for one sequence
and the tokens that sequence has decided. It feeds the draft model lazily,
when asked for drafts: the tokens decided since the last call (a turn's whole
prompt the first time; after a verification the served model's own token,
and nothing for the drafts that were kept, which its cache already holds),
then its own guesses one by one. Drafts that were rejected are cut from its
cache on the next call. Its cache always lacks the last decided token, whose
logits give the first draft.

:class:`DraftCaches` keeps each agent's drafter between its turns (the few most
recently used ones), so a warm turn feeds the draft model only what is new, as
the block pool does for the served model. Those caches are outside the pool's
budget: about ``tokens x layers x 2 x kv_heads x head_dim x 2`` bytes each
(2.5 MiB per 1,000 tokens for a 0.5B draft model with 2 KV heads of 64 and 24
layers), kept for at most ``max_batch_size`` agents.

Each sequence's drafts come from its own passes of the draft model, not from
one pass over the batch. Drafting costs time, so the batch allocates drafts
before making them (``drafting.allocate_drafts`` with ``cost_share``) and
its clock (``step_rates``) stops speculation when it still does not pay.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

import mlx.core as mx


class ModelDrafter:
    """Drafts for one sequence from the draft model; ``prefill_step_size``: tokens fed per pass."""

    def __init__(self, model: Any, history: Sequence[int] = (), prefill_step_size: int = 512) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self.prefill_step_size = prefill_step_size
        self.tokens: list[int] = list(history)
        self.in_use = False  # a running sequence drafts with it (DraftCaches lends it to one at a time)
        self.fed = 0  # tokens the draft model has computed for this drafter (what its drafts cost)
        self._cache = make_prompt_cache(model)
        self._in_cache: list[int] = []  # the tokens the draft model's cache holds, in order
        self._agreed = 0  # _in_cache and tokens are known to agree up to here

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens the sequence decided (generated, or fed as the prompt)."""
        self.tokens.extend(tokens)

    def rebase(self, history: Sequence[int]) -> None:
        """A new turn of the same agent: ``history`` is its whole context now. What the cache holds of it is
        kept (the longest common prefix); the rest is fed at the next proposal."""
        self.tokens = list(history)
        agreed, limit = 0, min(len(self._in_cache), len(self.tokens))
        while agreed < limit and self._in_cache[agreed] == self.tokens[agreed]:
            agreed += 1
        self._agreed = agreed

    def has_draft(self) -> bool:
        """Whether a proposal could have tokens (a model guesses after any history)."""
        return bool(self.tokens)

    def propose(self, k: int) -> list[int]:
        """The draft model's greedy next ``k`` tokens after the sequence's history ([] for k <= 0)."""
        if k <= 0 or not self.tokens:
            return []
        logits = self._feed(self.tokens[self._sync():])
        drafts = [int(mx.argmax(logits[0, -1]).item())]
        while len(drafts) < k:
            logits = self.model(mx.array([[drafts[-1]]]), cache=self._cache)
            self.fed += 1
            drafts.append(int(mx.argmax(logits[0, -1]).item()))
        self._in_cache = [*self.tokens, *drafts[:-1]]
        self._agreed = len(self.tokens)
        return drafts

    def _sync(self) -> int:
        """Cut the cache back to what agrees with the history, short of its last token; that length."""
        tokens, cached = self.tokens, self._in_cache
        keep, limit = self._agreed, min(len(cached), len(tokens) - 1)
        keep = min(keep, limit)
        while keep < limit and cached[keep] == tokens[keep]:  # (the drafts the last verification kept)
            keep += 1
        if keep < len(cached):
            from mlx_lm.models.cache import trim_prompt_cache

            trim_prompt_cache(self._cache, len(cached) - keep)
            del cached[keep:]
        self._agreed = keep
        return keep

    def _feed(self, tokens: list[int]) -> mx.array:
        """Feed ``tokens`` (at least one) in chunks; the last chunk's logits."""
        step = self.prefill_step_size
        self.fed += len(tokens)
        while len(tokens) > step:
            self.model(mx.array([tokens[:step]]), cache=self._cache)
            mx.eval([c.state for c in self._cache])
            tokens = tokens[step:]
        return self.model(mx.array([tokens]), cache=self._cache)


class DraftCaches:
    """Each agent's drafter, kept between its turns for the ``kept`` most recently used idle agents."""

    def __init__(self, model: Any, kept: int, prefill_step_size: int = 512) -> None:
        self.model = model
        self.kept = kept
        self.prefill_step_size = prefill_step_size
        self._by_owner: OrderedDict[str, ModelDrafter] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_owner)

    def cost_share(self, target: Any) -> float:
        """What one decode step of the draft model costs against one pass of ``target``: the share of its
        weights' bytes (a decode step reads all of a model's weights, on every platform). The batch's clock
        (``step_rates``) covers what this leaves out: a draft model's steps run MLX's own kernels, the served
        model's may run faster ones (the CPU backend)."""
        return weight_bytes(self.model) / max(1, weight_bytes(target))

    def lend(self, owner: str | None, history: Sequence[int]) -> ModelDrafter:
        """A drafter for a sequence of ``owner`` starting from ``history``: the agent's own when it is free
        (fed only what is new), else a fresh one."""
        drafter = self._by_owner.get(owner) if owner is not None else None
        if drafter is None or drafter.in_use:
            drafter = ModelDrafter(self.model, history, self.prefill_step_size)
            if owner is not None:
                self._by_owner[owner] = drafter
        else:
            drafter.rebase(history)
        if owner is not None:
            self._by_owner.move_to_end(owner)
        drafter.in_use = True
        self._forget_idle()
        return drafter

    def give_back(self, drafter: ModelDrafter) -> None:
        """The sequence ended: the drafter waits for its agent's next turn."""
        drafter.in_use = False
        self._forget_idle()

    def _forget_idle(self) -> None:
        idle = [owner for owner, d in self._by_owner.items() if not d.in_use]
        for owner in idle[:max(0, len(idle) - self.kept)]:  # (oldest first)
            del self._by_owner[owner]


def weight_bytes(model: Any) -> int:
    from mlx.utils import tree_flatten

    return sum(array.nbytes for _, array in tree_flatten(model.parameters()))
