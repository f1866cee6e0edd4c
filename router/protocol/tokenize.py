"""vLLM's ``/tokenize`` and ``/detokenize`` request bodies."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pdserve.router.limits import check_token_id
from pdserve.router.protocol.errors import RequestError
from pdserve.router.protocol.messages import ChatMessage
from pdserve.router.protocol.requests import check_continuation
from pdserve.router.protocol.validation import Text, TokenId, vocab_size


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a completion ``prompt``, or chat ``messages`` through the
    chat template (one of the two)."""

    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("give exactly one of 'prompt' and 'messages'", "prompt")
        check_continuation(self.continue_final_message, self.add_generation_prompt)
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``: token ids in the vocabulary."""

    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)

    @field_validator("tokens")
    @classmethod
    def _in_vocabulary(cls, value: list[int], info: ValidationInfo) -> list[int]:
        for t in value:
            check_token_id(t, vocab_size(info))
        return value
