"""Prompt helpers every task shares: tokenizing without special tokens, rendering chat turns (or the plain text
for tokenizers without a chat template), and splitting a rendered prompt at a marker into (head, tail) ids."""

from __future__ import annotations


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of a piece of a prompt (no BOS/EOS: the chat template or the task places those)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_text(tokenizer, messages: list[dict], plain: str) -> str:
    """`messages` through the tokenizer's chat template with the generation prompt; without a template (a base
    model) `plain`, after the BOS token where the tokenizer itself starts a text with one (Gemma)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return bos_prefix(tokenizer) + plain


def bos_prefix(tokenizer) -> str:
    """The BOS token as text where the tokenizer adds it to a plain text, else "" (prompts are encoded without
    special tokens: a template, or this, places them)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None or getattr(tokenizer, "bos_token", None) is None:
        return ""
    ids = tokenizer("a")["input_ids"]
    return tokenizer.bos_token if ids and ids[0] == bos else ""


class PromptBuilder:
    """Chat-templated prompt around a context, split into (head, question) token ids."""

    MARK = "\x00CONTEXT\x00"

    def __init__(self, tokenizer, instruction: str, question: str, answer_prefix: str, chat: bool = True):
        self.tokenizer = tokenizer
        user = f"{instruction}\n{self.MARK}\n{question}"
        text = chat_text(tokenizer, [{"role": "user", "content": user}], user + "\n") if chat else user + "\n"
        if not chat:
            text = bos_prefix(tokenizer) + text
        head, tail = (text + answer_prefix).split(self.MARK)
        self.head_ids, self.tail_ids = self.encode(head), self.encode(tail)

    def encode(self, text: str) -> list[int]:
        return encode(self.tokenizer, text)
