"""vLLM's ``/tokenize`` and ``/detokenize`` request bodies."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pdserve.router.limits import check_token_id
from pdserve.router.protocol.errors import RequestError
from pdserve.router.protocol.messages import ChatMessage, ChatTemplateInputs
from pdserve.router.protocol.requests import check_continuation
from pdserve.router.protocol.validation import Text, TokenId, vocab_size


class TokenizeRequest(ChatTemplateInputs):
    """vLLM's ``POST /tokenize``: a completion ``prompt``, or chat ``messages`` through the
    chat template with what else a chat request gives it (``ChatTemplateInputs``: the
    same token ids as the chat request would be served). ``add_special_tokens`` (default:
    true for a prompt) adds the BOS to a prompt; with messages the template writes the
    special tokens, so true is refused. ``return_token_strs``: the tokens as strings too.
    """

    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("give exactly one of 'prompt' and 'messages'", "prompt")
        if self.prompt is not None:
            chat_only = sorted(set(ChatTemplateInputs.model_fields) & self.model_fields_set)
            if chat_only:
                raise RequestError(f"{chat_only[0]} goes with messages, not a prompt",
                                   chat_only[0])
        elif self.add_special_tokens:
            raise RequestError("add_special_tokens with messages is not supported: the chat "
                               "template writes the special tokens", "add_special_tokens")
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
