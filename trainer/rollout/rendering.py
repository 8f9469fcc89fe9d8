"""Conversation <-> token ids for the rollout loop: the chat template on the way in, the tokenizer's
decode on the way out."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from trainer.tiny.chat_template import check_text_only

__all__ = ["ConversationRenderer", "RENDER_CACHE_SIZE"]

RENDER_CACHE_SIZE = 1024


class ConversationRenderer:
    """Renders conversations for generation and decodes replies, for one tokenizer.

    ``chat_template_kwargs`` go to every ``apply_chat_template`` call (e.g. ``enable_thinking``);
    ``eos_token_ids`` are stripped from the end of a reply before decoding.
    """

    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: Sequence[int],
        chat_template_kwargs: dict[str, Any] | None = None,
        cache_size: int = RENDER_CACHE_SIZE,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.cache_size = cache_size
        self._cache: OrderedDict[str, list[int]] = OrderedDict()

    def render(self, messages: list[dict[str, Any]], schemas: list[dict[str, Any]] | None) -> list[int]:
        """Token ids of the conversation with the generation prompt (chat template + tokenizer).

        Cached by content (LRU, ``cache_size`` entries): the ``num_generations`` rollouts of a group
        open with the same prompt, and rendering is the loop's largest CPU cost per turn (~1.6 ms on
        the tiny model). Raises on messages that carry images (the trainer is text-only).
        """
        key = json.dumps([messages, schemas], sort_keys=True, default=str)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return list(cached)
        check_text_only(messages, "prompt")
        ids = list(
            self.tokenizer.apply_chat_template(
                messages,
                tools=schemas,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                **self.chat_template_kwargs,
            )
        )
        self._cache[key] = ids
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return list(ids)

    def decode(self, output_ids: Sequence[int]) -> str:
        """The reply's text: trailing EOS tokens stripped, special tokens kept (tool-call markup)."""
        end = len(output_ids)
        while end > 0 and output_ids[end - 1] in self.eos_token_ids:
            end -= 1
        return self.tokenizer.decode(list(output_ids[:end]), skip_special_tokens=False)
