"""What every API reads from a request: the body as a model, the chat and completion bodies, and
the structured-output fields they and the Responses API share."""
