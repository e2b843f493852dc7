"""Quality: perplexity, the scoring pass over the windows, the baseline cache, the streamed (bigger than memory) pass."""
