"""The prefill worker: pulls prefill jobs, computes KV, writes it into the decode worker's blocks."""
