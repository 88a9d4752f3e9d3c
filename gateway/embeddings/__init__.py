"""The Embeddings API: ``/v1/embeddings``, on the model's embed workers."""
