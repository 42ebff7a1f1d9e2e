"""GLM special-token names shared by both tokenizer back ends (sentencepiece and tokenizer.json).

The names are GLM-4.5 / GLM-5's, in a fixed order: tokenizers trained here give them the ids right
after their own control ids, in this order; a tokenizer.json from GLM itself has them at its own ids
(they are always looked up by name, never by position).
"""

from __future__ import annotations

EOS_TOKEN = "<|endoftext|>"

GLM_SPECIAL_TOKENS = (
    EOS_TOKEN,
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)
