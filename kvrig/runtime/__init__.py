"""Host runtime: runs bundles with real MLX on the host, with the KV configuration the phone applies."""
