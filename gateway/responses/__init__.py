"""The Responses API: ``/v1/responses``, run through the chat path, and its stored conversations."""
