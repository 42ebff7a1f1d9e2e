"""The OpenAI server's request schemas (pydantic): one per endpoint, ``CompletionRequest`` for
``POST /v1/completions`` and ``ChatCompletionRequest`` for ``POST /v1/chat/completions``, over the
sampling fields they share (``SamplingFields``).

A schema checks what a field is (types, fixed ranges: ``temperature`` in [0, 2], ``n`` in [1, 16]); what
depends on the served model (token ids below its vocabulary, lengths within its context, the forced
tool's name among ``tools``) is checked by the server. Types are strict (``true`` is not 1, ``"3"`` is not
3); fields OpenAI clients send that the server does not use (``user``, ``metadata``, ...) are accepted
and ignored. A refused field is a 400 whose ``param`` names it (glm5_jax.serve.http.parse_as, with the
field's description as what is allowed).
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

__all__ = ["ChatCompletionRequest", "CompletionRequest", "MAX_LOGPROBS", "MAX_N", "NamedToolChoice", "SamplingFields"]

MAX_N = 16
MAX_LOGPROBS = 20
Number = Union[StrictInt, StrictFloat]


class SamplingFields(BaseModel):
    """What both endpoints share: the model's name, sampling, stop conditions, streaming."""
    model_config = ConfigDict(extra="allow")

    model: Optional[Any] = None          # a name other than the served one is a 404 (the server checks)
    temperature: Optional[Number] = Field(None, ge=0, le=2, description="a number in [0, 2]")
    top_p: Optional[Number] = Field(None, gt=0, le=1, description="a number in (0, 1]")
    top_k: Optional[StrictInt] = Field(None, ge=-1, description="an integer >= 0 (-1 or 0: off)")
    presence_penalty: Optional[Number] = Field(None, ge=-2, le=2, description="0 (the only value supported)")
    frequency_penalty: Optional[Number] = Field(None, ge=-2, le=2, description="0 (the only value supported)")
    logit_bias: Optional[Dict[str, Any]] = Field(None, description="empty (logit_bias is not supported)")
    stop: Optional[Union[StrictStr, List[StrictStr]]] = Field(
        None, description="a non-empty string or a list of at most 16 non-empty strings")
    stop_token_ids: Optional[List[StrictInt]] = Field(None, description="a list of token ids")
    seed: Optional[StrictInt] = Field(None, ge=-2 ** 63, lt=2 ** 64, description="an integer")
    ignore_eos: StrictBool = Field(False, description="a boolean")
    n: Optional[StrictInt] = Field(None, ge=1, le=MAX_N, description=f"an integer in [1, {MAX_N}]")
    max_tokens: Optional[StrictInt] = Field(None, description="an integer >= 1 (>= 0 with echo)")
    stream: StrictBool = Field(False, description="a boolean")
    stream_options: Optional[Any] = None     # {"include_usage": bool}; anything else: no usage chunk
    rollout_id: Optional[Any] = None         # a string names the TITO record; anything else: the request's id

    @property
    def include_usage(self) -> bool:
        so = self.stream_options
        return bool(so.get("include_usage")) if isinstance(so, dict) else False

    @property
    def rollout(self) -> Optional[str]:
        return self.rollout_id if isinstance(self.rollout_id, str) else None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""
    prompt: Union[StrictStr, List[StrictInt], List[Union[StrictStr, List[StrictInt]]]] = Field(
        description="a string, a list of strings, a list of token ids or a list of token-id lists")
    echo: StrictBool = Field(False, description="a boolean")
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS,
                                          description=f"an integer in [0, {MAX_LOGPROBS}]")
    suffix: Optional[Literal[None]] = Field(None, description="absent (suffix is not supported)")
    best_of: Optional[Literal[1]] = Field(None, description="1 (best_of is not supported)")


class _Function(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: the generation prompt forces that call."""
    type: Literal["function"]
    function: _Function


class ChatTemplateKwargs(BaseModel):
    """Handed to the chat template; GLM's switches are booleans, any other key goes to a checkpoint's own
    Jinja template as is."""
    model_config = ConfigDict(extra="allow")
    enable_thinking: StrictBool = Field(True, description="a boolean")
    clear_thinking: StrictBool = Field(True, description="a boolean")


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""
    messages: List[Dict[str, Any]] = Field(min_length=1, description="a non-empty list of message objects")
    tools: Optional[List[Dict[str, Any]]] = Field(None, description="a list of tool objects")
    tool_choice: Optional[Union[Literal["auto", "none", "required"], NamedToolChoice]] = Field(
        None, description="auto, none, required or a named function {'type': 'function', 'function': {'name'}}")
    chat_template_kwargs: Optional[ChatTemplateKwargs] = Field(
        None, description="an object; enable_thinking / clear_thinking are booleans")
    logprobs: StrictBool = Field(False, description="a boolean")
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS,
                                              description=f"an integer in [0, {MAX_LOGPROBS}]")
    max_completion_tokens: Optional[StrictInt] = Field(None, description="an integer >= 1")
