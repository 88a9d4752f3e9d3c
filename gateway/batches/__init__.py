"""The Files and Batch APIs: ``/v1/files``, ``/v1/batches``, and the runner that calls the other
routes through ASGI."""
