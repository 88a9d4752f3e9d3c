"""The decode worker: owns requests end to end, local or remote prefill, continuous-batch decode."""
