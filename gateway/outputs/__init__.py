"""A choice's output text, shared by chat completions and the Responses API: the output plan,
incremental detokenization and stop strings, tool calls and reasoning."""
