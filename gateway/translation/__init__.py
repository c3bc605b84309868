"""Translation between the APIs the gateway speaks, in every direction, in one place.

The gateway's own request path speaks OpenAI chat completions; every route kind serves it
(`openai` natively, `anthropic` through `anthropic`, `local` natively). A client of another API
whose model is served by a route of another kind is translated to chat on the way in and back on
the way out:

- `anthropic`: chat -> Anthropic Messages (`chat_to_anthropic`) and Anthropic's answers -> chat
  (`anthropic_to_chat`), used by the `anthropic` upstream kind;
- `gemini`: chat -> Gemini `generateContent` (`chat_to_gemini`) and Gemini's answers -> chat
  (`gemini_to_chat`), used by the `gemini` upstream kind and by `vertex` for Google's models
  (`vertex` serves Claude models with `anthropic`);
- `messages_chat`: Anthropic Messages requests -> chat, and chat answers -> Messages, used by
  `POST /v1/messages` on `openai` and `local` routes;
- `responses_chat`: OpenAI Responses requests -> chat, and chat answers -> Responses, used by
  `POST /v1/responses` on `anthropic` and `local` routes.

Everything here is pure: no I/O, no clock except the `created` stamps, inputs never mutated.
"""
