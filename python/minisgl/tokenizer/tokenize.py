"""TokenizeManager (chapter 13): a request's prompt (plain text, a chat, or token ids) to token
ids."""

from __future__ import annotations

from typing import cast

import torch
from transformers import PreTrainedTokenizerBase

from minisgl.message import TokenizeMsg


class TokenizeManager:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)

    def tokenize(self, msg: TokenizeMsg) -> torch.Tensor:
        """The prompt as a 1-D int32 tensor. Raises ValueError, saying what is wrong, for an
        empty prompt or token ids outside the vocabulary."""
        prompt = msg.prompt
        if isinstance(prompt, str):  # plain text: special tokens as the model's tokenizer adds
            ids = self.tokenizer.encode(prompt)
        elif prompt and all(isinstance(m, dict) for m in prompt):
            # a chat: the template writes every special token itself (BOS included), so the
            # templated text is encoded without adding any
            chat = cast(list[dict[str, str]], prompt)
            text = self.tokenizer.apply_chat_template(chat, tokenize=False,
                                                      add_generation_prompt=True)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = list(prompt)  # token ids, passed through
            bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < self.vocab_size]
            if bad:
                raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {bad[:3]}")
        if not ids:
            raise ValueError("the prompt is empty")
        return torch.tensor(ids, dtype=torch.int32)
