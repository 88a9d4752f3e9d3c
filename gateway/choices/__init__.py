"""One choice's token stream in the service: which worker streams it, its chunks off the
reply subscription, and its mid-stream tokens written to the client from the reply handler."""
