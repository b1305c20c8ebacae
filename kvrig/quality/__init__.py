"""Quality: perplexity of weight recipes and KV schemes against the unquantized source, the package gate."""
