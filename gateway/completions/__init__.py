"""The OpenAI chat and text completions: ``/v1/chat/completions``, ``/v1/completions``, and the
chat path the Responses API runs through."""
